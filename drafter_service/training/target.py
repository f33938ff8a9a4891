"""The target LM: a small transformers ``LlamaForCausalLM`` trained from scratch with next-token cross-entropy."""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.training.presets import Preset


def target_config(p: Preset, vocab_size: int, eos_id: int) -> LlamaConfig:
    if p.hidden_size % p.num_heads or p.num_heads % p.num_kv_heads:
        raise ValueError(f"hidden {p.hidden_size} / heads {p.num_heads} / kv heads {p.num_kv_heads} do not divide")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.hidden_size // p.num_heads,
        hidden_act="silu",
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=p.rms_norm_eps,
        rope_theta=p.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
    )


def build_target(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False  # training and evaluation here run full sequences
    return model


def lm_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a [B, T] batch."""
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
