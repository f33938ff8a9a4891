"""The merge window: before a batch starts, wait a little for the engines that stepped together with the queued ones.

Several engines that share one drafter and step at about the same moment (the data-parallel ranks of one deployment,
which synchronise every step; benchmarks/bench_merged_engines.py at its barrier) send their requests within a few
hundred microseconds of one another. Without a wait, the step thread launches the first request it finds; one that
lands 100 us later waits for that whole batch and then runs in a batch of its own, so N engines cost up to N drafter
steps per engine step instead of one.

The rule is co-arrival: an engine's request is worth waiting for when, at its previous step, it arrived within
window_s of a queued engine's previous request ("they stepped together last time, they will again"). Per engine (an
owner: a step channel or a ProposeStream; unary requests have none and are never waited for) only the arrival time of
its last request is kept (a step channel's: when its client rang the doorbell, even if the step thread was busy and
saw it later). Before the step thread forms a batch:

  - the *partners* are the engines that are not queued and whose last arrival lies within window_s of a queued
    engine's last arrival;
  - the thread polls for them until every partner has a request queued, or until window_s has passed since it was
    ready to wait (having read the requests that were there) or since it read the last partner that came, whichever
    is later. (Counted from the first request's arrival instead, the window went on reading: a step channel's
    request is parsed by this thread, 0.1-0.35 ms per EAGLE-3 request on an H200's host, and four engines' requests
    used up a 300 us window before the wait began.) A partner that comes is an anchor too: its own partners are
    waited for, so engines spread over more than window_s in a chain of gaps under window_s (four engines 0.1-0.25
    ms apart) are all caught, each gap confirmed by a request that came;
  - the whole wait ends by the last batch's duration after the queue's first request (MAX_MERGE_WAIT_S at most, and
    window_s at least): waiting longer costs more than running the late engines' steps on their own. A first
    request that already waited that long (the thread was busy: load) starts at once, counted as late, so the window
    adds nothing under load; one engine alone has no partner and pays only the bookkeeping.

A wait that runs out (a partner did not come) costs at most window_s after the last read: the late engine's new
arrival no longer lies near the others', so it is not waited for next time unless it steps with them again. Engines
of unrelated cadences rarely arrive within window_s of one another (about 2 * window_s / cycle of their steps), so
they are rarely waited for; engines at one cadence whose offsets change by milliseconds every step are waited for
often, each wait ending window_s after the last request that came (docs/performance.md, "Engines out of step").
"""
import bisect
from dataclasses import dataclass

FORGET_S = 30.0  # an owner with no request for this long is forgotten (its channel or stream is gone, or idle)
MAX_MERGE_WAIT_S = 0.010  # a merge-window wait ends by this long after the queue's first request, whatever else
MERGE_POLL_S = 20e-6  # during a wait the step thread polls the channels and the queue this often


@dataclass
class MergeWindowCounters:
    """Exported by metrics.py (drafter_merge_window_*); written by the step thread only."""
    waits: int = 0  # batch starts that waited for partners
    complete: int = 0  # of those, waits that ended with every partner queued
    waited_s: float = 0.0  # time spent waiting, in all
    late: int = 0  # batch starts that left partners out without waiting: the first request had waited the cap


class MergeWindow:
    def __init__(self, window_s: float):
        if not window_s >= 0:
            raise ValueError(f"the merge window must be >= 0 s (got {window_s})")
        self.window_s = window_s
        self.last_arrival: dict[str, float] = {}  # owner -> time.perf_counter() when its last batched request arrived
        self._forget_at = 0.0  # when observe() next drops the owners not seen for FORGET_S
        self.counters = MergeWindowCounters()

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def observe(self, arrivals: dict[str, float]) -> None:
        """A batch's requests, as owner -> the arrival of its first request in the batch (unary ones left out)."""
        self.last_arrival.update(arrivals)
        if arrivals:
            now = max(arrivals.values())
            if now >= self._forget_at:
                self.last_arrival = {o: t for o, t in self.last_arrival.items() if now - t <= FORGET_S}
                self._forget_at = now + FORGET_S

    def partners(self, queued_owners: set[str]) -> set[str]:
        """The owners not in queued_owners whose last arrival lies within window_s of a queued owner's last one."""
        if not self.enabled or len(self.last_arrival) < 2:
            return set()
        anchors = sorted(self.last_arrival[o] for o in queued_owners if o in self.last_arrival)
        if not anchors:
            return set()
        w = self.window_s
        found = set()
        for owner, t in self.last_arrival.items():
            if owner in queued_owners:
                continue
            i = bisect.bisect_left(anchors, t - w)  # the first anchor >= t - w: a partner when it is <= t + w
            if i < len(anchors) and anchors[i] <= t + w:
                found.add(owner)
        return found

    def record_wait(self, seconds: float, complete: bool) -> None:
        self.counters.waits += 1
        self.counters.complete += int(complete)
        self.counters.waited_s += seconds
