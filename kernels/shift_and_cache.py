"""Multi-layer EAGLE: shift each request's window right by a per-request amount, refilling the front from a
small per-request cache of the previous round's tail, then refresh that cache.

Used for token ids, positions and slot mappings (1-D, ``[T]``) and for hidden states (``[T, H]``); one function
serves both (a 1-D tensor is a hidden size of 1). Request b owns rows ``window_start[b] ..= window_end[b]``
(inclusive) of ``src`` and ``dst``. For ``0 <= i < window_len``:

    dst[window_start + i] = cache[b, cached_len[b] - shift[b] + i]   if i < shift[b]     (needs shift <= cached_len)
                            src[window_start + i - shift[b]]          otherwise

Then the cache row is refreshed from the new window: ``cache[b, m] = dst[store_start[b] + m]`` for
``m < store_len[b]`` and 0 for ``store_len[b] <= m < MAX_SHIFT``. The caller sets ``cached_len = store_len`` after
every tensor of the round has been shifted (see shift_cache_store_window). ``dst`` must not alias ``src``.
Rows of dst outside every window and cache rows ``>= B`` are not touched.
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def shift_cache_store_window(
    window_start: torch.Tensor,  # [B] int
    token_indices_to_sample: torch.Tensor,  # [B] int, after the shift
    max_shift: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # store_start [B], store_len [B]: the last <= max_shift rows up to the sample
    store_start = torch.maximum(window_start, token_indices_to_sample + 1 - max_shift)
    store_len = (token_indices_to_sample - store_start + 1).clamp(min=0, max=max_shift)
    return store_start, store_len


def shift_and_cache_ref(
    src: torch.Tensor,  # [T] or [T, H]
    dst: torch.Tensor,  # like src (written in the windows)
    cache: torch.Tensor,  # [>= B, MAX_SHIFT] or [>= B, MAX_SHIFT, H] (rows < B rewritten)
    window_start: torch.Tensor,  # [B] int
    window_end: torch.Tensor,  # [B] int, inclusive
    shift: torch.Tensor,  # [B] int, 0 <= shift <= cached_len
    cached_len: torch.Tensor,  # [B] int, valid entries at the front of each cache row
    store_start: torch.Tensor,  # [B] int
    store_len: torch.Tensor,  # [B] int, <= MAX_SHIFT
) -> None:
    assert dst.data_ptr() != src.data_ptr(), "dst must not alias src"
    max_shift = cache.shape[1]
    rows = zip(window_start.tolist(), window_end.tolist(), shift.tolist(), cached_len.tolist(),
               store_start.tolist(), store_len.tolist())
    for b, (start, end, shift_b, cached_b, store_start_b, store_len_b) in enumerate(rows):
        assert 0 <= shift_b <= cached_b, "shift must not exceed the cached length"
        assert 0 <= store_len_b <= max_shift
        window_len = end - start + 1
        from_cache = min(shift_b, window_len)
        dst[start:start + from_cache] = cache[b, cached_b - shift_b:cached_b - shift_b + from_cache]
        dst[start + from_cache:end + 1] = src[start + from_cache - shift_b:end + 1 - shift_b]
        cache[b] = 0
        cache[b, :store_len_b] = dst[store_start_b:store_start_b + store_len_b]


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  src, dst [T, H] (H = 1 for 1-D; unit stride on H); cache [>= B, MAX_SHIFT, H] contiguous;
#          window_start, window_end, shift, cached_len, store_start, store_len [B].
# Writes:  kernel 1: dst rows window_start[b] ..= window_end[b]; kernel 2: cache[b, :, :] for b < B.
# Two launches so that no program reads a cache row or a dst row another program of the same launch writes.
# Grid:    (B, cdiv(H, BLOCK_H)) for both: one program per request and hidden-column block.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _shift_from_cache_kernel(
    src_ptr, dst_ptr, cache_ptr, window_start_ptr, window_end_ptr, shift_ptr, cached_len_ptr,
    src_stride, dst_stride, hidden_size,
    MAX_SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    request = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden_size
    start = tl.load(window_start_ptr + request).to(tl.int64)
    window_len = tl.load(window_end_ptr + request).to(tl.int64) - start + 1
    shift = tl.load(shift_ptr + request).to(tl.int64)
    cached_len = tl.load(cached_len_ptr + request).to(tl.int64)
    cache_row = cache_ptr + request.to(tl.int64) * MAX_SHIFT * hidden_size

    for chunk_start in range(0, window_len, BLOCK_T):
        i = chunk_start + tl.arange(0, BLOCK_T)  # [BLOCK_T] index inside the window
        in_window = (i < window_len)[:, None] & col_mask[None, :]
        from_cache = (i < shift)[:, None]
        cached = tl.load(cache_row + (cached_len - shift + i)[:, None] * hidden_size + cols[None, :],
                         mask=in_window & from_cache)
        shifted = tl.load(src_ptr + (start + i - shift)[:, None] * src_stride + cols[None, :],
                          mask=in_window & ~from_cache)
        tl.store(dst_ptr + (start + i)[:, None] * dst_stride + cols[None, :], tl.where(from_cache, cached, shifted),
                 mask=in_window)


@triton.jit
def _refresh_cache_kernel(
    dst_ptr, cache_ptr, store_start_ptr, store_len_ptr,
    dst_stride, hidden_size,
    MAX_SHIFT: tl.constexpr, PADDED_SHIFT: tl.constexpr, BLOCK_H: tl.constexpr,
):
    request = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden_size
    store_start = tl.load(store_start_ptr + request).to(tl.int64)
    store_len = tl.load(store_len_ptr + request)
    m = tl.arange(0, PADDED_SHIFT)
    cache_mask = (m < MAX_SHIFT)[:, None] & col_mask[None, :]
    values = tl.load(dst_ptr + (store_start + m)[:, None] * dst_stride + cols[None, :],
                     mask=cache_mask & (m < store_len)[:, None], other=0)
    cache_row = cache_ptr + request.to(tl.int64) * MAX_SHIFT * hidden_size
    tl.store(cache_row + m[:, None] * hidden_size + cols[None, :], values, mask=cache_mask)


def shift_and_cache_triton(
    src: torch.Tensor,  # [T] or [T, H]
    dst: torch.Tensor,  # like src (written in the windows)
    cache: torch.Tensor,  # [>= B, MAX_SHIFT] or [>= B, MAX_SHIFT, H]
    window_start: torch.Tensor,  # [B] int
    window_end: torch.Tensor,  # [B] int, inclusive
    shift: torch.Tensor,  # [B] int
    cached_len: torch.Tensor,  # [B] int
    store_start: torch.Tensor,  # [B] int
    store_len: torch.Tensor,  # [B] int
) -> None:
    assert dst.data_ptr() != src.data_ptr(), "dst must not alias src"
    assert src.dim() in (1, 2) and dst.shape == src.shape and cache.dim() == src.dim() + 1
    assert src.dtype == dst.dtype == cache.dtype and cache.is_contiguous()
    src_2d = src if src.dim() == 2 else src[:, None]
    dst_2d = dst if dst.dim() == 2 else dst[:, None]
    assert src_2d.stride(1) == 1 or src_2d.shape[1] == 1
    assert dst_2d.stride(1) == 1 or dst_2d.shape[1] == 1
    num_requests = window_start.shape[0]
    max_shift, hidden_size = cache.shape[1], src_2d.shape[1]
    if num_requests == 0:
        return
    block_h = min(128, triton.next_power_of_2(hidden_size))
    grid = (num_requests, triton.cdiv(hidden_size, block_h))
    _shift_from_cache_kernel[grid](
        src_2d, dst_2d, cache, window_start, window_end, shift, cached_len,
        src_2d.stride(0), dst_2d.stride(0), hidden_size,
        MAX_SHIFT=max_shift, BLOCK_T=min(128, 4096 // block_h), BLOCK_H=block_h,
    )
    _refresh_cache_kernel[grid](
        dst_2d, cache, store_start, store_len,
        dst_2d.stride(0), hidden_size,
        MAX_SHIFT=max_shift, PADDED_SHIFT=triton.next_power_of_2(max_shift), BLOCK_H=block_h,
    )
