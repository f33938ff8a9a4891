"""Causal attention of new query rows over a sequence's paged K/V (prefill chunks and 1-token decode alike).

Sequence i owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (q_len_i rows). Those rows are the
*last* q_len_i positions of its context, which holds ``seq_lens[i]`` positions in total, so row j sits at
position ``seq_lens[i] - q_len_i + j`` and attends to context positions ``0 ..= that position``.
The K/V of every context position (the new rows too) must already be in the cache.
GQA: query head h reads KV head ``h // (Hq // Hkv)``.
"""

from dataclasses import dataclass

import torch

from drafter_kernels._triton_shim import DEFAULT_SM_COUNT, device_sm_count, tl, triton


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
    context_cache: dict | None = None,  # only paged_attention_batched uses it (GatheredContext)
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


def paged_attention_batched(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    context_cache: dict | None = None,
) -> torch.Tensor:
    """paged_attention_ref's function, for the whole batch in a few tensor ops instead of a loop over sequences:
    the CPU serving path (ops.paged_attention on CPU tensors; the reference stays the plain loop that tests compare
    against). Every sequence's context is gathered into one padded head-major [B, Hkv, L, D] tensor (L: the longest
    context, whole blocks; GatheredContext) and its query rows into a padded [B, Hkv, G*Q, D] (Q: the longest query,
    G query heads per KV head), so that one fused attention call (scaled_dot_product_attention) over the B * Hkv
    (sequence, KV head) pairs does the whole batch; padding is masked out. The head-major copy costs a transpose at
    the gather (an earlier version read strided [B, L, D] views of a token-major copy instead: torch's CPU bmm then
    looped over the matrices one by one);
    with a context_cache the gather happens once per engine step. When padding would more than double the work of
    the per-sequence loop (a long prefill beside short decodes: a new sequence's prompt in a decode batch), the
    short ones go together and each long one alone (_short_and_long); one sequence takes a shorter path
    (_one_sequence: no padding, no kept copy, no mask for a decode row).
    context_cache: a dict the caller keeps for the forwards of one engine step (the first draft step and its decode
    steps, where the same sequences' contexts only grow): the gathered copy is kept there per layer (GatheredContext,
    keyed by the layer's cache) and a later call copies in only the positions written since (one per sequence in
    a decode step), instead of gathering the whole context again (batch 128 x 256 positions: most of the step's
    time). Valid only while nothing but these calls' own new
    rows is written to the sequences' blocks."""
    B = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if B == 0 or q.shape[0] == 0:
        return out
    if B == 1:
        return _one_sequence(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]  # [B]
    ctx = seq_lens.to(torch.int64)
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())
    if max_q == 0:
        return out
    # work of the padded tensors against the per-sequence loop's (both ~ query rows x context positions)
    if B * max_q * max_ctx > 2 * int((q_lens * ctx).sum()) + 4096:
        return _short_and_long(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, q_lens)
    n_blocks = -(-max_ctx // block_size)
    # table entries past a sequence's own blocks may be anything: read block 0 there (masked out below)
    owned = torch.arange(n_blocks)[None, :] < (-(-ctx // block_size))[:, None]  # [B, n_blocks]
    blocks = torch.where(owned, block_tables[:, :n_blocks].long(), 0)
    L = n_blocks * block_size
    # One gathered copy each of K and V, head-major. The cache's positions outside a sequence's context (the rest of
    # its last block, block 0 read in place of blocks it does not own) may hold anything, NaN included: the copy has
    # zeros there (GatheredContext), and the mask below hides them.
    key = k_cache.data_ptr()
    kept = context_cache.get(key) if context_cache is not None else None
    if kept is None or not kept.refresh(k_cache, v_cache, blocks, ctx, block_size):
        kept = GatheredContext.gather(k_cache, v_cache, blocks, ctx, block_size)
        if context_cache is not None:
            context_cache[key] = kept
    k, v = kept.k[:, :, :L], kept.v[:, :, :L]  # [B, Hkv, L, D]; zero at every position outside the context
    # query rows, padded per sequence: row j of sequence b is q[starts[b] + j] for j < q_lens[b]
    j = torch.arange(max_q)
    row_valid = j[None, :] < q_lens[:, None]  # [B, Q]
    rows = (starts[:-1, None] + j[None, :]).clamp(max=q.shape[0] - 1)  # [B, Q]
    # GQA: query head h = kv * group + g reads KV head kv; the group's heads and rows share one matmul
    qp = q[rows].float().reshape(B, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(
        B, num_kv_heads, group * max_q, head_dim)  # [B, Hkv, G*Q, D]
    q_pos = ctx[:, None] - q_lens[:, None] + j[None, :]  # [B, Q] position of each query row
    masked = torch.arange(L)[None, None, :] > q_pos[:, :, None]  # [B, Q, L]: future positions, and past the context
    # [B, 1, G*Q, L]: row g * Q + j sees what query row j sees, the same for every KV head (broadcast by the attention)
    bias = torch.zeros(B, 1, max_q, L).masked_fill_(masked[:, None], float("-inf"))
    if group > 1 and max_q > 1:
        bias = bias.repeat(1, 1, group, 1)
    # every (sequence, KV head) is one attention of G*Q query rows over L positions: the kept layout is head-major, so
    # k and v are [B, Hkv, L, D] views with plain row strides. torch's fused CPU attention (scaled_dot_product_attention
    # with the bias as its mask) does scores, softmax and the weighted sum without materializing the probabilities:
    # 0.93 -> 0.65 ms against baddbmm + softmax + bmm at batch 128 of the tiny head (m = 3, context 256). (No row is
    # wholly masked: a padding row sits past its sequence's context and sees all of it; NaN would be zeroed anyway.)
    o = torch.nn.functional.scaled_dot_product_attention(qp, k, v, attn_mask=bias, scale=scale).nan_to_num_(0.0)
    o = o.view(B, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, D]
    if (int(q_lens.min()) == max_q and q.shape[0] == B * max_q and int(starts[-1]) == B * max_q
            and out.is_contiguous()):
        out.view(B, max_q, num_kv_heads, group, head_dim).copy_(o)  # every sequence max_q rows, in order: all rows
    else:
        out[rows[row_valid]] = o.reshape(B, max_q, num_q_heads, head_dim)[row_valid].to(out.dtype)
    return out


SHORT_QUERY_ROWS = 8  # _short_and_long: sequences of at most this many query rows go together (a decode step's m)


def _short_and_long(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                    q_lens: torch.Tensor) -> torch.Tensor:
    """paged_attention_batched for a batch whose padding would dominate: the sequences of at most SHORT_QUERY_ROWS
    query rows through paged_attention_batched together (their rows gathered into a batch of their own, the answer
    scattered back; no context cache: the step's decode steps keep theirs), each longer one through _one_sequence.
    Fewer than two short ones, or no long one: the per-sequence loop. (A CPU step of 64 decodes and one 128-token
    prompt ran the loop over all 65 sequences: ~22 ms of its attention per layer on the dev CPU.)"""
    short = q_lens <= SHORT_QUERY_ROWS
    n_short = int(short.sum())
    if n_short < 2 or n_short == q_lens.shape[0]:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=out)
    idx = torch.nonzero(short).flatten()
    lens = q_lens[idx]
    qsl = torch.zeros(n_short + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=qsl[1:])
    # row r of the short batch is row (its sequence's start in q) + (r - its start in the short batch)
    rows = torch.repeat_interleave(query_start_loc[idx].to(torch.int64) - qsl[:-1], lens) + torch.arange(int(qsl[-1]))
    answer = paged_attention_batched(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx],
                                     qsl.to(query_start_loc.dtype), scale)
    out[rows] = answer
    for i in torch.nonzero(~short).flatten().tolist():
        if int(q_lens[i]):
            _one_sequence(q, k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1],
                          query_start_loc[i : i + 2], scale, out)
    return out


def _one_sequence(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out) -> torch.Tensor:
    """paged_attention_batched for one sequence: its context gathered head-major, one fused attention over its
    Hkv heads (each KV head's G query heads and rows as one matrix), a causal bias only for several query rows."""
    q_start, q_end = (int(x) for x in query_start_loc[:2])
    ctx, q_len = int(seq_lens[0]), q_end - q_start
    if q_len == 0:
        return out
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    blocks = block_tables[0, : -(-ctx // block_size)].long()
    k, v = (torch.index_select(c.reshape(c.shape[0], -1), 0, blocks).float().view(-1, num_kv_heads, head_dim)[:ctx]
            .transpose(0, 1) for c in (k_cache, v_cache))  # [Hkv, ctx, D] views
    qp = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        num_kv_heads, group * q_len, head_dim)  # [Hkv, G*Q, D]: row g * Q + j is query row j of head kv * G + g
    bias = None
    if q_len > 1:  # row j sits at position ctx - q_len + j and sees positions up to it
        bias = torch.zeros(q_len, ctx).masked_fill_(
            torch.arange(ctx)[None, :] > torch.arange(ctx - q_len, ctx)[:, None], float("-inf")).repeat(group, 1)
    o = torch.nn.functional.scaled_dot_product_attention(qp, k, v, attn_mask=bias, scale=scale)
    out[q_start:q_end] = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
        q_len, num_kv_heads * group, head_dim).to(out.dtype)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], blocks [B, n] int64, zero [B, n * block_size] bool (the gathered
    positions outside the context) -> [B, Hkv, n * block_size, D] float32: a head-major copy of the blocks, 0.0 where
    zero is set. (index_select on [num_blocks, block_size * Hkv * D] rows, ~5x faster on the CPU than
    cache[blocks], then one transposing copy.)"""
    B, n = blocks.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    rows = torch.index_select(cache.reshape(cache.shape[0], -1), 0, blocks.reshape(-1)).float()
    rows = rows.view(B, n * block_size, num_kv_heads * head_dim)
    rows[zero.nonzero(as_tuple=True)] = 0.0  # (an index_put of the few positions: 10x faster than a masked_fill)
    return rows.view(B, n * block_size, num_kv_heads, head_dim).permute(0, 2, 1, 3).contiguous()


@dataclass
class GatheredContext:
    """One layer's K/V context of a batch, gathered by paged_attention_batched and kept in its context_cache for
    the next forward of the same engine step. Head-major (one [positions, D] matrix per sequence and KV head, what
    the fused attention reads without a copy; the gather transposes once). Room for one block more than gathered, so
    that the decode steps' new positions fit without a new buffer. Invariant: positions [0, fresh_len[b]) of row b
    equal the paged cache, every later position is 0.0 (never the cache's garbage, which may be NaN)."""
    blocks: torch.Tensor  # [B, n] int64: the block ids gathered (0 for table entries a sequence did not own)
    k: torch.Tensor  # [B, Hkv, (n + 1) * block_size, D] float32
    v: torch.Tensor
    fresh_len: torch.Tensor  # [B] int64: the context length at the last call

    @classmethod
    def gather(cls, k_cache, v_cache, blocks: torch.Tensor, ctx: torch.Tensor, block_size: int) -> "GatheredContext":
        B = blocks.shape[0]
        # the spare column gathers block 0 too (zeros: past every context, until positions of its own are copied in)
        with_spare = torch.cat([blocks, blocks.new_zeros(B, 1)], 1)
        outside = torch.arange(with_spare.shape[1] * block_size)[None, :] >= ctx[:, None]
        k, v = (_gather_blocks(c, with_spare, outside) for c in (k_cache, v_cache))
        return cls(blocks=blocks, k=k, v=v, fresh_len=ctx.clone())

    def refresh(self, k_cache, v_cache, blocks: torch.Tensor, ctx: torch.Tensor, block_size: int) -> bool:
        """Bring the copy up to the contexts ctx [B] of blocks [B, n] (this call's tables), copying only positions
        [fresh_len, ctx) from the cache (a decode step: one position per sequence). False (nothing changed) when it
        cannot: another batch, a shorter context, more blocks than the buffer holds, or a block of the known
        positions that moved."""
        B, n = blocks.shape
        n_kept = self.blocks.shape[1]
        capacity = self.k.shape[2] // block_size
        if B != self.blocks.shape[0] or n > capacity or bool((ctx < self.fresh_len).any()):
            return False
        known_blocks = -(-self.fresh_len // block_size)  # [B] blocks holding the known positions
        cols = torch.arange(min(n, n_kept))
        known = cols[None, :] < known_blocks[:, None]
        if not torch.equal(torch.where(known, blocks[:, : cols.numel()], 0),
                           torch.where(known, self.blocks[:, : cols.numel()], 0)):
            return False
        new = int((ctx - self.fresh_len).max())  # positions to copy per sequence (decode steps: 1)
        if new > 0:
            # positions [fresh_len, ctx) of each sequence, the last one repeated where it has fewer (same data)
            pos = torch.minimum(self.fresh_len[:, None] + torch.arange(new)[None, :], ctx[:, None] - 1)  # [B, new]
            slots = (blocks.gather(1, pos // block_size) * block_size + pos % block_size).reshape(-1)
            who = torch.arange(B)[:, None].expand(B, new)
            num_kv_heads, head_dim = self.k.shape[1], self.k.shape[3]
            for kept, cache in ((self.k, k_cache), (self.v, v_cache)):
                rows = torch.index_select(cache.reshape(-1, num_kv_heads * head_dim), 0, slots).float()
                kept.transpose(1, 2)[who, pos] = rows.view(B, new, num_kv_heads, head_dim)
        # the known positions' blocks were checked equal; positions past ctx stay 0.0 (never copied)
        self.blocks = blocks
        self.fresh_len = ctx.clone()
        return True


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  q [T, Hq, D] (unit stride on D); k_cache, v_cache [num_blocks, block_size, Hkv, D] (same strides);
#          block_tables [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32.
# Writes:  out[query_start_loc[i] : query_start_loc[i + 1], :, :] for every sequence i; no other row of out.
#
# One kernel serves prefill and decode. A program takes BLOCK_M query rows of one sequence times BLOCK_H query
# heads of one KV group, flattened into a [BLOCK_M * BLOCK_H, D] tile (row-major: row r, head h at r * BLOCK_H + h),
# so that every K/V tile it loads serves all query heads sharing that KV head (GQA). It walks the context in tiles
# of BLOCK_N positions, looking each position's cache block up in the block table (tiles and cache blocks need not
# align), and keeps a running (max, sum, weighted V) per flattened row ("online softmax") in fp32.
#
# Split-K ("flash decoding"): when every sequence's query rows fit one program (max_query_len <= BLOCK_M), the
# context a program needs is cut into num_splits contiguous ranges of whole tiles, one program each; the split
# programs write partial (max, sum, unnormalized acc) to fp32 scratch and _paged_attention_reduce_kernel merges
# them. num_splits is chosen on the host from shapes only (batch size, heads, block_tables.shape[1] * block_size),
# and each split's range is computed in the kernel from the device-side seq_len, so the grid is static for a
# given batch size (CUDA-graph safe) and the splits always cover exactly the sequence's real context; splits past
# a short context are empty and write (-inf, 0, 0). Without SPLIT (num_splits == 1) the program writes out directly.
# num_splits, the block-table stride and part_rows are runtime values, not specialized: they change with the context
# length and the batch, and as constexprs (or specialized ints) each new value compiled both kernels again, 0.4-0.5 s
# on the step thread (an H200 run of eager pre-drafting passes at batch 1: one such stall every ~64 tokens of
# context, docs/predraft.md). SPLIT and BLOCK_S (a power of two) take few values.
#
# Packed grid (PACKED_GRID, only without splits): a batch of uneven queries (one long prefill beside many 1-3 row
# decodes: the step a new sequence joins) gets cdiv(max_query_len, BLOCK_M) programs per sequence on the grid above,
# nearly all of them returning at once (batch 128 beside a 512-row prompt: 4096 programs per head block for ~160 with
# work). With PACKED_GRID, axis 0 walks the batch's query tiles instead: sequence i's tiles are numbered from
# first_tile(i) = qsl[i] // BLOCK_M + i, which grows strictly with i and leaves room for the cdiv(q_len_i, BLOCK_M)
# tiles of sequence i before first_tile(i + 1); so T // BLOCK_M + B programs cover every tile, and a program finds its
# sequence by a binary search of first_tile over the batch. The grid depends on T and B only (CUDA-graph safe).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["block_tables_stride", "part_rows", "num_splits", "num_seqs"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_offset, cache_stride_h,
    block_tables_stride, num_q_heads, part_rows, num_splits, num_seqs,
    QUERIES_PER_KV: tl.constexpr, HEAD_BLOCKS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, PACKED_GRID: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid (B, cdiv(max_query_len, BLOCK_M), Hkv * HEAD_BLOCKS_PER_KV * num_splits), or with PACKED_GRID
    # (T // BLOCK_M + B, 1, Hkv * HEAD_BLOCKS_PER_KV).
    # Scratch (SPLIT): part_max, part_sum [B, part_rows, Hq, num_splits] fp32 and part_acc [..., HEAD_DIM].
    if PACKED_GRID:
        tile_id = tl.program_id(0)
        lo = 0  # the last sequence whose first tile (qsl[i] // BLOCK_M + i) is <= tile_id
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile_id:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        m_block = tile_id - (tl.load(query_start_loc_ptr + seq) // BLOCK_M + seq)
    else:
        seq = tl.program_id(0)
        m_block = tl.program_id(1)
    split = tl.program_id(2) % num_splits
    head_block = tl.program_id(2) // num_splits
    kv_head = head_block // HEAD_BLOCKS_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    flat = tl.arange(0, BLOCK_M * BLOCK_H)
    rows = m_block * BLOCK_M + flat // BLOCK_H  # row index inside this sequence's query
    head_in_group = (head_block % HEAD_BLOCKS_PER_KV) * BLOCK_H + flat % BLOCK_H
    heads = kv_head * QUERIES_PER_KV + head_in_group
    valid = (rows < q_len) & (head_in_group < QUERIES_PER_KV)
    row_pos = ctx_len - q_len + rows  # position of each query row in the context
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q_rows = (q_start + rows).to(tl.int64)
    q_tile = tl.load(q_ptr + q_rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                     mask=valid[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M * BLOCK_H, BLOCK_D]

    row_max = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], tl.float32)

    # Causal: this program needs context positions [0, needed), up to the position of its last row.
    needed = ctx_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    num_tiles = tl.cdiv(needed, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_begin, tile_end):
        k_pos = tile * BLOCK_N + offs_n  # [BLOCK_N]
        in_ctx = k_pos < needed
        block_ids = tl.load(block_tables_ptr + seq * block_tables_stride + k_pos // KV_BLOCK_SIZE,
                            mask=in_ctx, other=0).to(tl.int64)
        kv_offsets = block_ids * cache_stride_block + (k_pos % KV_BLOCK_SIZE) * cache_stride_offset \
            + kv_head * cache_stride_h  # [BLOCK_N]
        kv_mask = in_ctx[:, None] & dim_mask[None, :]
        k_tile = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v_tile = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale  # [M * H, BLOCK_N]
        visible = (k_pos[None, :] <= row_pos[:, None]) & in_ctx[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row may see nothing yet (a split that starts past its position): keep its state at (-inf, 0, 0).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(row_max - shift)
        probs = tl.exp(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        row_max = new_max

    if not SPLIT:
        # every valid row sees position 0, so row_sum > 0 there; the guard only keeps masked rows finite
        result = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + q_rows[:, None] * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dim_mask[None, :])
    else:
        part = ((seq.to(tl.int64) * part_rows + rows) * num_q_heads + heads) * num_splits + split
        part_mask = valid & (rows < part_rows)
        tl.store(part_max_ptr + part, row_max, mask=part_mask)
        tl.store(part_sum_ptr + part, row_sum, mask=part_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=part_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["part_rows", "num_splits"])
def _paged_attention_reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    out_stride_t, out_stride_h, num_q_heads, part_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Grid (B, part_rows, Hq): merges the num_splits (<= BLOCK_S) partials of one query row and head into out.
    seq = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if row >= tl.load(query_start_loc_ptr + seq + 1) - q_start:
        return
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    part = ((seq.to(tl.int64) * part_rows + row) * num_q_heads + head) * num_splits + splits  # [BLOCK_S]
    split_max = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    split_acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                        mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    global_max = tl.max(split_max, 0)  # finite: the split holding position 0 saw it
    weight = tl.exp(split_max - global_max)  # 0 for empty splits
    total = tl.sum(weight * split_sum, 0)
    result = tl.sum(weight[:, None] * split_acc, 0) / total
    out_row = (q_start + row).to(tl.int64)
    tl.store(out_ptr + out_row * out_stride_t + head * out_stride_h + dims, result.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


MAX_SPLITS = 128


def attention_launch_config(num_seqs: int, max_query_len: int, num_q_heads: int, num_kv_heads: int,
                            head_dim: int, max_context: int, sm_count: int = DEFAULT_SM_COUNT,
                            fp32: bool = False) -> dict:
    """Tile sizes, warps and number of context splits, from host-known shapes only (never device values).

    max_context: block_tables.shape[1] * block_size, an upper bound of every seq_len. fp32 (IEEE FMA dots) gets
    smaller tiles than bf16/fp16 (tensor cores) so that neither spills registers on sm_90.
    """
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    max_rows = 32 if fp32 else 64  # flattened (query row, head) rows of one program
    block_h = min(max_rows, triton.next_power_of_2(group))
    block_m = max(1, min(triton.next_power_of_2(max_query_len), max_rows // block_h))
    block_h = max(block_h, 16 // block_m)  # tl.dot needs >= 16 rows: pad with masked heads
    block_n = 16 if fp32 else (64 if block_d <= 128 else 32)
    num_warps = 4 if block_m * block_h <= 16 else 8
    m_blocks = triton.cdiv(max_query_len, block_m)
    head_blocks = triton.cdiv(group, block_h)
    num_splits = 1
    if m_blocks == 1:  # short queries (decode, a few draft rows): split the context to fill the GPU
        programs = num_seqs * num_kv_heads * head_blocks
        target = 2 * sm_count
        num_splits = max(1, min(MAX_SPLITS, triton.cdiv(max_context, block_n), triton.cdiv(target, programs)))
    return dict(block_d=block_d, block_h=block_h, block_m=block_m, block_n=block_n, num_warps=num_warps,
                m_blocks=m_blocks, head_blocks=head_blocks, num_splits=num_splits)


def packed_grid_programs(num_tokens: int, num_seqs: int, cfg: dict) -> int | None:
    """Programs per head block on the packed grid (the kernel's comment), when it takes fewer than the per-sequence
    grid's B * cdiv(max_query_len, BLOCK_M) and the context is not split; None otherwise."""
    if cfg["num_splits"] > 1:
        return None
    programs = num_tokens // cfg["block_m"] + num_seqs
    return programs if programs < num_seqs * cfg["m_blocks"] else None


def _paged_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out,
                            *, num_splits: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, packed: bool | None = None):
    """paged_attention_triton with the split count, KV tile, warps or grid (packed: True / False) optionally forced
    (tests, benchmark sweeps, compile_variants)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    cfg = attention_launch_config(num_seqs, max_query_len, num_q_heads, num_kv_heads, head_dim,
                                  block_tables.shape[1] * block_size, device_sm_count(q.device), q.dtype == torch.float32)
    if num_splits is not None:
        assert num_splits == 1 or cfg["m_blocks"] == 1, "split-K needs max_query_len <= BLOCK_M"
        cfg["num_splits"] = num_splits
    if block_n is not None:
        cfg["block_n"] = block_n
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    if packed:
        assert num_splits in (None, 1), "the packed grid does not split the context"
        cfg["num_splits"] = 1
    num_splits = cfg["num_splits"]
    part_rows = max_query_len
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, part_rows, num_q_heads, num_splits, **f32)
        part_sum = torch.empty(num_seqs, part_rows, num_q_heads, num_splits, **f32)
        part_acc = torch.empty(num_seqs, part_rows, num_q_heads, num_splits, head_dim, **f32)
    else:
        part_max = part_sum = part_acc = out  # unused
    packed_programs = packed_grid_programs(num_tokens, num_seqs, cfg)
    if packed is not None:
        packed_programs = num_tokens // cfg["block_m"] + num_seqs if packed else None
    if packed_programs is not None:
        grid = (packed_programs, 1, num_kv_heads * cfg["head_blocks"])
    else:
        grid = (num_seqs, cfg["m_blocks"], num_kv_heads * cfg["head_blocks"] * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        part_acc, part_max, part_sum,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_q_heads, part_rows, num_splits, num_seqs,
        QUERIES_PER_KV=num_q_heads // num_kv_heads, HEAD_BLOCKS_PER_KV=cfg["head_blocks"], HEAD_DIM=head_dim,
        BLOCK_D=cfg["block_d"], BLOCK_M=cfg["block_m"], BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"],
        KV_BLOCK_SIZE=block_size, SPLIT=num_splits > 1, PACKED_GRID=packed_programs is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
    )
    if num_splits > 1:
        _paged_attention_reduce_kernel[(num_seqs, part_rows, num_q_heads)](
            out, part_acc, part_max, part_sum, query_start_loc,
            out.stride(0), out.stride(1), num_q_heads, part_rows, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=cfg["block_d"], BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def launch_variants(num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int,
                    sm_count: int = DEFAULT_SM_COUNT, fp32: bool = False) -> list[tuple[int, int, bool]]:
    """(max_query_len, num_splits, packed grid) launches that, one after the other, compile every kernel variant
    attention_launch_config and packed_grid_programs can pick for these heads and contexts of up to max_context
    positions: each query-row tile (BLOCK_M, with its BLOCK_H and warps) with the context whole and split, the longest
    tile on the packed grid too, and each tile of the reduce over the splits (BLOCK_S, a power of two up to the most
    splits a batch of one sequence gets)."""
    launches, seen = [], set()
    q_len = 1
    while True:
        cfg = attention_launch_config(1, q_len, num_q_heads, num_kv_heads, head_dim, max_context, sm_count, fp32)
        for splits in ((1, 2) if cfg["m_blocks"] == 1 else (1,)):  # (only a one-tile query splits the context)
            if (cfg["block_m"], splits > 1) not in seen:
                seen.add((cfg["block_m"], splits > 1))
                launches.append((q_len, splits, False))
        if cfg["m_blocks"] > 1:  # longer queries: more tiles of the same BLOCK_M, the context whole; or packed
            launches.append((q_len, 1, True))
            break
        q_len += 1
    decode = attention_launch_config(1, 1, num_q_heads, num_kv_heads, head_dim, max_context, sm_count, fp32)
    most = decode["num_splits"]  # (one sequence: the most programs per split, so the most splits)
    splits = 4
    while splits // 2 < most:  # BLOCK_S = next_power_of_2(num_splits): 2 is compiled above, then 4, 8, ...
        launches.append((1, min(splits, most), False))
        splits *= 2
    return launches


def compile_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, max_context: int,
                     dtype: torch.dtype) -> int:
    """Launch the attention once per kernel variant (launch_variants) on throw-away queries, so that the Triton JIT
    compiles every variant now and never in the middle of a step (0.2-0.5 s each on an H100/H200). k/v_cache: the
    real caches (their strides are part of what a kernel is compiled for); queries as the layers pass them
    (contiguous [T, Hq, D] of dtype). Reads block 0 of the caches, writes nothing to them. Returns the launches."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    variants = launch_variants(num_q_heads, num_kv_heads, head_dim, max_context, device_sm_count(device),
                               dtype == torch.float32)
    for q_len, splits, packed in variants:
        q = torch.zeros(q_len, num_q_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(1, triton.cdiv(q_len, block_size), dtype=torch.int32, device=device)
        seq_lens = torch.full((1,), q_len, dtype=torch.int32, device=device)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        _paged_attention_launch(q, k_cache, v_cache, tables, seq_lens, qsl, 1.0, q_len, torch.empty_like(q),
                                num_splits=splits, packed=packed)
    return len(variants)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # host-side bound of the query lengths; None means "up to T" (no host sync)
    out: torch.Tensor | None = None,  # [T, Hq, D]
    context_cache: dict | None = None,  # ignored: the kernel reads the paged cache in place
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert block_size >= 1 and block_size & (block_size - 1) == 0, "block_size must be a power of 2"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_query_len = num_tokens if max_query_len is None else max(1, min(max_query_len, num_tokens))
    return _paged_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                   max_query_len, out)
