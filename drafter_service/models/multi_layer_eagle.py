"""Multi-layer EAGLE: ``n_predict`` layers, layer j drafts position j + 1 (vLLM's MultiLayerEagleProposer, seed 003).

Every layer runs over the same rows (the committed positions of the step): row t of layer j takes the token
x[t+1+j] and the output of layer j-1 at row t (layer 0: the target's final hidden state h[t]), so each layer has
its own KV cache over the committed positions and the drafts need no positions of their own. Where x[t+1+j] is
not committed yet (the last j rows) it is the draft of layer j-1, j-2, ...; those rows are recomputed at the
next step (drafter_service/engine/multi_layer_inputs.py).

Layer j (the MTP layer layout of vLLM, Llama blocks):
    x   = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))            eh_proj: [H, 2H]
    out = Llama decoder layer(x)  (input_layernorm, attention, post_attention_layernorm, MLP, residuals)
    logits_j = head_j(shared_head.norm(out));  the hidden input of layer j+1 is ``out`` (pre-norm)

Weights (keys after loading), j = 0 .. n_predict-1: layers.{j}.{enorm, hnorm}.weight [H],
layers.{j}.eh_proj.weight [H, 2H], layers.{j}.input_layernorm.weight, layers.{j}.self_attn.{q,k,v,o}_proj.weight,
layers.{j}.post_attention_layernorm.weight, layers.{j}.mlp.{gate,up,down}_proj.weight,
layers.{j}.shared_head.norm.weight [H], layers.{j}.shared_head.head.weight [V, H] (else the shared lm_head.weight,
the head's or the target's); embed_tokens.weight [V, H] (the head's or the target's).
"""
import torch

from drafter_kernels import ops
from drafter_kernels.rope import build_cos_sin_cache

from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.models.llama_layer import (LlamaAttention, LlamaDims, LlamaMLP, embedding_and_hidden_norms,
                                                linear)


class _MtpLayer:
    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], prefix: str, lm_head: torch.Tensor):
        w = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.enorm_w, self.hnorm_w, self.eh_proj_w = w("enorm.weight"), w("hnorm.weight"), w("eh_proj.weight")
        self.input_norm_w, self.post_norm_w = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        self.attn = LlamaAttention(dims, weights, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(weights, f"{prefix}.mlp")
        self.head_norm_w = w("shared_head.norm.weight")
        self.head_w = weights.get(f"{prefix}.shared_head.head.weight", lm_head)


class MultiLayerEagleHead:
    method = "multi_layer_eagle"
    drafting = "multi_layer"
    parallel_token_id = None

    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], num_predict: int, rope_theta: float,
                 rope_scaling: dict | None, max_positions: int):
        self.dims = dims
        self.num_predict = num_predict
        self.num_kv_layers = num_predict  # one KV cache per layer
        self.embed_tokens = weights["embed_tokens.weight"]  # [V, H]
        lm_head = weights.get("lm_head.weight")
        self.layers = [_MtpLayer(dims, weights, f"layers.{j}", lm_head) for j in range(num_predict)]
        self.cos_sin_cache = build_cos_sin_cache(max_positions, dims.head_dim, rope_theta, rope_scaling).to(
            self.embed_tokens.device)

    @property
    def vocab_size(self) -> int:
        return self.layers[0].head_w.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def hidden_states_width(self) -> int:
        return self.dims.hidden_size

    def combine_hidden_states(self, target_states: torch.Tensor) -> torch.Tensor:
        return target_states

    def forward_layer(self, j: int, input_ids: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata,
                      kv_layer: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Layer j: input_ids [T] (x[t+1+j]), hidden_states [T, H] -> pre-norm output [T, H]."""
        L, eps = self.layers[j], self.dims.rms_norm_eps
        eh, _ = embedding_and_hidden_norms(self.embed_tokens, input_ids, hidden_states, L.enorm_w, L.hnorm_w, eps)
        x = linear(eh, L.eh_proj_w)
        normed, _ = ops.rms_norm(x, L.input_norm_w, eps)
        attn_out = L.attn(normed, meta, kv_layer[0], kv_layer[1], self.cos_sin_cache)
        y, residual = ops.rms_norm(attn_out, L.post_norm_w, eps, residual=x)
        return residual + L.mlp(y)

    def compute_logits_layer(self, j: int, out: torch.Tensor) -> torch.Tensor:
        """[B, H] outputs of layer j -> [B, V] logits of draft j + 1."""
        L = self.layers[j]
        normed, _ = ops.rms_norm(out, L.head_norm_w, self.dims.rms_norm_eps)
        return linear(normed, L.head_w)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
