"""Load an engine step's rows into the static buffers of the first-step and decode CUDA graphs, in one launch.

The first draft step of B sequences replays a graph captured for (bs, M): bs >= B padded sequences of M rows each,
sequence i's m_i real rows last (right-aligned; engine/cuda_graphs.py says why). Before the replay the step's packed
metadata (engine/step_metadata.py: rows in batch order, sequence i owning rows [qsl[i], qsl[i+1])) must be laid out
that way. For padded row r = i * M + j (sequence i, row j < M):

  fs_positions[r]   seq_len_i - M + j          seq_len_i = draft_seq_lens[i] (p_i + m_i); M for padding sequences
  fs_input_ids[r]   input_ids[t]               t = qsl[i+1] - M + j, for the real rows j >= M - m_i; 0 otherwise
  fs_slots[r]       slot_mapping[t]            PADDING_SLOT_ID for padding rows (no KV write)
  fs_hidden[r, :]   hidden_states[t, :]        (cast to the buffer's dtype first); padding rows are not written

and per sequence i < bs (the decode graphs' buffers; only rows < B and block-table columns < w are written for real
sequences):

  positions[i] = draft_positions[i]  seq_lens[i] = seq_len_i  steps_left[i] = draft_steps[i] (0 for padding)
  block_tables[i, :w] = draft_block_tables[i]

Every sequence of such a step drafts (the graph path's condition), so the draft_* fields are indexed by batch
position. The torch reference is what the proposer ran before as some ten separate ops (copies, fills, an arange,
an index_copy for mixed m); on the GPU each op was a host launch of its own, host work the GPU waited for.
"""
import torch

from drafter_kernels._triton_shim import tl, triton
from drafter_kernels.kv_write import PADDING_SLOT_ID


def load_first_step_rows_ref(
    input_ids: torch.Tensor,  # [T] int64: the step's first-step rows (row t of sequence i gets x[t+1])
    hidden_states: torch.Tensor,  # [T, W] the rows' target hidden states (any float dtype)
    slot_mapping: torch.Tensor,  # [T] int64
    query_start_loc: torch.Tensor,  # [B + 1] int32
    draft_positions: torch.Tensor,  # [B] int64: each sequence's last position p_i + m_i - 1
    draft_seq_lens: torch.Tensor,  # [B] int32: p_i + m_i
    draft_block_tables: torch.Tensor,  # [B, w] int32
    draft_steps: torch.Tensor,  # [B] int32: decode steps each needs
    rows_per_seq: int,  # M >= every m_i
    out_positions: torch.Tensor,  # [bs] int64 (rows < B written)
    out_seq_lens: torch.Tensor,  # [bs] int32 (written)
    out_block_tables: torch.Tensor,  # [bs, >= w] int32 (rows < B, columns < w written)
    out_steps_left: torch.Tensor,  # [bs] int32 (written)
    out_fs_positions: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_input_ids: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_slots: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_hidden: torch.Tensor,  # [bs * M, W] (real rows written)
) -> None:
    M, B, T, w = rows_per_seq, draft_positions.shape[0], input_ids.shape[0], draft_block_tables.shape[1]
    bs = out_seq_lens.shape[0]
    out_positions[:B] = draft_positions
    out_seq_lens[:B] = draft_seq_lens
    out_seq_lens[B:] = M
    out_block_tables[:B, :w] = draft_block_tables
    out_steps_left[:B] = draft_steps
    out_steps_left[B:] = 0
    r = torch.arange(bs * M, device=input_ids.device)
    out_fs_positions.copy_(out_seq_lens.to(torch.int64)[r // M] - M + r % M)
    ends = query_start_loc[1:].to(torch.int64)  # [B] qsl[i + 1]
    row_seq = torch.repeat_interleave(torch.arange(B, device=input_ids.device),
                                      ends.diff(prepend=ends.new_zeros(1)), output_size=T)  # [T] sequence of each row
    dest = (row_seq + 1) * M - ends[row_seq] + torch.arange(T, device=input_ids.device)  # [T] padded row of row t
    out_fs_slots.fill_(PADDING_SLOT_ID)
    out_fs_input_ids.zero_()
    out_fs_slots[dest] = slot_mapping
    out_fs_input_ids[dest] = input_ids
    out_fs_hidden[dest] = hidden_states.to(out_fs_hidden.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Grid: (bs * M,): one program per padded row r = i * M + j. It writes the row's fields and copies its hidden row in
# BLOCK_W chunks; the program of row j == 0 also writes sequence i's fields (its block-table row in BLOCK_W chunks).
# Every integer argument is do_not_specialize: the kernel runs eagerly each step, and a batch or context that
# happened to be 1 or a multiple of 16 must not compile another variant on the step thread.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_seqs", "rows_per_seq", "width", "table_width", "hidden_stride",
                               "out_hidden_stride", "table_stride", "out_table_stride"])
def _load_first_step_rows_kernel(
    input_ids_ptr, hidden_ptr, slots_ptr, qsl_ptr, draft_pos_ptr, draft_seq_lens_ptr, draft_tables_ptr,
    draft_steps_ptr,
    out_pos_ptr, out_seq_lens_ptr, out_tables_ptr, out_steps_ptr, out_fs_pos_ptr, out_fs_ids_ptr, out_fs_slots_ptr,
    out_fs_hidden_ptr,
    num_seqs, rows_per_seq, width, table_width, hidden_stride, out_hidden_stride, table_stride, out_table_stride,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    i = r // rows_per_seq
    j = r % rows_per_seq
    real_seq = i < num_seqs
    # (masked scalar loads: a padding sequence reads nothing; its seq_len is M, its m 0)
    seq_len = tl.where(real_seq, tl.load(draft_seq_lens_ptr + i, mask=real_seq, other=0).to(tl.int64),
                       rows_per_seq.to(tl.int64))
    end = tl.load(qsl_ptr + i + 1, mask=real_seq, other=0).to(tl.int64)
    m = end - tl.load(qsl_ptr + i, mask=real_seq, other=0).to(tl.int64)
    tl.store(out_fs_pos_ptr + r, seq_len - rows_per_seq + j)
    real_row = j >= rows_per_seq - m  # (never for a padding sequence: m = 0)
    t = end - rows_per_seq + j  # the step's row of padded row r (when real)
    if real_row:
        tl.store(out_fs_ids_ptr + r, tl.load(input_ids_ptr + t))
        tl.store(out_fs_slots_ptr + r, tl.load(slots_ptr + t))
        cols = tl.arange(0, BLOCK_W)
        src = hidden_ptr + t * hidden_stride
        dst = out_fs_hidden_ptr + r.to(tl.int64) * out_hidden_stride
        for c in range(0, width, BLOCK_W):
            mask = c + cols < width
            tl.store(dst + c + cols, tl.load(src + c + cols, mask=mask), mask=mask)
    else:
        tl.store(out_fs_ids_ptr + r, tl.zeros((), dtype=tl.int64))
        tl.store(out_fs_slots_ptr + r, tl.full((), -1, dtype=tl.int64))  # PADDING_SLOT_ID
    if j == 0:
        tl.store(out_seq_lens_ptr + i, seq_len.to(tl.int32))
        if real_seq:
            tl.store(out_pos_ptr + i, tl.load(draft_pos_ptr + i))
            tl.store(out_steps_ptr + i, tl.load(draft_steps_ptr + i))
            cols = tl.arange(0, BLOCK_W)
            for c in range(0, table_width, BLOCK_W):
                mask = c + cols < table_width
                row = tl.load(draft_tables_ptr + i.to(tl.int64) * table_stride + c + cols, mask=mask)
                tl.store(out_tables_ptr + i.to(tl.int64) * out_table_stride + c + cols, row, mask=mask)
        else:
            tl.store(out_steps_ptr + i, tl.zeros((), dtype=tl.int32))


def load_first_step_rows_triton(
    input_ids: torch.Tensor, hidden_states: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
    draft_positions: torch.Tensor, draft_seq_lens: torch.Tensor, draft_block_tables: torch.Tensor,
    draft_steps: torch.Tensor, rows_per_seq: int, out_positions: torch.Tensor, out_seq_lens: torch.Tensor,
    out_block_tables: torch.Tensor, out_steps_left: torch.Tensor, out_fs_positions: torch.Tensor,
    out_fs_input_ids: torch.Tensor, out_fs_slots: torch.Tensor, out_fs_hidden: torch.Tensor,
) -> None:
    M, B, T, w = rows_per_seq, draft_positions.shape[0], input_ids.shape[0], draft_block_tables.shape[1]
    bs, width = out_seq_lens.shape[0], hidden_states.shape[1]
    assert B <= bs and out_fs_positions.shape[0] == bs * M and out_fs_hidden.shape[0] >= bs * M
    assert out_block_tables.shape[0] >= B and out_block_tables.shape[1] >= w and out_fs_hidden.shape[1] == width
    assert hidden_states.shape[0] == T and query_start_loc.shape[0] == B + 1
    assert hidden_states.stride(1) == 1 and out_fs_hidden.stride(1) == 1
    assert draft_block_tables.stride(1) == 1 and out_block_tables.stride(1) == 1
    if bs * M == 0:
        return
    if hidden_states.dtype != out_fs_hidden.dtype:  # (torch's cast, so that the rows equal the reference's exactly)
        hidden_states = hidden_states.to(out_fs_hidden.dtype)
    _load_first_step_rows_kernel[(bs * M,)](
        input_ids, hidden_states, slot_mapping, query_start_loc, draft_positions, draft_seq_lens, draft_block_tables,
        draft_steps,
        out_positions, out_seq_lens, out_block_tables, out_steps_left, out_fs_positions, out_fs_input_ids,
        out_fs_slots, out_fs_hidden,
        B, M, width, w, hidden_states.stride(0), out_fs_hidden.stride(0), draft_block_tables.stride(0),
        out_block_tables.stride(0),
        BLOCK_W=1024,
    )
