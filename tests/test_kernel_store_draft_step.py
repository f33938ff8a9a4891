"""store_draft_step: Triton kernel vs torch reference on random padded decode batches (with and without a draft
vocabulary's d2t, columns 0 and K, hidden sizes not a multiple of the block, one row past the batch that must stay
untouched)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, kernel_module  # noqa: E402

store = kernel_module("store_draft_step")


def buffers(bs: int, hidden_size: int, columns: int, vocab: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(draft_ids=torch.randint(0, vocab, (bs,), generator=gen),
                  head_out=torch.randn(bs, hidden_size, generator=gen).to(dtype))
    outputs = dict(  # one row more than the batch: the kernel gets [:bs] and must not touch the last
        input_ids=torch.randint(0, 10**6, (bs + 1,), generator=gen),
        hidden=torch.randn(bs + 1, hidden_size, generator=gen).to(dtype),
        drafts_out=torch.randint(0, 10**6, (bs + 1, columns), generator=gen),
        hidden_steps=torch.randn(bs + 1, columns, hidden_size, generator=gen).to(dtype))
    return ({k: v.to(device) for k, v in inputs.items()}, {k: v.to(device) for k, v in outputs.items()},
            torch.randint(0, 50_000, (vocab,), generator=gen).to(device))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("bs,hidden_size,column", [(1, 64, 0), (3, 1030, 5), (16, 4096, 2), (48, 100, 16)])
@pytest.mark.parametrize("with_d2t", [True, False])
def test_store_draft_step_matches_reference(device, dtype, bs, hidden_size, column, with_d2t):
    inputs, expected, d2t = buffers(bs, hidden_size, 17, 500, dtype, device, bs * 31 + column)
    d2t = d2t if with_d2t else None
    actual = {k: v.clone() for k, v in expected.items()}
    before = {k: v.clone() for k, v in expected.items()}
    col = torch.tensor([column], device=device)
    store.store_draft_step_ref(inputs["draft_ids"], d2t, inputs["head_out"], col,
                               **{k: v[:bs] for k, v in expected.items()})
    store.store_draft_step_triton(inputs["draft_ids"], d2t, inputs["head_out"], col,
                                  **{k: v[:bs] for k, v in actual.items()})
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name  # (copies and an add: exact)
        assert torch.equal(actual[name][bs], before[name][bs]), name  # the row past the batch: untouched
    # and what the reference does, spelled out: the token in the target vocabulary, the other columns untouched
    target = inputs["draft_ids"] + (d2t[inputs["draft_ids"]] if with_d2t else 0)
    assert torch.equal(expected["input_ids"][:bs], target)
    assert torch.equal(expected["drafts_out"][:bs, column], target)
    assert torch.equal(expected["hidden_steps"][:bs, column], inputs["head_out"])
    others = [c for c in range(17) if c != column]
    assert torch.equal(expected["drafts_out"][:, others], before["drafts_out"][:, others])
    assert torch.equal(expected["hidden_steps"][:, others], before["hidden_steps"][:, others])
