"""Llama building blocks of the draft heads: attention over the paged KV cache, SiLU MLP, RMSNorm weight.

At load, q/k/v_proj are concatenated into one [Hq*D + 2*Hkv*D, H] weight and gate/up_proj into one [2I, H]
weight, so that a forward reads each in a single GEMM (at small batch a GEMM is a weight read; one large read runs
closer to memory bandwidth than three small ones and saves two launches). The outputs are split by column views.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_kernels import ops

from drafter_service.models.attention_metadata import AttentionMetadata


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


def embedding_and_hidden_norms(table: torch.Tensor, input_ids: torch.Tensor, hidden: torch.Tensor,
                               embed_norm_w: torch.Tensor, hidden_norm_w: torch.Tensor, eps: float):
    """cat(rms_norm(table[input_ids]), rms_norm(hidden)) [T, 2H] and rms_norm(hidden) [T, H] (a view of its second
    half on CUDA): the input of an EAGLE-3 layer, and of a multi-layer EAGLE layer's eh_proj. Where the Triton kernels
    run, each norm writes its half of one buffer and the first reads the embedding rows itself: two kernels, no
    gather, no concatenation (EAGLE-3 at the 8B shape, H200: 1.21 -> 1.18 ms of GPU time per step at batch 1 without
    the concatenation, 10-20 us less without the gather). Elsewhere (CPU, DRAFTER_KERNELS=torch) the references'
    out= copies would cost more than the concatenation (~30 us per forward on the dev CPU), so it concatenates."""
    hidden = hidden.to(table.dtype)
    if ops.use_triton(table):
        H = table.shape[1]
        x = torch.empty(input_ids.shape[0], 2 * H, dtype=table.dtype, device=table.device)
        ops.rms_norm(table, embed_norm_w, eps, out=x[:, :H], rows=input_ids)
        normed, _ = ops.rms_norm(hidden, hidden_norm_w, eps, out=x[:, H:])
        return x, normed
    normed, _ = ops.rms_norm(hidden, hidden_norm_w, eps)
    return torch.cat([ops.rms_norm(table[input_ids], embed_norm_w, eps)[0], normed], dim=-1), normed


def fuse_rows(weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
    """[sum of rows, in] weight (and bias, when every part has one; when none has, None)."""
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        biases = [b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                  for w, b in zip(weights, biases)]
    bias = torch.cat(biases) if biases[0] is not None else None
    return torch.cat(weights), bias


class LlamaAttention:
    """q/k/v/o projections (q/k/v as one fused weight), RoPE, write K/V of the new rows, paged causal attention."""

    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], prefix: str):
        self.dims = dims
        self.scale = dims.head_dim ** -0.5
        w = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        b = lambda name: weights.get(f"{prefix}.{name}")  # noqa: E731
        self.qkv_w, self.qkv_b = fuse_rows([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")],
                                           [b("q_proj.bias"), b("k_proj.bias"), b("v_proj.bias")])
        self.o_w, self.o_b = w("o_proj.weight"), b("o_proj.bias")
        self.q_size = dims.num_heads * dims.head_dim
        self.kv_size = dims.num_kv_heads * dims.head_dim

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> torch.Tensor:
        d = self.dims
        n = x.shape[0]
        qkv = linear(x, self.qkv_w, self.qkv_b)  # [n, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(n, d.num_heads, d.head_dim)  # views: row stride q_size + 2 * kv_size
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, d.num_kv_heads, d.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, d.num_kv_heads, d.head_dim)
        q, k = ops.apply_rope(q, k, meta.positions, cos_sin_cache)
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  self.scale, max_query_len=meta.max_query_len, context_cache=meta.context_cache)
        return linear(out.reshape(n, d.num_heads * d.head_dim), self.o_w, self.o_b)


class LlamaMLP:
    """down(silu(gate(x)) * up(x)), gate and up as one fused weight."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        self.gate_up_w, self.gate_up_b = fuse_rows(
            [weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]],
            [weights.get(f"{prefix}.gate_proj.bias"), weights.get(f"{prefix}.up_proj.bias")])
        self.down_w = weights[f"{prefix}.down_proj.weight"]
        self.down_b = weights.get(f"{prefix}.down_proj.bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_w, self.gate_up_b)  # [n, 2I]
        return linear(ops.silu_and_mul(gate_up), self.down_w, self.down_b)  # silu(gate) * up: one kernel on CUDA
