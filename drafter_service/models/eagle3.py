"""EAGLE-3 draft head for Llama targets (yuhuili/EAGLE3-*, vLLM's Eagle3LlamaForCausalLM / LlamaForCausalLMEagle3).

The target sends, per committed position t, three of its hidden states concatenated: ``feats[t] = cat(h_a[t],
h_b[t], h_c[t])`` [3 * H_target], where h_i is the residual stream entering target layer i (HF
``output_hidden_states[i]``). Row t of a forward holds position t:

    first step   hidden[t] = fc(feats[t])                      (fc: [H, 3 * H_target], applied to target states only)
    decode step  hidden    = the head's own pre-norm output of the previous step (fc is NOT applied)
    layer        e = input_layernorm(embed(x[t+1])),  r = hidden,  n = hidden_norm(hidden)
                 a = attn(cat(e, n))                   (q/k/v over 2H; the residual r is the pre-norm hidden)
                 y = post_attention_layernorm(a + r);  out = (a + r) + mlp(y)          -> pre-norm output [H]
    logits       lm_head(norm(out)) over the draft vocabulary; target id = draft id + d2t[draft id]

With ``norm_before_residual`` in the config the residual is hidden_norm(hidden) instead (vLLM's option).

Served with --engine-applies-fc (``engine_applies_fc``), the engine applies fc itself and sends fc(feats[t]) [H]:
the first step takes those rows as they come (combine_hidden_states only casts), and the head keeps no fc weight
(P-EAGLE's mask_hidden is combined once, at load). The bytes per token on the wire are a third.

Weights (keys after loading): fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight [V_draft, H], d2t [V_draft] (absent when V_draft = V), embed_tokens.weight [V, H] (the head's or
the target's). P-EAGLE heads add mask_hidden [3 * H_target] (see drafter_service/engine/parallel_inputs.py).
"""
import torch

from drafter_kernels import ops
from drafter_kernels.rope import build_cos_sin_cache

from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.models.llama_layer import (LlamaAttention, LlamaDims, LlamaMLP, embedding_and_hidden_norms,
                                                linear)


class Eagle3Head:
    method = "eagle3"
    num_kv_layers = 1

    def __init__(self, dims: LlamaDims, weights: dict[str, torch.Tensor], target_hidden_size: int, vocab_size: int,
                 rope_theta: float, rope_scaling: dict | None, max_positions: int, norm_before_residual: bool = False,
                 parallel_token_id: int | None = None, engine_applies_fc: bool = False):
        self.dims = dims
        self.target_hidden_size = target_hidden_size
        self._vocab_size = vocab_size
        self.embed_tokens = weights["embed_tokens.weight"]  # [V, H]
        self.lm_head = weights["lm_head.weight"]  # [V_draft, H]
        self.d2t = weights.get("d2t")  # [V_draft] int64 or None (identity)
        self.fc_w = weights["fc.weight"]  # [H, 3 * H_target]; None below when the engine applies it
        self.input_norm_w = weights["midlayer.input_layernorm.weight"]
        self.hidden_norm_w = weights["midlayer.hidden_norm.weight"]
        self.post_norm_w = weights["midlayer.post_attention_layernorm.weight"]
        self.norm_w = weights["norm.weight"]
        self.attn = LlamaAttention(dims, weights, "midlayer.self_attn")
        self.mlp = LlamaMLP(weights, "midlayer.mlp")
        self.norm_before_residual = norm_before_residual
        self.cos_sin_cache = build_cos_sin_cache(max_positions, dims.head_dim, rope_theta, rope_scaling).to(
            self.norm_w.device)
        # Parallel drafting (P-EAGLE): the input token and the (already combined) hidden state of masked slots.
        self.drafting = "sequential" if parallel_token_id is None else "parallel"
        self.parallel_token_id = parallel_token_id
        self.mask_hidden = None
        if parallel_token_id is not None:
            self.mask_hidden = linear(weights["mask_hidden"].view(1, -1).to(self.fc_w.dtype), self.fc_w).view(-1)  # [H]
        if engine_applies_fc:
            self.fc_w = None  # (100 MB at the 8B shape that the engine holds instead)

    @property
    def vocab_size(self) -> int:
        """Target vocabulary size (the bound of the token ids the engine sends and receives)."""
        return self._vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def engine_applies_fc(self) -> bool:
        """Served with --engine-applies-fc: the engine sends fc's output, and the head holds no fc weight."""
        return self.fc_w is None

    @property
    def hidden_states_width(self) -> int:
        """Columns of a request's hidden states: the three target layers' states, or fc of them (engine_applies_fc)."""
        return self.dims.hidden_size if self.engine_applies_fc else 3 * self.target_hidden_size

    def combine_hidden_states(self, target_states: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] target features -> [T, H] (first step only); with engine_applies_fc the rows are
        fc's output already ([T, H]): only cast to the head's dtype."""
        if self.engine_applies_fc:
            return target_states.to(self.norm_w.dtype)
        return linear(target_states.to(self.fc_w.dtype), self.fc_w)

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids [T] (shifted: x[t+1]), hidden_states [T, H] (combined) -> pre-norm output [T, H]."""
        eps = self.dims.rms_norm_eps
        hidden = hidden_states.to(self.embed_tokens.dtype)
        # the attention's input cat(e, n) [T, 2H] (llama_layer.py: two kernels where Triton runs)
        x, normed = embedding_and_hidden_norms(self.embed_tokens, input_ids, hidden, self.input_norm_w,
                                               self.hidden_norm_w, eps)
        residual = normed if self.norm_before_residual else hidden
        k_cache, v_cache = kv_layers[0]
        attn_out = self.attn(x, meta, k_cache, v_cache, self.cos_sin_cache)
        y, residual = ops.rms_norm(attn_out, self.post_norm_w, eps, residual=residual)
        return residual + self.mlp(y)

    def compute_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        """[B, H] pre-norm outputs -> [B, V_draft] draft-vocabulary logits."""
        normed, _ = ops.rms_norm(head_out, self.norm_w, self.dims.rms_norm_eps)
        return linear(normed, self.lm_head)

    def next_hidden(self, head_out: torch.Tensor) -> torch.Tensor:
        """The hidden input of the next draft step: the pre-norm output (no fc)."""
        return head_out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]
