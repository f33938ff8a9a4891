"""Copy the target model's batch into the drafter's input buffers, expanding each request by its new-token slots.

Request r owns target rows ``query_start_loc[r] : query_start_loc[r + 1]``; rows up to ``query_end_loc[r]`` are
accepted, the rest (``query_start_loc[r + 1] - 1 - query_end_loc[r]`` rows) were rejected by verification.
With ``P = num_padding_slots_per_request`` (1 bonus slot + P - 1 parallel-drafting slots), request r's output
window starts at ``query_start_loc[r] + r * (P - 1)`` when ``shift_input_ids`` (EAGLE: token of row j is the
target token of row j + 1, so the first target token is dropped) and at ``query_start_loc[r] + r * P`` otherwise.
Inside the window, index j holds, in order:

    [0, V)          V valid tokens: the accepted target tokens (shifted by one when shift_input_ids)
    V               the bonus token next_token_ids[r]
    (V, V + P)      parallel_drafting_token_id, flagged in out_is_masked
    [V + P, end)    one slot per rejected row: padding_token_id, position 0, flagged in out_is_rejected

Positions are ``target_positions[query_start_loc[r]] + j`` (not shifted). out_new_token_indices[r * P + i] is the
output row of slot V + i. With shift_input_ids, out_hidden_state_mapping[query_start_loc[r] + j] = window start + j
for every target row of the request (rejected ones included); without, it is not written.
Total output rows: T_in + B * (P - 1) with shift, T_in + B * P without.
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def _window_start(query_start: int, request: int, num_padding_slots: int, shift_input_ids: bool) -> int:
    return query_start + request * (num_padding_slots - 1 if shift_input_ids else num_padding_slots)


def copy_and_expand_inputs_ref(
    target_token_ids: torch.Tensor,  # [T_in] int
    target_positions: torch.Tensor,  # [T_in] int64
    next_token_ids: torch.Tensor,  # [B] int, the bonus token of each request
    query_start_loc: torch.Tensor,  # [B + 1] int32
    query_end_loc: torch.Tensor,  # [B] int32, index of each request's last accepted row
    out_input_ids: torch.Tensor,  # [T_out] int (written)
    out_positions: torch.Tensor,  # [T_out] int64 (written)
    out_is_rejected: torch.Tensor,  # [T_out] bool (written)
    out_is_masked: torch.Tensor,  # [T_out] bool (written)
    out_new_token_indices: torch.Tensor,  # [B * P] int (written)
    out_hidden_state_mapping: torch.Tensor,  # [T_in] int (written when shift_input_ids)
    padding_token_id: int,
    parallel_drafting_token_id: int,
    num_padding_slots_per_request: int,  # P >= 1
    shift_input_ids: bool,
) -> None:
    num_slots = num_padding_slots_per_request
    assert num_slots >= 1
    starts, ends = query_start_loc.tolist(), query_end_loc.tolist()
    device = target_token_ids.device
    for request, query_end in enumerate(ends):
        query_start, next_query_start = starts[request], starts[request + 1]
        num_rejected = next_query_start - query_end - 1
        num_valid = query_end - query_start + (0 if shift_input_ids else 1)
        first_source = query_start + (1 if shift_input_ids else 0)
        window = _window_start(query_start, request, num_slots, shift_input_ids)
        window_len = num_valid + num_slots + num_rejected
        j = torch.arange(window_len, device=device)
        rows = window + j

        token_ids = torch.full((window_len,), padding_token_id, dtype=out_input_ids.dtype, device=device)
        token_ids[:num_valid] = target_token_ids[first_source:first_source + num_valid].to(out_input_ids.dtype)
        token_ids[num_valid] = next_token_ids[request].to(out_input_ids.dtype)
        token_ids[num_valid + 1:num_valid + num_slots] = parallel_drafting_token_id
        is_rejected = j >= num_valid + num_slots
        positions = torch.where(is_rejected, 0, target_positions[query_start] + j)

        out_input_ids[rows] = token_ids
        out_positions[rows] = positions.to(out_positions.dtype)
        out_is_rejected[rows] = is_rejected
        out_is_masked[rows] = (j > num_valid) & (j < num_valid + num_slots)
        new_token_rows = window + num_valid + torch.arange(num_slots, device=device)
        out_new_token_indices[request * num_slots:(request + 1) * num_slots] = new_token_rows.to(
            out_new_token_indices.dtype)
        if shift_input_ids:
            num_target_rows = next_query_start - query_start
            out_hidden_state_mapping[query_start:next_query_start] = (
                window + torch.arange(num_target_rows, device=device)).to(out_hidden_state_mapping.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs/outputs as in copy_and_expand_inputs_ref (all 1-D, contiguous).
# Writes:  each request's output window (out_input_ids, out_positions, out_is_rejected, out_is_masked), its P
#          entries of out_new_token_indices and, with SHIFT_INPUT_IDS, its rows of out_hidden_state_mapping.
# Grid:    (B,): one program per request walks its window in BLOCK chunks (prefills can be long).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _copy_and_expand_inputs_kernel(
    target_token_ids_ptr, target_positions_ptr, next_token_ids_ptr, query_start_loc_ptr, query_end_loc_ptr,
    out_input_ids_ptr, out_positions_ptr, out_is_rejected_ptr, out_is_masked_ptr,
    out_new_token_indices_ptr, out_hidden_state_mapping_ptr,
    padding_token_id, parallel_drafting_token_id, num_slots,
    SHIFT_INPUT_IDS: tl.constexpr, BLOCK: tl.constexpr,
):
    request = tl.program_id(0)
    query_start = tl.load(query_start_loc_ptr + request)
    next_query_start = tl.load(query_start_loc_ptr + request + 1)
    query_end = tl.load(query_end_loc_ptr + request)
    num_rejected = next_query_start - query_end - 1
    if SHIFT_INPUT_IDS:
        num_valid = query_end - query_start
        first_source = query_start + 1
        window = query_start + request * (num_slots - 1)
    else:
        num_valid = query_end - query_start + 1
        first_source = query_start
        window = query_start + request * num_slots
    window_len = num_valid + num_slots + num_rejected
    num_target_rows = next_query_start - query_start
    start_position = tl.load(target_positions_ptr + query_start)
    bonus_token = tl.load(next_token_ids_ptr + request)

    for chunk_start in range(0, window_len, BLOCK):
        j = chunk_start + tl.arange(0, BLOCK)
        in_window = j < window_len
        is_valid = j < num_valid
        is_new_token = (j >= num_valid) & (j < num_valid + num_slots)  # bonus + parallel drafting
        is_parallel = (j > num_valid) & (j < num_valid + num_slots)
        is_rejected = j >= num_valid + num_slots

        token_ids = tl.load(target_token_ids_ptr + first_source + j, mask=in_window & is_valid, other=0)
        token_ids = tl.where(j == num_valid, bonus_token, token_ids)
        token_ids = tl.where(is_parallel, parallel_drafting_token_id, token_ids)
        token_ids = tl.where(is_rejected, padding_token_id, token_ids)
        positions = tl.where(is_rejected, 0, start_position + j)

        rows = window + j
        tl.store(out_input_ids_ptr + rows, token_ids.to(out_input_ids_ptr.dtype.element_ty), mask=in_window)
        tl.store(out_positions_ptr + rows, positions.to(out_positions_ptr.dtype.element_ty), mask=in_window)
        tl.store(out_is_rejected_ptr + rows, is_rejected, mask=in_window)
        tl.store(out_is_masked_ptr + rows, is_parallel, mask=in_window)
        tl.store(out_new_token_indices_ptr + request * num_slots + (j - num_valid),
                 rows.to(out_new_token_indices_ptr.dtype.element_ty), mask=in_window & is_new_token)
        if SHIFT_INPUT_IDS:  # window_len >= num_target_rows here, so the chunks cover every target row
            tl.store(out_hidden_state_mapping_ptr + query_start + j,
                     rows.to(out_hidden_state_mapping_ptr.dtype.element_ty), mask=j < num_target_rows)


def copy_and_expand_inputs_triton(
    target_token_ids: torch.Tensor,  # [T_in] int
    target_positions: torch.Tensor,  # [T_in] int64
    next_token_ids: torch.Tensor,  # [B] int
    query_start_loc: torch.Tensor,  # [B + 1] int32
    query_end_loc: torch.Tensor,  # [B] int32
    out_input_ids: torch.Tensor,  # [T_out] int (written)
    out_positions: torch.Tensor,  # [T_out] int64 (written)
    out_is_rejected: torch.Tensor,  # [T_out] bool (written)
    out_is_masked: torch.Tensor,  # [T_out] bool (written)
    out_new_token_indices: torch.Tensor,  # [B * P] int (written)
    out_hidden_state_mapping: torch.Tensor,  # [T_in] int (written when shift_input_ids)
    padding_token_id: int,
    parallel_drafting_token_id: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
) -> None:
    num_requests = query_end_loc.shape[0]
    assert num_padding_slots_per_request >= 1
    tensors = (target_token_ids, target_positions, next_token_ids, query_start_loc, query_end_loc, out_input_ids,
               out_positions, out_is_rejected, out_is_masked, out_new_token_indices, out_hidden_state_mapping)
    assert all(t.is_contiguous() for t in tensors)
    if num_requests == 0:
        return
    _copy_and_expand_inputs_kernel[(num_requests,)](
        *tensors,
        padding_token_id, parallel_drafting_token_id, num_padding_slots_per_request,
        SHIFT_INPUT_IDS=shift_input_ids, BLOCK=128,
    )
