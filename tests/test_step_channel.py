"""Shared-memory step channels (docs/step_channel.md): the same ProposeRequest / ProposeResponse bytes as a unary
Propose, through a mailbox the drafter's step thread polls.

Drafts through a channel equal the gRPC path and the naive reference (inline states and states in shared memory);
a malformed request, another namespace's request, garbage and bytes that never match their crc get an error
reply naming the problem, and the channel stays usable; hellos the drafter refuses say why; a client cannot
shrink the mailbox; a client that goes away (closes, or is killed) has its channel reclaimed; a channel the
drafter closes sends the client back to gRPC without losing the step.
"""
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_client.client import build_request, parse_response
from drafter_client.step_channel import StepChannel, StepChannelError
from drafter_client.protocol.mailbox import Mailbox
from drafter_client.protocol import pb
from fake_engine import FakeSequence
from naive_eagle import NaiveEagle1

H, V = 64, 512
STEPS = 24


@pytest.fixture(scope="module", params=[True, False], ids=["checksums", "no-checksums"])
def ch_server(request, tiny_model, tmp_path_factory):
    """A drafter whose mailboxes carry crcs, and one whose do not (the default on x86-64: mailbox.py)."""
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path_factory.mktemp("chan"))
    cfg.step_channel_checksums = request.param
    with ServerThread(cfg) as s:
        yield s


def open_channels(server: ServerThread) -> int:
    return server.server.channels.open_count()


def wait_until(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def step(sid, p=0, m=4, nxt=1, k=3):
    return SequenceStep(sid, p, list(range(10, 10 + m)), torch.randn(m, H), nxt, k)


async def test_drafts_through_the_channel_match_grpc_and_naive(ch_server, tiny_model):
    naive = NaiveEagle1(*tiny_model)
    rng = random.Random(5)
    async with DrafterClient(ch_server.uds, namespace="eng-ch") as fast, \
            DrafterClient(ch_server.uds, namespace="eng-grpc") as slow, \
            DrafterClient(ch_server.uds, namespace="eng-ch-shm") as both:
        info = await fast.get_info()
        assert info.step_channel_socket == ch_server.server.config.step_channel_path()
        assert await fast.open_step_channel()
        assert await both.open_step_channel(request_bytes=4096)  # descriptors only: the smallest area will do
        assert await both.enable_shared_memory(max_step_tokens=256, dtype=torch.float32) == "system"
        wait_until(lambda: open_channels(ch_server) == 2)  # (the step thread adopts a new channel between batches)
        seqs = {c: [FakeSequence(f"s{i}", prompt, H, V, random.Random(i), chunk)
                    for i, (prompt, chunk) in enumerate([(40, None), (95, 16), (7, None)])]
                for c in ("fast", "slow", "both")}
        checked = 0
        for n in range(STEPS):
            ks = [rng.randint(1, 6) for _ in range(3)]
            replies = {}
            for name, client in (("fast", fast), ("slow", slow), ("both", both)):
                replies[name] = await client.propose([s.next_step(k) for s, k in zip(seqs[name], ks)])
            for i in range(3):
                a, b, c = (replies[x].sequences[i] for x in ("fast", "slow", "both"))
                assert a.ok and b.ok and c.ok, (a, b, c)
                assert a.drafts.tolist() == b.drafts.tolist() == c.drafts.tolist()
                assert a.committed_length == b.committed_length == c.committed_length
                s = seqs["fast"][i]
                if a.drafts.numel():
                    assert a.drafts.tolist() == naive.drafts(s.tokens, s.hidden, a.drafts.numel())
                    checked += 1
                for x in ("fast", "slow", "both"):
                    seqs[x][i].last_drafts = replies[x].sequences[i].drafts.tolist()
        assert checked >= 40
        assert fast.steps_through_channel == STEPS and fast.steps_through_grpc == 0
        assert both.steps_through_channel == STEPS and both.steps_by_reference == STEPS
        assert slow.steps_through_channel == 0 and slow.steps_through_grpc == STEPS
        text = ch_server.server.runtime.metrics.prometheus_text()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("drafter_step_channel"))
        assert float(values["drafter_step_channel_requests_total"]) >= 2 * STEPS
        assert float(values["drafter_step_channels"]) == 2
        for c in (fast, slow, both):
            await c.release([f"s{i}" for i in range(3)])
    wait_until(lambda: open_channels(ch_server) == 0)  # close() closed them; the drafter noticed


async def test_bad_requests_get_error_replies_and_the_channel_stays_usable(ch_server):
    async with DrafterClient(ch_server.uds, namespace="bad-ch") as c:
        assert await c.open_step_channel()
        # the same message a unary Propose fails with
        bad = SequenceStep("b", 0, [1, 2, 3], torch.randn(2, H), 1, 2)
        with pytest.raises(DrafterError) as e:
            await c.propose([bad])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "hidden_states" in e.value.message
        assert c.steps_through_channel == 1 and c.step_channel_open  # answered through the channel
        ch = c._step_channel

        async def raw(payload: bytes) -> "pb.ProposeResponse":
            assert ch.try_claim() and not ch.try_claim()  # one call at a time
            reply = await ch.call(payload, timeout=10)
            assert not ch.busy  # the call gave the claim back
            return pb.ProposeResponse.FromString(reply)

        # another namespace's request
        other = build_request("someone-else", [step("x")], request_id=7)
        r = await raw(other.SerializeToString())
        assert r.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "someone-else" in r.error.message
        assert r.request_id == 7
        # garbage
        r = await raw(b"\xff" * 100)
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "ProposeRequest" in r.error.message
        # a doorbell whose bytes never check out (a crc that never matches; without crcs, a length past the
        # request area): answered after a second
        box = ch.box
        assert box.checksums == ch_server.server.config.step_channel_checksums
        ch._seq += 1
        box.mm[box.request.start : box.request.start + 4] = b"abcd"
        box.words[box.request.length] = 4 if box.checksums else box.request.capacity + 1
        box.words[box.request.crc] = 12345
        box.words[box.request.seq] = ch._seq
        t0 = time.monotonic()
        while box.doorbell(box.reply) != ch._seq:
            await asyncio.sleep(0.01)
            assert time.monotonic() - t0 < 5
        r = pb.ProposeResponse.FromString(box.read(box.reply, ch._seq))
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_crc" in r.error.message
        # still usable
        ok = await c.propose([step("fine")])
        assert ok.sequences[0].ok and ok.sequences[0].drafts.numel() == 3
        assert c.steps_through_channel == 2
        # a request larger than the request area goes over gRPC
        c.close_step_channel()
        assert await c.open_step_channel(request_bytes=4096)
        big = await c.propose([step("big", m=40)])  # 40 x 64 x 4 bytes inline
        assert big.sequences[0].ok and c.steps_through_grpc == 1
        await c.release(["fine", "big"])


def hello(path: str, message: bytes) -> tuple[dict | None, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(message)
        data, fds, _, _ = socket.recv_fds(s, 4096, 1)
        return (json.loads(data) if data else None), fds


def test_refused_hellos_say_why(ch_server):
    path = ch_server.server.config.step_channel_path()
    cases = [({"version": 1, "namespace": "a", "request_bytes": 4096, "reply_bytes": 4096}, "FAILED_PRECONDITION",
              "speaks version 2"),
             ({"version": 2, "namespace": "a", "request_bytes": 2**40, "reply_bytes": 4096}, "INVALID_ARGUMENT",
              "hello.request_bytes"),
             ({"version": 2, "namespace": "a", "request_bytes": 4096, "reply_bytes": "x"}, "INVALID_ARGUMENT",
              "hello.reply_bytes"),
             ({"version": 2, "namespace": "n" * 3000, "request_bytes": 4096, "reply_bytes": 4096}, "INVALID_ARGUMENT",
              "namespace")]
    for body, code, fragment in cases:
        answer, fds = hello(path, json.dumps(body).encode() + b"\n")
        assert fds == [] and answer["ok"] is False and answer["code"] == code and fragment in answer["message"], answer
    answer, fds = hello(path, b"not json\n")
    assert answer["code"] == "INVALID_ARGUMENT" and fds == []
    with pytest.raises(StepChannelError) as e:
        StepChannel.open(path, "a", 2**40, 4096)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: open_channels(ch_server) == 0)  # (channels of earlier tests go within 0.1 s)


def test_a_client_cannot_resize_the_mailbox(ch_server):
    path = ch_server.server.config.step_channel_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(json.dumps({"version": 2, "namespace": "rs", "request_bytes": 4096,
                              "reply_bytes": 4096}).encode() + b"\n")
        data, (fd,), _, _ = socket.recv_fds(s, 4096, 1)
        assert json.loads(data)["ok"]
        size = os.fstat(fd).st_size
        assert size == Mailbox.segment_bytes(4096, 4096)
        for new_size in (0, size - 4096, size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, new_size)
        os.close(fd)
        wait_until(lambda: open_channels(ch_server) == 1)
    wait_until(lambda: open_channels(ch_server) == 0)  # the connection closed: the channel went


def test_a_killed_client_loses_its_channel(ch_server):
    code = textwrap.dedent(f"""
        import sys, time
        from drafter_client.step_channel import StepChannel
        ch = StepChannel.open({ch_server.server.config.step_channel_path()!r}, "killed", 4096, 4096)
        print("open", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        wait_until(lambda: open_channels(ch_server) == 1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: open_channels(ch_server) == 0, 2.0)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_channel_the_drafter_closes_sends_steps_back_to_grpc(ch_server):
    async with DrafterClient(ch_server.tcp, namespace="closed-ch") as c:
        assert not await c.open_step_channel(socket_path="/nonexistent/drafter.steps")  # unreachable: gRPC
        path = ch_server.server.config.step_channel_path()
        assert await c.open_step_channel(socket_path=path)
        assert (await c.propose([step("c")])).sequences[0].ok
        ch_server.call(lambda: ch_server.server.channels.close_all("test"))
        r = await c.propose([step("c", p=4, m=1)])  # not taken by the closed channel: resent over gRPC
        assert r.sequences[0].ok and r.sequences[0].committed_length == 5
        assert c.steps_through_channel == 1 and c.steps_through_grpc == 1 and not c.step_channel_open
        await c.release(["c"])


async def test_concurrent_steps_share_the_channel_and_grpc(ch_server):
    async with DrafterClient(ch_server.uds, namespace="conc-ch") as c:
        assert await c.open_step_channel()
        rs = await asyncio.gather(*(c.propose([step(f"q{i}")]) for i in range(6)))
        assert all(r.sequences[0].ok and r.sequences[0].drafts.numel() == 3 for r in rs)
        assert c.steps_through_channel >= 1 and c.steps_through_channel + c.steps_through_grpc == 6
        await c.release([f"q{i}" for i in range(6)])


def test_sync_client_steps_through_the_channel_on_the_calling_thread(ch_server, tiny_model):
    """With a channel open, SyncDrafterClient.propose() never hands the step to its event loop; drafts equal a
    gRPC-only client's (and the naive reference's) over many steps, with shared-memory slots recycled; the
    caller's timer slack is left as it was; a channel the drafter closes sends the next step over gRPC."""
    from drafter_client.sync import SyncDrafterClient
    from drafter_client.protocol.timer_slack import get_timer_slack

    naive = NaiveEagle1(*tiny_model)
    rng = random.Random(11)
    slack = get_timer_slack()
    with SyncDrafterClient(ch_server.uds, namespace="sync-ch") as fast, \
            SyncDrafterClient(ch_server.uds, namespace="sync-grpc") as slow:
        assert fast.open_step_channel(request_bytes=4096)
        assert fast.enable_shared_memory(max_step_tokens=128, dtype=torch.float32, slots=2) == "system"

        async def not_on_the_loop(*args, **kwargs):
            raise AssertionError("propose() went to the event loop although the channel was free")

        loop_propose, fast._client.propose = fast._client.propose, not_on_the_loop
        seqs = {c: [FakeSequence(f"s{i}", prompt, H, V, random.Random(i), None) for i, prompt in enumerate((30, 9))]
                for c in ("fast", "slow")}
        for n in range(12):  # 12 steps through a 2-slot ring: every slot reused
            ks = [rng.randint(1, 5) for _ in range(2)]
            a = fast.propose([s.next_step(k) for s, k in zip(seqs["fast"], ks)])
            b = slow.propose([s.next_step(k) for s, k in zip(seqs["slow"], ks)])
            for i in range(2):
                x, y = a.sequences[i], b.sequences[i]
                assert x.ok and y.ok and x.drafts.tolist() == y.drafts.tolist()
                s = seqs["fast"][i]
                assert x.drafts.tolist() == naive.drafts(s.tokens, s.hidden, x.drafts.numel())
                seqs["fast"][i].last_drafts = x.drafts.tolist()
                seqs["slow"][i].last_drafts = y.drafts.tolist()
        client = fast._client
        assert client.steps_through_channel == 12 and client.steps_by_reference == 12 and client.steps_inline == 0
        assert get_timer_slack() == slack
        fast._client.propose = loop_propose
        ch_server.call(lambda: ch_server.server.channels.close_all("test"))
        r = fast.propose([seqs["fast"][0].next_step(2)])  # not taken by the closed channel: over gRPC
        assert r.sequences[0].ok and client.steps_through_grpc == 1 and not client.step_channel_open
        fast.release(["s0", "s1"])
        slow.release(["s0", "s1"])


def test_parse_response_of_a_channel_reply_matches_grpc(ch_server):
    """Error replies raise the same DrafterError a failed unary Propose does."""
    resp = pb.ProposeResponse(error=pb.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="nope"))
    with pytest.raises(DrafterError) as e:
        parse_response(resp)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.message == "nope"


def test_a_channel_claim_is_exclusive_across_threads_and_freed_by_every_ending():
    """try_claim is a lock: one caller at a time whichever thread it is on; a call that fails gives the claim
    back and closes the channel, after which nobody can claim it."""
    import mmap as mmap_module
    import threading

    mm = mmap_module.mmap(-1, Mailbox.segment_bytes(4096, 4096))
    Mailbox.initialize(mm, 4096, 4096, checksums=False).release()
    ours, drafter_end = socket.socketpair()
    ch = StepChannel(ours, mm, spin_s=0.0, poll_s=0.001)
    got = []
    barrier = threading.Barrier(8)

    def contend():
        barrier.wait()
        got.append(ch.try_claim())

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got.count(True) == 1 and ch.busy
    ch.unclaim()
    assert not ch.busy and ch.try_claim()
    with pytest.raises(StepChannelError) as e:  # no reply ever comes: the deadline passes
        ch.call_blocking(b"request", timeout=0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not ch.busy and ch.closed and not ch.try_claim()
    with pytest.raises(RuntimeError):  # a call needs a claim
        ch.call_blocking(b"request", timeout=0.2)
    drafter_end.close()


async def test_a_large_step_is_written_straight_into_the_mailbox(ch_server, tiny_model):
    """Inline states of DIRECT_STATES_MIN_BYTES or more travel as a DirectRequest, which writes itself into the
    mailbox (the one copy of the states on the client's side): the drafter reads the same step (with and without
    crcs) and drafts what it drafts over gRPC, and what the naive reference drafts."""
    from drafter_client.messages import DIRECT_STATES_MIN_BYTES, DirectRequest, serialize_request

    rows = 400  # 400 x 64 fp32 = 100 KiB
    g = torch.Generator().manual_seed(11)
    big = SequenceStep("big", 0, torch.randint(0, V, (rows,), generator=g), torch.randn(rows, H, generator=g), 7, 4)
    assert rows * H * 4 >= DIRECT_STATES_MIN_BYTES and isinstance(serialize_request("x", [big]), DirectRequest)
    async with DrafterClient(ch_server.uds, namespace="big-ch", chunk_min_bytes=None) as fast, \
            DrafterClient(ch_server.uds, namespace="big-grpc", chunk_min_bytes=None) as slow:
        assert await fast.open_step_channel()
        a, b = await fast.propose([big]), await slow.propose([big])
        assert fast.steps_through_channel == 1 and slow.steps_through_channel == 0
        assert a.sequences[0].ok and a.sequences[0].drafts.tolist() == b.sequences[0].drafts.tolist()
        assert a.sequences[0].drafts.tolist() == NaiveEagle1(*tiny_model).drafts(
            big.token_ids.tolist() + [7], big.hidden_states, 4)
        await fast.release(["big"])
        await slow.release(["big"])


def test_a_channel_closed_with_a_request_read_in_place_keeps_its_mapping_until_the_view_dies():
    """A large request is read as a view of the mailbox (no copy). Closing the channel while a request still holds
    such a view (queued, not yet stepped) must not unmap it under the view: the mapping goes when the view does, and
    the pinning is undone (unpin) before."""
    import fcntl
    import mmap
    import os
    import socket

    from drafter_client.protocol.mailbox import Mailbox
    from drafter_service.transport.step_channels import Channel, ChannelLimits, ChannelSet

    unpinned = []
    channels = ChannelSet(socket_path="/nonexistent", limits=ChannelLimits(1, 1 << 22, 1 << 23),
                          decode=None, encode=None, metrics=None, checksums=False,
                          pin=lambda mm: (lambda: unpinned.append(len(mm))))
    size = Mailbox.segment_bytes(1 << 21, 1 << 12)
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    box = Mailbox.initialize(mm, 1 << 21, 1 << 12, False)
    ours, theirs = socket.socketpair()
    ch = Channel(id=1, namespace="ns", conn=ours, fd=fd, mm=mm, box=box)
    channels._count, channels._bytes = 1, size
    channels._pin(ch)
    assert ch.in_place and ch.unpin is not None
    payload = bytes(range(256)) * 4096  # 1 MiB, as a client writes it (one mapping here for both sides)
    box.write(box.request, 1, payload)
    view = box.view(box.request, 1)
    assert view is not None and bytes(view[:256]) == payload[:256] and len(view) == len(payload)
    channels._close(ch, "test", client_gone=False)  # (the view still holds the mapping: no BufferError escapes)
    assert unpinned == [size] and ch.closed
    assert bytes(view[-256:]) == payload[-256:]  # still mapped
    view.release()
    theirs.close()


@pytest.mark.parametrize("rehearsal_ms, most", [(0.01, None), (1.0, 0.2)])
def test_rehearsals_take_at_most_a_fifth_of_the_wait(monkeypatch, rehearsal_ms, most):
    """While a call waits, the last reply's parse is re-run every REHEARSE_EVERY_S, and at most REHEARSE_DUTY of the
    time: a rehearsal of 10 us runs every 0.2 ms, one of 1 ms at most a fifth of the wait (a clock of our own: polls
    cost 10 us, a rehearsal what it says)."""
    import threading

    from drafter_client import step_channel
    clock = [0.0]
    monkeypatch.setattr(step_channel.time, "monotonic", lambda: clock[0])
    ch = StepChannel.__new__(StepChannel)
    ch.closed, ch.spin_s, ch.poll_s, ch._claim = False, 1.0, 0.0, threading.Lock()
    ch._send = lambda payload: 1
    ch._check_waiting = lambda *args: None

    def reply(seq):
        clock[0] += 10e-6
        return b"answer" if clock[0] >= 0.1 else None
    ch._reply = reply
    rehearsals = []

    def rehearse():
        rehearsals.append(clock[0])
        clock[0] += rehearsal_ms * 1e-3
    ch.rehearse = rehearse
    assert ch.try_claim()
    waiting = ch._wait(b"request", None)
    with pytest.raises(StopIteration) as done:
        while True:
            next(waiting)
    assert done.value.value == b"answer" and not ch.busy
    busy = len(rehearsals) * rehearsal_ms * 1e-3 / clock[0]
    if most is None:  # (cheap: one every REHEARSE_EVERY_S and the polls between)
        gaps = [b - a for a, b in zip(rehearsals, rehearsals[1:])]
        assert len(rehearsals) > 300 and all(step_channel.REHEARSE_EVERY_S <= g < 0.00025 for g in gaps)
    else:
        assert 0.1 < busy <= most + 0.01, busy


def test_a_request_carries_its_send_time_which_the_drafter_checks():
    """request_sent_ns (the mailbox header): stamped when the client rings the doorbell; the drafter believes it only
    as a CLOCK_MONOTONIC time of this host within its limit (a client of another time namespace, an older client that
    writes none, or one that lies places its request at the time the drafter saw it)."""
    import mmap as mmap_module
    import time as time_module

    from drafter_client.protocol import mailbox as mb

    mm = mmap_module.mmap(-1, Mailbox.segment_bytes(4096, 4096))
    box = Mailbox.initialize(mm, 4096, 4096, checksums=False)
    assert box.request_age_s(1.0) is None  # nothing written yet
    before = time_module.monotonic_ns()
    box.write(box.request, 1, b"request")
    assert before <= box.words[mb._REQUEST_SENT_NS] <= time_module.monotonic_ns()
    assert 0.0 <= box.request_age_s(1.0) < 0.5
    box.write(box.reply, 1, b"reply")  # (a reply carries no send time)
    for lie in (time_module.monotonic_ns() + 10**10, time_module.monotonic_ns() - 5 * 10**9):
        box.words[mb._REQUEST_SENT_NS] = lie  # 10 s ahead, 5 s old
        assert box.request_age_s(1.0) is None
    box.release()
    mm.close()
