"""gil_yield.GilYield: between two polls time.sleep(0), and every HANDOFF_EVERY-th call a real sleep (in which a
thread woken for the GIL can take it; scripts/spin_gil_handoff.py measures what that does for gRPC latency)."""
from drafter_client.protocol import gil_yield


def test_every_nth_yield_is_a_real_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(gil_yield.time, "sleep", slept.append)
    y = gil_yield.GilYield()
    for _ in range(3 * gil_yield.HANDOFF_EVERY):
        y()
    assert slept.count(gil_yield.HANDOFF_S) == 3 and slept.count(0) == 3 * (gil_yield.HANDOFF_EVERY - 1)
    assert all(s == gil_yield.HANDOFF_S for s in slept[gil_yield.HANDOFF_EVERY - 1 :: gil_yield.HANDOFF_EVERY])
    assert 0 < gil_yield.HANDOFF_S < 1e-3  # (long enough for a woken thread, short against a step)
