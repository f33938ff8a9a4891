"""EAGLE-1 draft head for Llama targets (the published layout of yuhuili/EAGLE-*, vLLM's LlamaForCausalLMEagle).

Row t of a forward holds position t: its input is ``fc(cat(embed(x[t+1]), h[t]))`` where h[t] is the target's
final (post-norm) hidden state at t, or during drafting the head's own output at t. Then one Llama decoder
layer *without* input_layernorm, no final norm; the output predicts h[t+1] and ``lm_head(output)`` gives the
logits of x[t+2]. embed_tokens and lm_head are the target's unless the head carries its own.

Weights (keys after loading): fc.weight [H, 2H] (+ fc.bias), layers.0.self_attn.{q,k,v,o}_proj.weight,
layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight, embed_tokens.weight [V, H],
lm_head.weight [V, H].
"""
import torch

from drafter_kernels import ops
from drafter_kernels.rope import build_cos_sin_cache

from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.models.llama_layer import LlamaAttention, LlamaDims, LlamaMLP, linear


class Eagle1Head:
    method = "eagle"
    drafting = "sequential"
    num_kv_layers = 1

    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], rope_theta: float,
                 rope_scaling: dict | None, max_positions: int):
        self.dims = dims
        self.embed_tokens = weights["embed_tokens.weight"]  # [V, H]
        self.lm_head = weights["lm_head.weight"]  # [V, H]
        self.fc_w = weights["fc.weight"]  # [H, 2H]
        self.fc_b = weights.get("fc.bias")
        self.attn = LlamaAttention(dims, weights, "layers.0.self_attn")
        self.post_norm_w = weights["layers.0.post_attention_layernorm.weight"]
        self.mlp = LlamaMLP(weights, "layers.0.mlp")
        device = self.fc_w.device
        self.cos_sin_cache = build_cos_sin_cache(max_positions, dims.head_dim, rope_theta, rope_scaling).to(device)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def hidden_states_width(self) -> int:
        """Columns of the target hidden states the engine sends."""
        return self.dims.hidden_size

    d2t = None  # drafts are target-vocabulary ids (draft_to_target is the identity)

    def combine_hidden_states(self, target_states: torch.Tensor) -> torch.Tensor:
        """Target states -> the hidden input of the first step: as they are (fc mixes them with the embedding)."""
        return target_states

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids [T] (already shifted: x[t+1]), hidden_states [T, H] -> head output [T, H] (pre-lm_head)."""
        embeds = self.embed_tokens[input_ids]
        x = linear(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1), self.fc_w, self.fc_b)
        k_cache, v_cache = kv_layers[0]
        # Layer 0 of an EAGLE-1 head has no input_layernorm.
        attn_out = self.attn(x, meta, k_cache, v_cache, self.cos_sin_cache)
        normed, residual = ops.rms_norm(attn_out, self.post_norm_w, self.dims.rms_norm_eps, residual=x)
        return residual + self.mlp(normed)

    def compute_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] target-vocabulary logits (no final norm in EAGLE-1)."""
        return linear(head_out, self.lm_head)

    def next_hidden(self, head_out: torch.Tensor) -> torch.Tensor:
        """The hidden input of the next draft step: the head's own output."""
        return head_out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
