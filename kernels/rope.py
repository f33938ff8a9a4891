"""Rotary position embedding, Llama ("neox", rotate-half) layout, with Llama-3 frequency scaling.

``cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))``, shape ``[max_pos, head_dim]``.
"""
import math

import torch


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
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions]  # [T, D]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
