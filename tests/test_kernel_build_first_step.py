"""build_first_step_rows: Triton kernel vs torch reference on random steps (mixed m, padding sequences, block tables
of any width, inputs with room and garbage past the step's own entries), plus a worked example."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

build = kernel_module("build_first_step")
FUNCTIONS = {"ref": build.build_first_step_rows_ref, "triton": build.build_first_step_rows_triton}
GARBAGE = 1 << 20  # what the inputs hold past the step's entries (the record's room for larger steps): never read


def padded(values: list[int] | torch.Tensor, size: int) -> torch.Tensor:
    out = torch.full((size,), GARBAGE, dtype=torch.int32)
    values = torch.as_tensor(values, dtype=torch.int32).reshape(-1)
    out[: values.shape[0]] = values
    return out


def record_fields(gen: torch.Generator, m: torch.Tensor, p: torch.Tensor, block_size: int) -> dict:
    """The record's fields (int32, with room past the step's own entries) of a step whose B sequences bring m [B]
    rows from positions p [B]: random next tokens, draft steps, committed tokens and block tables from gen."""
    B, T = m.shape[0], int(m.sum())
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = m.cumsum(0)
    w = -(-int((p + m).max() + 6) // block_size) + int(torch.randint(0, 3, (1,), generator=gen))
    return dict(
        header=torch.tensor([B, w], dtype=torch.int32),
        start_positions=padded(p, B + 3),
        query_start_loc=padded(qsl, B + 4),
        next_tokens=padded(torch.randint(0, 32000, (B,), generator=gen), B + 3),
        draft_steps=padded(torch.randint(0, 8, (B,), generator=gen), B + 3),
        token_ids=padded(torch.randint(0, 32000, (T,), generator=gen), T + 5),
        block_tables=padded(torch.randint(0, 500, (B * w,), generator=gen), B * w + 7),
    )


def random_step(seed: int, B: int, M: int, width: int, block_size: int, device):
    """The raw columns of a step of B sequences with 1 <= m_i <= M rows each (M reached once), as the record holds
    them: int32, with room past the step's own entries."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randint(1, M + 1, (B,), generator=gen)
    m[torch.randint(0, B, (1,), generator=gen)] = M
    p = torch.randint(M, 300, (B,), generator=gen)
    fields = record_fields(gen, m, p, block_size)
    fields["hidden_states"] = torch.randn(int(m.sum()) + 2, width, generator=gen).to(torch.bfloat16)
    return {k: v.to(device) for k, v in fields.items()}


def run(fn, fields: dict, M: int, bs: int, width: int, block_size: int, device, table_width: int = 40):
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
        out_draft_column=poisoned((2,), torch.int64, device),
    )
    views = {k: (v[:bs] if k in ("out_positions", "out_seq_lens", "out_steps_left", "out_block_tables")
                 else v[:1] if k == "out_draft_column" else v[: bs * M]) for k, v in out.items()}
    fn(**fields, block_size=block_size, rows_per_seq=M, **views)
    return out


def host_packing(fields: dict, B: int, block_size: int):
    """What step_metadata.py packs on the host for the eager path from the same record fields: (qsl [B + 1] int64
    numpy, and the step's input ids, positions and slots, [T] int64 tensors each)."""
    import numpy as np
    from drafter_service.engine.step_metadata import _pack_vectorized

    w = int(fields["header"][1])
    cpu = {k: v.cpu() for k, v in fields.items()}
    qsl = cpu["query_start_loc"][: B + 1].numpy().astype(np.int64)
    m, T = np.diff(qsl), int(qsl[-1])
    host, _, _ = _pack_vectorized(
        cpu["start_positions"][:B].numpy().astype(np.int64), m, cpu["token_ids"][:T].numpy().astype(np.int64),
        cpu["next_tokens"][:B].numpy().astype(np.int64), np.ones(B, dtype=np.int64),
        cpu["block_tables"][: B * w].numpy().reshape(B, w), np.zeros(B, dtype=np.float32), np.zeros(B, dtype=np.int64),
        np.zeros(B, dtype=np.int64), block_size)
    per = -(-T // 2) * 2  # ids, positions, slots: each [T] int64, padded to 16 bytes
    wide = host[: 2 * 3 * per].view(torch.int64)
    return qsl, wide[:T], wide[per : per + T], wide[2 * per : 2 * per + T]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_worked_example(device, function):
    # two sequences, block size 16, M = 3, padded to bs = 3: sequence 0 brings x[40], x[41] (2 rows, t = 0, 1; next
    # token 12), sequence 1 brings x[7..9] (3 rows, t = 2..4; next token 23)
    fields = dict(
        header=torch.tensor([2, 3], dtype=torch.int32),
        start_positions=padded([40, 7], 3), query_start_loc=padded([0, 2, 5], 4), next_tokens=padded([12, 23], 3),
        draft_steps=padded([4, 2], 3), token_ids=padded([10, 11, 20, 21, 22], 6),
        # sequence 0: positions 40..41 in table column 2 (block 9); sequence 1: positions 7..9 in column 0 (block 4)
        block_tables=padded([1, 2, 9, 4, 3, 5], 7),
        hidden_states=torch.arange(12.).view(6, 2).to(torch.bfloat16))
    fields = {k: v.to(device) for k, v in fields.items()}
    out = run(FUNCTIONS[function], fields, 3, 3, 2, 16, device, table_width=4)
    P, X = POISON_INT, -1
    assert out["out_positions"].tolist() == [41, 9, P, P]  # (padding sequences' positions are not written)
    assert out["out_seq_lens"].tolist() == [42, 10, 3, P]
    assert out["out_steps_left"].tolist() == [4, 2, 0, P]
    assert out["out_block_tables"].tolist() == [[1, 2, 9, P], [4, 3, 5, P], [P] * 4, [P] * 4]
    assert out["out_fs_positions"].tolist() == [39, 40, 41, 7, 8, 9, 0, 1, 2, P]
    assert out["out_fs_input_ids"].tolist() == [0, 11, 12, 21, 22, 23, 0, 0, 0, P]
    assert out["out_fs_slots"].tolist() == [X, 9 * 16 + 8, 9 * 16 + 9, 4 * 16 + 7, 4 * 16 + 8, 4 * 16 + 9, X, X, X, P]
    hidden = out["out_fs_hidden"].float()
    assert hidden[1:6].tolist() == torch.arange(10.).view(5, 2).tolist()
    assert hidden[[0, 6, 7, 8, 9]].isnan().all()  # padding rows and the row past the batch: not written
    assert out["out_draft_column"].tolist() == [0, P]  # draft 1's column of drafts_out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,M,bs,width,block_size", [(1, 1, 1, 8, 16), (5, 3, 8, 40, 16), (16, 1, 16, 1030, 16),
                                                     (33, 8, 48, 24, 32), (7, 4, 7, 2100, 1)])
def test_matches_reference(device, B, M, bs, width, block_size):
    fields = random_step(B * 31 + M, B, M, width, block_size, device)
    table_width = int(fields["header"][1]) + 2
    expected = run(build.build_first_step_rows_ref, fields, M, bs, width, block_size, device, table_width)
    actual = run(build.build_first_step_rows_triton, fields, M, bs, width, block_size, device, table_width)
    for name in expected:
        e, a = expected[name], actual[name]
        if e.is_floating_point():
            assert torch.equal(a.isnan(), e.isnan()), name
            assert torch.equal(a[~e.isnan()], e[~e.isnan()]), name  # (a copy: exact)
        else:
            assert torch.equal(a, e), name


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_the_host_packing(device):
    """The slots, positions and shifted ids it builds are those step_metadata.py packs on the host for the eager
    path (the same step, the same block tables)."""
    B, M, bs, width, block_size = 6, 3, 8, 16, 16
    fields = random_step(5, B, M, width, block_size, device)
    out = run(build.build_first_step_rows_ref if device == "cpu" else build.build_first_step_rows_triton, fields, M,
              bs, width, block_size, device)
    qsl, ids, positions, slots = host_packing(fields, B, block_size)
    dest = torch.tensor([(i + 1) * M - int(qsl[i + 1]) + t for i in range(B) for t in range(qsl[i], qsl[i + 1])])
    assert out["out_fs_input_ids"].cpu()[dest].tolist() == ids.tolist()
    assert out["out_fs_positions"].cpu()[dest].tolist() == positions.tolist()
    assert out["out_fs_slots"].cpu()[dest].tolist() == slots.tolist()
