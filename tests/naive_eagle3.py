"""Naive references for EAGLE-3 (sequential and parallel drafting) and multi-layer EAGLE: no KV cache, the whole
sequence recomputed at every draft step, fp64.

Independent of the server's code on purpose (their own weight reading, norms, RoPE, attention): they are the
oracles. Written from the method descriptions (vLLM's llama_eagle3.py, P-EAGLE, multi_layer_eagle.py), not from
drafter_service. ``pick(logits_row, j)`` chooses draft j (0-based) from its logits row (draft-vocabulary
columns); the default is greedy.
"""
import json
import pathlib

import torch

from naive_eagle import NaiveLlama, greedy, load_weights


class NaiveEagle3(NaiveLlama):
    def __init__(self, head_dir, target_dir):
        head_dir, target_dir = pathlib.Path(head_dir), pathlib.Path(target_dir)
        cfg = json.loads((head_dir / "config.json").read_text())
        raw = load_weights(head_dir)
        w = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
             for k, v in raw.items()}
        self.d2t = w.pop("d2t", None)
        w.pop("t2d", None)
        w = {k: v.double() for k, v in w.items()}
        super().__init__(cfg, w)
        t = load_weights(target_dir)
        self.embed = w.get("embed_tokens.weight", t["model.embed_tokens.weight"].double())
        self.lm_head = w.get("lm_head.weight", t["lm_head.weight"].double())
        self.vocab = cfg["vocab_size"]
        self.width = w["fc.weight"].shape[1]  # 3 * target hidden size
        self.ptd = cfg.get("ptd_token_id", cfg.get("pard_token"))
        self.mask_hidden = w["mask_hidden"].reshape(-1) if self.ptd is not None else None

    def to_target(self, d: int) -> int:
        return d if self.d2t is None else d + int(self.d2t[d])

    def forward(self, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Rows = positions 0..L-1, inputs (ids[t] = x[t+1], hidden[t] already through fc or a head output);
        returns the pre-norm outputs [L, H]."""
        e = self.rms(self.embed[torch.tensor(ids)], "midlayer.input_layernorm.weight")
        n = self.rms(hidden, "midlayer.hidden_norm.weight")
        residual = n if self.cfg.get("norm_before_residual") else hidden
        h = residual + self.attention(torch.cat([e, n], -1), "midlayer.self_attn.")
        return h + self.mlp(self.rms(h, "midlayer.post_attention_layernorm.weight"), "midlayer.mlp.")

    def logits(self, out_row: torch.Tensor) -> torch.Tensor:
        return self.rms(out_row, "norm.weight") @ self.lm_head.T  # draft vocabulary

    def drafts(self, tokens: list[int], feats: torch.Tensor, k: int, pick=greedy) -> list[int]:
        """tokens = x[0..L] (the last is the next token), feats = the target's 3 states h[0..L-1]: k drafts,
        one decode step each."""
        L = len(tokens) - 1
        ids, hid = list(tokens[1 : L + 1]), feats[:L].double() @ self.w["fc.weight"].T
        out = []
        for j in range(k):
            o = self.forward(ids, hid)
            d = self.to_target(pick(self.logits(o[-1]), j))
            out.append(d)
            ids.append(d)
            hid = torch.cat([hid, o[-1:]])
        return out

    def parallel_drafts(self, tokens: list[int], feats: torch.Tensor, k: int, pick=greedy) -> list[int]:
        """P-EAGLE: one forward over the L committed rows plus k-1 rows (ptd token, fc(mask_hidden))."""
        L = len(tokens) - 1
        fc = self.w["fc.weight"]
        ids = list(tokens[1 : L + 1]) + [self.ptd] * (k - 1)
        hid = torch.cat([feats[:L].double() @ fc.T, (self.mask_hidden @ fc.T).expand(k - 1, -1)])
        o = self.forward(ids, hid)
        return [self.to_target(pick(self.logits(o[L - 1 + j]), j)) for j in range(k)]


class NaiveMultiLayer(NaiveLlama):
    def __init__(self, head_dir, target_dir):
        head_dir, target_dir = pathlib.Path(head_dir), pathlib.Path(target_dir)
        cfg = json.loads((head_dir / "config.json").read_text())
        w = {k: v.double() for k, v in load_weights(head_dir).items()}
        super().__init__(cfg, w)
        t = load_weights(target_dir)
        self.n = cfg["n_predict"]
        self.embed = w.get("embed_tokens.weight", t["model.embed_tokens.weight"].double())
        shared = w.get("lm_head.weight", t["lm_head.weight"].double())
        self.heads = [w.get(f"layers.{j}.shared_head.head.weight", shared) for j in range(self.n)]
        self.width = self.H
        self.vocab = self.heads[0].shape[0]

    def layer(self, j: int, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        p = f"layers.{j}."
        e = self.rms(self.embed[torch.tensor(ids)], p + "enorm.weight")
        x = torch.cat([e, self.rms(hidden, p + "hnorm.weight")], -1) @ self.w[p + "eh_proj.weight"].T
        h = x + self.attention(self.rms(x, p + "input_layernorm.weight"), p + "self_attn.")
        return h + self.mlp(self.rms(h, p + "post_attention_layernorm.weight"), p + "mlp.")

    def drafts(self, tokens: list[int], hidden: torch.Tensor, k: int, pick=greedy) -> list[int]:
        """Layer j over rows 0..L-1 with tokens x[t+1+j] (drafts past x[L]) and layer j-1's outputs; draft j+1 from
        its last row. All n layers run; the first k drafts are returned."""
        L = len(tokens) - 1
        x, hid, out = list(tokens), hidden[:L].double(), []
        for j in range(self.n):
            hid = self.layer(j, x[1 + j : L + 1 + j], hid)
            logits = self.rms(hid[-1], f"layers.{j}.shared_head.norm.weight") @ self.heads[j].T
            d = pick(logits, j)
            out.append(d)
            x.append(d)
        return out[:k]
