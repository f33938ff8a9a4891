"""mask_finished_rows: Triton kernel vs torch reference on random padded decode batches (rows finished, padding rows
with negative steps, one row past the batch that must stay untouched)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, kernel_module  # noqa: E402

mask = kernel_module("mask_finished_rows")


def batch(bs: int, hidden_size: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return dict(  # one row more than the batch: the kernel gets [:bs] and must not touch the last
        steps_left=torch.randint(-2, 4, (bs + 1,), generator=gen, dtype=torch.int32),
        slot_mapping=torch.randint(0, 1000, (bs + 1,), generator=gen),
        seq_lens=torch.randint(2, 500, (bs + 1,), generator=gen, dtype=torch.int32),
        input_ids=torch.randint(1, 32000, (bs + 1,), generator=gen),
        hidden=torch.randn(bs + 1, hidden_size, generator=gen).to(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("bs,hidden_size", [(1, 64), (8, 100), (16, 4096), (48, 1030)])
def test_mask_finished_rows_matches_reference(device, dtype, bs, hidden_size):
    rows = batch(bs, hidden_size, dtype, device, bs)
    rows["steps_left"][0] = 0  # finished (and, with more than one row, row 1 drafting)
    rows["steps_left"][1] = 2
    expected = {k: v.to(device) for k, v in rows.items()}
    actual = {k: v.clone() for k, v in expected.items()}
    before = {k: v.clone() for k, v in expected.items()}
    mask.mask_finished_rows_ref(**{k: v[:bs] for k, v in expected.items()})
    mask.mask_finished_rows_triton(**{k: v[:bs] for k, v in actual.items()})
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name  # (copies and constants: exact)
        assert torch.equal(actual[name][bs], before[name][bs]), name  # the row past the batch: untouched
    finished = before["steps_left"][:bs] <= 0
    assert finished[0] and (bs == 1 or not finished[1])
    assert (expected["hidden"][:bs][finished] == 0).all()
    assert torch.equal(expected["hidden"][:bs][~finished], before["hidden"][:bs][~finished])
