"""Whether a pass can pay for a step batch: the odds that every pre-drafting sequence of the batch hits.

A step batch is answered when its last sequence is (proposer.step returns every output at once), so pre-drafting
takes drafting off the engine's path only when *every* pre-drafting sequence of the batch hits. With a per-sequence
hit rate h the chance of that is about h^n for n sequences: at h = 0.8, 0.8 at batch 1, 0.17 at 8, 2e-7 at 64. Below
that, a request mostly waits for a plain step over its misses (carrying the rows of its hits that a pass has not
written yet), which at a large batch costs about what the plain step without pre-drafting does, and the passes cost
on top: on a GPU shared with the target they slow its verification. Measured on the demo pair (docs/predraft.md),
batch 64 lost 7-22% of tokens/s with passes at every budget, on a shared GPU and on a GPU of its own.

OddsCheck keeps h as a decaying average of the outcomes of sequences that had branches (hit or miss; a step that
found nothing prepared says nothing about h) and lets a step batch of n pre-drafting sequences keep what a pass needs
only when h^n >= min_all_hit (a size that was refused: h^n >= HYSTERESIS * min_all_hit). A batch size refused
PROBE_AFTER times in a row is let through once, so that its pass measures h again (h moves with the text and the
head; a size refused on the prior alone gets measured). Step thread only.
"""
import logging

log = logging.getLogger(__name__)

MIN_ALL_HIT = 0.25  # the default --predraft-min-all-hit
PRIOR_HIT_RATE = 0.85  # h before any outcome is seen, ...
PRIOR_WEIGHT = 8.0  # ... worth this many outcomes
DECAY = 0.98  # per outcome: the estimate covers the last ~50 outcomes
PROBE_AFTER = 128  # refusals of one batch size in a row before a step of that size is let through once
# a size refused comes back on at min_all_hit * HYSTERESIS, so that odds hovering at the threshold do not flip the
# decision (and log it) every few steps
HYSTERESIS = 1.25


class OddsCheck:
    def __init__(self, min_all_hit: float = MIN_ALL_HIT, probe_after: int = PROBE_AFTER):
        self.min_all_hit = min_all_hit  # 0: every batch is allowed (the check is off)
        self.probe_after = probe_after
        self._hits = PRIOR_HIT_RATE * PRIOR_WEIGHT  # decayed counts
        self._outcomes = PRIOR_WEIGHT
        self._refused: dict[int, int] = {}  # bit length of n -> refusals in a row
        self._allowed_last: dict[int, bool] = {}  # bit length of n -> the last decision (logged when it changes)
        self.allowed = True  # the decision for the last step batch

    @property
    def hit_rate(self) -> float:
        return self._hits / self._outcomes

    def observe(self, hit: bool) -> None:
        """A sequence that had branches hit (or missed) at its step."""
        self._hits = DECAY * self._hits + hit
        self._outcomes = DECAY * self._outcomes + 1.0

    def all_hit(self, n: int) -> float:
        """The estimated chance that all n pre-drafting sequences of a batch hit."""
        return self.hit_rate ** n

    def decide(self, n: int) -> bool:
        """Once per step batch with n >= 1 pre-drafting sequences (before its hits are answered): whether its plain
        step keeps what a pass needs and the pass after it runs. Also kept in self.allowed."""
        size = n.bit_length()
        odds = self.all_hit(n)
        needed = self.min_all_hit * (1.0 if self._allowed_last.get(size, True) else HYSTERESIS)
        if self.min_all_hit <= 0 or odds >= needed:
            self._refused[size] = 0
            self._note(size, True, odds)
            self.allowed = True
            return True
        refused = self._refused.get(size, 0) + 1
        if refused > self.probe_after:  # a probe: this batch's pass measures the hit rate again
            self._refused[size] = 0
            self.allowed = True
            return True
        self._refused[size] = refused
        self._note(size, False, odds)
        self.allowed = False
        return False

    def _note(self, size: int, allowed: bool, odds: float) -> None:
        """Log a batch size's decision when it changes."""
        if self._allowed_last.get(size, True) != allowed:
            log.info("pre-drafting %s for batches of %d-%d sequences: all of them would hit with a chance of %.2f "
                     "(per-sequence hit rate %.2f; --predraft-min-all-hit %.2f)", "on" if allowed else "off",
                     1 << (size - 1), (1 << size) - 1, odds, self.hit_rate, self.min_all_hit)
        self._allowed_last[size] = allowed
