"""Build an engine step's first-step rows and decode rows, on the device, from the step's raw columns.

The first draft step of B sequences replays a graph captured for (bs, M): bs >= B padded sequences of M rows each,
sequence i's m_i real rows last (right-aligned; engine/cuda_graphs.py says why). This kernel is the graph's first
node: it reads the step's columns from buffers at fixed addresses (the host writes them and copies them in before the
replay: engine/cuda_graphs.py, "the step's record") and writes the graph's static rows, so that the positions, KV
slots, shifted input ids and block-table rows are computed inside the graph instead of packed on the host.

Inputs (int32; only the first B / T / B * w entries are read, B and w from ``header``):

  header            [2]        B (sequences in the step), w (block-table width of the step)
  start_positions   [B]        p_i
  query_start_loc   [B + 1]    sequence i's committed rows are [qsl[i], qsl[i+1]) of token_ids / hidden_states
  next_tokens       [B]        x[p_i + m_i]: the bonus token
  draft_steps       [B]        k_i - 1: the decode steps sequence i needs
  token_ids         [T]        the committed tokens x[p_i .. p_i+m_i-1], sequence after sequence
  block_tables      [B * w]    sequence i's block ids at [i * w, (i + 1) * w)
  hidden_states     [T, W]     the rows' target hidden states (in the static buffer's dtype)

For padded row r = i * M + j (sequence i, row j < M), with m_i = qsl[i+1] - qsl[i] and seq_len_i = p_i + m_i (M for
a padding sequence, i >= B, whose m is 0):

  fs_positions[r]   seq_len_i - M + j
  real rows (j >= M - m_i), step row t = qsl[i+1] - M + j at position pos = seq_len_i - M + j:
    fs_input_ids[r] token_ids[t + 1], or next_tokens[i] for the sequence's last row (row t gets x[t+1])
    fs_slots[r]     block_tables[i * w + pos // block_size] * block_size + pos % block_size
    fs_hidden[r, :] hidden_states[t, :]
  padding rows:     fs_input_ids[r] = 0, fs_slots[r] = PADDING_SLOT_ID (no KV write), fs_hidden[r] not written

and per sequence i < bs (the decode graphs' buffers):

  seq_lens[i] = seq_len_i;  for i < B: positions[i] = seq_len_i - 1, steps_left[i] = draft_steps[i],
  block_tables[i, :w] = the sequence's blocks;  for B <= i < bs: steps_left[i] = 0 (masked; nothing else written)

and draft_column[0] = 0: the column of drafts_out that draft 1 goes to (the decode steps advance it).

These are the values engine/step_metadata.py packs on the host for the eager path (positions, slot_mapping, the
shifted input ids) followed by what kernels/load_first_step.py laid out before this kernel replaced both.
"""
import torch

from drafter_kernels._triton_shim import tl, triton
from drafter_kernels.kv_write import PADDING_SLOT_ID


def record_rows_ref(header: torch.Tensor, start_positions: torch.Tensor, query_start_loc: torch.Tensor,
                    next_tokens: torch.Tensor, draft_steps: torch.Tensor, token_ids: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int, padding_seq_len: int, out_positions: torch.Tensor,
                    out_seq_lens: torch.Tensor, out_block_tables: torch.Tensor, out_steps_left: torch.Tensor):
    """What the references of both first-step builders (this one, padded; build_packed_first_step.py, packed) do
    alike: from the record (the inputs as documented above), the decode rows of sequences i < bs (positions,
    seq_lens, steps, block tables; a padding sequence i >= B gets steps 0 and seq_len padding_seq_len) and the step's
    own rows t = 0..T-1: their sequence, position, input id (x[t+1]; the last row of a sequence its next token) and
    KV slot. Returns (B, qsl [B + 1] int64, T, row_seq, t, positions, ids, slots), the last five [T] int64."""
    B, w = (int(x) for x in header[:2].tolist())
    dev = out_seq_lens.device
    qsl = query_start_loc[: B + 1].to(torch.int64)
    m, T = qsl.diff(), int(qsl[B])
    seq_lens = start_positions[:B].to(torch.int64) + m  # [B]
    tables = block_tables[: B * w].view(B, w)
    out_positions[:B] = seq_lens - 1
    out_seq_lens[:B] = seq_lens.to(torch.int32)
    out_seq_lens[B:] = padding_seq_len
    out_block_tables[:B, :w] = tables
    out_steps_left[:B] = draft_steps[:B]
    out_steps_left[B:] = 0
    row_seq = torch.repeat_interleave(torch.arange(B, device=dev), m, output_size=T)  # [T]
    t = torch.arange(T, device=dev)
    positions = start_positions[:B].to(torch.int64)[row_seq] + t - qsl[row_seq]
    ids = torch.empty(T, dtype=torch.int64, device=dev)
    ids[:-1] = token_ids[1:T]
    ids[qsl[1:][m > 0] - 1] = next_tokens[:B].to(torch.int64)[m > 0]  # each sequence's last row
    blocks = tables[row_seq, positions // block_size].to(torch.int64)
    return B, qsl, T, row_seq, t, positions, ids, blocks * block_size + positions % block_size


def build_first_step_rows_ref(
    header: torch.Tensor,  # [2] int32: B, w
    start_positions: torch.Tensor,  # [>= B] int32
    query_start_loc: torch.Tensor,  # [>= B + 1] int32
    next_tokens: torch.Tensor,  # [>= B] int32
    draft_steps: torch.Tensor,  # [>= B] int32
    token_ids: torch.Tensor,  # [>= T] int32
    block_tables: torch.Tensor,  # [>= B * w] int32
    hidden_states: torch.Tensor,  # [>= T, W]
    block_size: int,
    rows_per_seq: int,  # M >= every m_i
    out_positions: torch.Tensor,  # [bs] int64 (rows < B written)
    out_seq_lens: torch.Tensor,  # [bs] int32 (written)
    out_block_tables: torch.Tensor,  # [bs, >= w] int32 (rows < B, columns < w written)
    out_steps_left: torch.Tensor,  # [bs] int32 (written)
    out_fs_positions: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_input_ids: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_slots: torch.Tensor,  # [bs * M] int64 (written)
    out_fs_hidden: torch.Tensor,  # [bs * M, W] (real rows written)
    out_draft_column: torch.Tensor,  # [1] int64 (set to 0)
) -> None:
    M, bs = rows_per_seq, out_seq_lens.shape[0]
    B, qsl, T, row_seq, t, positions, ids, slots = record_rows_ref(
        header, start_positions, query_start_loc, next_tokens, draft_steps, token_ids, block_tables, block_size, M,
        out_positions, out_seq_lens, out_block_tables, out_steps_left)  # (a padding sequence: M rows at 0..M-1)
    r = torch.arange(bs * M, device=out_seq_lens.device)
    out_fs_positions.copy_(out_seq_lens.to(torch.int64)[r // M] - M + r % M)
    dest = (row_seq + 1) * M - qsl[1:][row_seq] + t  # [T] padded row of row t
    out_fs_slots.fill_(PADDING_SLOT_ID)
    out_fs_input_ids.zero_()
    out_fs_slots[dest] = slots
    out_fs_input_ids[dest] = ids
    out_fs_hidden[dest] = hidden_states[:T].to(out_fs_hidden.dtype)
    out_draft_column.zero_()


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Grid: (bs * M,): one program per padded row r = i * M + j. It writes the row's fields and copies its hidden row in
# BLOCK_W chunks; the program of row j == 0 also writes sequence i's fields (its block-table row in BLOCK_W chunks),
# program 0 the draft column.
# B and w are read from the header (device memory): the kernel is captured once per (bs, M) in a CUDA graph and
# replayed for every step of that shape, whatever its B and w. Every integer argument is do_not_specialize, so that
# no M or width compiles another variant.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["block_size", "rows_per_seq", "width", "hidden_stride", "out_hidden_stride",
                               "out_table_stride"])
def _build_first_step_rows_kernel(
    header_ptr, p_ptr, qsl_ptr, next_ptr, steps_ptr, tokens_ptr, tables_ptr, hidden_ptr,
    out_pos_ptr, out_seq_lens_ptr, out_tables_ptr, out_steps_ptr, out_fs_pos_ptr, out_fs_ids_ptr, out_fs_slots_ptr,
    out_fs_hidden_ptr, out_column_ptr,
    block_size, rows_per_seq, width, hidden_stride, out_hidden_stride, out_table_stride,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    if r == 0:
        tl.store(out_column_ptr, tl.zeros((), dtype=tl.int64))
    i = r // rows_per_seq
    j = r % rows_per_seq
    num_seqs = tl.load(header_ptr)
    table_width = tl.load(header_ptr + 1)
    real_seq = i < num_seqs
    # (masked loads: a padding sequence reads nothing; its m is 0, its seq_len M)
    start = tl.load(qsl_ptr + i, mask=real_seq, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + i + 1, mask=real_seq, other=0).to(tl.int64)
    m = end - start
    p = tl.load(p_ptr + i, mask=real_seq, other=0).to(tl.int64)
    seq_len = tl.where(real_seq, p + m, rows_per_seq.to(tl.int64))
    pos = seq_len - rows_per_seq + j
    tl.store(out_fs_pos_ptr + r, pos)
    real_row = j >= rows_per_seq - m  # (never for a padding sequence: m = 0)
    t = end - rows_per_seq + j  # the step's row of padded row r (when real)
    table_row = tables_ptr + i.to(tl.int64) * table_width
    if real_row:
        if t + 1 < end:
            token = tl.load(tokens_ptr + t + 1).to(tl.int64)
        else:
            token = tl.load(next_ptr + i).to(tl.int64)
        tl.store(out_fs_ids_ptr + r, token)
        block = tl.load(table_row + pos // block_size).to(tl.int64)
        tl.store(out_fs_slots_ptr + r, block * block_size + pos % block_size)
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
            tl.store(out_pos_ptr + i, seq_len - 1)
            tl.store(out_steps_ptr + i, tl.load(steps_ptr + i))
            cols = tl.arange(0, BLOCK_W)
            for c in range(0, table_width, BLOCK_W):
                mask = c + cols < table_width
                tl.store(out_tables_ptr + i.to(tl.int64) * out_table_stride + c + cols,
                         tl.load(table_row + c + cols, mask=mask), mask=mask)
        else:
            tl.store(out_steps_ptr + i, tl.zeros((), dtype=tl.int32))


def build_first_step_rows_triton(
    header: torch.Tensor, start_positions: torch.Tensor, query_start_loc: torch.Tensor, next_tokens: torch.Tensor,
    draft_steps: torch.Tensor, token_ids: torch.Tensor, block_tables: torch.Tensor, hidden_states: torch.Tensor,
    block_size: int, rows_per_seq: int, out_positions: torch.Tensor, out_seq_lens: torch.Tensor,
    out_block_tables: torch.Tensor, out_steps_left: torch.Tensor, out_fs_positions: torch.Tensor,
    out_fs_input_ids: torch.Tensor, out_fs_slots: torch.Tensor, out_fs_hidden: torch.Tensor,
    out_draft_column: torch.Tensor,
) -> None:
    M, bs, width = rows_per_seq, out_seq_lens.shape[0], hidden_states.shape[1]
    assert out_fs_positions.shape[0] == bs * M and out_fs_hidden.shape[0] >= bs * M
    assert out_fs_hidden.shape[1] == width and hidden_states.dtype == out_fs_hidden.dtype
    assert hidden_states.stride(1) == 1 and out_fs_hidden.stride(1) == 1 and out_block_tables.stride(1) == 1
    assert all(x.dtype == torch.int32 for x in (header, start_positions, query_start_loc, next_tokens, draft_steps,
                                                token_ids, block_tables))
    assert out_draft_column.dtype == torch.int64 and out_draft_column.numel() == 1
    if bs * M == 0:
        out_draft_column.zero_()  # (as the reference: nothing else to build)
        return
    _build_first_step_rows_kernel[(bs * M,)](
        header, start_positions, query_start_loc, next_tokens, draft_steps, token_ids, block_tables, hidden_states,
        out_positions, out_seq_lens, out_block_tables, out_steps_left, out_fs_positions, out_fs_input_ids,
        out_fs_slots, out_fs_hidden, out_draft_column,
        block_size, M, width, hidden_states.stride(0), out_fs_hidden.stride(0), out_block_tables.stride(0),
        BLOCK_W=1024,
    )
