"""The merge window (engine/merge_window.py): which engines a batch start waits for, and the step thread's waits."""
import asyncio
import contextlib
import threading
import time
import types

import pytest
import torch

from drafter_service.config import ServerConfig
from drafter_service.cli import parse_args
from drafter_service.engine.merge_window import FORGET_S, MergeWindow
from drafter_service.engine import scheduler as scheduler_module
from drafter_service.engine.scheduler import StepScheduler
from drafter_service.engine.step_io import StepInput, StepOutput


def test_partners_are_the_engines_that_arrived_within_the_window_of_a_queued_one():
    w = MergeWindow(0.001)
    w.observe({"a": 10.0000, "b": 10.0004})  # b came 0.4 ms after a
    w.observe({"c": 10.0030})  # 3 ms after a: another cadence
    w.observe({"d": 10.0019})  # 1.5 ms after b, 1.1 ms before c: outside the window of all
    assert w.partners({"a"}) == {"b"}
    assert w.partners({"b"}) == {"a"}
    assert w.partners({"c"}) == set()
    assert w.partners({"d"}) == set()
    assert w.partners({"a", "b"}) == set()  # (both queued: nobody to wait for)
    assert w.partners({"unknown"}) == set()  # (an engine seen for the first time has no partner yet)
    w.observe({"e": 10.0008})  # 0.4 ms after b: a partner of b, and of a (0.8 ms)
    assert w.partners({"a"}) == {"b", "e"}
    assert w.partners({"e"}) == {"a", "b"}


def test_the_window_edges_are_inclusive_and_a_zero_window_never_waits():
    w = MergeWindow(0.5)  # (values exact in binary: 0.5 s apart)
    w.observe({"a": 100.0, "b": 100.5, "c": 101.0})
    assert w.partners({"a"}) == {"b"}
    assert w.partners({"b"}) == {"a", "c"}
    off = MergeWindow(0.0)
    off.observe({"a": 1.0, "b": 1.0})
    assert not off.enabled and off.partners({"a"}) == set()
    with pytest.raises(ValueError, match="merge window"):
        MergeWindow(-1e-6)
    with pytest.raises(ValueError, match="merge window"):
        MergeWindow(float("nan"))


def test_an_engine_not_seen_for_a_while_is_forgotten():
    w = MergeWindow(0.001)
    w.observe({"a": 1.0, "gone": 1.0002})
    w.observe({"a": 1.0 + FORGET_S + 1})  # (the next clean-up runs at the first observation FORGET_S on)
    assert "gone" not in w.last_arrival and w.partners({"a"}) == set()


def test_the_window_is_a_server_flag_with_limits():
    default = ServerConfig(model="m")
    assert default.merge_window_us_for("cuda") == 300 and default.merge_window_us_for("cpu") == 0
    assert ServerConfig(model="m", merge_window_us=500).merge_window_us_for("cpu") == 500
    assert parse_args(["--model", "m", "--merge-window-us", "0"]).merge_window_us == 0
    assert parse_args(["--model", "m", "--merge-window-us", "10000"]).merge_window_us == 10_000
    for bad in (-1, 10_001):
        with pytest.raises(ValueError, match="merge_window_us"):
            ServerConfig(model="m", merge_window_us=bad)


class _RecordingProposer:
    """Just what the step thread calls: each batch's owners are recorded, every step answers at once (or after
    step_s)."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.batches: list[list[str | None]] = []
        self.metrics = types.SimpleNamespace(observe_queue_wait=lambda s: None)
        self.predraft = types.SimpleNamespace(has_work=lambda: False, observe_window=lambda s: None, cycle_check=False)
        self.device = torch.device("cpu")

    def expire_idle(self):
        pass

    def expiry_wait(self):
        return None

    def step(self, steps):
        self.batches.append([s.owner for s in steps])
        if self.step_s:
            time.sleep(self.step_s)
        return [StepOutput() for _ in steps]


def _step(owner, i):
    return [StepInput("ns", f"{owner}-{i}", 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4), 1, 2,
                      owner=owner)]


@contextlib.asynccontextmanager
async def _running(proposer, window_s: float):
    """A step thread over proposer with a merge window of window_s, stopped on the way out."""
    sched = StepScheduler(proposer, max_batch_tokens=1024, max_batch_seqs=64, merge_window_s=window_s)
    sched.start()
    try:
        yield sched
    finally:
        await sched.stop()


async def _round(sched, i, owners, gap_s):
    """The owners' steps, gap_s apart (the first at once), each through submit(); back when all are answered."""
    tasks = []
    for j, owner in enumerate(owners):
        if j:
            await asyncio.sleep(gap_s)
        tasks.append(asyncio.create_task(sched.submit(_step(owner, i))))
    await asyncio.gather(*tasks)


async def test_engines_that_stepped_together_share_a_batch_and_a_missing_one_costs_one_wait():
    proposer = _RecordingProposer()
    async with _running(proposer, 0.05) as sched:
        for i in range(6):  # two engines, the second 10 ms after the first (the step thread runs the first at once)
            await _round(sched, i, ["engine a", "engine b"], 0.010)
        counters = sched.merge_window.counters
        # the first round teaches the window that they arrive together; every later one merges them (on a loaded
        # machine the step thread may wake after b came too, a merge with no wait: one round in five spared)
        assert all(sorted(b) == ["engine a", "engine b"] for b in proposer.batches[-5:]), proposer.batches
        assert counters.waits >= 4 and counters.complete == counters.waits
        waits = counters.waits
        await asyncio.sleep(0.06)  # (from here a cycle longer than the window, as real engines' steps are)
        await _round(sched, 6, ["engine a"], 0)  # b is gone: the wait for it runs out once ...
        assert counters.waits == waits + 1 and counters.complete == waits
        assert counters.waited_s >= 0.04
        for i in range(7, 10):  # ... and never again: a's new arrival is not near b's last one
            await asyncio.sleep(0.06)
            await _round(sched, i, ["engine a"], 0)
        assert counters.waits == waits + 1
        assert proposer.batches[-4:] == [["engine a"]] * 4


async def test_a_group_spread_wider_than_the_window_is_followed_through_its_arrivals(monkeypatch):
    """Three engines 6 ms apart, a window of 10 ms: the third is 12 ms after the first, but each comes within the
    window of the one before, so the wait follows them (a step of 30 ms allows a wait that long; the cap on any wait,
    10 ms in the server, is raised here so that the gaps can be wide enough for a loaded 2-core machine's timers)."""
    monkeypatch.setattr(scheduler_module, "MAX_MERGE_WAIT_S", 0.05)
    proposer = _RecordingProposer(step_s=0.030)
    async with _running(proposer, 0.010) as sched:
        for i in range(10):
            await _round(sched, i, ["engine a", "engine b", "engine c"], 0.006)
        # A wait that did not follow the arrivals would end 10 ms after a's and never merge c (12 ms). (A loaded machine
        # may delay an engine past the window now and then; the group then splits for two rounds, until the window has
        # seen them together again: four rounds in eight spared.)
        assert proposer.batches[-8:].count(["engine a", "engine b", "engine c"]) >= 4, proposer.batches
        # the wait ends as soon as the group is in (about the 12 ms spread per step), not when the window runs out
        # after the last one that came (22 ms)
        counters = sched.merge_window.counters
        assert counters.complete >= 3 and counters.waited_s < 0.018 * counters.waits


async def test_a_wait_never_runs_past_the_last_batch(monkeypatch):
    """A partner that keeps coming within the window of the previous arrival cannot stretch the wait past the last
    batch's duration (here 15 ms): the engines after that run in the next batch. (The server's cap on any wait, 10 ms,
    is raised here so that the gaps can be wide enough for a loaded 2-core machine's timers.)"""
    monkeypatch.setattr(scheduler_module, "MAX_MERGE_WAIT_S", 0.05)
    proposer = _RecordingProposer(step_s=0.015)
    async with _running(proposer, 0.009) as sched:
        owners = [f"engine {i}" for i in range(6)]  # 6 ms apart: the last comes 30 ms after the first
        for i in range(5):
            await _round(sched, i, owners, 0.006)
        # (the wait ends 15 ms after the first request, the last batch's duration: the engines of 0, 6 and 12 ms join;
        # uncapped it would follow the chain to the sixth, 39 ms)
        assert sum(len(b) > 4 for b in proposer.batches[-8:]) == 0, proposer.batches
        assert sched.merge_window.counters.waited_s < 0.022 * sched.merge_window.counters.waits


async def test_one_engine_and_unary_requests_never_wait():
    proposer = _RecordingProposer()
    async with _running(proposer, 0.05) as sched:
        for i in range(5):
            await _round(sched, i, ["engine a"], 0)
        for i in range(5):  # unary calls (no owner) now and then, as a health check's or a benchmark's would be
            await _round(sched, 10 + i, [None, None], 0.002)
        assert sched.merge_window.counters.waits == 0
        assert None not in sched.merge_window.last_arrival


async def test_a_job_ends_a_wait_early():
    """Release and GetInfo run between batches: a merge-window wait gives way to them."""
    proposer = _RecordingProposer()
    async with _running(proposer, 5.0) as sched:
        for i in range(2):
            await _round(sched, i, ["engine a", "engine b"], 0.003)
        ran = threading.Event()
        task = asyncio.create_task(sched.submit(_step("engine a", 2)))  # b does not come: a 5 s wait would start
        await asyncio.sleep(0.05)
        await asyncio.wait_for(sched.run_exclusive(ran.set), 2.0)
        await asyncio.wait_for(task, 2.0)
        assert ran.is_set() and sched.merge_window.counters.waited_s < 2.0


async def test_a_request_that_waited_the_window_already_starts_at_once_and_counts_late():
    """A step thread busy past the window (here a 30 ms job) finds a request that has waited 5 ms or more: its batch
    starts without waiting for the partner, which is counted as a late start."""
    proposer = _RecordingProposer()
    async with _running(proposer, 0.005) as sched:
        for i in range(3):
            await _round(sched, i, ["engine a", "engine b"], 0.001)
        counters = sched.merge_window.counters
        waits, late = counters.waits, counters.late
        job = asyncio.create_task(sched.run_exclusive(time.sleep, 0.03))
        await asyncio.sleep(0.005)  # (the job holds the step thread)
        await asyncio.wait_for(sched.submit(_step("engine a", 3)), 2.0)
        await job
        assert proposer.batches[-1] == ["engine a"]
        assert counters.late == late + 1 and counters.waits == waits
        await _round(sched, 4, ["engine b"], 0)


class _SlowReadChannels:
    """A stand-in for the step channels (step_channels.ChannelSet) whose poll hands over the requests given to it, each
    after read_s of reading on the step thread, as a large request's parse takes."""

    def __init__(self, read_s: float):
        self.read_s = read_s
        self.inbox: list = []
        self.lock = threading.Lock()

    def open_count(self):
        return 1

    def close_all(self, why):
        pass

    def poll(self, enqueue, read_ahead: bool = True) -> bool:
        with self.lock:
            found, self.inbox = self.inbox, []
        for p in found:
            time.sleep(self.read_s)
            enqueue(p)
        return bool(found)


async def test_reading_the_requests_that_are_here_does_not_use_up_the_window():
    """Engines a and b ring at once, c 1 ms later; each request takes 2 ms to read, on the step thread, and the thread
    reads a and b before it can wait. Counted from a's arrival, the 3 ms window was gone by then and c ran in a batch
    of its own every step (four EAGLE-3 engines on an H200 lost 300 us windows that way); counted from when the
    thread is ready to wait, c joins a and b."""
    from drafter_service.engine.scheduler import PendingRequest
    proposer = _RecordingProposer(step_s=0.010)
    channels = _SlowReadChannels(0.002)
    async with _running(proposer, 0.003) as sched:
        sched.attach_channels(channels)
        channels.wake()  # (as ChannelSet does when a channel opens: a thread asleep with no channel starts polling)
        loop = asyncio.get_running_loop()

        def channel_request(owner, i):
            done = loop.create_future()

            def deliver(out, exc) -> None:  # (returns no bookkeeping: PendingRequest.deliver)
                loop.call_soon_threadsafe(done.set_result, None)
            with channels.lock:
                channels.inbox.append(PendingRequest(_step(owner, i), deliver))
            return done

        for i in range(10):
            a, b = channel_request("engine a", i), channel_request("engine b", i)
            await asyncio.sleep(0.001)
            await asyncio.gather(a, b, channel_request("engine c", i))
            await asyncio.sleep(0.02)
        # Counted from a's arrival, c never joins. (The first round teaches the window who steps together; a loaded
        # machine may delay c past the window now and then, and the group then splits for two rounds, until the
        # window has seen them together again: four rounds in eight spared.)
        merged = proposer.batches[-8:].count(["engine a", "engine b", "engine c"])
        assert merged >= 4, proposer.batches
        assert sched.merge_window.counters.late == 0


async def test_two_engines_through_step_channels_share_a_batch(tiny_model, tmp_path):
    """The drafter end to end: two engines (a client and a step channel each, namespaces of their own), the second
    sending 3 ms after the first every step. With a window wider than that gap, every step after the first runs
    both in one batch, and the drafts are the ones each engine gets alone."""
    from conftest import ServerThread, make_config
    from drafter_client import DrafterClient, SequenceStep

    head, target = tiny_model
    g = torch.Generator().manual_seed(0)
    steps = {ns: SequenceStep("s", 0, list(range(10, 14)), torch.randn(4, 64, generator=g), 1, 3)
             for ns in ("engine-a", "engine-b")}
    with ServerThread(make_config(head, target, tmp_path, merge_window_us=10_000)) as server:
        async with DrafterClient(server.uds, namespace="engine-a") as a, \
                DrafterClient(server.uds, namespace="engine-b") as b:
            assert await a.open_step_channel() and await b.open_step_channel()
            alone = {ns: (await c.propose([steps[ns]])).sequences[0].drafts.tolist()
                     for ns, c in (("engine-a", a), ("engine-b", b))}  # (each engine's step alone, in turn)

            async def late(c, ns):
                await asyncio.sleep(0.003)
                return await c.propose([steps[ns]])

            scheduler, rounds = server.server.scheduler, 8
            batches_before = scheduler.batches_run
            for _ in range(rounds):  # (the same step re-sent: the protocol allows re-sending committed positions)
                ra, rb = await asyncio.gather(a.propose([steps["engine-a"]]), late(b, "engine-b"))
                assert ra.sequences[0].drafts.tolist() == alone["engine-a"]
                assert rb.sequences[0].drafts.tolist() == alone["engine-b"]
            assert a.steps_through_channel == b.steps_through_channel == rounds + 1
            counters = scheduler.merge_window.counters
            # from the loop's first or second round on, both engines' steps run in one batch (up to two rounds spared
            # for a loaded machine that delays the second engine past the window)
            merged_rounds = 2 * rounds - (scheduler.batches_run - batches_before)
            assert merged_rounds >= rounds - 3 and counters.complete >= counters.waits - 2, (merged_rounds, counters)
            text = server.server.runtime.metrics.prometheus_text()
            assert f"drafter_merge_window_complete_total {float(counters.complete)}" in text


def test_a_merged_batch_answers_every_request_before_the_replies_bookkeeping():
    """Each request's deliver writes its reply and hands back its bookkeeping (step_channels.py: metrics, trace); the
    thread runs the bookkeeping once every request of the batch has its reply, so that a merged batch's later engines
    do not wait for the earlier ones' metrics. A bookkeeping that raises is logged; the others still run."""
    from drafter_service.engine.scheduler import PendingRequest

    events = []

    def deliver(i):
        def book():
            events.append(("book", i))
            if i == 1:
                raise RuntimeError("a metric failed")

        def d(out, exc):
            assert exc is None and len(out) == 1
            events.append(("reply", i))
            return book
        return d

    sched = StepScheduler(_RecordingProposer(), max_batch_tokens=1024, max_batch_seqs=64)
    sched._run_batch([PendingRequest(_step(f"engine {i}", 0), deliver(i)) for i in range(3)])
    assert events == [("reply", 0), ("reply", 1), ("reply", 2), ("book", 0), ("book", 1), ("book", 2)]
    assert sched.batches_run == 1 and sched.requests_merged == 3
