"""Whether pre-drafting pays off for the engine, measured: its step cycle with passes against without.

The fit check (predraft.py) keeps passes out of the way of the drafter's next request, but a pass that fits can
still make the engine slower: on a GPU that the drafter shares with the target, a pass slows the verification it
overlaps; at a large batch most requests carry a sequence that misses, so the request waits for a plain step all
the same. What the engine feels is its step cycle, one request's arrival to the next one's (verification plus the
wait for drafts). CycleCheck measures it in turns and keeps passes only where they shorten it:

  trial_on    TRIAL_STEPS cycles with passes (the first SETTLE not counted: they still see the other mode)
  trial_off   TRIAL_STEPS cycles without
  then        hold_on  for HOLD_STEPS requests when the median cycle with passes was shorter by MARGIN or more,
              hold_off otherwise, for a back-off that starts at FIRST_OFF_STEPS and doubles on each loss in a row
              (up to MAX_OFF_STEPS); then the next trial_on.

The Predrafter keeps one check per request size (the bit length of its sequence count), since whether passes pay
depends on the batch, and consults them only with --predraft-cycle-check (Predrafter.cycle_check).

Only cycles between consecutive requests of one engine count (the scheduler passes those: one owner, a stream or a
step channel, asking for pre-drafting): with several engines the arrivals interleave, no turn ends, and passes stay
on as the fit check decides. Step thread only.
"""
import logging
import statistics

log = logging.getLogger(__name__)

TRIAL_STEPS = 24
SETTLE = 2
HOLD_STEPS = 512
FIRST_OFF_STEPS = 256
MAX_OFF_STEPS = 8192
MARGIN = 0.02


class CycleCheck:
    def __init__(self, trial_steps: int = TRIAL_STEPS, hold_steps: int = HOLD_STEPS,
                 first_off_steps: int = FIRST_OFF_STEPS, max_off_steps: int = MAX_OFF_STEPS, margin: float = MARGIN):
        self.trial_steps, self.hold_steps, self.margin = trial_steps, hold_steps, margin
        self.first_off_steps, self.max_off_steps = first_off_steps, max_off_steps
        self.state = "trial_on"
        self._cycles: list[float] = []  # seconds, this turn's
        self._on_median: float | None = None
        self._steps_left = 0  # of a hold
        self._off_steps = first_off_steps  # the next hold_off's length
        # the last decision: (median cycle with passes, without, passes kept), for logs and benchmarks
        self.last: tuple[float, float, bool] | None = None

    def passes_allowed(self) -> bool:
        return self.state in ("trial_on", "hold_on")

    def on_step(self) -> None:
        """Once per request observed (Predrafter.observe_cycle): holds count them."""
        if self.state in ("hold_on", "hold_off"):
            self._steps_left -= 1
            if self._steps_left <= 0:
                self.state, self._cycles = "trial_on", []

    def observe_cycle(self, seconds: float) -> None:
        """One engine's request arrived `seconds` after its previous one."""
        if self.state not in ("trial_on", "trial_off"):
            return
        self._cycles.append(seconds)
        if len(self._cycles) < SETTLE + self.trial_steps:
            return
        median = statistics.median(self._cycles[SETTLE:])
        self._cycles = []
        if self.state == "trial_on":
            self._on_median, self.state = median, "trial_off"
            return
        on, off = self._on_median, median
        keep = on < off * (1.0 - self.margin)
        self.last = (on, off, keep)
        if keep:
            self.state, self._steps_left, self._off_steps = "hold_on", self.hold_steps, self.first_off_steps
        else:
            self.state, self._steps_left = "hold_off", self._off_steps
            self._off_steps = min(2 * self._off_steps, self.max_off_steps)
        log.info("pre-drafting %s for %d requests: the engine's step cycle was %.2f ms with passes, %.2f ms without "
                 "(medians of %d)", "on" if keep else "off", self._steps_left, on * 1e3, off * 1e3, self.trial_steps)
