"""advance_draft_step: Triton kernel vs torch reference, plus a worked example of the max_model_len clamp; the draft
column it advances on the way (the counter a captured decode step reads)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

draft_step = kernel_module("draft_step")
FUNCTIONS = {"ref": draft_step.advance_draft_step_ref, "triton": draft_step.advance_draft_step_triton}


def run(fn, positions, block_tables, seq_lens, block_size, max_model_len, num_padded, device, column=None,
        max_column=0):
    seq_lens = seq_lens.clone()
    out_positions = poisoned((positions.shape[0],), torch.int64, device)
    out_slots = poisoned((num_padded + 1,), torch.int64, device)  # the last entry lies past the padded batch
    column = None if column is None else torch.tensor([column], device=device)
    fn(positions, block_tables, seq_lens, block_size, max_model_len, out_positions, out_slots[:num_padded],
       column, max_column)
    return out_positions, out_slots, seq_lens, column


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_worked_example(device, function):
    # block_size 16, max_model_len 40. Request 0 steps 15 -> 16 (second block), request 1 steps 39 -> 40: past
    # the end, so position 0, slot -1, seq_len 1. Two CUDA-graph padding rows.
    positions = torch.tensor([15, 39], device=device)
    block_tables = torch.tensor([[7, 3, 9], [2, 5, 8]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([16, 40], dtype=torch.int32, device=device)
    out_positions, out_slots, new_seq_lens, column = run(FUNCTIONS[function], positions, block_tables, seq_lens, 16,
                                                         40, 4, device, column=2, max_column=5)
    assert out_positions.tolist() == [16, 0]
    assert out_slots.tolist() == [3 * 16 + 0, -1, -1, -1, POISON_INT]
    assert new_seq_lens.tolist() == [17, 1]
    assert column.tolist() == [3]  # the next column of the step's drafts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("num_padded", [0, 3])
def test_the_draft_column_stops_at_its_limit(device, function, num_padded):
    # (a graph's warm-up and capture runs replay more steps than there are columns: the last one takes them all;
    # num_padded 0: no row to advance, the column still moves, as the captured step's would)
    rows = min(num_padded, 2)
    positions, seq_lens = torch.zeros(rows, dtype=torch.int64, device=device), torch.ones(rows, dtype=torch.int32,
                                                                                          device=device)
    block_tables = torch.zeros(rows, 2, dtype=torch.int32, device=device)
    for start, want in ((3, 4), (4, 4), (9, 4)):
        *_, column = run(FUNCTIONS[function], positions, block_tables, seq_lens, 16, 64, num_padded, device,
                         column=start, max_column=4)
        assert column.tolist() == [want]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_requests,num_padded,block_size", [(1, 1, 16), (5, 8, 32), (1100, 1200, 16)])
def test_matches_reference(device, num_requests, num_padded, block_size):
    gen = torch.Generator().manual_seed(num_requests)
    max_model_len, max_blocks = 100, 7
    positions = torch.randint(0, max_model_len, (num_requests,), generator=gen)  # includes 99 -> past the end
    positions[0] = max_model_len - 1
    block_tables = torch.randint(0, 500, (num_requests + 2, max_blocks), generator=gen, dtype=torch.int32)
    seq_lens = (positions + 1).int()
    args = [t.to(device) for t in (positions, block_tables, seq_lens)]
    for column in (None, 0, 7):  # (with and without the draft column: two kernel variants)
        expected = run(draft_step.advance_draft_step_ref, *args, block_size, max_model_len, num_padded, device,
                       column, 15)
        actual = run(draft_step.advance_draft_step_triton, *args, block_size, max_model_len, num_padded, device,
                     column, 15)
        for e, a in zip(expected, actual):
            assert (a is None and e is None) or torch.equal(a, e)
    assert (expected[1][num_requests:num_padded] == -1).all() and expected[1][num_padded] == POISON_INT
    assert (expected[0] != POISON_INT).all()


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_positions(device):
    positions = torch.tensor([3, 20], device=device)
    block_tables = torch.tensor([[4, 6], [1, 2]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([4, 21], dtype=torch.int32, device=device)
    slots = torch.empty(2, dtype=torch.int64, device=device)
    draft_step.advance_draft_step_triton(positions, block_tables, seq_lens, 16, 64, positions, slots)
    assert positions.tolist() == [4, 21] and slots.tolist() == [4 * 16 + 4, 2 * 16 + 5]
