"""Causal attention of new query rows over a sequence's paged K/V (prefill chunks and 1-token decode alike).

Sequence i owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (q_len_i rows). Those rows are the
*last* q_len_i positions of its context, which holds ``seq_lens[i]`` positions in total, so row j sits at
position ``seq_lens[i] - q_len_i + j`` and attends to context positions ``0 ..= that position``.
The K/V of every context position (the new rows too) must already be in the cache.
GQA: query head h reads KV head ``h // (Hq // Hkv)``.
"""
import torch


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32, entries past a sequence's blocks are ignored
    seq_lens: torch.Tensor,  # [B] int32, context length including the query rows
    query_start_loc: torch.Tensor,  # [B + 1] int32, starts with 0
    scale: float,
    max_query_len: int | None = None,  # host-side max of the query lengths; kernels use it to pick a path
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
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
