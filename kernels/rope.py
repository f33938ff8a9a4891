"""Rotary position embedding, Llama ("neox", rotate-half) layout, with Llama-3 frequency scaling.

``cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))``, shape ``[max_pos, head_dim]``.
"""
import math

import torch

from drafter_kernels._triton_shim import tl, triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp64; supports no scaling, "linear" and "llama3"."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def build_cos_sin_cache(max_positions: int, head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # [P, D]


def apply_rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32
    *,
    q_out: torch.Tensor | None = None,  # [T, Hq, D]: written instead of a new tensor
    k_out: torch.Tensor | None = None,  # [T, Hkv, D]: written instead of a new tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    q_rot, k_rot = rotate(q), rotate(k)
    return (q_rot if q_out is None else q_out.copy_(q_rot)), (k_rot if k_out is None else k_out.copy_(k_rot))


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  q [T, Hq, D], k [T, Hkv, D] (unit stride on D); positions [T] int; cos_sin_cache [max_pos, D] fp32.
# Writes:  q_out [T, Hq, D] and k_out [T, Hkv, D], all of them.
# Grid:    (T,): one program rotates every head of one token with that token's cos/sin row.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(
    src_ptr, src_stride_h, dst_ptr, dst_stride_h, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # cos, sin: [BLOCK_HALF] fp32. Rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    heads = tl.arange(0, BLOCK_HEADS)
    halves = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (halves[None, :] < HALF)
    src = src_ptr + heads[:, None] * src_stride_h + halves[None, :]
    dst = dst_ptr + heads[:, None] * dst_stride_h + halves[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h,
    q_out_stride_t, q_out_stride_h, k_out_stride_t, k_out_stride_h,
    cos_sin_stride, num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    halves = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + halves, mask=halves < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + halves, mask=halves < HALF, other=0.0)
    _rotate_heads(q_ptr + token * q_stride_t, q_stride_h, q_out_ptr + token * q_out_stride_t, q_out_stride_h,
                  cos, sin, num_q_heads, HALF, BLOCK_Q_HEADS, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_stride_t, k_stride_h, k_out_ptr + token * k_out_stride_t, k_out_stride_h,
                  cos, sin, num_kv_heads, HALF, BLOCK_KV_HEADS, BLOCK_HALF)


def apply_rope_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32
    *,
    q_out: torch.Tensor | None = None,  # [T, Hq, D]
    k_out: torch.Tensor | None = None,  # [T, Hkv, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.dtype == torch.float32
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.stride(2) == 1 and k_out.stride(2) == 1
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), num_q_heads, num_kv_heads,
        HALF=half, BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
