"""The two input layouts: copy-and-expand (parallel drafting, seed 000; our per-request-slots torch reference, and
its agreement with the kernels' one-slot-count version) and shift-and-cache (multi-layer EAGLE, seed 003, on the
kernels' shift_and_cache)."""
import torch

from drafter_service.engine.multi_layer_inputs import shift_and_cache
from drafter_service.engine.parallel_inputs import copy_and_expand_inputs_ref

PTD, PAD = -2, 0


def test_copy_and_expand_with_rejected_rows_and_per_request_slots():
    # request 0: 4 input rows, the last a rejected draft; request 1: 4 rows all accepted; request 2: 2 rows, k = 1
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 30, 31])
    positions = torch.tensor([5, 6, 7, 8, 0, 1, 2, 3, 40, 41])
    out = copy_and_expand_inputs_ref(tokens, positions, next_token_ids=torch.tensor([100, 200, 300]),
                                     query_start_loc=torch.tensor([0, 4, 8, 10]),
                                     query_end_loc=torch.tensor([2, 7, 9]), slots=torch.tensor([3, 3, 1]),
                                     padding_token_id=PAD, parallel_token_id=PTD)
    assert out.query_start_loc.tolist() == [0, 6, 12, 14]
    assert out.input_ids.tolist() == [11, 12, 100, PTD, PTD, PAD,  # shifted, bonus, 2 parallel slots, rejected
                                      21, 22, 23, 200, PTD, PTD,
                                      31, 300]
    assert out.positions.tolist() == [5, 6, 7, 8, 9, 0, 0, 1, 2, 3, 4, 5, 40, 41]
    assert out.is_masked.tolist() == [False] * 3 + [True] * 2 + [False] * 5 + [True] * 2 + [False] * 2
    assert out.is_rejected.tolist() == [False] * 5 + [True] + [False] * 8
    assert out.new_token_indices.tolist() == [2, 3, 4, 9, 10, 11, 13]
    # hidden state of input row i -> output row i of its request (x[t+1] pairs with h[t])
    assert out.hidden_state_mapping.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13]


def test_shift_and_cache_prepends_cached_rows_and_keeps_the_last_max_shift():
    W, MAX_SHIFT = 2, 3
    # sequence 0: cache [a1, a2, a3], re-feed 2 rows, 4 new rows; sequence 1: new, 1 row, nothing cached
    cached_ids = torch.tensor([[101, 102, 103], [0, 0, 0]])
    cached_pos = torch.tensor([[1, 2, 3], [0, 0, 0]])
    cached_hidden = torch.arange(2 * MAX_SHIFT * W, dtype=torch.float32).view(2, MAX_SHIFT, W)
    src_ids = torch.tensor([104, 105, 106, 107, 900])
    src_pos = torch.tensor([4, 5, 6, 7, 0])
    src_hidden = 100 + torch.arange(5 * W, dtype=torch.float32).view(5, W)
    win = shift_and_cache(src_ids, src_pos, src_pos + 1000, src_hidden, query_start_loc=[0, 4, 5],
                          shift=[2, 0], cached_len=[3, 0], cached_token_ids=cached_ids.clone(),
                          cached_positions=cached_pos.clone(), cached_slot_mapping=cached_pos + 1000,
                          cached_hidden_states=cached_hidden.clone())  # rewritten in place
    assert win.query_start_loc == [0, 6, 7]
    assert win.token_ids.tolist() == [102, 103, 104, 105, 106, 107, 900]
    assert win.positions.tolist() == [2, 3, 4, 5, 6, 7, 0]
    assert win.slot_mapping.tolist() == [1002, 1003, 1004, 1005, 1006, 1007, 1000]
    assert torch.equal(win.hidden_states[:2], cached_hidden[0, 1:3]) and torch.equal(win.hidden_states[2:], src_hidden)
    assert win.cached_len == [3, 1]
    assert win.cached_token_ids.tolist() == [[105, 106, 107], [900, 0, 0]]
    assert win.cached_positions.tolist() == [[5, 6, 7], [0, 0, 0]]
    assert torch.equal(win.cached_hidden_states[0], src_hidden[1:4])


def test_copy_and_expand_equals_the_kernels_reference_when_slots_are_equal():
    from drafter_kernels.copy_expand_inputs import copy_and_expand_inputs_ref as kernels_ref

    g = torch.Generator().manual_seed(0)
    lens, rejected, P = [3, 1, 6, 2], [1, 0, 2, 0], 4
    qsl = [0]
    for n, r in zip(lens, rejected):
        qsl.append(qsl[-1] + n + r)
    T = qsl[-1]
    tokens, positions = torch.randint(0, 100, (T,), generator=g), torch.arange(T) * 3
    qs, qe = torch.tensor(qsl), torch.tensor([qsl[i] + lens[i] - 1 for i in range(len(lens))])
    nxt = torch.randint(0, 100, (len(lens),), generator=g)
    ours = copy_and_expand_inputs_ref(tokens, positions, nxt, qs, qe, torch.full((len(lens),), P), PAD, PTD)
    T_out = T + len(lens) * (P - 1)
    out = dict(out_input_ids=torch.empty(T_out, dtype=torch.int64), out_positions=torch.empty(T_out, dtype=torch.int64),
               out_is_rejected=torch.empty(T_out, dtype=torch.bool), out_is_masked=torch.empty(T_out, dtype=torch.bool),
               out_new_token_indices=torch.empty(len(lens) * P, dtype=torch.int64),
               out_hidden_state_mapping=torch.empty(T, dtype=torch.int64))
    kernels_ref(tokens, positions, nxt, qs.int(), qe.int(), **out, padding_token_id=PAD,
                parallel_drafting_token_id=PTD, num_padding_slots_per_request=P, shift_input_ids=True)
    assert torch.equal(ours.input_ids, out["out_input_ids"]) and torch.equal(ours.positions, out["out_positions"])
    assert torch.equal(ours.is_rejected, out["out_is_rejected"]) and torch.equal(ours.is_masked, out["out_is_masked"])
    assert torch.equal(ours.new_token_indices, out["out_new_token_indices"])
    assert torch.equal(ours.hidden_state_mapping, out["out_hidden_state_mapping"])
