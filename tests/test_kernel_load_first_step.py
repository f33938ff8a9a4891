"""load_first_step_rows: Triton kernel vs torch reference on random steps (mixed m, padding sequences, block tables
narrower than the buffer, hidden states in another dtype than the buffer), plus a worked example."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

load = kernel_module("load_first_step")
FUNCTIONS = {"ref": load.load_first_step_rows_ref, "triton": load.load_first_step_rows_triton}


def random_step(seed: int, B: int, M: int, bs: int, width: int, device):
    """The packed metadata fields of a step of B sequences with 1 <= m_i <= M rows each (M reached once)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randint(1, M + 1, (B,), generator=gen)
    m[torch.randint(0, B, (1,), generator=gen)] = M
    T = int(m.sum())
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = m.cumsum(0)
    seq_lens = (torch.randint(M, 300, (B,), generator=gen) + m).to(torch.int32)
    w = int(torch.randint(1, 9, (1,), generator=gen))
    fields = dict(
        input_ids=torch.randint(0, 32000, (T,), generator=gen),
        hidden_states=torch.randn(T, width, generator=gen),  # float32 into a bfloat16 buffer
        slot_mapping=torch.randint(0, 10_000, (T,), generator=gen),
        query_start_loc=qsl,
        draft_positions=seq_lens.to(torch.int64) - 1,
        draft_seq_lens=seq_lens,
        draft_block_tables=torch.randint(0, 500, (B, w), generator=gen, dtype=torch.int32),
        draft_steps=torch.randint(0, 8, (B,), generator=gen, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in fields.items()}


def run(fn, fields: dict, M: int, bs: int, width: int, device, table_width: int = 12):
    """fn into poisoned buffers (one entry more than the padded batch everywhere: it must stay unwritten)."""
    out = dict(
        out_positions=poisoned((bs + 1,), torch.int64, device),
        out_seq_lens=poisoned((bs + 1,), torch.int32, device),
        out_block_tables=poisoned((bs + 1, table_width), torch.int32, device),
        out_steps_left=poisoned((bs + 1,), torch.int32, device),
        out_fs_positions=poisoned((bs * M + 1,), torch.int64, device),
        out_fs_input_ids=poisoned((bs * M + 1,), torch.int64, device),
        out_fs_slots=poisoned((bs * M + 1,), torch.int64, device),
        out_fs_hidden=poisoned((bs * M + 1, width), torch.bfloat16, device),
    )
    views = {k: (v[:bs] if k in ("out_positions", "out_seq_lens", "out_steps_left", "out_block_tables")
                 else v[: bs * M]) for k, v in out.items()}
    fn(**fields, rows_per_seq=M, **views)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_worked_example(device, function):
    # two sequences, M = 3, padded to bs = 3: sequence 0 has 2 rows (t = 0, 1), sequence 1 has 3 rows (t = 2..4)
    fields = dict(
        input_ids=torch.tensor([10, 11, 20, 21, 22]), hidden_states=torch.arange(10.).view(5, 2),
        slot_mapping=torch.tensor([100, 101, 200, 201, 202]),
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        draft_positions=torch.tensor([41, 9]), draft_seq_lens=torch.tensor([42, 10], dtype=torch.int32),
        draft_block_tables=torch.tensor([[5, 6], [7, 8]], dtype=torch.int32),
        draft_steps=torch.tensor([4, 2], dtype=torch.int32))
    fields = {k: v.to(device) for k, v in fields.items()}
    out = run(FUNCTIONS[function], fields, 3, 3, 2, device, table_width=3)
    P, X = POISON_INT, -1
    assert out["out_positions"].tolist() == [41, 9, P, P]  # (padding sequences' positions are not written)
    assert out["out_seq_lens"].tolist() == [42, 10, 3, P]
    assert out["out_steps_left"].tolist() == [4, 2, 0, P]
    assert out["out_block_tables"].tolist() == [[5, 6, P], [7, 8, P], [P, P, P], [P, P, P]]
    assert out["out_fs_positions"].tolist() == [39, 40, 41, 7, 8, 9, 0, 1, 2, P]
    assert out["out_fs_input_ids"].tolist() == [0, 10, 11, 20, 21, 22, 0, 0, 0, P]
    assert out["out_fs_slots"].tolist() == [X, 100, 101, 200, 201, 202, X, X, X, P]
    hidden = out["out_fs_hidden"].float()
    assert hidden[1:6].tolist() == torch.arange(10.).view(5, 2).tolist()
    assert hidden[[0, 6, 7, 8, 9]].isnan().all()  # padding rows and the row past the batch: not written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,M,bs,width", [(1, 1, 1, 8), (5, 3, 8, 40), (16, 1, 16, 1030), (33, 8, 48, 24),
                                          (7, 4, 7, 2100)])
def test_matches_reference(device, B, M, bs, width):
    fields = random_step(B * 31 + M, B, M, bs, width, device)
    expected = run(load.load_first_step_rows_ref, fields, M, bs, width, device)
    actual = run(load.load_first_step_rows_triton, fields, M, bs, width, device)
    for name in expected:
        e, a = expected[name], actual[name]
        assert torch.equal(a.isnan(), e.isnan()) if e.is_floating_point() else True, name
        if e.is_floating_point():
            assert torch.equal(a[~e.isnan()], e[~e.isnan()]), name  # (a copy and a cast: exact)
        else:
            assert torch.equal(a, e), name
