"""Build a first draft step's rows *packed* (the step's rows as they come, padding rows after them), on the device,
from the step's raw columns.

The padded first-step graphs (kernels/build_first_step.py) give every sequence M rows, M = the batch's largest m: a
step in which a sequence joins (its prompt of 128-2048 rows beside the others' 1-8 row decodes) would pad every
sequence to the prompt's length. A packed first-step graph is captured per (bs, R) instead: bs padded sequences and
R rows, the step's T <= R rows first, sequence after sequence, as the record holds them, then R - T padding rows
that belong to no sequence (query_start_loc ends at T: the attention never writes or reads them as queries; slot
PADDING_SLOT_ID: no KV write; input id 0, position 0). The hidden states need no layout: row t of the step is row t
of the record's hidden-state buffer, which the graph reads in place.

Inputs (int32, the record of engine/first_step_record.py; only the first B / T / B * w entries are read, B and w
from ``header``):

  header            [2]        B (sequences in the step), w (block-table width of the step)
  start_positions   [B]        p_i
  query_start_loc   [B + 1]    sequence i's committed rows are [qsl[i], qsl[i+1])
  next_tokens       [B]        x[p_i + m_i]: the bonus token
  draft_steps       [B]        k_i - 1: the decode steps sequence i needs
  token_ids         [T]        the committed tokens x[p_i .. p_i+m_i-1], sequence after sequence
  block_tables      [B * w]    sequence i's block ids at [i * w, (i + 1) * w)

Outputs, for row t < R (sequence i of row t < T: the last i with qsl[i] <= t; pos = p_i + t - qsl[i]):

  fs_positions[t]   pos; 0 for a padding row (t >= T)
  fs_input_ids[t]   token_ids[t + 1], or next_tokens[i] for the sequence's last row; 0 for a padding row
  fs_slots[t]       block_tables[i * w + pos // block_size] * block_size + pos % block_size; PADDING_SLOT_ID

and per sequence i < bs (the first step's query layout, and the decode graphs' buffers):

  query_start_loc_out[i] = qsl[min(i, B)] (and entry bs too): padding sequences are empty queries at T
  last_rows[i] = query_start_loc_out[i + 1] - 1 (the row that gives draft 1), at least 0: T - 1 for i >= B
  seq_lens[i] = p_i + m_i (1 for i >= B);  for i < B: positions[i] = seq_len_i - 1, steps_left[i] = draft_steps[i],
  block_tables[i, :w] = the sequence's blocks;  for B <= i < bs: steps_left[i] = 0 (masked; nothing else written)

and draft_column[0] = 0. These are the values the padded builder writes, packed instead of right-aligned.
"""
import torch

from drafter_kernels._triton_shim import tl, triton
from drafter_kernels.build_first_step import record_rows_ref
from drafter_kernels.kv_write import PADDING_SLOT_ID


def build_packed_first_step_rows_ref(
    header: torch.Tensor,  # [2] int32: B, w
    start_positions: torch.Tensor,  # [>= B] int32
    query_start_loc: torch.Tensor,  # [>= B + 1] int32
    next_tokens: torch.Tensor,  # [>= B] int32
    draft_steps: torch.Tensor,  # [>= B] int32
    token_ids: torch.Tensor,  # [>= T] int32
    block_tables: torch.Tensor,  # [>= B * w] int32
    block_size: int,
    out_positions: torch.Tensor,  # [bs] int64 (rows < B written)
    out_seq_lens: torch.Tensor,  # [bs] int32 (written)
    out_block_tables: torch.Tensor,  # [bs, >= w] int32 (rows < B, columns < w written)
    out_steps_left: torch.Tensor,  # [bs] int32 (written)
    out_query_start_loc: torch.Tensor,  # [bs + 1] int32 (written)
    out_last_rows: torch.Tensor,  # [bs] int64 (written)
    out_fs_positions: torch.Tensor,  # [R] int64 (written)
    out_fs_input_ids: torch.Tensor,  # [R] int64 (written)
    out_fs_slots: torch.Tensor,  # [R] int64 (written)
    out_draft_column: torch.Tensor,  # [1] int64 (set to 0)
) -> None:
    bs, R = out_seq_lens.shape[0], out_fs_positions.shape[0]
    B, qsl, T, _, _, positions, ids, slots = record_rows_ref(
        header, start_positions, query_start_loc, next_tokens, draft_steps, token_ids, block_tables, block_size, 1,
        out_positions, out_seq_lens, out_block_tables, out_steps_left)  # (a padding sequence: an empty query)
    assert B <= bs and T <= R, (B, bs, T, R)
    out_query_start_loc[: B + 1] = qsl.to(torch.int32)
    out_query_start_loc[B + 1 :] = T
    out_last_rows.copy_((out_query_start_loc[1:].to(torch.int64) - 1).clamp(min=0))
    # rows T..R-1 are padding
    out_fs_positions.zero_()
    out_fs_input_ids.zero_()
    out_fs_slots.fill_(PADDING_SLOT_ID)
    out_fs_positions[:T] = positions
    out_fs_input_ids[:T] = ids
    out_fs_slots[:T] = slots
    out_draft_column.zero_()


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Grid: (max(R, bs + 1),). Program r writes row r (r < R): its sequence found by a binary search of qsl over the
# step's B sequences; and sequence r's fields (r < bs) with its block-table row in BLOCK_W chunks, and entry r of
# query_start_loc_out (r <= bs); program 0 the draft column. B, w and T are read from the record (device memory): the
# kernel is captured once per (bs, R) and replayed whatever the step's B, w and T; every integer argument is
# do_not_specialize, so that no R or width compiles another variant.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["block_size", "num_rows", "padded_seqs", "out_table_stride"])
def _build_packed_first_step_rows_kernel(
    header_ptr, p_ptr, qsl_ptr, next_ptr, steps_ptr, tokens_ptr, tables_ptr,
    out_pos_ptr, out_seq_lens_ptr, out_tables_ptr, out_steps_ptr, out_qsl_ptr, out_last_ptr,
    out_fs_pos_ptr, out_fs_ids_ptr, out_fs_slots_ptr, out_column_ptr,
    block_size, num_rows, padded_seqs, out_table_stride,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    if r == 0:
        tl.store(out_column_ptr, tl.zeros((), dtype=tl.int64))
    num_seqs = tl.load(header_ptr)
    table_width = tl.load(header_ptr + 1)
    total = tl.load(qsl_ptr + num_seqs)  # T
    if r < num_rows:
        if r < total:
            lo = 0  # the last sequence whose rows start at or before row r
            hi = num_seqs - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tl.load(qsl_ptr + mid) <= r:
                    lo = mid
                else:
                    hi = mid - 1
            start = tl.load(qsl_ptr + lo)
            end = tl.load(qsl_ptr + lo + 1)
            pos = tl.load(p_ptr + lo).to(tl.int64) + r - start
            if r + 1 < end:
                token = tl.load(tokens_ptr + r + 1).to(tl.int64)
            else:
                token = tl.load(next_ptr + lo).to(tl.int64)
            block = tl.load(tables_ptr + lo.to(tl.int64) * table_width + pos // block_size).to(tl.int64)
            tl.store(out_fs_pos_ptr + r, pos)
            tl.store(out_fs_ids_ptr + r, token)
            tl.store(out_fs_slots_ptr + r, block * block_size + pos % block_size)
        else:
            tl.store(out_fs_pos_ptr + r, tl.zeros((), dtype=tl.int64))
            tl.store(out_fs_ids_ptr + r, tl.zeros((), dtype=tl.int64))
            tl.store(out_fs_slots_ptr + r, tl.full((), -1, dtype=tl.int64))  # PADDING_SLOT_ID
    if r <= padded_seqs:
        tl.store(out_qsl_ptr + r, tl.load(qsl_ptr + tl.minimum(r, num_seqs)))
    if r < padded_seqs:
        if r < num_seqs:
            start = tl.load(qsl_ptr + r)
            end = tl.load(qsl_ptr + r + 1)
            seq_len = tl.load(p_ptr + r) + end - start
            tl.store(out_seq_lens_ptr + r, seq_len)
            tl.store(out_pos_ptr + r, seq_len.to(tl.int64) - 1)
            tl.store(out_steps_ptr + r, tl.load(steps_ptr + r))
            tl.store(out_last_ptr + r, tl.maximum(end.to(tl.int64) - 1, 0))
            cols = tl.arange(0, BLOCK_W)
            table_row = tables_ptr + r.to(tl.int64) * table_width
            for c in range(0, table_width, BLOCK_W):
                mask = c + cols < table_width
                tl.store(out_tables_ptr + r.to(tl.int64) * out_table_stride + c + cols,
                         tl.load(table_row + c + cols, mask=mask), mask=mask)
        else:
            tl.store(out_seq_lens_ptr + r, tl.full((), 1, dtype=tl.int32))
            tl.store(out_steps_ptr + r, tl.zeros((), dtype=tl.int32))
            tl.store(out_last_ptr + r, tl.maximum(total.to(tl.int64) - 1, 0))


def build_packed_first_step_rows_triton(
    header: torch.Tensor, start_positions: torch.Tensor, query_start_loc: torch.Tensor, next_tokens: torch.Tensor,
    draft_steps: torch.Tensor, token_ids: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    out_positions: torch.Tensor, out_seq_lens: torch.Tensor, out_block_tables: torch.Tensor,
    out_steps_left: torch.Tensor, out_query_start_loc: torch.Tensor, out_last_rows: torch.Tensor,
    out_fs_positions: torch.Tensor, out_fs_input_ids: torch.Tensor, out_fs_slots: torch.Tensor,
    out_draft_column: torch.Tensor,
) -> None:
    bs, R = out_seq_lens.shape[0], out_fs_positions.shape[0]
    assert out_query_start_loc.shape[0] == bs + 1 and out_last_rows.shape[0] == bs
    assert out_fs_input_ids.shape[0] == R and out_fs_slots.shape[0] == R and out_block_tables.stride(1) == 1
    assert all(x.dtype == torch.int32 for x in (header, start_positions, query_start_loc, next_tokens, draft_steps,
                                                token_ids, block_tables, out_query_start_loc))
    assert out_draft_column.dtype == torch.int64 and out_draft_column.numel() == 1
    _build_packed_first_step_rows_kernel[(max(R, bs + 1),)](
        header, start_positions, query_start_loc, next_tokens, draft_steps, token_ids, block_tables,
        out_positions, out_seq_lens, out_block_tables, out_steps_left, out_query_start_loc, out_last_rows,
        out_fs_positions, out_fs_input_ids, out_fs_slots, out_draft_column,
        block_size, R, bs, out_block_tables.stride(0),
        BLOCK_W=1024,
    )
