"""Causal attention of new query rows over a sequence's paged K/V (prefill chunks and 1-token decode alike).

Sequence i owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (q_len_i rows). Those rows are the
*last* q_len_i positions of its context, which holds ``seq_lens[i]`` positions in total, so row j sits at
position ``seq_lens[i] - q_len_i + j`` and attends to context positions ``0 ..= that position``.
The K/V of every context position (the new rows too) must already be in the cache.
GQA: query head h reads KV head ``h // (Hq // Hkv)``.
"""
import torch

from ._triton_shim import tl, triton


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32, entries past a sequence's blocks are ignored
    seq_lens: torch.Tensor,  # [B] int32, context length including the query rows
    query_start_loc: torch.Tensor,  # [B + 1] int32, starts with 0
    scale: float,
    *,
    max_query_len: int | None = None,  # host-side upper bound of the query lengths (only the Triton path uses it)
    out: torch.Tensor | None = None,  # [T, Hq, D]; rows owned by no sequence are left untouched
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()  # [ctx, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [Hq, q_len, ctx]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  q [T, Hq, D] (unit stride on D); k_cache, v_cache [num_blocks, block_size, Hkv, D] (same strides);
#          block_tables [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32.
# Writes:  out[query_start_loc[i] : query_start_loc[i + 1], :, :] for every sequence i; no other row of out.
# Both kernels keep a running (max, sum, weighted V) per query row ("online softmax") in fp32 and walk the
# sequence's KV blocks through its block table, one cache block (block_size positions) per iteration.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _paged_attention_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_offset, cache_stride_h,
    block_tables_stride,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid (B, cdiv(max_query_len, BLOCK_M), Hq): one program = BLOCK_M query rows of one sequence, one query head.
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    q_head = tl.program_id(2)
    kv_head = q_head // QUERIES_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row index inside this sequence's query
    row_mask = rows < q_len
    row_pos = ctx_len - q_len + rows  # [BLOCK_M] position of each query row in the context
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q_rows = (q_start + rows).to(tl.int64)
    q_tile = tl.load(q_ptr + q_rows[:, None] * q_stride_t + q_head * q_stride_h + dims[None, :],
                     mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causal: this tile needs context positions 0 ..= the position of its last row.
    last_needed_pos = tl.minimum(ctx_len - q_len + (m_block + 1) * BLOCK_M, ctx_len) - 1
    num_kv_blocks = last_needed_pos // KV_BLOCK_SIZE + 1
    offs_in_block = tl.arange(0, KV_BLOCK_SIZE)
    for kv_block in range(0, num_kv_blocks):
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride + kv_block).to(tl.int64)
        k_pos = kv_block * KV_BLOCK_SIZE + offs_in_block  # [KV_BLOCK_SIZE]
        kv_mask = (k_pos[:, None] < ctx_len) & dim_mask[None, :]
        kv_offsets = block_id * cache_stride_block + offs_in_block[:, None] * cache_stride_offset \
            + kv_head * cache_stride_h + dims[None, :]
        k_tile = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [KV_BLOCK_SIZE, BLOCK_D]
        v_tile = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)

        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, KV_BLOCK_SIZE]
        visible = (k_pos[None, :] <= row_pos[:, None]) & (k_pos[None, :] < ctx_len)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: position 0 is visible to every row
        rescale = tl.exp(row_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        row_max = new_max

    result = acc / row_sum[:, None]
    tl.store(out_ptr + q_rows[:, None] * out_stride_t + q_head * out_stride_h + dims[None, :],
             result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _paged_attention_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_offset, cache_stride_h,
    block_tables_stride,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
    # Grid (B, Hq): every sequence has 0 or 1 query row, which sits at position ctx_len - 1 and sees all context.
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    kv_head = q_head // QUERIES_PER_KV

    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_row:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_row = q_row.to(tl.int64)
    q_vec = tl.load(q_ptr + q_row * q_stride_t + q_head * q_stride_h + dims, mask=dim_mask, other=0.0).to(tl.float32)

    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    offs_in_block = tl.arange(0, KV_BLOCK_SIZE)
    for kv_block in range(0, tl.cdiv(ctx_len, KV_BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride + kv_block).to(tl.int64)
        k_pos = kv_block * KV_BLOCK_SIZE + offs_in_block
        kv_mask = (k_pos[:, None] < ctx_len) & dim_mask[None, :]
        kv_offsets = block_id * cache_stride_block + offs_in_block[:, None] * cache_stride_offset \
            + kv_head * cache_stride_h + dims[None, :]
        k_tile = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [KV_BLOCK_SIZE, BLOCK_D]
        v_tile = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.sum(q_vec[None, :] * k_tile, 1) * scale  # [KV_BLOCK_SIZE]
        scores = tl.where(k_pos < ctx_len, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 0))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, 0)
        acc = acc * rescale + tl.sum(probs[:, None] * v_tile, 0)
        running_max = new_max

    result = acc / running_sum
    tl.store(out_ptr + q_row * out_stride_t + q_head * out_stride_h + dims, result.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # 1 selects the decode kernel; None means "up to T" (no host sync either way)
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 16"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_query_len = num_tokens if max_query_len is None else max_query_len

    common_args = (
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
    )
    queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if max_query_len == 1:
        _paged_attention_decode_kernel[(num_seqs, num_q_heads)](
            *common_args,
            QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=block_size,
        )
    else:
        block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
        _paged_attention_prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), num_q_heads)](
            *common_args,
            QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, KV_BLOCK_SIZE=block_size,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    return out
