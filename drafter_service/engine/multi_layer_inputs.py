"""Shift-and-cache for multi-layer EAGLE: re-feed the rows whose upper-layer KV was built from drafts.

Layer j of a multi-layer head reads, at row t, the token x[t+1+j] (models/multi_layer_eagle.py). At a step that
ends at C = p + m, the last j rows of layer j therefore read drafts (or nothing committed yet): their KV in layer
j is provisional. Rows t <= C - n_predict read committed tokens only, in every layer, and are final. So after a
step the final prefix of a sequence is ``final_len = min(C, max(w0, C - n_predict + 1))`` where w0 is the first
row of the step's window, and the next step must start its window at ``w0 = min(p, final_len)``: the rows
[w0, p) are re-fed from a per-sequence cache of the window's last MAX_SHIFT = n_predict rows (token ids,
positions, KV slots, target hidden states), exactly the cache of vLLM's MultiLayerEagleProposer (seed 003).

Difference from the seed, by construction of our protocol: vLLM's padded batch holds the rejected drafts at the
end of each request's window, so its kernel shifts the window right by ``shift`` rows (dropping them) and fills
the vacated front from the cache. Our engine sends only committed rows, so nothing is to be dropped: the window
grows by ``shift`` rows in front. ``shift_and_cache`` below gets exactly that from the same kernel
(drafter_kernels/shift_and_cache.py, through ops) by giving each sequence's window ``shift`` padding rows at the
end of the source, which the shift pushes out. The cache refresh (the window's last MAX_SHIFT rows) is the seed's.
"""
from dataclasses import dataclass

import torch

from drafter_kernels import ops
from drafter_kernels.shift_and_cache import shift_cache_store_window


@dataclass
class ShiftCache:
    """One sequence's cache: the last ``length`` rows of its previous window, in position order (device tensors)."""

    token_ids: torch.Tensor  # [MAX_SHIFT] int64: x[t] of each row
    positions: torch.Tensor  # [MAX_SHIFT] int64
    slot_mapping: torch.Tensor  # [MAX_SHIFT] int64
    hidden_states: torch.Tensor  # [MAX_SHIFT, W]: the target hidden state h[t]
    length: int  # rows held
    start_position: int  # position of row 0 (host copy of positions[0], so control flow needs no device sync)
    final_len: int  # positions [0, final_len) have final KV in every layer


@dataclass
class ShiftedWindow:
    token_ids: torch.Tensor  # [T_out] int64: x[t] of each window row
    positions: torch.Tensor  # [T_out] int64
    slot_mapping: torch.Tensor  # [T_out] int64
    hidden_states: torch.Tensor  # [T_out, W]
    query_start_loc: list[int]  # [B + 1]: sequence b owns window rows [qsl[b], qsl[b+1])
    cached_token_ids: torch.Tensor  # [B, MAX_SHIFT] the refreshed caches (left-aligned, zero-padded)
    cached_positions: torch.Tensor  # [B, MAX_SHIFT]
    cached_slot_mapping: torch.Tensor  # [B, MAX_SHIFT]
    cached_hidden_states: torch.Tensor  # [B, MAX_SHIFT, W]
    cached_len: list[int]  # [B]


def shift_and_cache(
    src_token_ids: torch.Tensor,  # [T] int64: the committed rows of the step, all sequences packed
    src_positions: torch.Tensor,  # [T] int64
    src_slot_mapping: torch.Tensor,  # [T] int64
    src_hidden_states: torch.Tensor,  # [T, W]
    query_start_loc: list[int],  # [B + 1]: sequence b owns src rows [qsl[b], qsl[b+1])
    shift: list[int],  # [B]: rows to re-feed in front of sequence b's rows, from its cache
    cached_len: list[int],  # [B]: usable rows of each cache (rows at or after the step's first position dropped)
    cached_token_ids: torch.Tensor,  # [B, MAX_SHIFT]
    cached_positions: torch.Tensor,  # [B, MAX_SHIFT]
    cached_slot_mapping: torch.Tensor,  # [B, MAX_SHIFT]
    cached_hidden_states: torch.Tensor,  # [B, MAX_SHIFT, W]
) -> ShiftedWindow:
    """Window of sequence b = cache rows [cached_len - shift, cached_len) ++ src rows of b; new cache = the
    window's last min(MAX_SHIFT, window length) rows. The cached_* tensors are rewritten with the new caches."""
    B, max_shift = cached_token_ids.shape
    assert all(0 <= s <= c <= max_shift for s, c in zip(shift, cached_len)), "a shift needs that many cached rows"
    dev = src_token_ids.device
    lens = [shift[b] + query_start_loc[b + 1] - query_start_loc[b] for b in range(B)]
    out_qsl = [0]
    for n in lens:
        out_qsl.append(out_qsl[-1] + n)
    # the padded source: sequence b's rows at the front of its window, then shift[b] rows the shift pushes out
    rows = torch.cat([torch.arange(query_start_loc[b], query_start_loc[b + 1]) for b in range(B)])
    padded_at = torch.cat([out_qsl[b] + torch.arange(query_start_loc[b + 1] - query_start_loc[b])
                           for b in range(B)]).to(dev)
    window_start = torch.tensor(out_qsl[:-1], dtype=torch.int64)
    window_end = torch.tensor(out_qsl[1:], dtype=torch.int64) - 1
    store_start, store_len = shift_cache_store_window(window_start, window_end, max_shift)
    meta = [t.to(dev) for t in (window_start, window_end, torch.tensor(shift, dtype=torch.int64),
                                torch.tensor(cached_len, dtype=torch.int64), store_start, store_len)]
    out = []
    for src, cache in ((src_token_ids, cached_token_ids), (src_positions, cached_positions),
                       (src_slot_mapping, cached_slot_mapping), (src_hidden_states, cached_hidden_states)):
        padded = torch.zeros(out_qsl[-1], *src.shape[1:], dtype=src.dtype, device=dev)
        padded[padded_at] = src[rows.to(dev)]
        dst = torch.empty_like(padded)
        ops.shift_and_cache(padded, dst, cache, *meta)
        out.append(dst)
    return ShiftedWindow(out[0], out[1], out[2], out[3], out_qsl, cached_token_ids, cached_positions,
                         cached_slot_mapping, cached_hidden_states, store_len.tolist())
