"""copy_and_expand_inputs: Triton kernel vs torch reference, plus a hand-worked example of the layout."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

copy_expand = kernel_module("copy_expand_inputs")
FUNCTIONS = {"ref": copy_expand.copy_and_expand_inputs_ref, "triton": copy_expand.copy_and_expand_inputs_triton}
PADDING_TOKEN, PARALLEL_TOKEN = 0, 99


def run(fn, inputs, num_output_rows, num_slots, shift, bool_fill, device):
    target_ids, target_positions, next_ids, query_start_loc, query_end_loc = inputs
    num_requests, num_input_rows = next_ids.shape[0], target_ids.shape[0]
    outputs = dict(
        out_input_ids=poisoned((num_output_rows + 3,), torch.int32, device),  # 3 rows past the batch
        out_positions=poisoned((num_output_rows + 3,), torch.int64, device),
        out_is_rejected=torch.full((num_output_rows + 3,), bool_fill, device=device),
        out_is_masked=torch.full((num_output_rows + 3,), bool_fill, device=device),
        out_new_token_indices=poisoned((num_requests * num_slots,), torch.int32, device),
        out_hidden_state_mapping=poisoned((num_input_rows + 2,), torch.int32, device),
    )
    fn(*inputs, *outputs.values(), PADDING_TOKEN, PARALLEL_TOKEN, num_slots, shift)
    return outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_hand_worked_example(device, function):
    # Request 0: target rows 0..3 at positions 5..8, rows 0..2 accepted, row 3 rejected. Request 1: rows 4..5 at
    # positions 0..1, both accepted. Bonus tokens 100 and 200; P = 3 slots (bonus + 2 parallel), shift on.
    inputs = (torch.tensor([10, 11, 12, 13, 20, 21]), torch.tensor([5, 6, 7, 8, 0, 1]), torch.tensor([100, 200]),
              torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([2, 5], dtype=torch.int32))
    inputs = tuple(t.to(device) for t in inputs)
    out = run(FUNCTIONS[function], inputs, 10, 3, True, False, device)
    P, X = PARALLEL_TOKEN, POISON_INT
    assert out["out_input_ids"].tolist() == [11, 12, 100, P, P, PADDING_TOKEN, 21, 200, P, P, X, X, X]
    assert out["out_positions"].tolist() == [5, 6, 7, 8, 9, 0, 0, 1, 2, 3, X, X, X]
    assert out["out_is_rejected"].tolist() == [False] * 5 + [True] + [False] * 7
    assert out["out_is_masked"].tolist() == [False, False, False, True, True, False, False, False, True, True] + [
        False] * 3
    assert out["out_new_token_indices"].tolist() == [2, 3, 4, 7, 8, 9]
    assert out["out_hidden_state_mapping"].tolist() == [0, 1, 2, 3, 6, 7, X, X]


def random_batch(query_lens, rejected, gen, device):
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    query_end_loc = query_start_loc[1:] - 1 - torch.tensor(rejected, dtype=torch.int32)
    num_rows = int(query_start_loc[-1])
    positions = torch.cat([torch.arange(n) + int(torch.randint(0, 50, (1,), generator=gen)) for n in query_lens])
    inputs = (torch.randint(1, 1000, (num_rows,), generator=gen, dtype=torch.int32), positions,
              torch.randint(1000, 2000, (len(query_lens),), generator=gen), query_start_loc, query_end_loc)
    return tuple(t.to(device) for t in inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("num_slots", [1, 3])
@pytest.mark.parametrize("query_lens,rejected", [
    ([1], [0]),
    ([4, 1, 4, 3], [2, 0, 0, 3 - 1]),
    ([300, 2, 1, 7, 4], [0, 1, 0, 3, 3]),  # a prefill longer than the kernel's chunk
])
def test_matches_reference(device, shift, num_slots, query_lens, rejected):
    gen = torch.Generator().manual_seed(sum(query_lens) + num_slots)
    inputs = random_batch(query_lens, rejected, gen, device)
    num_output_rows = sum(query_lens) + len(query_lens) * (num_slots - 1 if shift else num_slots)
    for bool_fill in (False, True):  # bool outputs cannot hold a sentinel: poison them both ways
        expected = run(copy_expand.copy_and_expand_inputs_ref, inputs, num_output_rows, num_slots, shift, bool_fill,
                       device)
        actual = run(copy_expand.copy_and_expand_inputs_triton, inputs, num_output_rows, num_slots, shift, bool_fill,
                     device)
        for name in expected:
            assert torch.equal(actual[name], expected[name]), name
        # Exactly the batch's rows are written: the 3 trailing rows keep their poison.
        assert (expected["out_input_ids"][:num_output_rows] != POISON_INT).all()
        assert (expected["out_input_ids"][num_output_rows:] == POISON_INT).all()
        assert (expected["out_is_rejected"][num_output_rows:] == bool_fill).all()
        mapping_written = (expected["out_hidden_state_mapping"] != POISON_INT).sum()
        assert mapping_written == (sum(query_lens) if shift else 0)
