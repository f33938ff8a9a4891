"""build_packed_first_step_rows: Triton kernel vs torch reference on random steps (a long prompt beside short rows,
padding sequences and padding rows, block tables of any width, inputs with garbage past the step's own entries), a
worked example, and agreement with the host packing of the eager path."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402
from test_kernel_build_first_step import host_packing, padded, record_fields  # noqa: E402

build = kernel_module("build_packed_first_step")
FUNCTIONS = {"ref": build.build_packed_first_step_rows_ref, "triton": build.build_packed_first_step_rows_triton}


def random_step(seed: int, B: int, prompt: int, block_size: int, device):
    """The raw columns of a step of B sequences with 1-4 rows each, one of them (a new sequence, at position 0)
    bringing `prompt` rows, as the record holds them: int32, with room past the step's own entries."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randint(1, 5, (B,), generator=gen)
    p = torch.randint(0, 300, (B,), generator=gen)
    joins = int(torch.randint(0, B, (1,), generator=gen))
    m[joins], p[joins] = prompt, 0
    fields = record_fields(gen, m, p, block_size)
    return {k: v.to(device) for k, v in fields.items()}, int(m.sum())


def run(fn, fields: dict, R: int, bs: int, block_size: int, device, table_width: int = 40):
    """fn into poisoned buffers (one entry more than the graph's sizes everywhere: it must stay unwritten)."""
    out = dict(
        out_positions=poisoned((bs + 1,), torch.int64, device),
        out_seq_lens=poisoned((bs + 1,), torch.int32, device),
        out_block_tables=poisoned((bs + 1, table_width), torch.int32, device),
        out_steps_left=poisoned((bs + 1,), torch.int32, device),
        out_query_start_loc=poisoned((bs + 2,), torch.int32, device),
        out_last_rows=poisoned((bs + 1,), torch.int64, device),
        out_fs_positions=poisoned((R + 1,), torch.int64, device),
        out_fs_input_ids=poisoned((R + 1,), torch.int64, device),
        out_fs_slots=poisoned((R + 1,), torch.int64, device),
        out_draft_column=poisoned((2,), torch.int64, device),
    )
    sizes = dict(out_query_start_loc=bs + 1, out_fs_positions=R, out_fs_input_ids=R, out_fs_slots=R,
                 out_draft_column=1)
    views = {k: v[: sizes.get(k, bs)] for k, v in out.items()}
    fn(**fields, block_size=block_size, **views)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_worked_example(device, function):
    # block size 16, bs = 3, R = 8: sequence 0 brings x[40], x[41] (rows 0-1; next token 12), sequence 1 (new) its
    # prompt x[0..3] (rows 2-5; next token 23); rows 6-7 are padding, sequence 2 a padding sequence
    fields = dict(
        header=torch.tensor([2, 3], dtype=torch.int32),
        start_positions=padded([40, 0], 3), query_start_loc=padded([0, 2, 6], 4), next_tokens=padded([12, 23], 3),
        draft_steps=padded([4, 2], 3), token_ids=padded([10, 11, 20, 21, 22, 24], 7),
        # sequence 0: positions 40..41 in table column 2 (block 9); sequence 1: positions 0..3 in column 0 (block 4)
        block_tables=padded([1, 2, 9, 4, 3, 5], 7))
    fields = {k: v.to(device) for k, v in fields.items()}
    out = run(FUNCTIONS[function], fields, 8, 3, 16, device, table_width=4)
    P, X = POISON_INT, -1
    assert out["out_positions"].tolist() == [41, 3, P, P]  # (padding sequences' positions are not written)
    assert out["out_seq_lens"].tolist() == [42, 4, 1, P]
    assert out["out_steps_left"].tolist() == [4, 2, 0, P]
    assert out["out_block_tables"].tolist() == [[1, 2, 9, P], [4, 3, 5, P], [P] * 4, [P] * 4]
    assert out["out_query_start_loc"].tolist() == [0, 2, 6, 6, P]
    assert out["out_last_rows"].tolist() == [1, 5, 5, P]
    assert out["out_fs_positions"].tolist() == [40, 41, 0, 1, 2, 3, 0, 0, P]
    assert out["out_fs_input_ids"].tolist() == [11, 12, 21, 22, 24, 23, 0, 0, P]
    assert out["out_fs_slots"].tolist() == [9 * 16 + 8, 9 * 16 + 9, 4 * 16, 4 * 16 + 1, 4 * 16 + 2, 4 * 16 + 3, X, X,
                                           P]
    assert out["out_draft_column"].tolist() == [0, P]  # draft 1's column of drafts_out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,prompt,bs,R,block_size", [(1, 1, 1, 1, 16), (1, 37, 1, 64, 16), (5, 20, 8, 64, 16),
                                                      (16, 1, 16, 64, 16), (33, 70, 48, 256, 32), (7, 9, 8, 40, 1),
                                                      (3, 90, 4, 128, 16)])
def test_matches_reference(device, B, prompt, bs, R, block_size):
    fields, T = random_step(B * 31 + prompt, B, prompt, block_size, device)
    assert T <= R
    table_width = int(fields["header"][1]) + 2
    expected = run(build.build_packed_first_step_rows_ref, fields, R, bs, block_size, device, table_width)
    actual = run(build.build_packed_first_step_rows_triton, fields, R, bs, block_size, device, table_width)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_an_empty_record_makes_every_row_padding(device, function):
    """Graph capture clears the record (B = 0): every row a padding row, every sequence a masked padding one."""
    fields = dict(header=torch.zeros(2, dtype=torch.int32), start_positions=padded([], 2),
                  query_start_loc=torch.zeros(3, dtype=torch.int32), next_tokens=padded([], 2),
                  draft_steps=padded([], 2), token_ids=padded([], 2), block_tables=padded([], 2))
    out = run(FUNCTIONS[function], {k: v.to(device) for k, v in fields.items()}, 6, 2, 16, device, table_width=3)
    P = POISON_INT
    assert out["out_fs_slots"].tolist() == [-1] * 6 + [P]
    assert out["out_steps_left"].tolist() == [0, 0, P] and out["out_seq_lens"].tolist() == [1, 1, P]
    assert out["out_query_start_loc"].tolist() == [0, 0, 0, P] and out["out_last_rows"].tolist() == [0, 0, P]


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_the_host_packing(device):
    """The slots, positions and shifted ids it builds are those step_metadata.py packs on the host for the eager
    path (the same step, the same block tables), in the same rows."""
    B, prompt, bs, R, block_size = 6, 25, 8, 64, 16
    fields, T = random_step(5, B, prompt, block_size, device)
    fn = build.build_packed_first_step_rows_ref if device == "cpu" else build.build_packed_first_step_rows_triton
    out = run(fn, fields, R, bs, block_size, device)
    _, ids, positions, slots = host_packing(fields, B, block_size)
    assert out["out_fs_input_ids"].cpu()[:T].tolist() == ids.tolist()
    assert out["out_fs_positions"].cpu()[:T].tolist() == positions.tolist()
    assert out["out_fs_slots"].cpu()[:T].tolist() == slots.tolist()
