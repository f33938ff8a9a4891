"""Llama building blocks for the EAGLE heads, numerically the same conventions as transformers' Llama.

Parameter names match the published checkpoints (``q_proj``, ``gate_proj``, ``post_attention_layernorm``...).
Attention takes explicit position ids and optional keys/values of earlier draft steps, so one module serves
training (causal, or the training-time-test mask) and step-by-step drafting.
"""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] or [B, T] -> cos, sin [..., T, head_dim] (rotate-half layout, as HF Llama)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [T, D] or [B, T, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, in_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] = (),  # keys/values of earlier steps, [B, kv_heads, S, D]
        mask: torch.Tensor | None = None,  # bool [T, S_total], True = may attend
        causal: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        if causal and (past or mask is not None):
            raise ValueError("causal=True is only for a single step without past keys or a mask")
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
