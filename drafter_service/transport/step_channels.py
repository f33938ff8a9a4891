"""Shared-memory step channels (docs/step_channel.md): engine steps on one node without a gRPC message each.

Opening: a client connects to the drafter's channel socket (GetInfo.step_channel_socket) and sends a hello, one
JSON line {"version": 2, "namespace": ..., "request_bytes": ..., "reply_bytes": ...}. The drafter creates a
mailbox (mailbox.py) in a memfd sealed against resizing, and answers with one JSON line ({"ok": true, capacities}
or {"ok": false, "code": "INVALID_ARGUMENT", "message": ...}) carrying the memfd (SCM_RIGHTS). The connection
stays open for the channel's lifetime: when the client closes it, or dies, the drafter closes the channel and
unmaps the mailbox. Nothing is left in /dev/shm. The sequences first created through the channel belong to it:
when its client goes away they are freed too (release_owner); a channel the drafter closes (shutdown) keeps them,
its client goes on over gRPC.

Serving: the step thread (scheduler.py) polls every open mailbox. A new request is copied out of the mailbox (one
of MIN_SCAN_BYTES or more is read in place instead: a view of the mailbox, whose inline states go to the device
from there; on CUDA the mapping is registered as pinned memory when the channel opens, so that this is one DMA),
parsed and checked exactly as a Propose is (DrafterServicer.decode_propose: the same limits, the same shared-
memory references), and queued with the gRPC requests; its reply is written back on the step thread. On a channel
whose hello asked for frames, a request frame (drafter_client.protocol.step_frame) is read as arrays instead,
checked by validation.parse_frame, and answered with a reply frame (_handle_frame). A request
malformed as a whole gets a ProposeResponse with ``error`` set (the code a Propose would have failed with), and
one whose namespace is not the channel's gets PERMISSION_DENIED.

Reading ahead: a client rings a frame's head bell (Mailbox.head_bell) once the frame's bytes before its states are
written, then copies the states. The step thread, polling, checks the head right then (_read_ahead), while the states
are still being copied (at 128 sequences of 4096-wide states both take some 0.25-0.3 ms), and at the doorbell queues
what it read instead of reading the frame again, as long as request_len is unchanged. On a mailbox with CHECKSUMS, a
mapping read by copy (not in place), or an ingest-only drafter it waits for the doorbell, as before.

Threads: an acceptor thread handles hellos; everything else about an open channel happens on the step thread.
"""
import fcntl
import json
import logging
import mmap
import os
import pathlib
import socket
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from drafter_client.protocol.mailbox import VERSION, Mailbox
from drafter_client.protocol import pb, step_frame
from drafter_service.transport.received_request import MIN_SCAN_BYTES, read_request
from drafter_service.engine.batch_io import BatchInput, BatchOutput
from drafter_service.engine.scheduler import PendingRequest, set_owner
from drafter_service.transport.servicer import ReplyHead, frame_reply, frame_reply_head
from drafter_service.engine.step_io import StepInput, StepOutput
from drafter_service import tracing
from drafter_service.transport.auth import ANY, AuthError, restrict_socket
from drafter_service.transport.validation import RequestError, check_namespace

log = logging.getLogger(__name__)

HELLO_MAX_BYTES = 4096
HELLO_TIMEOUT_S = 2.0
MIN_AREA_BYTES = 4096
LIVENESS_PERIOD_S = 0.1  # how often the step thread checks that each channel's client is still connected
STUCK_REQUEST_S = 1.0  # a doorbell whose bytes never check out is answered with an error after this
MAX_REQUEST_AGE_S = 1.0  # a request's send time (mailbox request_sent_ns) older than this is not believed: seen time
REHEARSE_EVERY_S = 0.0005  # the step thread re-reads the last request frame at most this often (ChannelSet.rehearse)
REHEARSE_DUTY = 0.2  # and for at most this share of its spin: after a rehearsal of d seconds, none for 4d


@dataclass
class Channel:
    id: int
    namespace: str
    conn: socket.socket  # the client's connection: its end is the channel's end
    fd: int
    mm: mmap.mmap
    box: Mailbox
    taken: int = 0  # the last request_seq read
    unreadable_since: float | None = None  # a doorbell rang but its bytes do not check out (yet)
    checked_at: float = 0.0
    closed: bool = False
    requests: int = 0
    read_ahead: int = 0  # of them, request frames queued as read at their head bell
    # large requests are read in place (a view of the mailbox, no copy): on the CPU always, on CUDA when the mapping
    # could be registered as pinned memory (ChannelSet.pin), so that their states go to the device in one DMA
    in_place: bool = False
    unpin: Callable[[], None] | None = None  # undoes ChannelSet.pin (before the mapping is closed)
    frames: bool = False  # the client asked for request frames (step_frame.py) in its hello, and got them
    ahead: "_ReadAhead | None" = None  # the next request frame, checked at its head bell (before its doorbell)
    bell_looked_at: int = 0  # the last head bell _read_ahead answered, whatever it found: each bell is looked at once

    @property
    def owner(self) -> str:
        """The owner of the sequences this channel creates (StepInput.owner)."""
        return f"step channel {self.id}"


@dataclass
class _ParsedFrame:
    """A request frame read and checked (_parse_frame): its steps, or the error to answer it with."""
    request_id: int
    frame: "step_frame.RequestFrame | None"
    steps: "BatchInput | list[StepInput] | None"
    dry: bool
    error: RequestError | None
    t_enter: float  # time.perf_counter() when the read began / ended
    t_parsed: float


@dataclass
class _ReadAhead:
    seq: int  # the request_seq the head bell announced
    length: int  # request_len when the head was read: what is read ahead is used only while it is the same
    parsed: _ParsedFrame


@dataclass
class ChannelLimits:
    max_channels: int  # open at once, all namespaces
    max_area_bytes: int  # request or reply area, each (the gRPC message limit)
    max_total_bytes: int  # mailbox bytes of all open channels


@dataclass
class ChannelSet:
    socket_path: str
    limits: ChannelLimits
    decode: Callable[..., tuple[list[StepInput], bool]]  # (request, hidden, states): DrafterServicer.decode_propose
    # (outputs, request) -> reply message: servicer.build_response
    encode: Callable[[list[StepOutput], "pb.ProposeRequest"], "pb.ProposeResponse"]
    metrics: object  # metrics.Metrics
    checksums: bool  # mailboxes with CHECKSUMS (mailbox.py; the server: --step-channel-checksums)
    wake: Callable[[], None] = lambda: None  # set by the scheduler: wakes the step thread
    # (request frame) -> (BatchInput or, for a small step, list[StepInput]; dry): DrafterServicer.decode_frame; None:
    # no frames (hellos asking get none)
    decode_frame: "Callable[[step_frame.RequestFrame], tuple[BatchInput | list[StepInput], bool]] | None" = None
    # set by the scheduler: frees the sequences an owner (Channel.owner) created (step thread)
    release_owner: Callable[[str], int] = lambda owner: 0
    authorizer: object = None  # auth.Authorizer: with tokens, a hello must carry one that allows its namespace
    socket_group: str | None = None  # the channel socket's group (mode 0660)
    # Diagnostics (scripts/rpc_timeline.py): a text file that gets one JSON line per channel request with the
    # time.perf_counter() of each phase (seen, enter, parsed, worker_start, worker_end, resumed, replied).
    trace_file: object = None
    # on a channel whose mailbox could not be pinned (pin below), a request of at least MIN_SCAN_BYTES is copied out
    # of the mailbox into a buffer from this allocator (n -> writable memoryview of n bytes): on CUDA pinned host
    # memory (runtime), so that its inline states, read as a view (received_request.py), go to the device in one DMA
    # (host_staging.py) instead of a copy into pinned memory first; None: new bytes
    read_buffer: "Callable[[int], memoryview] | None" = None
    # on CUDA (runtime): registers a new channel's mapping as pinned host memory (mm -> the function that undoes it;
    # raises when it cannot), so that large requests are read in place and their states DMA'd from the mailbox; a
    # channel it fails for copies them into read_buffer. None (the CPU): large requests are read in place
    pin: "Callable[[mmap.mmap], Callable[[], None]] | None" = None
    # whether frames may be read ahead (module docstring) now: the server says no while it is ingest-only (that
    # mode copies the states to the device as it parses)
    may_read_ahead: Callable[[], bool] = lambda: True
    in_place_reads: int = 0  # requests read as a view of their mailbox (diagnostics, tests)
    frames_read_ahead: int = 0  # request frames queued as checked at their head bell (diagnostics, tests)
    early_replies: int = 0  # replies whose all but the drafts was encoded while the step ran (diagnostics, tests)
    frames_taken: int = 0  # request frames checked and queued (diagnostics, tests)
    # whether each request frame's bytes before its states are kept for rehearse() (set by the scheduler when its
    # step thread rehearses: --step-channel-rehearse-after-s)
    rehearse_frames: bool = False
    rehearsals: int = 0  # rehearse() runs (diagnostics, tests)
    _rehearsal: bytes | None = None  # the last request frame cut before its states (step thread only)
    _next_rehearsal: float = 0.0  # (time.perf_counter())
    _open: list[Channel] = field(default_factory=list)  # step thread only
    _new: deque = field(default_factory=deque)  # acceptor -> step thread
    _listener: socket.socket | None = None
    _acceptor: threading.Thread | None = None
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)  # open count / bytes, read by the acceptor
    _count: int = 0
    _bytes: int = 0

    # ---- acceptor (its own thread) ----

    def start(self) -> None:
        path = pathlib.Path(self.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise ValueError(f"--step-channel-socket {path} exists and is not a socket")
            path.unlink()  # a stale socket from a previous run
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        restrict_socket(str(path), self.socket_group)  # before listen(): nobody connects with a wider mode
        self._listener.listen(16)
        self._acceptor = threading.Thread(target=self._accept_loop, name="drafter-channels", daemon=True)
        self._acceptor.start()
        log.info("step channels on %s", path)

    def stop(self) -> None:
        """Stop accepting (the step thread closes the open channels when it ends)."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
            pathlib.Path(self.socket_path).unlink(missing_ok=True)
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)

    def _accept_loop(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: stop
                return
            try:
                self._open_channel(conn)
            except Exception:
                log.exception("opening a step channel")
                conn.close()

    def _open_channel(self, conn: socket.socket) -> None:
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = self._read_hello(conn)
            namespace, req_bytes, rep_bytes = self._check_hello(hello)
        except RequestError as e:
            self.metrics.record_rpc_error(e.code.name)
            _send_line(conn, {"ok": False, "code": e.code.name, "message": e.message})
            conn.close()
            return
        except (OSError, ValueError) as e:  # timeout, reset, not JSON
            log.info("step-channel hello refused: %s", e)
            conn.close()
            return
        size = Mailbox.segment_bytes(req_bytes, rep_bytes)
        with self._lock:
            if self._count >= self.limits.max_channels or self._bytes + size > self.limits.max_total_bytes:
                _send_line(conn, {"ok": False, "code": "RESOURCE_EXHAUSTED", "message":
                                  f"{self._count} step channels of {self._bytes} bytes are open; at most "
                                  f"{self.limits.max_channels} channels and {self.limits.max_total_bytes} bytes: "
                                  "use gRPC, or close channels"})
                conn.close()
                return
            self._count += 1
            self._bytes += size
        try:
            fd = os.memfd_create("drafter-step-channel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size)
            box = Mailbox.initialize(mm, req_bytes, rep_bytes, self.checksums)
            frames = self.decode_frame is not None and hello.get("frames") == step_frame.VERSION
            ch = Channel(id=self._next_id, namespace=namespace, conn=conn, fd=fd, mm=mm, box=box, frames=frames)
            self._next_id += 1
            answer = {"ok": True, "channel": ch.id, "request_capacity": req_bytes, "reply_capacity": rep_bytes}
            if frames:  # (a client that did not ask, or asked for another version, gets protobuf only)
                answer["frames"] = step_frame.VERSION
            socket.send_fds(conn, [_line(answer)], [fd])
            conn.settimeout(None)
        except BaseException:
            with self._lock:
                self._count -= 1
                self._bytes -= size
            raise
        self._pin(ch)  # (here, not on the step thread: registering a large mailbox takes a while)
        log.info("namespace %r opened step channel %d (%d + %d bytes)", namespace, ch.id, req_bytes, rep_bytes)
        self._new.append(ch)
        self.wake()

    @staticmethod
    def _read_hello(conn: socket.socket) -> dict:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(HELLO_MAX_BYTES - len(data))
            if not chunk:
                raise ValueError("connection closed before the hello ended")
            data += chunk
            if len(data) >= HELLO_MAX_BYTES and not data.endswith(b"\n"):
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"hello: longer than {HELLO_MAX_BYTES} bytes")
        try:
            hello = json.loads(data)
        except ValueError:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "hello: not one JSON object") from None
        if not isinstance(hello, dict):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "hello: not one JSON object")
        return hello

    def _check_hello(self, hello: dict) -> tuple[str, int, int]:
        if hello.get("version") != VERSION:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"hello.version {hello.get('version')!r}: this drafter speaks version {VERSION} "
                               "(client and drafter releases must match)")
        namespace = hello.get("namespace", "")
        if not isinstance(namespace, str):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "hello.namespace: not a string")
        check_namespace(namespace)
        if self.authorizer is not None and self.authorizer.tokens is not None:
            token = hello.get("token")
            try:
                allowed = self.authorizer.namespaces_for_token(token if isinstance(token, str) else None)
                self.authorizer.check(None if ANY in allowed else allowed, namespace)
            except AuthError as e:
                raise RequestError(e.code, f"hello.token: {e.message}") from None
        sizes = []
        for key in ("request_bytes", "reply_bytes"):
            v = hello.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not MIN_AREA_BYTES <= v <= self.limits.max_area_bytes:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"hello.{key} {v!r}: an integer from {MIN_AREA_BYTES} to "
                                   f"{self.limits.max_area_bytes} (the drafter's --max-message-bytes)")
            sizes.append(v)
        return namespace, sizes[0], sizes[1]

    # ---- the step thread ----

    def open_count(self) -> int:
        return len(self._open) + len(self._new)

    def poll(self, enqueue: Callable[[PendingRequest], None], read_ahead: bool = True) -> bool:
        """Take every channel's new request (queued with enqueue, or answered at once when malformed); True when
        there was any. read_ahead: whether a frame whose head bell rang may be read ahead (module docstring) when
        no request was found; False when a batch is about to run (the scheduler's queue holds requests): reading a
        frame that cannot join it would only delay it."""
        while self._new:
            self._open.append(self._new.popleft())
        if not self._open:
            return False
        found = False
        now = None
        bells = []  # channels whose next frame's head bell rang
        for ch in self._open:
            box = ch.box
            seq = box.doorbell(box.request)
            if seq == ch.taken:
                if box.head_bell() == seq + 1 and ch.bell_looked_at != seq + 1:
                    bells.append(ch)
                continue
            t_seen = time.perf_counter()
            # when the client rang the doorbell (the mailbox's request_sent_ns), in this clock: a request that
            # landed while the step thread ran a batch is seen only after it, but it arrived before
            age = box.request_age_s(MAX_REQUEST_AGE_S)
            arrived = t_seen if age is None else t_seen - age
            ahead, ch.ahead = ch.ahead, None
            length = box.words[box.request.length]
            if ahead is not None and ahead.seq == seq and length == ahead.length:
                self._take(ch, seq)
                found = True
                self.frames_read_ahead += 1
                ch.read_ahead += 1
                self.in_place_reads += 1  # (a view of the mailbox: _read_ahead)
                self._queue_frame(ch, seq, ahead.parsed, enqueue, t_seen, arrived)
                continue
            large = length >= MIN_SCAN_BYTES
            # (a view of the mailbox: the client writes again only after the reply; a frame's states then go to
            # the device from it, whatever its size)
            if ch.in_place and (large or ch.frames):
                payload = box.view(box.request, seq)
                self.in_place_reads += payload is not None
            else:
                payload = box.read(box.request, seq, self.read_buffer if large else None)
            if payload is None:
                now = now or time.monotonic()
                if ch.unreadable_since is None:
                    ch.unreadable_since = now
                elif now - ch.unreadable_since > STUCK_REQUEST_S:
                    self._take(ch, seq)
                    self._reply_error(ch, seq, 0, RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT, "request: its bytes do not match request_crc (or "
                        "request_len exceeds the request area) a second after the doorbell rang"))
                continue
            self._take(ch, seq)
            found = True
            self._handle(ch, seq, payload, enqueue, t_seen, arrived)
        if bells and read_ahead and not found:  # (the head of a next frame is in; its states are coming)
            for ch in bells:
                self._read_ahead(ch, ch.taken + 1)
        now = now or time.monotonic()
        for ch in self._open:
            if now - ch.checked_at > LIVENESS_PERIOD_S:
                ch.checked_at = now
                if not _still_connected(ch.conn):
                    self._close(ch, "the client closed the channel", client_gone=True)
        if any(ch.closed for ch in self._open):
            self._open = [ch for ch in self._open if not ch.closed]
        return found

    def _pin(self, ch: Channel) -> None:
        """A new channel (acceptor thread): whether its large requests are read in place (module docstring)."""
        if self.pin is None:
            ch.in_place = True
            return
        try:
            ch.unpin = self.pin(ch.mm)
            ch.in_place = True
        except Exception as e:  # (large requests are then copied into pinned memory, as before)
            log.warning("step channel %d: its mailbox could not be pinned (%s): large requests are copied out of it",
                        ch.id, e)

    def _take(self, ch: Channel, seq: int) -> None:
        ch.taken = seq
        ch.unreadable_since = None
        ch.requests += 1
        ch.box.take(seq)

    def _handle(self, ch: Channel, seq: int, payload: bytes, enqueue, t_seen: float, arrived: float) -> None:
        """Decode a channel's request and queue it (arrived: when its client sent it, time.perf_counter's clock: the
        queue wait and the merge window count from there), or answer its error."""
        if ch.frames and step_frame.starts_with(payload, step_frame.REQUEST_MAGIC):
            self._handle_frame(ch, seq, payload, enqueue, t_seen, arrived)
            return
        t_enter = time.perf_counter()
        request_id = 0
        try:
            try:
                received = read_request(payload)  # (large inline states stay a view of the payload)
            except DecodeError:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "request: not a serialized drafter.v1.ProposeRequest") from None
            request = received.request
            request_id = request.request_id
            if request.namespace != ch.namespace:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"namespace {request.namespace!r}: this channel was opened by namespace "
                                   f"{ch.namespace!r}")
            steps, dry = self.decode(request, None, received.states)
        except RequestError as e:
            self._reply_error(ch, seq, request_id, e)
            return
        set_owner(steps, ch.owner)  # a sequence this request creates belongs to the channel
        t_parsed = time.perf_counter()
        trace = {} if self.trace_file is not None else None
        # the reply but its drafts, serialized while the GPU drafted (a request whose steps run from columns)
        head = ReplyHead(request_id, None if request.HasField("columns") or not isinstance(steps, BatchInput)
                         else steps.sequence_ids)

        def deliver(outputs, exc):
            t_stepped = time.perf_counter()
            if exc is not None:
                self._reply_error(ch, seq, request_id, RequestError(grpc.StatusCode.INTERNAL, f"step failed: {exc}"))
                return
            reply = head.reply(outputs)
            if reply is not None:
                self.early_replies += 1
            else:
                reply = self.encode(outputs, request).SerializeToString()
            return self._answer(ch, seq, request_id, reply, request, trace, t_seen, t_enter, t_parsed, t_stepped)

        # (a channel closed before its request ran: nobody reads the reply, and its sequences are freed already)
        enqueue(PendingRequest(steps, deliver, trace=trace, dry=dry, cancelled=lambda: ch.closed,
                               enqueued_at=arrived,
                               early=head if isinstance(steps, BatchInput) and not dry else None))

    def _handle_frame(self, ch: Channel, seq: int, payload, enqueue, t_seen: float, arrived: float) -> None:
        """_handle for a request frame (step_frame.py): checked as a columnar request, answered with a reply frame
        (a request-level error: the ProposeResponse with ``error`` set that _handle answers)."""
        self._queue_frame(ch, seq, self._parse_frame(ch, payload), enqueue, t_seen, arrived)

    def _read_ahead(self, ch: Channel, seq: int) -> None:
        """Check the request frame whose head bell rang (seq: the coming request_seq) while its states are still
        being written (module docstring); its doorbell then queues what was read (poll)."""
        box = ch.box
        ch.bell_looked_at = seq  # (whatever comes of it: a bell whose bytes are no frame is not viewed at every poll)
        if not (ch.frames and ch.in_place and not box.checksums and self.may_read_ahead()):
            return
        payload = box.view(box.request, seq)  # (request_len bytes, the states' section still being written)
        if payload is None:
            return
        if not step_frame.starts_with(payload, step_frame.REQUEST_MAGIC):  # (only frames ring the head bell)
            payload.release()
            return
        # (read_request copies all but the states; the states stay a view, read by the step after the doorbell)
        ch.ahead = _ReadAhead(seq, len(payload), self._parse_frame(ch, payload))

    def _parse_frame(self, ch: Channel, payload) -> _ParsedFrame:
        """Read and check a request frame: its steps (their sequences to be created belong to the channel), or the
        RequestError to answer it with."""
        t_enter = time.perf_counter()
        request_id = 0
        try:
            try:
                frame = step_frame.read_request(payload)  # (all but the states copied out of the mailbox)
            except step_frame.FrameError as e:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            request_id = frame.request_id
            if frame.namespace != ch.namespace:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"namespace {frame.namespace!r}: this channel was opened by namespace "
                                   f"{ch.namespace!r}")
            steps, dry = self.decode_frame(frame)
        except RequestError as e:
            return _ParsedFrame(request_id, None, None, False, e, t_enter, time.perf_counter())
        set_owner(steps, ch.owner)
        t_parsed = time.perf_counter()
        if self.rehearse_frames and not dry:  # (a copy of its head, a few hundred bytes a sequence: rehearse)
            self._rehearsal = step_frame.without_states(payload, frame)
        return _ParsedFrame(request_id, frame, steps, dry, None, t_enter, t_parsed)

    def rehearse(self) -> None:
        """Re-read and re-check the last request frame (its copy cut before the states; the results are dropped), at
        most every REHEARSE_EVERY_S and for at most REHEARSE_DUTY of the time (the check of a large frame lasts a few
        hundred microseconds: a request that comes meanwhile waits for it to end). The step thread calls this while it
        spins waiting for the next request, once it has waited --step-channel-rehearse-after-s since its last batch:
        Python work that last ran milliseconds ago runs several times slower than warm on the VM hosts measured
        (docs/performance.md, thirteenth and twenty-fifth sessions), and an engine's next step comes a target forward
        after its last one. A rehearsal that fails (it should not: the frame passed these checks) is not tried again
        until the next frame."""
        r = self._rehearsal
        start = time.perf_counter()
        if r is None or start < self._next_rehearsal:
            return
        try:
            self.decode_frame(step_frame.read_request(r, with_states=False), rehearsal=True)
        except Exception:
            log.debug("rehearsing the last request frame failed", exc_info=True)
            self._rehearsal = None
        self.rehearsals += 1
        end = time.perf_counter()
        self._next_rehearsal = end + step_frame.rehearsal_pause(end - start, REHEARSE_EVERY_S, REHEARSE_DUTY)

    def _queue_frame(self, ch: Channel, seq: int, parsed: _ParsedFrame, enqueue, t_seen: float,
                     arrived: float) -> None:
        """Queue a request frame read and checked (at its doorbell, or ahead of it), or answer its error."""
        request_id, frame = parsed.request_id, parsed.frame
        if parsed.error is not None:
            self._reply_error(ch, seq, request_id, parsed.error)
            return
        t_enter, t_parsed = parsed.t_enter, parsed.t_parsed
        trace = {} if self.trace_file is not None else None
        head: list = []  # the reply frame but its drafts, encoded while the GPU drafted (frame_reply_head)

        def early(answer: BatchOutput | None) -> None:  # (PendingRequest.early: None drops it)
            head[:] = [] if answer is None else [frame_reply_head(answer, request_id)]

        def deliver(outputs, exc):
            t_stepped = time.perf_counter()
            if exc is not None:
                self._reply_error(ch, seq, request_id, RequestError(grpc.StatusCode.INTERNAL, f"step failed: {exc}"))
                return
            if isinstance(outputs, list):  # (a small frame, parsed as one StepInput per sequence)
                outputs = BatchOutput.from_outputs(outputs)
            early_head = head[0] if head and outputs.outputs is None else None
            self.early_replies += early_head is not None
            reply = frame_reply(outputs, request_id, early_head)
            return self._answer(ch, seq, request_id, reply, frame, trace, t_seen, t_enter, t_parsed, t_stepped)

        steps = parsed.steps
        self.frames_taken += 1
        enqueue(PendingRequest(steps, deliver, trace=trace, dry=parsed.dry, cancelled=lambda: ch.closed,
                               enqueued_at=arrived,
                               early=early if isinstance(steps, BatchInput) and not parsed.dry else None))

    def _answer(self, ch: Channel, seq: int, request_id: int, reply: bytes, request, trace: dict | None,
                t_seen: float, t_enter: float, t_parsed: float, t_stepped: float) -> "Callable[[], None] | None":
        """Write a step's reply (a serialized ProposeResponse or a reply frame; one larger than the reply area is
        answered with RESOURCE_EXHAUSTED instead); returns the recording of its phases (metrics, the trace file, a
        span), which the scheduler runs once the batch's other requests have their replies (PendingRequest.deliver)."""
        if len(reply) > ch.box.reply.capacity:
            self._reply_error(ch, seq, request_id, RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"reply: {len(reply)} bytes; this channel's reply area holds "
                f"{ch.box.reply.capacity}: open it with a larger reply_bytes"))
            return None
        self._write(ch, seq, reply)
        t_replied = time.perf_counter()

        def record() -> None:
            # (a frame read ahead was parsed before its doorbell (t_seen): its wait counts from the doorbell)
            self.metrics.record_rpc_timing(t_parsed - t_enter, t_stepped - max(t_parsed, t_seen),
                                           t_replied - t_stepped, channel=True)
            if trace is not None:
                trace.update(request_id=request_id, seen=t_seen, enter=t_enter, parsed=t_parsed, resumed=t_stepped,
                             replied=t_replied)
                self.trace_file.write(json.dumps(trace) + "\n")
            if tracing.enabled():  # (off by default: then nothing more on the step thread)
                tracing.record_step("channel", request, {"enter": t_enter, "parsed": t_parsed, "stepped": t_stepped,
                                                         "replied": t_replied})
        return record

    def _reply_error(self, ch: Channel, seq: int, request_id: int, e: RequestError) -> None:
        self.metrics.record_rpc_error(e.code.name)
        reply = pb.ProposeResponse(request_id=request_id, error=pb.Status(code=e.code.value[0], message=e.message))
        self._write(ch, seq, reply.SerializeToString())

    def _write(self, ch: Channel, seq: int, reply: bytes) -> None:
        if not ch.closed:
            ch.box.write(ch.box.reply, seq, reply)

    def _close(self, ch: Channel, why: str, client_gone: bool = False) -> None:
        """client_gone: the client closed its end or died: the sequences the channel created are freed too."""
        if ch.closed:
            return
        ch.closed = True
        ch.ahead = None  # (its views of the mailbox)
        if client_gone:
            self.release_owner(ch.owner)
        size = Mailbox.segment_bytes(ch.box.request.capacity, ch.box.reply.capacity)
        ch.box.close()
        ch.box.release()
        if ch.unpin is not None:  # (a request still queued with a view of the mailbox is then copied to the device)
            try:
                ch.unpin()
            except Exception:
                log.exception("step channel %d: unpinning its mailbox", ch.id)
            ch.unpin = None
        try:
            ch.mm.close()
        except BufferError:  # a view still alive: unmapped when collected
            pass
        os.close(ch.fd)
        ch.conn.close()
        with self._lock:
            self._count -= 1
            self._bytes -= size
        log.info("step channel %d of namespace %r closed after %d requests (%d frames read ahead): %s", ch.id,
                 ch.namespace, ch.requests, ch.read_ahead, why)

    def close_all(self, why: str) -> None:
        while self._new:
            self._open.append(self._new.popleft())
        for ch in self._open:
            self._close(ch, why)
        self._open = []


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _send_line(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall(_line(obj))
    except OSError:
        pass


def _still_connected(conn: socket.socket) -> bool:
    """False when the client closed its end (or sent anything: a client says goodbye by closing)."""
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False  # b"": the client closed its end; any bytes: it said goodbye. Both end the channel.
