"""Load an EAGLE head from a Hugging Face model directory, and the target's embed_tokens / lm_head when needed.

A head directory holds config.json (a LlamaConfig) and weights in model.safetensors, sharded safetensors
(model.safetensors.index.json) or pytorch_model.bin. From a target directory only config.json, embed_tokens and
lm_head are read, lazily through safetensors (the rest of a multi-GB target is never touched).

``detect_method`` names the layout (docs/methods.md lists them); one loader per method checks every key and
shape against the config. Every inconsistency fails here, at start-up, with a message naming the file, key or
field.
"""
import json
import logging
import pathlib
from dataclasses import dataclass, field

import torch

from drafter_service.models.eagle1 import Eagle1Head
from drafter_service.models.eagle3 import Eagle3Head
from drafter_service.models.llama_layer import LlamaDims
from drafter_service.models.multi_layer_eagle import MultiLayerEagleHead

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    pass


EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
FINAL_HIDDEN_SOURCE = ("the target's final hidden state (after its final norm, what lm_head consumes) at each "
                       "committed position")


@dataclass
class LoadedHead:
    model: object  # Eagle1Head | Eagle3Head | MultiLayerEagleHead
    name: str
    config: dict
    method: str = "eagle"
    target_layer_ids: list[int] = field(default_factory=list)  # EAGLE-3: target layers whose states are sent
    hidden_states_source: str = FINAL_HIDDEN_SOURCE


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


TOP_LEVEL_KEYS = ("lm_head.weight", "d2t", "t2d", "mask_hidden")


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Some exports prefix every key with "model."; the published EAGLE heads do not.
    if state and all(k.startswith("model.") or k in TOP_LEVEL_KEYS for k in state):
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


TARGET_KEYS = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def detect_method(cfg: dict, state: dict[str, torch.Tensor], where: str) -> str:
    """Which layout a head directory holds: "eagle" (EAGLE-1), "eagle3" or "multi_layer_eagle" (docs/methods.md)."""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    if any(k.startswith("midlayer.") for k in state) or "layers.0.hidden_norm.weight" in state:
        return "eagle3"
    if any(a in EAGLE3_ARCHITECTURES for a in archs) or "draft_vocab_size" in cfg:
        why = next((a for a in archs if a in EAGLE3_ARCHITECTURES), None) or "field 'draft_vocab_size'"
        raise ModelLoadError(f"{where}: config.json declares an EAGLE-3 head ({why}) but weight "
                             "'midlayer.hidden_norm.weight' is missing")
    if "n_predict" in cfg:
        if "layers.0.eh_proj.weight" not in state:
            raise ModelLoadError(f"{where}: config.json has field 'n_predict' (multi-layer EAGLE) but weight "
                                 "'layers.0.eh_proj.weight' is missing")
        return "multi_layer_eagle"
    if "layers.0.eh_proj.weight" in state:
        raise ModelLoadError(f"{where}: weights of a multi-layer EAGLE head (layers.0.eh_proj.weight) but config.json "
                             "lacks field 'n_predict'")
    if "fc.weight" in state and any(k.startswith("layers.0.") for k in state):
        return "eagle"
    raise ModelLoadError(f"{where}: unknown head layout: expected EAGLE-1 (fc.weight + layers.0.*), EAGLE-3 "
                         "(midlayer.* + fc.weight) or multi-layer EAGLE (n_predict + layers.{j}.eh_proj.weight); "
                         f"found keys {sorted(state)[:8]}")


def load_head(model_dir: str, target_dir: str | None, device: torch.device, dtype: torch.dtype,
              max_positions: int, engine_applies_fc: bool = False) -> LoadedHead:
    """engine_applies_fc (--engine-applies-fc): an EAGLE-3 head whose fc the engine applies before sending (its
    requests carry [n, hidden_size] rows); any other head refuses it."""
    mdir = pathlib.Path(model_dir)
    cfg = _read_config(mdir)
    state = _strip_prefix(read_state_dict(mdir))
    method = detect_method(cfg, state, str(mdir))
    if engine_applies_fc and method != "eagle3":
        raise ModelLoadError(f"{mdir}: --engine-applies-fc is for EAGLE-3 heads (an fc over three target layers' "
                             f"states); this head is {method!r}, whose engine sends hidden_size columns already")
    tdir = pathlib.Path(target_dir) if target_dir is not None else None
    if method == "eagle3":
        return _load_eagle3(mdir, cfg, state, tdir, device, dtype, max_positions, engine_applies_fc)
    load = {"eagle": _load_eagle1, "multi_layer_eagle": _load_multi_layer}[method]
    return load(mdir, cfg, state, tdir, device, dtype, max_positions)


# ---- pieces shared by the loaders ----

def _check_llama_layer(state: dict, prefix: str, dims: LlamaDims, in_features: int, where: str) -> None:
    """q/k/v (over in_features), o, post_attention_layernorm and the MLP of one Llama layer."""
    H, I = dims.hidden_size, dims.intermediate_size
    q_out, kv_out = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    for name, shape in [("self_attn.q_proj.weight", (q_out, in_features)),
                        ("self_attn.k_proj.weight", (kv_out, in_features)),
                        ("self_attn.v_proj.weight", (kv_out, in_features)), ("self_attn.o_proj.weight", (H, q_out)),
                        ("post_attention_layernorm.weight", (H,)), ("mlp.gate_proj.weight", (I, H)),
                        ("mlp.up_proj.weight", (I, H)), ("mlp.down_proj.weight", (H, I))]:
        _expect_shape(state, f"{prefix}.{name}", shape, where)


def _fill_from_target(state: dict, keys: list[str], tdir: pathlib.Path | None, where: str) -> None:
    """Read those of ``keys`` (embed_tokens.weight, lm_head.weight) the head lacks from the target model."""
    missing = [k for k in keys if k not in state]
    if not missing:
        return
    if tdir is None:
        raise ModelLoadError(f"{where}: the head has no {' / '.join(missing)}; pass --target-model DIR so they are "
                             "read from the target model")
    tcfg = _read_config(tdir)
    got = read_target_tensors(tdir, [TARGET_KEYS[k] for k in missing] + ["model.embed_tokens.weight"])
    for k in missing:
        if TARGET_KEYS[k] in got:
            state[k] = got[TARGET_KEYS[k]]
        elif k == "lm_head.weight" and tcfg.get("tie_word_embeddings") and "model.embed_tokens.weight" in got:
            state[k] = got["model.embed_tokens.weight"]
        else:
            raise ModelLoadError(f"{tdir}: target model has no {TARGET_KEYS[k]!r}")


def _target_field(tcfg: dict, name: str):
    """A field of the target's config.json, also looked up in text_config (multimodal targets)."""
    return tcfg.get(name, (tcfg.get("text_config") or {}).get(name))


def _to_device(state: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else torch.int64) for k, v in state.items()}


# ---- EAGLE-1 ----

def _load_eagle1(mdir: pathlib.Path, cfg: dict, state: dict, tdir: pathlib.Path | None, device: torch.device,
                 dtype: torch.dtype, max_positions: int) -> LoadedHead:
    where = str(mdir)
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.") and not k.startswith("layers.0.")})
    if extra_layers:
        raise ModelLoadError(f"{where}: EAGLE-1 heads have one layer; found weights of layers {extra_layers}")
    for key in ("ptd_token_id", "pard_token"):
        if key in cfg:
            raise ModelLoadError(f"{where}: config.json field {key!r} asks for parallel drafting, which this server "
                                 "supports for EAGLE-3 heads only")
    dims = _dims(cfg, where)
    H = dims.hidden_size
    _expect_shape(state, "fc.weight", (H, 2 * H), where)
    if "fc.bias" in state:
        _expect_shape(state, "fc.bias", (H,), where)
    _check_llama_layer(state, "layers.0", dims, H, where)
    if "layers.0.input_layernorm.weight" in state:
        log.warning("%s: layers.0.input_layernorm.weight is present but EAGLE-1 layer 0 has no input norm; ignored", where)
        del state["layers.0.input_layernorm.weight"]

    _fill_from_target(state, ["embed_tokens.weight", "lm_head.weight"], tdir, where)
    vocab = state["lm_head.weight"].shape[0]
    _expect_shape(state, "embed_tokens.weight", (state["embed_tokens.weight"].shape[0], H), where)
    _expect_shape(state, "lm_head.weight", (vocab, H), where)
    if state["embed_tokens.weight"].shape[0] < vocab:
        raise ModelLoadError(f"{where}: embed_tokens has {state['embed_tokens.weight'].shape[0]} rows but lm_head "
                             f"has {vocab}")

    weights = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model = Eagle1Head(dims, weights, rope_theta=float(cfg.get("rope_theta", 10000.0)),
                       rope_scaling=cfg.get("rope_scaling"), max_positions=max_positions)
    return LoadedHead(model=model, name=mdir.resolve().name, config=cfg, method="eagle")


# ---- EAGLE-3 (and P-EAGLE: EAGLE-3 with parallel drafting) ----

def _aux_layer_ids(cfg: dict, tcfg: dict | None, where: str) -> list[int]:
    """Target layers whose input hidden states the engine sends: the config's, else (2, L//2, L-3)."""
    eagle_cfg = cfg.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    L = _target_field(tcfg, "num_hidden_layers") if tcfg is not None else None
    if ids is None:
        if L is None:
            raise ModelLoadError(f"{where}: EAGLE-3 needs the target's layer ids: set "
                                 "eagle_config.eagle_aux_hidden_state_layer_ids in config.json, or pass "
                                 "--target-model DIR (its num_hidden_layers L gives the default 2, L//2, L-3)")
        L = int(L)
        ids = [2, L // 2, L - 3]
    if not (isinstance(ids, list) and len(ids) == 3 and all(type(i) is int for i in ids)):
        raise ModelLoadError(f"{where}: field 'eagle_aux_hidden_state_layer_ids' must be a list of 3 layer ids "
                             f"(got {ids!r})")
    bad = [i for i in ids if i < 0 or (L is not None and i >= int(L))]
    if bad:
        raise ModelLoadError(f"{where}: field 'eagle_aux_hidden_state_layer_ids' {ids}: ids {bad} are outside the "
                             f"target's layers [0, {L})")
    return ids


def _load_eagle3(mdir: pathlib.Path, cfg: dict, state: dict, tdir: pathlib.Path | None, device: torch.device,
                 dtype: torch.dtype, max_positions: int, engine_applies_fc: bool = False) -> LoadedHead:
    where = str(mdir)
    if not any(k.startswith("midlayer.") for k in state):  # vLLM's naming of the one layer: layers.0.*
        state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                 for k, v in state.items()}
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.")})
    if extra_layers:
        raise ModelLoadError(f"{where}: EAGLE-3 heads have one layer (midlayer.*); found weights of layers "
                             f"{extra_layers}")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{where}: config.json field 'num_hidden_layers' is {cfg['num_hidden_layers']}; this "
                             "server loads one-layer EAGLE-3 heads")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ModelLoadError(f"{where}: config.json field 'eagle_config.use_aux_hidden_state' is false; only heads "
                             "over the three auxiliary target states are supported")
    dims = _dims(cfg, where)
    H = dims.hidden_size
    H_target = int(cfg.get("target_hidden_size") or H)
    if "vocab_size" not in cfg:
        raise ModelLoadError(f"{where}: config.json lacks field 'vocab_size' (the target vocabulary size)")
    V = int(cfg["vocab_size"])
    V_draft = int(cfg.get("draft_vocab_size") or V)
    tcfg = _read_config(tdir) if tdir is not None else None
    if tcfg is not None:
        t_hidden, t_vocab = _target_field(tcfg, "hidden_size"), _target_field(tcfg, "vocab_size")
        if t_hidden is not None and int(t_hidden) != H_target:
            raise ModelLoadError(f"{where}: the target's hidden_size is {t_hidden} but the head expects "
                                 f"{H_target} (config.json field 'target_hidden_size', else 'hidden_size')")
        if t_vocab is not None and int(t_vocab) != V:
            raise ModelLoadError(f"{where}: config.json field 'vocab_size' is {V} but the target's is {t_vocab}")

    p = "midlayer."
    _expect_shape(state, "fc.weight", (H, 3 * H_target), where)
    for name in ("input_layernorm.weight", "hidden_norm.weight"):
        _expect_shape(state, p + name, (H,), where)
    _check_llama_layer(state, "midlayer", dims, 2 * H, where)
    _expect_shape(state, "norm.weight", (H,), where)

    if "lm_head.weight" not in state and V_draft != V:
        raise ModelLoadError(f"{where}: weight 'lm_head.weight' is missing (the draft-vocabulary lm_head, "
                             f"[{V_draft}, {H}])")
    from_target = "embed_tokens.weight" not in state
    _fill_from_target(state, ["embed_tokens.weight"] + (["lm_head.weight"] if V_draft == V else []), tdir, where)
    if from_target and tuple(state["embed_tokens.weight"].shape) != (V, H):
        raise ModelLoadError(f"{where}: the head has no 'embed_tokens.weight' and the target's has shape "
                             f"{tuple(state['embed_tokens.weight'].shape)}, not ({V}, {H}): a head whose hidden size "
                             "differs from the target's must carry its own embed_tokens.weight")
    _expect_shape(state, "embed_tokens.weight", (V, H), where)
    _expect_shape(state, "lm_head.weight", (V_draft, H), where)

    if "d2t" in state:
        _expect_shape(state, "d2t", (V_draft,), where)
        d2t = state["d2t"].to(torch.int64)
        target_ids = torch.arange(V_draft) + d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= V:
            raise ModelLoadError(f"{where}: weight 'd2t' maps draft ids to target ids outside [0, {V})")
        state["d2t"] = d2t
    elif V_draft != V:
        raise ModelLoadError(f"{where}: draft_vocab_size {V_draft} < vocab_size {V} but weight 'd2t' (target id = "
                             "draft id + d2t[draft id]) is missing")
    state.pop("t2d", None)  # target -> draft membership; not needed to draft

    parallel_token_id = cfg.get("ptd_token_id", cfg.get("pard_token"))
    if parallel_token_id is not None:
        if type(parallel_token_id) is not int or not 0 <= parallel_token_id < V:
            raise ModelLoadError(f"{where}: config.json field 'ptd_token_id' / 'pard_token' must be a token id in "
                                 f"[0, {V}) (got {parallel_token_id!r})")
        if "mask_hidden" not in state:
            raise ModelLoadError(f"{where}: parallel drafting (config.json 'ptd_token_id' / 'pard_token') needs "
                                 "weight 'mask_hidden' (the hidden state of the masked slots), which is missing")
        if state["mask_hidden"].numel() != 3 * H_target:
            raise ModelLoadError(f"{where}: weight 'mask_hidden' has shape {tuple(state['mask_hidden'].shape)}; "
                                 f"expected {3 * H_target} elements (3 * target hidden size)")
    elif "mask_hidden" in state:
        log.warning("%s: mask_hidden is present but config.json has no ptd_token_id / pard_token; drafting "
                    "sequentially, mask_hidden ignored", where)
        del state["mask_hidden"]

    layer_ids = _aux_layer_ids(cfg, tcfg, where)
    model = Eagle3Head(dims, _to_device(state, device, dtype), target_hidden_size=H_target, vocab_size=V,
                       rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
                       max_positions=max_positions, norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                       parallel_token_id=parallel_token_id, engine_applies_fc=engine_applies_fc)
    source = (f"the target's residual-stream hidden states entering layers {layer_ids} (Hugging Face "
              f"output_hidden_states[i] for i in {layer_ids}: the output of layer i-1, before any norm), "
              f"concatenated in that order: [n, 3 * {H_target}]")
    if engine_applies_fc:
        source = (f"fc(x) = x @ fc.weight.T of this head (fc.weight [{H}, {3 * H_target}], applied by the engine: "
                  f"--engine-applies-fc) over x = {source}; the engine sends fc(x): [n, {H}]")
    return LoadedHead(model=model, name=mdir.resolve().name, config=cfg, method="eagle3",
                      target_layer_ids=layer_ids, hidden_states_source=source)


# ---- multi-layer EAGLE ----

def _load_multi_layer(mdir: pathlib.Path, cfg: dict, state: dict, tdir: pathlib.Path | None, device: torch.device,
                      dtype: torch.dtype, max_positions: int) -> LoadedHead:
    where = str(mdir)
    n = cfg["n_predict"]
    if type(n) is not int or n < 1:
        raise ModelLoadError(f"{where}: config.json field 'n_predict' must be an integer >= 1 (got {n!r})")
    found = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if found != list(range(n)):
        raise ModelLoadError(f"{where}: config.json field 'n_predict' is {n} but the weights hold layers {found}; "
                             f"expected layers.0 .. layers.{n - 1}")
    dims = _dims(cfg, where)
    H = dims.hidden_size
    for j in range(n):
        p = f"layers.{j}."
        for name in ("enorm.weight", "hnorm.weight", "input_layernorm.weight", "shared_head.norm.weight"):
            _expect_shape(state, p + name, (H,), where)
        _expect_shape(state, p + "eh_proj.weight", (H, 2 * H), where)
        _check_llama_layer(state, f"layers.{j}", dims, H, where)
    needs_shared_head = any(f"layers.{j}.shared_head.head.weight" not in state for j in range(n))
    _fill_from_target(state, ["embed_tokens.weight"] + (["lm_head.weight"] if needs_shared_head else []), tdir, where)
    heads = [k for k in [f"layers.{j}.shared_head.head.weight" for j in range(n)] + ["lm_head.weight"] if k in state]
    vocab = state[heads[0]].shape[0]
    for k in heads:
        _expect_shape(state, k, (vocab, H), where)
    _expect_shape(state, "embed_tokens.weight", (state["embed_tokens.weight"].shape[0], H), where)
    if state["embed_tokens.weight"].shape[0] < vocab:
        raise ModelLoadError(f"{where}: embed_tokens has {state['embed_tokens.weight'].shape[0]} rows but the "
                             f"lm_head has {vocab}")
    model = MultiLayerEagleHead(dims, _to_device(state, device, dtype), num_predict=n,
                                rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
                                max_positions=max_positions)
    return LoadedHead(model=model, name=mdir.resolve().name, config=cfg, method="multi_layer_eagle")
