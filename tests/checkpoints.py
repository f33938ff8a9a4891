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


def _random(g: torch.Generator):
    def w(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std
    return w


def _llama_layer(w, g: torch.Generator, prefix: str, H: int, I: int, q: int, kv: int, in_features: int,
                 input_norm: bool) -> dict[str, torch.Tensor]:
    state = {
        f"{prefix}.self_attn.q_proj.weight": w(q, in_features),
        f"{prefix}.self_attn.k_proj.weight": w(kv, in_features),
        f"{prefix}.self_attn.v_proj.weight": w(kv, in_features),
        f"{prefix}.self_attn.o_proj.weight": w(H, q),
        f"{prefix}.post_attention_layernorm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
        f"{prefix}.mlp.gate_proj.weight": w(I, H),
        f"{prefix}.mlp.up_proj.weight": w(I, H),
        f"{prefix}.mlp.down_proj.weight": w(H, I),
    }
    if input_norm:
        state[f"{prefix}.input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    return state


def _write_state(d: pathlib.Path, state: dict, bin_format: bool) -> None:
    if bin_format:
        torch.save(state, d / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))


def write_target(target: pathlib.Path, *, vocab: int, hidden: int, num_layers: int, seed: int) -> None:
    """A target directory: config.json and only embed_tokens / lm_head / final norm."""
    target.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=num_layers)
    (target / "config.json").write_text(json.dumps(cfg))
    save_file(target_state(cfg, seed), str(target / "model.safetensors"))


def write_eagle3(root: pathlib.Path, *, seed: int = 0, draft_vocab: int | None = 200, target_hidden: int | None = None,
                 embed: bool = False, bin_format: bool = True, architecture: str = "LlamaForCausalLMEagle3",
                 aux_layer_ids: list[int] | None = None, target_layers: int = 8, parallel_token_id: int | None = None,
                 layer_prefix: str = "midlayer", drop: tuple[str, ...] = (), **cfg_overrides
                 ) -> tuple[pathlib.Path, pathlib.Path]:
    """An EAGLE-3 head as published (yuhuili/EAGLE3-*: midlayer.*, fc over 3 target states, norm, draft-vocab
    lm_head, d2t / t2d; no embed_tokens unless asked) and a target with ``target_layers`` layers.

    draft_vocab=None: the full target vocabulary, no d2t. parallel_token_id: a P-EAGLE head (ptd_token_id +
    mask_hidden). drop: keys to leave out (bad-layout tests)."""
    cfg = llama_config(architectures=[architecture], **cfg_overrides)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Ht = target_hidden or H
    if target_hidden:
        cfg["target_hidden_size"] = Ht
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    if parallel_token_id is not None:
        cfg["ptd_token_id"] = parallel_token_id
    g = torch.Generator().manual_seed(seed)
    w = _random(g)
    hd = H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    state = _llama_layer(w, g, "midlayer", H, I, q, kv, 2 * H, input_norm=True)
    state["midlayer.hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    state["fc.weight"] = w(H, 3 * Ht)
    state["norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    Vd = draft_vocab or V
    state["lm_head.weight"] = w(Vd, H, std=2.0)
    if draft_vocab is not None:
        target_ids = torch.randperm(V, generator=g)[:Vd].sort().values
        state["d2t"] = target_ids - torch.arange(Vd)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[target_ids] = True
        state["t2d"] = t2d
    if embed:
        state["embed_tokens.weight"] = w(V, H, std=1.0)
    if parallel_token_id is not None:
        state["mask_hidden"] = torch.randn(1, 3 * Ht, generator=g)
    if layer_prefix != "midlayer":
        state = {(layer_prefix + k.removeprefix("midlayer") if k.startswith("midlayer.") else k): v
                 for k, v in state.items()}
    return _write_head_and_target(root, cfg, state, drop, bin_format, vocab=V, hidden=Ht, num_layers=target_layers,
                                  seed=seed + 1)


def _write_head_and_target(root: pathlib.Path, cfg: dict, state: dict[str, torch.Tensor], drop: tuple[str, ...],
                           bin_format: bool, **target_kwargs) -> tuple[pathlib.Path, pathlib.Path]:
    """root/head (config.json + weights, minus the keys in `drop`) and root/target (write_target(**target_kwargs))."""
    for k in drop:
        state.pop(k)
    head, target = root / "head", root / "target"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps(cfg))
    _write_state(head, state, bin_format)
    write_target(target, **target_kwargs)
    return head, target


def write_multi_layer(root: pathlib.Path, *, seed: int = 0, n_predict: int = 3, own_heads: bool = False,
                      embed: bool = False, bin_format: bool = False, drop: tuple[str, ...] = (), **cfg_overrides
                      ) -> tuple[pathlib.Path, pathlib.Path]:
    """A multi-layer EAGLE head (our documented layout, docs/methods.md): n_predict MTP-style Llama layers
    layers.{j}.{enorm, hnorm, eh_proj, <Llama layer>, shared_head.norm[, shared_head.head]}. Without own_heads the
    lm_head is the target's."""
    cfg = llama_config(architectures=["MultiLayerEagleLlamaForCausalLM"], n_predict=n_predict, **cfg_overrides)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    w = _random(g)
    hd = H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    state: dict[str, torch.Tensor] = {}
    for j in range(n_predict):
        p = f"layers.{j}"
        state.update(_llama_layer(w, g, p, H, I, q, kv, H, input_norm=True))
        state[f"{p}.enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        state[f"{p}.hnorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        state[f"{p}.eh_proj.weight"] = w(H, 2 * H)
        state[f"{p}.shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        if own_heads:
            state[f"{p}.shared_head.head.weight"] = w(V, H, std=2.0)
    if embed:
        state["embed_tokens.weight"] = w(V, H, std=1.0)
    return _write_head_and_target(root, cfg, state, drop, bin_format, vocab=V, hidden=H, num_layers=4, seed=seed + 1)
