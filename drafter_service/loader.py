"""Load an EAGLE head from a Hugging Face model directory, and the target's embed_tokens / lm_head when needed.

A head directory holds config.json (a LlamaConfig) and weights in model.safetensors, sharded safetensors
(model.safetensors.index.json) or pytorch_model.bin. From a target directory only embed_tokens and lm_head are
read, lazily through safetensors (the rest of a multi-GB target is never touched).
Every inconsistency fails here, at start-up, with a message naming the file, key or field.
"""
import json
import logging
import pathlib
from dataclasses import dataclass

import torch

from .models.eagle1 import Eagle1Head
from .models.llama_layer import LlamaDims

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedHead:
    model: Eagle1Head
    name: str
    config: dict


def _read_config(model_dir: pathlib.Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (an EAGLE head directory needs config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


def _weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin"):
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    raise ModelLoadError(f"{model_dir}: no weights (model.safetensors, *.safetensors or pytorch_model.bin)")


def read_state_dict(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        if f.suffix == ".safetensors":
            state.update(load_file(str(f)))
        else:
            state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return state


def read_target_tensors(target_dir: pathlib.Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """Only the named tensors of a (possibly sharded, possibly huge) target checkpoint."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for key in wanted:
            if key in weight_map:
                with safe_open(str(target_dir / weight_map[key]), framework="pt") as f:
                    out[key] = f.get_tensor(key)
        return out
    files = _weight_files(target_dir)
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for key in wanted:
                    if key in f.keys() and key not in out:
                        out[key] = f.get_tensor(key)
        else:  # pytorch_model.bin: mmap so only the touched tensors are paged in
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            for key in wanted:
                if key in state and key not in out:
                    out[key] = state[key].clone()
    return out


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Some exports prefix every key with "model."; the published EAGLE-1 heads do not.
    if state and all(k.startswith("model.") or k == "lm_head.weight" for k in state):
        return {k.removeprefix("model."): v for k, v in state.items()}
    return state


def _dims(cfg: dict, where: str) -> LlamaDims:
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return LlamaDims(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: config.json lacks field {e.args[0]!r}") from e


def _expect_shape(state: dict, key: str, shape: tuple, where: str) -> None:
    if key not in state:
        raise ModelLoadError(f"{where}: weight {key!r} is missing")
    if tuple(state[key].shape) != tuple(shape):
        raise ModelLoadError(f"{where}: weight {key!r} has shape {tuple(state[key].shape)}, expected {tuple(shape)}")


def load_head(model_dir: str, target_dir: str | None, device: torch.device, dtype: torch.dtype,
              max_positions: int) -> LoadedHead:
    mdir = pathlib.Path(model_dir)
    cfg = _read_config(mdir)
    state = _strip_prefix(read_state_dict(mdir))
    where = str(mdir)
    if any(k.startswith("midlayer.") for k in state):
        raise ModelLoadError(f"{where}: this is an EAGLE-3 head (midlayer.* weights); this server loads EAGLE-1 heads")
    if "fc.weight" not in state or not any(k.startswith("layers.0.") for k in state):
        raise ModelLoadError(f"{where}: not an EAGLE-1 head: expected fc.weight and layers.0.* weights")
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.") and not k.startswith("layers.0.")})
    if extra_layers:
        raise ModelLoadError(f"{where}: EAGLE-1 heads have one layer; found weights of layers {extra_layers}")
    dims = _dims(cfg, where)
    H, I = dims.hidden_size, dims.intermediate_size
    q_out, kv_out = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    p = "layers.0."
    _expect_shape(state, "fc.weight", (H, 2 * H), where)
    if "fc.bias" in state:
        _expect_shape(state, "fc.bias", (H,), where)
    for name, shape in [("self_attn.q_proj.weight", (q_out, H)), ("self_attn.k_proj.weight", (kv_out, H)),
                        ("self_attn.v_proj.weight", (kv_out, H)), ("self_attn.o_proj.weight", (H, q_out)),
                        ("post_attention_layernorm.weight", (H,)), ("mlp.gate_proj.weight", (I, H)),
                        ("mlp.up_proj.weight", (I, H)), ("mlp.down_proj.weight", (H, I))]:
        _expect_shape(state, p + name, shape, where)
    if p + "input_layernorm.weight" in state:
        log.warning("%s: layers.0.input_layernorm.weight is present but EAGLE-1 layer 0 has no input norm; ignored", where)
        del state[p + "input_layernorm.weight"]

    missing = [k for k in ("embed_tokens.weight", "lm_head.weight") if k not in state]
    if missing:
        if target_dir is None:
            raise ModelLoadError(f"{where}: the head has no {' / '.join(missing)}; pass --target-model DIR so they "
                                 "are read from the target model")
        tdir = pathlib.Path(target_dir)
        tcfg = _read_config(tdir)
        keys = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
        got = read_target_tensors(tdir, [keys[k] for k in missing] + ["model.embed_tokens.weight"])
        for k in missing:
            if keys[k] in got:
                state[k] = got[keys[k]]
            elif k == "lm_head.weight" and tcfg.get("tie_word_embeddings") and "model.embed_tokens.weight" in got:
                state[k] = got["model.embed_tokens.weight"]
            else:
                raise ModelLoadError(f"{tdir}: target model has no {keys[k]!r}")
    vocab = state["lm_head.weight"].shape[0]
    _expect_shape(state, "embed_tokens.weight", (state["embed_tokens.weight"].shape[0], H), where)
    _expect_shape(state, "lm_head.weight", (vocab, H), where)
    if state["embed_tokens.weight"].shape[0] < vocab:
        raise ModelLoadError(f"{where}: embed_tokens has {state['embed_tokens.weight'].shape[0]} rows but lm_head "
                             f"has {vocab}")

    weights = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model = Eagle1Head(dims, weights, rope_theta=float(cfg.get("rope_theta", 10000.0)),
                       rope_scaling=cfg.get("rope_scaling"), max_positions=max_positions)
    return LoadedHead(model=model, name=mdir.resolve().name, config=cfg)
