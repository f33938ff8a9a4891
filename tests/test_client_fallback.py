"""A sick drafter never stops the engine (docs/protocol.md, "When the drafter is sick").

For a drafter that is slow (its step thread held, or a proxy that holds steps past the deadline), dead (nothing
listening; a sidecar child process killed), restarted (killed and started again at the same address; a proxy
switched to a fresh drafter) or failing (INTERNAL): propose() never raises by default on any path (unary, step
channel, ProposeSession, SyncDrafterClient) and answers "no drafts" (``result.fallback``) within its deadline; the
circuit breaker opens, answers at once without calling the drafter, and closes when the drafter answers again (a
step channel that was open is opened again); the sequences a restarted drafter lost say ``needs_resync`` and a
resync from position 0 drafts again; releases wait for the drafter instead of failing. With raise_on_error=True
the same faults raise DrafterError, and the caller's own errors raise either way. The reference engine's greedy
output equals plain greedy decoding through every fault, resending what the drafter missed (from position 0 on
needs_resync) when it keeps its states, decoding plainly the sequences that lost their drafter when it does not.

No call may wait past its deadline + SLACK_S (generous: the CPU is shared); the tests count those that do.
"""
import asyncio
import pathlib
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import CircuitBreaker, DrafterClient, DrafterError, SequenceStep, SyncDrafterClient
from drafter_client.engine.reference_engine import ReferenceEngine, SpecConfig
from drafter_client.engine.sidecar_process import SidecarProcess
from drafter_client.engine.target import TargetModel
from drafter_client.protocol import pb, pb_grpc

MODELS = pathlib.Path(__file__).resolve().parent.parent / "models"
H = 64  # the tiny model's hidden width (conftest's tiny_model)
DEADLINE_S = 0.3
SLACK_S = 0.5
SLOW_S = 2 * DEADLINE_S  # the proxy's "slow" drafter


def step(sid: str, p: int = 0, m: int = 4, k: int = 3) -> SequenceStep:
    return SequenceStep(sid, p, list(range(10, 10 + m)), torch.randn(m, H), 1, k)


def slow_breaker() -> CircuitBreaker:
    """A backoff long enough that the call right after a failure is surely refused."""
    return CircuitBreaker(base_s=1.0, max_s=1.0)


def quick_breaker() -> CircuitBreaker:
    return CircuitBreaker(base_s=0.05, max_s=0.2)


@dataclass
class Call:
    phase: str
    fallback: bool
    drafted: bool  # some sequence got drafts
    codes: list[int]
    reason: str


class Recorder:
    """Wraps a client's propose and release (and the propose of its sessions): counts the calls that took longer
    than their deadline + SLACK_S (``late``) and notes per propose the phase the test set, whether it fell back and
    whether any sequence got drafts."""

    def __init__(self, client: DrafterClient, deadline_s: float = DEADLINE_S):
        self.deadline_s = deadline_s
        self.calls: list[Call] = []
        self.phase = "before"
        self.late = 0
        client.propose = self._timed(client.propose)
        client.release = self._timed(client.release)
        stream = client.stream

        def timed_stream():
            session = stream()
            session.propose = self._timed(session.propose)
            return session

        client.stream = timed_stream

    def _timed(self, fn):
        async def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                r = await fn(*args, **kwargs)
            finally:
                if time.monotonic() - t0 > self.deadline_s + SLACK_S:
                    self.late += 1
            if hasattr(r, "sequences"):
                self.calls.append(Call(self.phase, r.fallback, any(s.drafts.numel() for s in r.sequences),
                                       [s.code for s in r.sequences], r.fallback_reason))
            return r
        return timed

    def drafted(self, phase: str) -> bool:
        return any(c.drafted for c in self.calls if c.phase == phase)

    def fallbacks(self, phase: str) -> int:
        return sum(c.fallback for c in self.calls if c.phase == phase)


def hold_step_thread(server: ServerThread, seconds: float, until: threading.Event | None = None) -> Future:
    """A slow drafter: its step thread does nothing else for `seconds` (or until `until` is set, at most `seconds`):
    no step, step-channel poll, Release or GetInfo is served meanwhile. Returns once the hold began; the future
    resolves when it ends."""
    began = threading.Event()
    until = until or threading.Event()

    def hold():
        began.set()
        until.wait(seconds)

    fut = asyncio.run_coroutine_threadsafe(server.server.scheduler.run_exclusive(hold), server.loop)
    assert began.wait(30)
    return fut


async def until_answered(call, timeout_s: float = 20.0):
    """Call (a propose) until the drafter answers (not a fallback); returns that result."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await call()
        if not r.fallback:
            return r
        assert time.monotonic() < deadline, f"the drafter never answered again: {r.fallback_reason}"
        await asyncio.sleep(0.05)


async def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultProxy(pb_grpc.DrafterServicer):
    """A drafter in-process that forwards GetInfo, Propose, ProposeStream and Release to a real one, with faults
    on demand (``mode``): "ok"; "slow": Propose and stream messages wait SLOW_S (past the client's deadline) before
    they are forwarded; "drop": UNAVAILABLE without forwarding (the drafter never sees the step; a stream ends);
    "internal": INTERNAL without forwarding (on a stream: an error reply, and the stream goes on).
    ``set_backend`` to a fresh drafter is a restart: it knows none of the sequences."""

    def __init__(self, backend: str):
        self.mode = "ok"
        self._channels = []
        self.set_backend(backend)

    def set_backend(self, address: str) -> None:
        channel = grpc.aio.insecure_channel(address)
        self._channels.append(channel)
        self._stub = pb_grpc.DrafterStub(channel)

    async def __aenter__(self) -> "FaultProxy":
        self._server = grpc.aio.server()
        pb_grpc.add_DrafterServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        await self._server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._server.stop(0)
        for channel in self._channels:
            await channel.close()

    async def _fault(self, context) -> None:
        if self.mode == "slow":
            await asyncio.sleep(SLOW_S)
        elif self.mode == "drop":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the drafter is unavailable")
        elif self.mode == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "injected: internal error")

    async def GetInfo(self, request, context):
        return await self._stub.GetInfo(request)

    async def Release(self, request, context):
        return await self._stub.Release(request)

    async def Propose(self, request, context):
        await self._fault(context)
        try:
            return await self._stub.Propose(request)
        except grpc.aio.AioRpcError as e:  # the drafter's refusal, as it gave it
            await context.abort(e.code(), e.details())

    async def ProposeStream(self, request_iterator, context):
        async for request in request_iterator:
            if self.mode == "internal":
                yield error_reply(request, grpc.StatusCode.INTERNAL, "injected")
                continue
            await self._fault(context)
            try:
                yield await self._stub.Propose(request)
            except grpc.aio.AioRpcError as e:  # on a stream, a refused request is an error reply
                yield error_reply(request, e.code(), e.details())


def error_reply(request: "pb.ProposeRequest", code: grpc.StatusCode, message: str) -> "pb.ProposeResponse":
    return pb.ProposeResponse(request_id=request.request_id, error=pb.Status(code=code.value[0], message=message))


# ---- the circuit breaker ----

async def test_default_step_deadline_from_the_environment(monkeypatch):
    from drafter_client.client import DEFAULT_STEP_TIMEOUT_S, default_step_timeout_s

    monkeypatch.delenv("DRAFTER_STEP_TIMEOUT_S", raising=False)
    assert default_step_timeout_s() == DEFAULT_STEP_TIMEOUT_S == 0.5
    monkeypatch.setenv("DRAFTER_STEP_TIMEOUT_S", "2.5")
    assert default_step_timeout_s() == 2.5
    async with DrafterClient("unix:/nonexistent") as c:
        assert c.step_timeout_s == 2.5
    async with DrafterClient("unix:/nonexistent", step_timeout_s=None) as c:
        assert c.step_timeout_s is None  # explicit wins
    monkeypatch.setenv("DRAFTER_STEP_TIMEOUT_S", "none")
    assert default_step_timeout_s() is None
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("DRAFTER_STEP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="DRAFTER_STEP_TIMEOUT_S"):
            default_step_timeout_s()


def test_breaker_backs_off_exponentially_with_jitter_and_lets_one_probe_through():
    now = [100.0]
    b = CircuitBreaker(base_s=0.1, max_s=1.0, jitter=0.2, clock=lambda: now[0])
    assert b.state == "closed" and b.allow() and b.allow()
    backoffs = []
    for i in range(8):
        backoffs.append(b.failure(f"failure {i}"))
        assert b.state == "open" and not b.allow() and b.retry_in_s == pytest.approx(backoffs[-1])
        now[0] += backoffs[-1]
        assert b.state == "half-open" and b.allow()  # the probe
        assert not b.allow()  # one probe at a time
    for i, backoff in enumerate(backoffs):
        nominal = min(1.0, 0.1 * 2**i)
        assert 0.8 * nominal <= backoff <= 1.2 * nominal, (i, backoff)
    assert len(set(backoffs[4:])) > 1  # jitter
    assert b.times_opened == 1 and b.reason == "failure 7"
    b.abandon()  # a cancelled probe: another call may probe
    assert b.allow()
    assert b.success() and b.state == "closed" and b.times_closed == 1 and b.allow()
    assert not b.success()  # already closed
    b.failure("again")
    assert b.times_opened == 2 and b.retry_in_s <= 0.12  # the backoff starts over


# ---- slow: the step thread held past the deadline ----

@pytest.mark.parametrize("path", ["unary", "stream", "channel"])
async def test_a_slow_drafter_gives_no_drafts_within_the_deadline(server, path):
    async with DrafterClient(server.uds, namespace=f"slow-{path}", step_timeout_s=DEADLINE_S,
                             breaker=slow_breaker()) as c:
        rec = Recorder(c)
        if path == "channel":
            assert await c.open_step_channel()
        session = c.stream() if path == "stream" else None
        propose = session.propose if session else c.propose
        assert (await propose([step("a")])).sequences[0].ok
        held = hold_step_thread(server, 1.5)
        r = await propose([step("a", p=4, m=1)])
        assert r.fallback and r.fallback_reason.startswith("DEADLINE_EXCEEDED"), r.fallback_reason
        s = r.sequences[0]
        assert s.sequence_id == "a" and s.code == 14 and s.drafts.numel() == 0 and not s.needs_resync
        assert c.breaker.state == "open" and c.fallback_steps == 1
        # the breaker answers at once, without building a request or calling the drafter
        request_ids = c._next_request_id
        r = await propose([step("a", p=4, m=1)])
        assert r.fallback and r.fallback_reason.startswith("circuit breaker open after DEADLINE_EXCEEDED")
        assert c._next_request_id == request_ids
        if path == "unary":  # a release waits for the drafter instead of failing
            deferred = await c.release(["gone"])
            assert deferred.deferred and deferred.released == 0 and c._unreleased == {"gone"}
        await asyncio.wrap_future(held)
        # the probe (once the backoff passed) finds the drafter well: the breaker closes. The timed-out step was
        # dropped or applied late; re-sending it from p = 4 is valid either way (p at or behind the drafter's) ...
        r = await until_answered(lambda: propose([step("a", p=4, m=1)]))
        assert c.breaker.state == "closed" and c.breaker.times_opened == 1 and c.breaker.times_closed == 1
        if r.sequences[0].needs_resync:  # ... unless the stream / step channel that created "a" ended with the
            assert path != "unary"  # deadline: the drafter freed its sequences (docs/protocol.md, "Sequence lifetime")
            assert r.sequences[0].code == 5
            r = await propose([step("a", p=0, m=5)])  # the resync
        assert r.sequences[0].ok and r.sequences[0].committed_length == 5
        if path == "channel":  # the channel the deadline closed is opened again
            await wait_until(lambda: c.step_channel_open)
            before = c.steps_through_channel
            assert (await propose([step("a", p=5, m=1)])).sequences[0].ok
            assert c.steps_through_channel == before + 1
        released = await c.release(["a"])  # (and "gone", which the drafter never held)
        assert released.released == 1 and released.not_found == [] and not released.deferred
        assert c._unreleased == set()
        if path == "stream":  # the stream a late reply would have shifted was replaced
            assert session.streams_opened == 2
            await session.close()
    assert rec.late == 0


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "loop"])
def test_sync_client_falls_back_on_both_paths(server, channel):
    with SyncDrafterClient(server.uds, namespace=f"sync-slow-{channel}", step_timeout_s=DEADLINE_S,
                           breaker=slow_breaker()) as c:
        late = 0

        def propose(*args):
            nonlocal late
            t0 = time.monotonic()
            r = c.propose(*args)
            late += time.monotonic() - t0 > DEADLINE_S + SLACK_S
            return r

        if channel:
            assert c.open_step_channel()
        assert propose([step("s")]).sequences[0].ok
        held = hold_step_thread(server, 1.5)
        r = propose([step("s", p=4, m=1)])
        assert r.fallback and r.fallback_reason.startswith("DEADLINE_EXCEEDED") and r.sequences[0].code == 14
        assert c.breaker.state == "open"
        r = propose([step("s", p=4, m=1)])
        assert r.fallback and r.fallback_reason.startswith("circuit breaker open")
        held.result(30)
        deadline = time.monotonic() + 20
        while (r := propose([step("s", p=4, m=1)])).fallback:
            assert time.monotonic() < deadline, r.fallback_reason
            time.sleep(0.05)
        assert c.breaker.state == "closed"
        if r.sequences[0].needs_resync:  # the channel that created "s" ended with the deadline: "s" was freed
            assert channel
            r = propose([step("s", p=0, m=5)])
        assert r.sequences[0].ok
        if channel:  # reopened on the client's loop; then steps go through it on the calling thread again
            client = c._client
            deadline = time.monotonic() + 10
            while not client.step_channel_open:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            before = client.steps_through_channel
            assert propose([step("s", p=5, m=1)]).sequences[0].ok and client.steps_through_channel == before + 1
        c.release(["s"])
    assert late == 0


async def test_raise_on_error_raises_what_would_fall_back(server):
    async with DrafterClient(server.uds, namespace="raise", step_timeout_s=DEADLINE_S, raise_on_error=True,
                             breaker=slow_breaker()) as c:
        rec = Recorder(c)
        session = c.stream()
        assert (await c.propose([step("r")])).sequences[0].ok
        held = hold_step_thread(server, 1.0)
        with pytest.raises(DrafterError) as e:
            await c.propose([step("r", p=4, m=1)])
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        for call in (c.propose, session.propose):  # the breaker is open: UNAVAILABLE at once
            with pytest.raises(DrafterError) as e:
                await call([step("r", p=4, m=1)])
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "circuit breaker open" in e.value.message
        with pytest.raises(DrafterError) as e:
            await c.release(["r"])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        await asyncio.wrap_future(held)
        await asyncio.sleep(c.breaker.retry_in_s + 0.05)
        assert (await session.propose([step("r", p=4, m=1)])).sequences[0].ok and c.breaker.state == "closed"
        await session.close()
        assert (await c.release(["r"])).released == 1
    assert rec.late == 0


# ---- dead: nothing listening ----

@pytest.mark.parametrize("where", ["unix", "tcp"])
async def test_nothing_listening_gives_no_drafts_and_never_raises(tmp_path, where):
    address = f"unix:{tmp_path}/nobody.sock" if where == "unix" else f"127.0.0.1:{free_tcp_port()}"
    async with DrafterClient(address, namespace="dead", step_timeout_s=DEADLINE_S, breaker=quick_breaker()) as c:
        rec = Recorder(c)
        session = c.stream()
        for i in range(10):
            for propose in (c.propose, session.propose):
                r = await propose([step("d", p=4 * i, m=4)])
                assert r.fallback and r.sequences[0].code == 14 and r.sequences[0].drafts.numel() == 0
            await asyncio.sleep(0.03)
        reasons = {call.reason.split(":")[0].split(" after")[0] for call in rec.calls}
        assert {"UNAVAILABLE", "circuit breaker open"} <= reasons, reasons  # probes, and refusals in between
        assert reasons <= {"UNAVAILABLE", "DEADLINE_EXCEEDED", "circuit breaker open"}, reasons
        assert c.breaker.failures >= 2 and c.breaker.times_closed == 0 and c.fallback_steps == 20
        r = await c.release(["d"])
        assert r.deferred and r.fallback_reason
        await session.close()
    assert rec.late == 0
    async with DrafterClient(address, namespace="dead", step_timeout_s=DEADLINE_S, raise_on_error=True) as c:
        with pytest.raises(DrafterError) as e:
            await c.propose([step("d")])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


# ---- INTERNAL, a broken stream, and the caller's own errors (through a proxy) ----

async def test_internal_errors_fall_back_and_the_callers_errors_raise(server):
    async with FaultProxy(server.tcp) as proxy, \
            DrafterClient(proxy.address, namespace="internal", step_timeout_s=DEADLINE_S,
                          breaker=quick_breaker()) as c:
        rec = Recorder(c)
        session = c.stream()
        for name, propose in (("unary", c.propose), ("stream", session.propose)):
            sid = f"i-{name}"
            proxy.mode = "ok"
            assert (await propose([step(sid)])).sequences[0].ok
            proxy.mode = "internal"
            r = await propose([step(sid, p=4, m=1)])
            assert r.fallback and r.fallback_reason.startswith("INTERNAL: injected"), r.fallback_reason
            proxy.mode = "ok"
            r = await until_answered(lambda: propose([step(sid, p=4, m=1)]))
            assert r.sequences[0].ok and c.breaker.state == "closed"
            # the caller's errors raise, and say nothing about the drafter's health
            bad = SequenceStep(sid, 0, [1, 2, 3], torch.randn(2, H), 1, 2)  # 3 tokens, 2 hidden rows
            with pytest.raises(DrafterError) as e:
                await propose([bad])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and c.breaker.state == "closed"
        assert session.streams_opened == 1  # an error reply does not end the stream
        # a stream that breaks is replaced at the next step
        proxy.mode = "drop"
        r = await session.propose([step("i-stream", p=5, m=1)])
        assert r.fallback and r.fallback_reason.startswith("UNAVAILABLE")
        proxy.mode = "ok"
        r = await until_answered(lambda: session.propose([step("i-stream", p=5, m=1)]))
        if r.sequences[0].needs_resync:  # the drafter freed the sequences of the stream that ended
            r = await session.propose([step("i-stream", p=0, m=6)])
        assert r.sequences[0].ok and session.streams_opened == 2
        # per-sequence statuses are no fallback: unknown and gap say needs_resync; a resync from 0 drafts again
        r = await c.propose([step("never-seen", p=4, m=1), step("i-unary", p=5, m=1)])
        assert not r.fallback and r.sequences[0].code == 5 and r.sequences[0].needs_resync
        assert r.sequences[1].ok and not r.sequences[1].needs_resync
        r = await c.propose([step("i-unary", p=9, m=1)])
        assert r.sequences[0].code == 9 and r.sequences[0].needs_resync
        r = await c.propose([step("never-seen", p=0, m=5)])
        assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 3
        assert (await c.release(["i-unary", "i-stream", "never-seen"])).released == 3
        await session.close()
    assert rec.late == 0


# ---- killed and restarted: a real sidecar child process ----

async def test_a_killed_and_restarted_sidecar(tiny_model):
    head, target = tiny_model
    with SidecarProcess(head, target, device="cpu") as sidecar:
        async with DrafterClient(sidecar.address, namespace="phoenix", step_timeout_s=DEADLINE_S,
                                 breaker=quick_breaker()) as c:
            rec = Recorder(c)
            assert await c.open_step_channel()
            session = c.stream()
            assert (await c.propose([step("a")])).sequences[0].ok and c.steps_through_channel == 1
            assert (await session.propose([step("b")])).sequences[0].ok
            sidecar.kill()
            r = await c.propose([step("a", p=4, m=1)])  # through the channel: the drafter went away
            assert r.fallback and r.fallback_reason.startswith("UNAVAILABLE") and not c.step_channel_open
            for _ in range(5):
                assert (await session.propose([step("b", p=4, m=1)])).fallback
                assert (await c.propose([step("a", p=4, m=1)])).fallback
                await asyncio.sleep(0.03)
            assert (await c.release(["gone"])).deferred
            sidecar.start()  # the same address, a drafter that knows no sequence
            for sid, propose in (("a", c.propose), ("b", session.propose)):
                r = await until_answered(lambda: propose([step(sid, p=4, m=1)]))
                assert r.sequences[0].code == 5 and r.sequences[0].needs_resync, r.sequences[0]
                r = await propose([step(sid, p=0, m=5)])  # the resync: the context from position 0
                assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 3
            assert c.breaker.state == "closed" and c.breaker.times_closed >= 1
            await wait_until(lambda: c.step_channel_open)  # the channel that was open is open again
            before = c.steps_through_channel
            assert (await c.propose([step("a", p=5, m=1)])).sequences[0].ok
            assert c.steps_through_channel == before + 1
            released = await c.release(["a", "b"])
            assert released.released == 2 and released.not_found == [] and c._unreleased == set()
            await session.close()
        assert rec.late == 0


# ---- the reference engine: greedy output is plain greedy decoding through every fault ----

@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    with ServerThread(make_config(MODELS / "eagle1", MODELS / "target", tmp_path_factory.mktemp("fb"))) as s:
        yield s


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.load(str(MODELS / "target"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    from drafter_client.benchmarks.prompts import DEMO

    tok = Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))
    return [tok.encode(t).ids for t in DEMO]


CFG = SpecConfig(max_new_tokens=40, num_drafts=3)
FAULT_AT, HEAL_AT = 3, 6  # engine steps (target forwards) where the fault begins and ends


@pytest.fixture(scope="module")
def plain(target, prompts) -> list[list[int]]:
    """Plain greedy decoding (tests/test_reference_engine.py checks it equals transformers' own)."""
    return asyncio.run(ReferenceEngine(target, None).generate_plain(prompts, CFG)).tokens


@pytest.mark.parametrize("fault,path,keep_states", [
    ("hold", "stream", True), ("hold", "unary", False), ("slow", "stream", True), ("drop", "unary", True),
    ("drop", "unary", False), ("internal", "stream", True), ("restart", "unary", True), ("restart", "stream", False)])
async def test_engine_output_is_plain_greedy_through_a_fault(bundled_server, target, prompts, plain, tmp_path, fault,
                                                             path, keep_states):
    """Faults from engine step FAULT_AT to HEAL_AT. "hold": the drafter's step thread is held (the engine talks
    to it directly; a stream that misses its deadline ends, and the drafter frees the sequences it created);
    the others through FaultProxy ("restart": switched to a fresh drafter)."""
    fresh = ServerThread(make_config(MODELS / "eagle1", MODELS / "target", tmp_path)) if fault == "restart" else None
    if fresh is not None:
        fresh.__enter__()
    healed = threading.Event()
    try:
        async with FaultProxy(bundled_server.tcp) as proxy, \
                DrafterClient(bundled_server.uds if fault == "hold" else proxy.address,
                              namespace=f"engine-{fault}-{path}-{keep_states}", step_timeout_s=DEADLINE_S,
                              breaker=quick_breaker()) as c:
            rec = Recorder(c)
            engine = ReferenceEngine(target, c, await c.get_info(), use_stream=path == "stream",
                                     keep_states=keep_states)

            def on_step(info):
                if info.step == FAULT_AT:
                    rec.phase = "fault"
                    if fault == "hold":
                        hold_step_thread(bundled_server, 30, until=healed)
                    elif fault == "restart":
                        proxy.set_backend(fresh.tcp)
                    else:
                        proxy.mode = fault
                if info.step == HEAL_AT:
                    rec.phase, proxy.mode = "after", "ok"
                    healed.set()

            result = await engine.generate(prompts, CFG, on_step=on_step)
        assert result.tokens == plain
        stats = result.acceptance
        assert rec.late == 0
        assert rec.drafted("before")
        if fault == "restart":  # the fresh drafter knows none of the sequences
            assert rec.fallbacks("fault") == 0 and any(5 in call.codes for call in rec.calls if call.phase == "fault")
        else:
            assert rec.fallbacks("fault") >= 1 and stats.fallback_steps >= 1
        if keep_states:  # what the drafter missed or lost is sent again: drafts resume
            assert stats.stopped_drafting == 0
            assert rec.drafted("after") or (fault == "restart" and rec.drafted("fault"))
            assert stats.resyncs >= (1 if fault == "restart" else 0)
        else:  # the sequences that lost their drafter are decoded plainly to their end
            assert stats.stopped_drafting >= 1 and not rec.drafted("after")
    finally:
        healed.set()
        if fresh is not None:
            fresh.__exit__(None, None, None)


async def test_engine_through_a_killed_and_restarted_sidecar(target, prompts, plain):
    """A real crash: SIGKILL mid-generation, steps through a step channel; the sidecar comes back at the same
    address, the engine resyncs its sequences from position 0 and drafts again through the reopened channel."""
    with SidecarProcess(MODELS / "eagle1", MODELS / "target", device="cpu") as sidecar:
        async with DrafterClient(sidecar.address, namespace="engine-crash", step_timeout_s=DEADLINE_S,
                                 breaker=quick_breaker()) as c:
            rec = Recorder(c)
            assert await c.open_step_channel()
            engine = ReferenceEngine(target, c, await c.get_info(), use_stream=False)
            through_channel = {}

            def on_step(info):
                if info.step == FAULT_AT:
                    rec.phase = "fault"
                    sidecar.kill()
                if info.step == HEAL_AT:
                    sidecar.start()  # (blocks this step until the sidecar serves: not a drafter wait)
                    deadline = time.monotonic() + 10
                    while c._channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
                    rec.phase = "after"
                    through_channel["at_restart"] = c.steps_through_channel

            result = await engine.generate(prompts, SpecConfig(max_new_tokens=48, num_drafts=3), on_step=on_step)
    assert [t[:CFG.max_new_tokens] for t in result.tokens] == plain
    stats = result.acceptance
    assert rec.late == 0
    assert rec.fallbacks("fault") >= 1 and stats.resyncs >= 1 and stats.stopped_drafting == 0
    assert rec.drafted("after") and c.steps_through_channel > through_channel["at_restart"]
