"""The calling thread's timer slack (Linux prctl PR_SET_TIMERSLACK / PR_GET_TIMERSLACK).

A thread that polls shared memory and yields with time.sleep(0) between polls (the drafter's step thread, a client
waiting on a step channel) sleeps at least its timer slack each time: 50 us by default, which is then how late it
notices a message. With a slack of 1 ns that sleep lasts a few microseconds.
"""
import ctypes
import sys

PR_SET_TIMERSLACK = 29  # linux/prctl.h
PR_GET_TIMERSLACK = 30

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def get_timer_slack() -> int | None:
    """The calling thread's timer slack in ns, or None where it cannot be read (not Linux)."""
    if _prctl is None:
        return None
    slack = _prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
    return slack if slack >= 0 else None


def set_timer_slack(ns: int) -> bool:
    """Set the calling thread's timer slack (best effort: False where it could not)."""
    return _prctl is not None and _prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
