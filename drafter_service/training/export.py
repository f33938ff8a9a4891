"""Writing the artifacts: target in transformers format, heads in the published EAGLE layouts, all weights bf16.

Head configs are LlamaConfig-shaped JSON written by hand (the heads are not transformers models). Both
``rope_theta`` (read by older loaders) and ``rope_parameters`` (transformers 5) are written.
"""
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from drafter_service.training.eagle1 import Eagle1Head
from drafter_service.training.eagle3 import Eagle3Head
from drafter_service.training.presets import Preset

WEIGHT_DTYPE = torch.bfloat16
SIZE_BUDGET_BYTES = 30_000_000


def _bf16_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in module.state_dict().items():
        t = t.detach().cpu()
        out[name] = (t.to(WEIGHT_DTYPE) if t.is_floating_point() else t).contiguous()
    return out


def _head_config(p: Preset, vocab_size: int, eos_id: int, architecture: str) -> dict:
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.hidden_size // p.num_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": p.rope_theta},
        "vocab_size": vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def round_to_bf16(module: torch.nn.Module) -> None:
    """Round the weights to bf16 in place (kept in fp32), so what is measured afterwards is what gets shipped."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(t.to(WEIGHT_DTYPE))


def save_target(model: LlamaForCausalLM, out_dir: Path, rope_theta: float) -> None:
    """save_pretrained in bf16; also writes top-level ``rope_theta`` (transformers 5 only writes rope_parameters)."""
    copy.deepcopy(model).to(WEIGHT_DTYPE).save_pretrained(str(out_dir))
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg["use_cache"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_eagle1(head: Eagle1Head, out_dir: Path, p: Preset, vocab_size: int, eos_id: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(_bf16_state(head), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = _head_config(p, vocab_size, eos_id, "LlamaForCausalLM")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_eagle3(head: Eagle3Head, out_dir: Path, p: Preset, vocab_size: int, eos_id: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(_bf16_state(head), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = _head_config(p, vocab_size, eos_id, "LlamaForCausalLMEagle3")
    cfg["draft_vocab_size"] = head.lm_head.out_features
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(p.aux_layer_ids), "use_aux_hidden_state": True}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_size_budget(paths: list[Path]) -> int:
    total = sum(dir_bytes(p) if p.is_dir() else p.stat().st_size for p in paths)
    if total > SIZE_BUDGET_BYTES:
        raise RuntimeError(f"artifacts take {total / 1e6:.1f} MB, over the {SIZE_BUDGET_BYTES / 1e6:.0f} MB budget: "
                           "shrink the preset (vocab_size, hidden_size, num_layers)")
    return total


def estimate_bytes(param_counts: list[int]) -> int:
    return 2 * sum(param_counts)  # bf16
