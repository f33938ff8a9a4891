"""The naive, cache-free reference of a pre-drafted branch (docs/predraft.md), for EAGLE-1 and EAGLE-3 heads: the
context with the target's states, then forced rows (the served drafts D_1..D_a and the bonus b) whose features are
the head's own outputs, then k drafts. Used by tests/test_predraft.py and scripts/soak.py."""
import torch

from drafter_service.engine.sampling import gumbel_sample, seed_to_int64
from naive_eagle3 import NaiveEagle3


class Naive:
    """One interface over the EAGLE-1 and EAGLE-3 references: drafts after forced rows with own features."""

    def __init__(self, naive):
        self.n = naive
        self.eagle3 = isinstance(naive, NaiveEagle3)

    def _inputs(self, feats: torch.Tensor) -> torch.Tensor:
        f = feats.double()
        return f @ self.n.w["fc.weight"].T if self.eagle3 else f

    def _logits(self, row: torch.Tensor) -> torch.Tensor:
        return self.n.logits(row) if self.eagle3 else row @ self.n.lm_head.T

    def _to_target(self, d: int) -> int:
        return self.n.to_target(d) if self.eagle3 else d

    def drafts(self, tokens: list[int], feats: torch.Tensor, forced: list[int], k: int, pick) -> list[int]:
        """tokens x[0..L] (the last is the next token), feats h[0..L-1] of the target; then the rows of `forced`
        tokens (target ids) with the head's own outputs as features; then k drafts (pick(logits, j) for draft j)."""
        L = len(tokens) - 1
        ids, hid = list(tokens[1 : L + 1]), self._inputs(feats[:L])
        for t in forced:
            o = self.n.forward(ids, hid)
            ids.append(t)
            hid = torch.cat([hid, o[-1:]])
        out = []
        for j in range(k):
            o = self.n.forward(ids, hid)
            d = self._to_target(pick(self._logits(o[-1]), j))
            out.append(d)
            ids.append(d)
            hid = torch.cat([hid, o[-1:]])
        return out


def picker(temperature: float, seed: int, position: int):
    """Draft j's choice: greedy, or the server's Gumbel noise at (seed, position + j)."""
    def pick(logits: torch.Tensor, j: int) -> int:
        if temperature == 0:
            return int(logits.argmax())
        return int(gumbel_sample(logits[None].float(), torch.tensor([temperature]),
                                 torch.tensor([seed_to_int64(seed)]), torch.tensor([position + j]))[0])
    return pick
