"""Llama building blocks of the draft heads: attention over the paged KV cache, SiLU MLP, RMSNorm weight."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_kernels import ops

from .attention_metadata import AttentionMetadata


@dataclass
class LlamaDims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False
    mlp_bias: bool = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class LlamaAttention:
    """q/k/v/o projections, RoPE, write K/V of the new rows, paged causal attention."""

    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], prefix: str):
        self.dims = dims
        self.scale = dims.head_dim ** -0.5
        w = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        b = lambda name: weights.get(f"{prefix}.{name}")  # noqa: E731
        self.q_w, self.k_w, self.v_w, self.o_w = w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight"), w("o_proj.weight")
        self.q_b, self.k_b, self.v_b, self.o_b = b("q_proj.bias"), b("k_proj.bias"), b("v_proj.bias"), b("o_proj.bias")

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> torch.Tensor:
        d = self.dims
        n = x.shape[0]
        q = linear(x, self.q_w, self.q_b).view(n, d.num_heads, d.head_dim)
        k = linear(x, self.k_w, self.k_b).view(n, d.num_kv_heads, d.head_dim)
        v = linear(x, self.v_w, self.v_b).view(n, d.num_kv_heads, d.head_dim)
        q, k = ops.apply_rope(q, k, meta.positions, cos_sin_cache)
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  self.scale, max_query_len=meta.max_query_len)
        return linear(out.reshape(n, d.num_heads * d.head_dim), self.o_w, self.o_b)


class LlamaMLP:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        self.gate_w = weights[f"{prefix}.gate_proj.weight"]
        self.up_w = weights[f"{prefix}.up_proj.weight"]
        self.down_w = weights[f"{prefix}.down_proj.weight"]
        self.gate_b = weights.get(f"{prefix}.gate_proj.bias")
        self.up_b = weights.get(f"{prefix}.up_proj.bias")
        self.down_b = weights.get(f"{prefix}.down_proj.bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(linear(x, self.gate_w, self.gate_b)) * linear(x, self.up_w, self.up_b)
        return linear(h, self.down_w, self.down_b)
