"""Naive EAGLE-1 reference for the tests: no KV cache, the whole sequence recomputed at every draft step.

Independent of the server's code on purpose (its own weight reading, RoPE, attention): it is the oracle.
``NaiveLlama`` (dense RMSNorm, RoPE, causal GQA attention, SiLU MLP) also serves the EAGLE-3 and multi-layer
references in naive_eagle3.py.
"""
import json
import pathlib

import torch
from safetensors.torch import load_file


def load_weights(d: pathlib.Path) -> dict[str, torch.Tensor]:
    if (d / "model.safetensors").exists():
        return load_file(str(d / "model.safetensors"))
    return torch.load(str(d / "pytorch_model.bin"), weights_only=True)


def greedy(logits: torch.Tensor, j: int) -> int:
    return int(logits.argmax())


class NaiveLlama:
    """RMSNorm, RoPE from position 0, causal GQA attention and SiLU MLP over a whole sequence."""

    def __init__(self, cfg: dict, w: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, w
        self.H = cfg["hidden_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = self.H // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg["rope_theta"]

    def rms(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[key]

    def _rope(self, x: torch.Tensor) -> torch.Tensor:  # x [L, heads, hd]
        L, hd = x.shape[0], self.hd
        inv = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w, L = self.w, x.shape[0]
        q = (x @ w[p + "q_proj.weight"].T).view(L, self.nh, self.hd)
        k = (x @ w[p + "k_proj.weight"].T).view(L, self.nkv, self.hd)
        v = (x @ w[p + "v_proj.weight"].T).view(L, self.nkv, self.hd)
        q, k = self._rope(q), self._rope(k)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / self.hd ** 0.5
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(L, self.nh * self.hd) @ w[p + "o_proj.weight"].T

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        return (torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
            @ w[p + "down_proj.weight"].T


class NaiveEagle1(NaiveLlama):
    def __init__(self, head_dir, target_dir):
        head_dir, target_dir = pathlib.Path(head_dir), pathlib.Path(target_dir)
        w = {k: v.double() for k, v in load_weights(head_dir).items()}
        super().__init__(json.loads((head_dir / "config.json").read_text()), w)
        t = load_weights(target_dir)
        self.embed = w.get("embed_tokens.weight", t["model.embed_tokens.weight"].double())
        self.lm_head = w.get("lm_head.weight", t["lm_head.weight"].double())

    def forward(self, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Rows = positions 0..L-1, inputs (ids[t] = x[t+1], hidden[t]); returns head outputs [L, H] (fp64)."""
        w = self.w
        x = torch.cat([self.embed[torch.tensor(ids)], hidden.double()], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        h = x + self.attention(x, "layers.0.self_attn.")  # layer 0 of EAGLE-1: no input_layernorm
        return h + self.mlp(self.rms(h, "layers.0.post_attention_layernorm.weight"), "layers.0.mlp.")

    def drafts(self, tokens: list[int], hidden: torch.Tensor, k: int) -> list[int]:
        """tokens = x[0..L] (the last is the next token), hidden = h[0..L-1]: the k greedy drafts for L+1.."""
        L = len(tokens) - 1
        ids, hid = list(tokens[1 : L + 1]), hidden[:L].double()
        out = []
        for _ in range(k):
            o = self.forward(ids, hid)
            d = int((o[-1] @ self.lm_head.T).argmax())
            out.append(d)
            ids.append(d)
            hid = torch.cat([hid, o[-1:]])
        return out

    def divergence(self, tokens: list[int], hidden: torch.Tensor, got: list[int]) -> tuple[int, float] | None:
        """Where drafts `got` (a drafter's, for the same context) first differ from this reference's greedy choice
        given got's own earlier drafts, and by how much: (index, the reference's top logit minus its logit for
        got[index]). None when every draft is the reference's argmax. A gap near fp32 rounding (1e-5 or less) is a
        near-tie that a float32 drafter can break the other way; a larger one is a wrong draft."""
        L = len(tokens) - 1
        ids, hid = list(tokens[1 : L + 1]), hidden[:L].double()
        for i, d in enumerate(got):
            o = self.forward(ids, hid)
            logits = o[-1] @ self.lm_head.T
            if int(logits.argmax()) != d:
                return i, float(logits.max() - logits[d])
            ids.append(d)
            hid = torch.cat([hid, o[-1:]])
        return None
