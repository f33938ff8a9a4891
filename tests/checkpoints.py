"""Small random checkpoints in the published layouts, written by the tests themselves (nothing is downloaded)."""
import json
import pathlib

import torch
from safetensors.torch import save_file

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0)


def llama_config(**overrides) -> dict:
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               hidden_act="silu", tie_word_embeddings=False, torch_dtype="float32")
    cfg.update(overrides)
    return cfg


def eagle1_state(cfg: dict, seed: int = 0, fc_bias: bool = False, embed: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std

    state = {
        "fc.weight": w(H, 2 * H),
        "layers.0.self_attn.q_proj.weight": w(q, H),
        "layers.0.self_attn.k_proj.weight": w(kv, H),
        "layers.0.self_attn.v_proj.weight": w(kv, H),
        "layers.0.self_attn.o_proj.weight": w(H, q),
        "layers.0.post_attention_layernorm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
        "layers.0.mlp.gate_proj.weight": w(I, H),
        "layers.0.mlp.up_proj.weight": w(I, H),
        "layers.0.mlp.down_proj.weight": w(H, I),
    }
    if fc_bias:
        state["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    if embed:
        state["embed_tokens.weight"] = w(cfg["vocab_size"], H, std=1.0)
    return state


def target_state(cfg: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Only what the drafter reads of a target: embed_tokens and lm_head (well-separated logits)."""
    g = torch.Generator().manual_seed(seed)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    return {"model.embed_tokens.weight": torch.randn(V, H, generator=g),
            "lm_head.weight": torch.randn(V, H, generator=g) * 2.0,
            "model.norm.weight": torch.ones(H)}


def write_eagle1(root: pathlib.Path, *, seed: int = 0, fc_bias: bool = True, embed: bool = False,
                 bin_format: bool = False, **cfg_overrides) -> tuple[pathlib.Path, pathlib.Path]:
    """Write a head dir and a target dir under root; returns (head_dir, target_dir)."""
    cfg = llama_config(**cfg_overrides)
    head, target = root / "head", root / "target"
    head.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps(cfg))
    state = eagle1_state(cfg, seed, fc_bias=fc_bias, embed=embed)
    if bin_format:
        torch.save(state, head / "pytorch_model.bin")
    else:
        save_file(state, str(head / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2)))
    save_file(target_state(cfg, seed + 1), str(target / "model.safetensors"))
    return head, target
