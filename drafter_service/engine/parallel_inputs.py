"""Input layout of parallel drafting (P-EAGLE): all k drafts of a sequence in one forward pass.

Torch reference of the copy-and-expand step (vLLM's ``copy_and_expand_eagle_inputs_kernel``, seed 000), generalized
from one slot count for the whole batch to one per request (our sequences ask for different k). The kernels
branch writes the Triton form; the proposer calls this function until both are wired together.

Per request r, its input rows ``query_start_loc[r] .. query_start_loc[r+1]-1`` hold the target's tokens at
consecutive positions; the accepted ones end at ``query_end_loc[r]`` (the rest, if any, are rejected drafts the
target verified; our engine never sends those, so that region is empty in the server). With S = slots[r]
(the bonus slot plus S-1 parallel-drafting slots) and shift_input_ids, the output rows of request r are:

    [0, n_valid)              x[t+1] of the accepted rows but the last        (n_valid = accepted rows - 1)
    n_valid                   the bonus token (next_token_ids[r])             -> its output gives draft 1
    n_valid+1 .. n_valid+S-1  parallel_token_id, "masked" (hidden: mask)     -> outputs give drafts 2 .. S
    then one row per rejected input row: padding_token_id, "rejected" (write no KV, ignore the output)

Positions are not shifted: output row j sits at (first input position) + j (rejected rows: 0). The hidden state
of input row i goes to output row i of its request (``hidden_state_mapping``), so row j pairs x[t+1] with h[t];
masked rows get the head's mask hidden state instead (the caller fills them).
Without shift_input_ids the accepted tokens are copied as they are (n_valid = accepted rows) and the slots follow.
"""
from dataclasses import dataclass

import torch


@dataclass
class ExpandedInputs:
    input_ids: torch.Tensor  # [T_out] int64
    positions: torch.Tensor  # [T_out] int64
    is_rejected: torch.Tensor  # [T_out] bool
    is_masked: torch.Tensor  # [T_out] bool: parallel-drafting slots (hidden = mask hidden)
    new_token_indices: torch.Tensor  # [sum slots] int64: output rows of the bonus + parallel slots, request order
    hidden_state_mapping: torch.Tensor  # [T_in] int64: output row of each input row's hidden state
    query_start_loc: torch.Tensor  # [B + 1] int64: request r owns output rows [qsl[r], qsl[r+1])


def copy_and_expand_inputs_ref(
    target_token_ids: torch.Tensor,  # [T_in] int64
    target_positions: torch.Tensor,  # [T_in] int64
    next_token_ids: torch.Tensor,  # [B] int64: the bonus token of each request
    query_start_loc: torch.Tensor,  # [B + 1] int64: request r owns input rows [qsl[r], qsl[r+1])
    query_end_loc: torch.Tensor,  # [B] int64: last accepted input row of each request (inclusive)
    slots: torch.Tensor,  # [B] int64 >= 1: bonus + parallel-drafting slots of each request
    padding_token_id: int,
    parallel_token_id: int,
    shift_input_ids: bool = True,
) -> ExpandedInputs:
    qsl, qel, n_slots = query_start_loc.tolist(), query_end_loc.tolist(), slots.tolist()
    B = len(n_slots)
    dev = target_token_ids.device
    shift = 1 if shift_input_ids else 0
    out_lens = [(qel[r] - qsl[r] + 1 - shift) + n_slots[r] + (qsl[r + 1] - qel[r] - 1) for r in range(B)]
    out_qsl = [0]
    for n in out_lens:
        out_qsl.append(out_qsl[-1] + n)
    T_out = out_qsl[-1]
    input_ids = torch.empty(T_out, dtype=torch.int64, device=dev)
    positions = torch.empty(T_out, dtype=torch.int64, device=dev)
    is_rejected = torch.zeros(T_out, dtype=torch.bool, device=dev)
    is_masked = torch.zeros(T_out, dtype=torch.bool, device=dev)
    new_token_indices = torch.empty(sum(n_slots), dtype=torch.int64, device=dev)
    hidden_state_mapping = torch.empty(target_token_ids.shape[0], dtype=torch.int64, device=dev)
    new_at = 0
    for r in range(B):
        start, S = out_qsl[r], n_slots[r]
        n_valid = qel[r] - qsl[r] + 1 - shift
        j = torch.arange(out_lens[r], device=dev)
        valid, bonus = j < n_valid, j == n_valid
        parallel = (j > n_valid) & (j < n_valid + S)
        rejected = j >= n_valid + S
        src = (qsl[r] + shift + j).clamp(max=target_token_ids.shape[0] - 1)
        ids = torch.where(valid, target_token_ids[src], torch.full_like(j, padding_token_id))
        ids = torch.where(bonus, next_token_ids[r], ids)
        ids = torch.where(parallel, torch.full_like(j, parallel_token_id), ids)
        input_ids[start : start + out_lens[r]] = ids
        positions[start : start + out_lens[r]] = torch.where(rejected, 0, target_positions[qsl[r]] + j)
        is_rejected[start : start + out_lens[r]] = rejected
        is_masked[start : start + out_lens[r]] = parallel
        new_token_indices[new_at : new_at + S] = start + n_valid + torch.arange(S, device=dev)
        new_at += S
        n_in = qsl[r + 1] - qsl[r]  # every input row's hidden state keeps its index within the request
        hidden_state_mapping[qsl[r] : qsl[r + 1]] = start + torch.arange(n_in, device=dev)
    return ExpandedInputs(input_ids, positions, is_rejected, is_masked, new_token_indices, hidden_state_mapping,
                          torch.tensor(out_qsl, dtype=torch.int64, device=dev))
