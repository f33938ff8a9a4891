"""EAGLE-3's fc on the engine's side, for a drafter served with ``--engine-applies-fc``.

An EAGLE-3 head's first step starts with fc(x) = x @ fc.weight.T over x = cat(h_a, h_b, h_c), the three target
layers' states of a token ([3 * H_target] columns). By default the engine sends x and the drafter applies fc. A
drafter started with ``--engine-applies-fc`` (GetInfo.engine_applies_fc) takes fc(x) instead, [H] columns: a third
of the bytes per token through gRPC, the shared-memory mailbox or ProposeChunked, and no fc weight in the drafter.
The engine then holds fc.weight ([H, 3 * H_target]: 96 MiB in bf16 at the Llama-3.1-8B shape) and runs one GEMM
per step on its own GPU, where the states already are:

    info = await client.get_info()
    fc = EngineFc.from_head("/models/EAGLE3-LLaMA3.1-Instruct-8B", device="cuda", dtype=info.model_dtype)
    states = fc(cat_of_three_layers) if info.engine_applies_fc else cat_of_three_layers   # [m, GetInfo width]

The drafts are those of the drafter's own fc up to rounding: the engine's GEMM runs on other row counts than the
drafter's would, and a bf16 GEMM's last bit can depend on them (docs/methods.md, "The fc on the engine's side").
"""
import json
import pathlib

import torch
import torch.nn.functional as F

FC_KEYS = ("fc.weight", "model.fc.weight")  # (some exports prefix every key with "model.")


def _weight_files(head_dir: pathlib.Path) -> list[pathlib.Path]:
    index = head_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [head_dir / weight_map[k] for k in FC_KEYS if k in weight_map][:1]
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin"):
        found = sorted(head_dir.glob(pattern))
        if found:
            return found
    raise FileNotFoundError(f"{head_dir}: no weights (model.safetensors, *.safetensors or pytorch_model.bin)")


def read_fc_weight(head_dir: str | pathlib.Path) -> torch.Tensor:
    """fc.weight of an EAGLE-3 head directory (Hugging Face layout: safetensors, sharded or not, or
    pytorch_model.bin), read alone."""
    head_dir = pathlib.Path(head_dir)
    for path in _weight_files(head_dir):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                key = next((k for k in FC_KEYS if k in f.keys()), None)
                if key is not None:
                    return f.get_tensor(key)
        else:  # (mmap: only fc.weight is paged in)
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            key = next((k for k in FC_KEYS if k in state), None)
            if key is not None:
                return state[key].clone()
    raise KeyError(f"{head_dir}: no weight 'fc.weight' (an EAGLE-3 head's fc over three target layers' states)")


class EngineFc:
    """fc of an EAGLE-3 head on the engine's device: ``fc(states)`` maps [..., 3 * H_target] to [..., H]."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.shape[1] % 3 != 0:
            raise ValueError(f"fc.weight must be [H, 3 * H_target], got {tuple(weight.shape)}")
        self.weight = weight  # [H, 3 * H_target]

    @classmethod
    def from_head(cls, head_dir: str | pathlib.Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype | str | None = None) -> "EngineFc":
        """The fc of the head in ``head_dir`` (the directory the drafter serves), on ``device``, in ``dtype`` (a
        torch dtype or its name, as GetInfo.model_dtype gives it; default: as stored). Pass the drafter's model dtype
        to compute what it would: a head stored in bf16 and served in fp32 applies fc in fp32."""
        weight = read_fc_weight(head_dir)
        if isinstance(dtype, str):
            named = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(named, torch.dtype):
                raise ValueError(f"unknown dtype name {dtype!r}")
            dtype = named
        return cls(weight.to(device=device, dtype=dtype or weight.dtype))

    @property
    def in_features(self) -> int:
        """Columns it takes: three target layers' states, 3 * H_target."""
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        """Columns of the result: the head's hidden size (GetInfo.hidden_states_width under --engine-applies-fc)."""
        return self.weight.shape[0]

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """[..., 3 * H_target] target states (any float dtype, on the weight's device) -> [..., H] in the weight's
        dtype: what the drafter's first step would compute from them."""
        if states.shape[-1] != self.in_features:
            raise ValueError(f"states have {states.shape[-1]} columns; this fc takes {self.in_features} "
                             "(three target layers' states, concatenated)")
        return F.linear(states.to(self.weight.dtype), self.weight)
