"""What the EAGLE heads read from the frozen target: final hidden states, auxiliary layer inputs, logits.

- final hidden h[t]: output of the target's final norm (what lm_head consumes) = ``model.model(...).last_hidden_state``.
- aux state "entering layer i": the input of decoder layer i (= output of layer i-1, = HF ``output_hidden_states[i]``),
  taken with forward pre-hooks so the definition does not depend on the transformers version.
"""
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM


@dataclass
class TargetFeatures:
    final: torch.Tensor  # [B, T, H] fp32
    logits: torch.Tensor  # [B, T, V] fp32
    aux: torch.Tensor | None  # [B, T, 3H] fp32, cat of the states entering aux_layer_ids (in that order)


@torch.no_grad()
def target_features(model: LlamaForCausalLM, ids: torch.Tensor, aux_layer_ids=None) -> TargetFeatures:
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i in aux_layer_ids or ():
        def grab(_module, args, kwargs, i=i):
            captured[i] = args[0] if args else kwargs["hidden_states"]
        hooks.append(model.model.layers[i].register_forward_pre_hook(grab, with_kwargs=True))
    try:
        final = model.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    logits = model.lm_head(final)
    aux = torch.cat([captured[i].float() for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return TargetFeatures(final=final.float(), logits=logits.float(), aux=aux)
