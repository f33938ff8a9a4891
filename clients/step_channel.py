"""The client's end of a shared-memory step channel (docs/step_channel.md; the drafter's end is
drafter_service/transport/step_channels.py, the mailbox layout clients/protocol/mailbox.py).

A channel carries the same ProposeRequest / ProposeResponse bytes a unary Propose would, through a mailbox the
drafter polls: no gRPC message, no thread of gRPC's or of the drafter's to wake. The waiting side spins: the
drafter's step thread for --step-channel-spin-s after each request, this client while it waits for a reply
(spin_s, then it polls every poll_s). One request at a time per channel: a caller claims the channel
(try_claim) and the call releases it when it ends; the claim is a lock, so that an event loop and another thread
(SyncDrafterClient's blocking path) can share a channel.
"""
import asyncio
import json
import mmap
import os
import socket
import threading
import time
from typing import Callable

import grpc

from drafter_client.protocol import step_frame
from drafter_client.protocol.mailbox import CLOSED, VERSION, Mailbox
from drafter_client.protocol.gil_yield import GilYield
from drafter_client.protocol.timer_slack import get_timer_slack, set_timer_slack

LIVENESS_PERIOD_S = 0.05  # while waiting: how often to check that the drafter still holds the channel's socket
# while waiting: how often to re-run the last reply's parse (StepChannel.rehearse): every REHEARSE_EVERY_S, and at
# most a fifth of the time (a rehearsal of a large reply lasts longer: a reply that comes during one waits for it)
REHEARSE_EVERY_S = 0.0002
REHEARSE_DUTY = 0.2


class StepChannelClosed(Exception):
    """The drafter closed the channel without taking the request: nothing was done, send it another way."""


class StepChannelError(Exception):
    """Opening refused, or the drafter went away mid-request; ``code`` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class StepChannel:
    """The client's end of a same-node step channel: a shared-memory mailbox the drafter's step thread polls,
    plus the Unix-socket connection whose lifetime is the channel's (docs/step_channel.md)."""
    def __init__(self, conn: socket.socket, mm: mmap.mmap, spin_s: float, poll_s: float, frames: bool = False):
        self.conn = conn
        self.mm = mm
        self.frames = frames  # the drafter takes request frames (step_frame.py) on this channel
        self.box = Mailbox(mm)
        self.spin_s = spin_s
        self.poll_s = poll_s
        self.closed = False
        self._claim = threading.Lock()  # held from try_claim() until the call's end
        self._seq = self.box.doorbell(self.box.request)
        # The last reply's parse, on a copy of it (set by the caller, DrafterClient._send_frame): re-run while a call
        # waits, every REHEARSE_EVERY_S, so that the reply finds that code and its data in the CPU's caches (run cold,
        # after the wait, the same Python work took 1.5-10x as long: docs/performance.md, ninth session). None: none.
        self.rehearse: "Callable[[], object] | None" = None

    @property
    def request_capacity(self) -> int:
        """The largest serialized request (bytes) the mailbox carries."""
        return self.box.request.capacity

    @property
    def busy(self) -> bool:
        """True while a call holds the channel."""
        return self._claim.locked()

    def try_claim(self) -> bool:
        """Take the channel for one call (call() or call_blocking() releases it); False when it is closed or in
        use. A claim not followed by a call is given back with unclaim()."""
        if self.closed or not self._claim.acquire(blocking=False):
            return False
        if self.closed:  # closed meanwhile
            self._claim.release()
            return False
        return True

    def unclaim(self) -> None:
        """Give back a claim that was not followed by a call."""
        self._claim.release()

    @classmethod
    def open(cls, socket_path: str, namespace: str, request_bytes: int, reply_bytes: int, spin_s: float = 0.05,
             poll_s: float = 0.0001, timeout_s: float = 5.0, token: str | None = None,
             frames: bool = True) -> "StepChannel":
        """Connect, say hello (with the bearer token when the drafter wants one; frames: asking for request frames,
        which a drafter that knows them grants), map the mailbox the drafter sends back (blocking; a few hundred
        microseconds).
        Raises OSError when the socket cannot be reached (another node, a container without the socket's volume),
        StepChannelError when the drafter refuses."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(timeout_s)
            conn.connect(socket_path)
            hello = {"version": VERSION, "namespace": namespace, "request_bytes": request_bytes,
                     "reply_bytes": reply_bytes}
            if token:
                hello["token"] = token
            if frames:
                hello["frames"] = step_frame.VERSION
            conn.sendall(json.dumps(hello).encode() + b"\n")
            data, fds, _, _ = socket.recv_fds(conn, 4096, 1)
            try:
                answer = json.loads(data)
                if not answer.get("ok"):
                    raise StepChannelError(getattr(grpc.StatusCode, answer.get("code", "UNKNOWN"),
                                                   grpc.StatusCode.UNKNOWN), answer.get("message", ""))
                if len(fds) != 1:
                    raise StepChannelError(grpc.StatusCode.INTERNAL, "the drafter's answer carried no mailbox")
                size = os.fstat(fds[0]).st_size
                mm = mmap.mmap(fds[0], size)
            finally:
                for fd in fds:
                    os.close(fd)  # the mapping keeps the memory
            conn.settimeout(None)
            return cls(conn, mm, spin_s, poll_s, frames=frames and answer.get("frames") == step_frame.VERSION)
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        """Tell the drafter (it closes its end within 0.1 s) and unmap."""
        if self.closed:
            return
        self.closed = True
        self.conn.close()
        self.box.release()
        try:
            self.mm.close()
        except BufferError:
            pass

    # ---- one request ----

    def _send(self, payload) -> int:  # bytes, or a DirectRequest (written into the mailbox: Mailbox.write)
        if self.box.state == CLOSED:
            raise StepChannelClosed("the drafter closed this channel")
        self._seq += 1
        self.box.write(self.box.request, self._seq, payload)
        return self._seq

    def _reply(self, seq: int) -> bytes | None:
        """The reply to seq, or None while it is not there; raises when it never will be."""
        box = self.box
        if box.doorbell(box.reply) == seq:
            reply = box.read(box.reply, seq)
            if reply is not None:
                return reply
        if box.state == CLOSED and box.doorbell(box.reply) != seq:
            if box.taken_seq != seq:
                raise StepChannelClosed("the drafter closed this channel before taking the request")
            raise StepChannelError(grpc.StatusCode.UNAVAILABLE,
                                   "the drafter closed the step channel while working on the request")
        return None

    def _drafter_gone(self) -> bool:
        try:
            return self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _check_waiting(self, started: float, deadline: float, now: float) -> None:
        if now > deadline:  # the reply may still come: this channel cannot be reused safely (closed below)
            raise StepChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply through the step channel in time")
        if now - started > LIVENESS_PERIOD_S and self._drafter_gone():
            raise StepChannelError(grpc.StatusCode.UNAVAILABLE, "the drafter went away (step channel closed)")

    def _wait(self, payload, timeout: float | None):
        """Send payload, then poll for the reply: a generator that yields how long to sleep before the next poll
        and returns the reply (call() and call_blocking() drive it with their own sleep). The caller holds the
        claim; it is released when this ends, however it ends."""
        if not self.busy:
            raise RuntimeError("claim the step channel first (try_claim)")
        try:
            seq = self._send(payload)
            deadline = time.monotonic() + timeout if timeout is not None else float("inf")
            started = last_check = rehearsed = time.monotonic()
            pause = REHEARSE_EVERY_S  # (between two rehearsals)
            while (reply := self._reply(seq)) is None:
                now = time.monotonic()
                if now - last_check > LIVENESS_PERIOD_S:
                    last_check = now
                    self._check_waiting(started, deadline, now)
                if self.rehearse is not None and now - rehearsed > pause:
                    self._rehearse()
                    rehearsed = time.monotonic()
                    pause = step_frame.rehearsal_pause(rehearsed - now, REHEARSE_EVERY_S, REHEARSE_DUTY)
                yield 0 if now - started < self.spin_s else self.poll_s  # spin, then poll
        except BaseException:  # the channel's state is unknown (or closed): nobody uses it again
            self.close()
            raise
        finally:
            self._claim.release()
        return reply

    def _rehearse(self) -> None:
        try:
            self.rehearse()
        except Exception:  # (it never should: it parsed that reply once already) not tried again
            self.rehearse = None

    async def call(self, payload, timeout: float | None = None) -> bytes:
        """Send one serialized ProposeRequest (bytes, or a DirectRequest that writes itself into the mailbox), return
        the serialized ProposeResponse. Cancelled mid-wait, the
        channel closes (its reply would come later)."""
        waiting = self._wait(payload, timeout)
        try:
            while True:
                await asyncio.sleep(next(waiting))  # 0: yield to the loop's other tasks, then poll again
        except StopIteration as done:
            return done.value
        finally:
            waiting.close()  # (a no-op once finished; on cancellation it closes the channel)

    def call_blocking(self, payload, timeout: float | None = None) -> bytes:
        """call() on the calling thread, without an event loop. Its spin sleeps with time.sleep(0), and every few
        polls a 20 us sleep in which the process's other threads can take the GIL (protocol/gil_yield.py); for the
        call, the thread's timer slack is 1 ns (Linux; restored after), or each of those sleeps would last the
        default 50 us slack and more."""
        waiting = self._wait(payload, timeout)
        slack = get_timer_slack()
        if slack is not None:
            set_timer_slack(1)
        try:
            yield_gil = GilYield()  # (the engine's other threads get the GIL while this one spins: gil_yield.py)
            while True:
                pause = next(waiting)
                if pause:
                    time.sleep(pause)
                else:
                    yield_gil()
        except StopIteration as done:
            return done.value
        finally:
            waiting.close()
            if slack is not None:
                set_timer_slack(slack)
