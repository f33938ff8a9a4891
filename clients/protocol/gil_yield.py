"""Yielding the GIL from a thread that busy-polls (the drafter's step thread over its step channels, a pre-drafting
pass over its CUDA events, SyncDrafterClient's calling thread waiting for a channel's reply), so that the process's
other threads (the drafter's event loop, which serves gRPC; an engine's own threads) still get it.

time.sleep(0) releases the GIL for about 4 us (the step thread's timer slack is 1 ns), but the polling thread takes
it back before a thread woken for it can run, and that thread then waits out Python's switch interval (5 ms) before
it forces a switch: every gRPC request paid up to that (scripts/spin_gil_handoff.py: a GetInfo's median 4.99 ms,
p90 9.35, against 2.11 / 2.58 with the handoff). So every HANDOFF_EVERY-th yield is a real sleep of HANDOFF_S, long
enough for the woken thread to take the GIL; what the poll watches for is seen at most HANDOFF_S later then.
"""
import time

HANDOFF_EVERY = 8
HANDOFF_S = 20e-6


class GilYield:
    """Call between two polls: time.sleep(0), and every HANDOFF_EVERY-th call time.sleep(HANDOFF_S)."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        time.sleep(HANDOFF_S if self.calls % HANDOFF_EVERY == 0 else 0)
