"""Advance every request by one autoregressive draft step: position, KV slot and context length.

For request r: ``position = positions[r] + 1``. If that reaches ``max_model_len`` the request is past its end: its
draft is garbage and will be ignored, so its position is clamped to 0 (keeps RoPE in range), its slot is
PADDING_SLOT_ID (its K/V is not written) and its seq_len becomes 1 (cheap attention). Otherwise the slot is
``block_tables[r, position // block_size] * block_size + position % block_size`` (block index clamped to the
table's width, which only matters for the garbage rows) and ``seq_lens[r] += 1`` (capped at max_model_len).
Rows ``B <= i < len(out_slot_mapping)`` are CUDA-graph padding: their slot is PADDING_SLOT_ID.

``draft_column`` (optional, [1] int64): the column of the step's drafts in a [B, K] buffer, advanced too:
``draft_column = min(draft_column + 1, max_column)``. A captured decode step (drafter_service/engine/cuda_graphs.py)
needs that counter on the device; counting it here spares the step two elementwise kernels of its own (an add and a
clamp: ~3 us of GPU time with their boundaries per decode step on an H200).
"""
import torch

from drafter_kernels._triton_shim import tl, triton
from drafter_kernels.kv_write import PADDING_SLOT_ID


def advance_draft_step_ref(
    positions: torch.Tensor,  # [B] int64, the positions of the step just run
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32 (updated in place)
    block_size: int,
    max_model_len: int,
    out_positions: torch.Tensor,  # [B] int64 (written; may be `positions` itself)
    out_slot_mapping: torch.Tensor,  # [B_padded >= B] int64 (written)
    draft_column: torch.Tensor | None = None,  # [1] int64 (updated in place): min(draft_column + 1, max_column)
    max_column: int = 0,
) -> None:
    if draft_column is not None:
        draft_column.add_(1).clamp_(max=max_column)
    num_requests, max_blocks = positions.shape[0], block_tables.shape[1]
    new_positions = positions + 1
    past_end = new_positions >= max_model_len
    clamped = torch.where(past_end, 0, new_positions)
    block_index = (clamped // block_size).clamp(max=max_blocks - 1)
    block_ids = block_tables[:num_requests].gather(1, block_index[:, None]).squeeze(1).long()
    slots = torch.where(past_end, PADDING_SLOT_ID, block_ids * block_size + clamped % block_size)
    new_seq_lens = torch.where(past_end, 1, seq_lens + 1).clamp(max=max_model_len)
    out_positions.copy_(clamped)
    out_slot_mapping[:num_requests] = slots.to(out_slot_mapping.dtype)
    out_slot_mapping[num_requests:] = PADDING_SLOT_ID
    seq_lens.copy_(new_seq_lens)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  positions [B]; block_tables [B, max_blocks] (unit stride on blocks); seq_lens [B].
# Writes:  out_positions [B], seq_lens [B] (in place), out_slot_mapping [B_padded], every entry; with HAS_COLUMN,
#          draft_column [1] (program 0 only; no other program reads it).
# Grid:    (cdiv(B_padded, BLOCK),): one program handles BLOCK rows (real requests and padding rows alike).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["block_tables_stride", "num_requests", "num_rows_padded", "max_blocks", "max_column"])
def _advance_draft_step_kernel(
    positions_ptr, block_tables_ptr, block_tables_stride, seq_lens_ptr, out_positions_ptr, out_slot_mapping_ptr,
    draft_column_ptr, num_requests, num_rows_padded, block_size, max_model_len, max_blocks, max_column,
    BLOCK: tl.constexpr, HAS_COLUMN: tl.constexpr,
):
    if HAS_COLUMN:
        if tl.program_id(0) == 0:
            column = tl.load(draft_column_ptr)
            tl.store(draft_column_ptr, tl.minimum(column + 1, max_column))
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_request = rows < num_requests
    new_positions = tl.load(positions_ptr + rows, mask=is_request, other=0).to(tl.int64) + 1
    past_end = new_positions >= max_model_len
    clamped = tl.where(past_end, 0, new_positions)
    block_index = tl.minimum(clamped // block_size, max_blocks - 1)
    block_ids = tl.load(block_tables_ptr + rows.to(tl.int64) * block_tables_stride + block_index,
                        mask=is_request, other=0).to(tl.int64)
    slots = tl.where(past_end | (rows >= num_requests), -1, block_ids * block_size + clamped % block_size)
    seq_lens = tl.load(seq_lens_ptr + rows, mask=is_request, other=0)
    new_seq_lens = tl.minimum(tl.where(past_end, 1, seq_lens + 1), max_model_len)

    tl.store(out_positions_ptr + rows, clamped.to(out_positions_ptr.dtype.element_ty), mask=is_request)
    tl.store(seq_lens_ptr + rows, new_seq_lens.to(seq_lens_ptr.dtype.element_ty), mask=is_request)
    tl.store(out_slot_mapping_ptr + rows, slots.to(out_slot_mapping_ptr.dtype.element_ty), mask=rows < num_rows_padded)


def advance_draft_step_triton(
    positions: torch.Tensor,  # [B] int64
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32 (updated in place)
    block_size: int,
    max_model_len: int,
    out_positions: torch.Tensor,  # [B] int64 (written)
    out_slot_mapping: torch.Tensor,  # [B_padded >= B] int64 (written)
    draft_column: torch.Tensor | None = None,  # [1] int64 (updated in place): min(draft_column + 1, max_column)
    max_column: int = 0,
) -> None:
    num_requests = positions.shape[0]
    num_rows_padded = out_slot_mapping.shape[0]
    assert num_rows_padded >= num_requests and block_tables.stride(1) == 1
    assert all(t.is_contiguous() for t in (positions, seq_lens, out_positions, out_slot_mapping))
    assert draft_column is None or (draft_column.numel() == 1 and draft_column.dtype == torch.int64)
    if num_rows_padded == 0:
        if draft_column is not None:
            draft_column.add_(1).clamp_(max=max_column)
        return
    block = min(1024, triton.next_power_of_2(num_rows_padded))
    _advance_draft_step_kernel[(triton.cdiv(num_rows_padded, block),)](
        positions, block_tables, block_tables.stride(0), seq_lens, out_positions, out_slot_mapping,
        draft_column if draft_column is not None else out_positions,  # (never read without a column)
        num_requests, num_rows_padded, block_size, max_model_len, block_tables.shape[1], max_column,
        BLOCK=block, HAS_COLUMN=draft_column is not None,
    )
