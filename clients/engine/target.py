"""The target model of the reference engine: a Hugging Face causal LM run batched over its own KV cache.

Every token fed to the model takes one cache *slot* per sequence; the batch shares the slot count. Slots of
rejected drafts become holes: the 2-D attention mask (``self.mask``, [B, slots], 1 = valid) hides them from every
later query, and RoPE positions are passed per sequence (``position_ids``), so a sequence's positions stay
contiguous whatever its holes. Prompts of different lengths are left-padded (padding slots are holes too).
One verification step is one ``extend`` over [bonus, drafts] for the whole batch, then ``keep`` marks which of
those slots the target committed.

What the drafter wants from the target (``drafter_features``): for EAGLE-1 the final hidden state (after the final
norm, what lm_head consumes) = the last entry of HF's ``output_hidden_states``; for EAGLE-3 the states entering
the target layers ``GetInfo.target_layer_ids``, concatenated = HF ``hidden_states[i]`` for each id i.
"""
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel

# transformers renamed the forward's ``past_key_values`` to ``cache`` (the old name is deprecated, removed in 5.40);
# pass whichever the installed version takes. The DynamicCache is ours and updated in place by the forward.
_CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@dataclass
class Forward:
    logits: torch.Tensor  # [B, W, V] fp32
    features: torch.Tensor  # [B, W, hidden_states_width]: what the drafter reads (see drafter_features)


def drafter_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int] | None) -> torch.Tensor:
    """HF ``output_hidden_states`` ([embeddings, input of layer 1, ..., final-norm output]) -> the drafter's input.

    layer_ids None or empty: EAGLE-1, the final (post-norm) state. Otherwise EAGLE-3: states entering those layers.
    """
    if not layer_ids:
        return hidden_states[-1]
    num_layers = len(hidden_states) - 1
    for i in layer_ids:
        if not 0 <= i < num_layers:
            raise ValueError(f"target layer id {i} is outside the target's layers [0, {num_layers})")
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


class TargetModel:
    def __init__(self, model: PreTrainedModel, feature_layer_ids: list[int] | None = None):
        self.model = model.eval()
        self.feature_layer_ids = list(feature_layer_ids or [])
        self.feature_fc = None  # EngineFc: applied to the features (a drafter served with --engine-applies-fc)
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.max_positions = int(model.config.max_position_embeddings)
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, slots]

    @classmethod
    def load(cls, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "TargetModel":
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model)

    @property
    def features_width(self) -> int:
        if self.feature_fc is not None:
            return self.feature_fc.out_features
        return self.hidden_size * max(1, len(self.feature_layer_ids))

    @property
    def batch_size(self) -> int:
        return self.mask.size(0)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> Forward:
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=self.mask, use_cache=True,
                         output_hidden_states=True, **{_CACHE_KWARG: self.cache})
        features = drafter_features(out.hidden_states, self.feature_layer_ids)
        if self.feature_fc is not None:  # (the drafter takes fc of the three layers' states: engine_fc.py)
            features = self.feature_fc(features)
        return Forward(logits=out.logits.float(), features=features)

    def prefill(self, prompts: list[list[int]]) -> Forward:
        """Start a new batch (drops the previous cache). Prompts are left-padded to the longest: row b's prompt
        occupies the last len(prompts[b]) columns of the returned logits / features."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt and no empty prompt")
        width = max(len(p) for p in prompts)
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            self.mask[b, width - len(p):] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = self.mask.to(self.device)
        self.cache = DynamicCache()
        return self._forward(tokens.to(self.device), positions.to(self.device))

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor) -> Forward:
        """Feed [B, W] more tokens at the given per-sequence positions; their W slots start out valid."""
        if tokens.shape != positions.shape or tokens.size(0) != self.batch_size:
            raise ValueError(f"extend: tokens {tuple(tokens.shape)} / positions {tuple(positions.shape)} do not "
                             f"match the batch of {self.batch_size}")
        self.mask = torch.cat([self.mask, torch.ones_like(tokens, device=self.device)], dim=1)
        return self._forward(tokens.to(self.device), positions.to(self.device))

    def keep(self, valid: torch.Tensor) -> None:
        """valid [B, W] bool: which slots of the last ``extend`` the sequences committed; the rest become holes."""
        self.mask[:, -valid.size(1):] = valid.to(self.mask.device, torch.long)

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.mask = self.mask[index]
        if self.cache is not None:
            self.cache.batch_select_indices(index)
