"""The client's circuit breaker: after the drafter failed a call, stop calling it for a while (docs/protocol.md,
"When the drafter is sick").

closed: every call goes to the drafter. A failure opens the breaker for a backoff: base_s * 2**(failures - 1),
capped at max_s, times a random factor in [1 - jitter, 1 + jitter]; while it is open, calls are answered at once
without network I/O. Once the backoff has passed, the next call goes through as the probe (half-open; other calls
are still refused meanwhile): a reply closes the breaker, a failure opens it again for the next, longer backoff.
"""
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CircuitBreaker:
    """Whether the client calls the drafter now; see the module's docstring. Not thread-safe by itself: the client
    uses it from one thread at a time (its event loop, or SyncDrafterClient's calling thread under its lock)."""

    base_s: float = 0.1  # the first backoff
    max_s: float = 5.0  # the cap
    jitter: float = 0.2  # +-20 %: engines that failed together do not probe together
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0  # consecutive failures; 0: closed
    open_until: float = 0.0  # (clock) when the next probe may go
    probing: bool = False  # a probe is in flight
    reason: str = ""  # the last failure
    times_opened: int = 0  # closed -> open transitions
    times_closed: int = 0  # open -> closed transitions (recoveries)

    @property
    def state(self) -> str:
        """"closed", "open" (backing off) or "half-open" (the backoff passed: the next call probes, or one does)."""
        if self.failures == 0:
            return "closed"
        return "half-open" if self.probing or self.clock() >= self.open_until else "open"

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe may go (0 when closed or due)."""
        return max(0.0, self.open_until - self.clock()) if self.failures else 0.0

    def allow(self) -> bool:
        """True: make the call (when the breaker is not closed, this call is the probe: report its end with
        success(), failure() or abandon()). False: answer without calling the drafter."""
        if self.failures == 0:
            return True
        if self.probing or self.clock() < self.open_until:
            return False
        self.probing = True
        return True

    def success(self) -> bool:
        """The drafter answered. Returns True when this closed an open breaker (the drafter recovered)."""
        recovered = self.failures > 0
        self.failures, self.probing, self.open_until = 0, False, 0.0
        if recovered:
            self.times_closed += 1
        return recovered

    def failure(self, reason: str) -> float:
        """The drafter failed a call: open (again) for the next backoff; returns the backoff in seconds."""
        if self.failures == 0:
            self.times_opened += 1
        self.failures += 1
        self.probing = False
        self.reason = reason
        backoff = min(self.max_s, self.base_s * 2 ** min(self.failures - 1, 30))
        backoff *= 1 + self.jitter * (2 * self.rng.random() - 1)
        self.open_until = self.clock() + backoff
        return backoff

    def abandon(self) -> None:
        """The call allow() let through ended without an answer either way (cancelled): another call may probe."""
        self.probing = False
