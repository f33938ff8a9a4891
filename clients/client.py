"""Async client: one engine step per call (Propose), a streaming session (ProposeStream), Release, GetInfo,
the shared-memory data plane (enable_shared_memory; docs/shared_memory.md) and the shared-memory step channel
(open_step_channel; docs/step_channel.md).

The drafter is an accelerator, never a dependency: every propose() has a deadline (step_timeout_s), a sick drafter
(no reply in time, UNAVAILABLE, a server fault) gives a "no drafts" result instead of an exception, and a circuit
breaker (breaker.py) stops calling it for a backoff after a failure (docs/protocol.md, "When the drafter is sick")."""
import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_client.auth import bearer_metadata
from drafter_client.batch import (COLUMNS_MIN_SEQUENCES, BatchDrafts, StepBatch, batch_as_result, columns_can_carry,
                                 fallback_batch, frame_from_batch, frame_from_steps, parse_batch_response,
                                 parse_frame_reply, serialize_batch, serialize_steps_as_columns, steps_as_batch)
from drafter_client.breaker import CircuitBreaker
from drafter_client.messages import (CHUNK_BYTES, CHUNKED_MIN_BYTES, FAULT_CODES, UPLOAD_PARTS_MIN_BYTES,
                                     ChunkedRequest, DirectRequest,
                                     DrafterError, ProposeResult, ReleaseResult, SequenceDrafts, SequenceStep,
                                     build_request, fallback_result, hidden_parts, parse_response, serialize_request)
from drafter_client.protocol import pb, pb_grpc, step_frame
from drafter_client.session import ProposeSession
from drafter_client.shm_ring import SharedTensorRef, SlotRing
from drafter_client.step_channel import StepChannel, StepChannelClosed, StepChannelError

# (re-exported: they were defined here before messages.py)
__all__ = ["DrafterClient", "DrafterError", "ProposeResult", "ReleaseResult", "SequenceDrafts", "SequenceStep",
           "build_request", "parse_response"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DEFAULT_STEP_TIMEOUT_S = 0.5  # propose()'s deadline: past it the step goes on without drafts
STEP_TIMEOUT_ENV = "DRAFTER_STEP_TIMEOUT_S"  # overrides DEFAULT_STEP_TIMEOUT_S for clients that pass none
_FROM_ENV = object()  # step_timeout_s not given: DRAFTER_STEP_TIMEOUT_S, else DEFAULT_STEP_TIMEOUT_S


def default_step_timeout_s() -> float | None:
    """The step deadline of a client built without one: $DRAFTER_STEP_TIMEOUT_S (seconds; "none": no deadline),
    else DEFAULT_STEP_TIMEOUT_S."""
    raw = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_STEP_TIMEOUT_S
    if raw.lower() == "none":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_TIMEOUT_ENV}={raw!r}: seconds (a number > 0) or 'none'") from None
    if not value > 0:
        raise ValueError(f"{STEP_TIMEOUT_ENV}={raw!r}: seconds (a number > 0) or 'none'")
    return value
# gRPC's reconnect backoff grows to 120 s while the drafter is down: capped at 1 s, a restarted drafter is reached
# again within about a second.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
REOPEN_RETRY_S = 5.0  # after a failed attempt to reopen the step channel, the next one waits this long
MAX_DEFERRED_RELEASE_IDS = 4096  # ids of deferred releases sent along with one Release

# Request-level codes the drafter answers with once it is done with the request's shared-memory slot (or before it
# read it). After any other failure (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE, ...) the drafter may still be
# reading the slot, so the slot is retired rather than reused.
ANSWERED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED}
# Registration failures that mean "this drafter cannot map that memory" (another node, another /dev/shm, another
# GPU set, shared memory off): enable_shared_memory(kind="auto") then tries the next kind, and finally inline.
FALLBACK_CODES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED}


_NOT_SENT = object()  # (_send_frame: the step did not go as a frame)


def _frame_result(sequence_ids: list[str], reply) -> ProposeResult:
    """propose()'s answer from a reply frame."""
    return batch_as_result(parse_frame_reply(reply, sequence_ids))


def _channel_reply(reply: bytes, parse: bool = False) -> "pb.ProposeResponse | ProposeResult":
    """A step channel's reply bytes as a ProposeResponse (parse: as a ProposeResult); bytes that do not parse are
    the drafter's fault (INTERNAL)."""
    try:
        resp = pb.ProposeResponse.FromString(reply)
    except DecodeError as e:
        raise DrafterError(grpc.StatusCode.INTERNAL, f"a step channel reply that does not parse: {e}") from None
    return parse_response(resp) if parse else resp


@dataclass
class _Staged:
    """A step's hidden states written into a ring slot; the slot is busy until done()."""

    ring: SlotRing
    slot: int
    ref: SharedTensorRef

    def done(self, answered: bool) -> None:
        """answered: the drafter replied (or never got the request), so it reads the slot no more."""
        (self.ring.release if answered else self.ring.retire)(self.slot)


class DrafterClient:
    """Async client over TCP (``host:port``) or a Unix socket (``unix:/path``). One per engine process."""

    def __init__(self, target: str, namespace: str = "", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 credentials: "grpc.ChannelCredentials | None" = None, token: str | None = None,
                 step_timeout_s: "float | None" = _FROM_ENV, raise_on_error: bool = False,  # type: ignore[assignment]
                 breaker: CircuitBreaker | None = None, chunk_min_bytes: int | None = CHUNKED_MIN_BYTES,
                 chunk_bytes: int = CHUNK_BYTES, upload_streams: int = 1,
                 upload_streams_min_bytes: int = UPLOAD_PARTS_MIN_BYTES):
        """target: ``host:port`` or ``unix:/path``; namespace: this engine's sequences and regions live under it.
        credentials: TLS channel credentials (drafter_client.auth.tls_credentials) for a TLS listener; token: a
        bearer token sent with every call and in step-channel hellos (drafter --auth-token-file).
        step_timeout_s: the deadline of propose() and release() in seconds (None: none); a call may override it.
        Default: $DRAFTER_STEP_TIMEOUT_S, else 0.5 s.
        raise_on_error: raise DrafterError when the drafter is sick instead of answering "no drafts" (fallback).
        breaker: the circuit breaker's settings (default CircuitBreaker(): backoff 0.1 s doubling to 5 s).
        chunk_min_bytes: a step whose inline hidden states reach this size goes by ProposeChunked, in chunks of
        chunk_bytes (docs/protocol.md; much faster than one message for a long prefill); None: never. A drafter
        without ProposeChunked (UNIMPLEMENTED) gets one message from then on.
        upload_streams: a ProposeChunked upload of at least upload_streams_min_bytes is spread over this many calls
        at once, each on a TCP connection of its own (one connection tops out below the network's speed; docs/
        performance.md, "Large steps over TCP"), where the drafter allows it (GetInfo.max_upload_parts); 1: one
        call. The extra connections open at the first such step."""
        self.target = target
        self.namespace = namespace
        self._token = token
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        options += RECONNECT_OPTIONS
        # call metadata of every Drafter call (health checks go without: probes need no token)
        self._metadata = bearer_metadata(token)
        self._credentials, self._options = credentials, options  # (the extra upload connections are made alike)
        self._channel = self._new_channel(options)
        self._stub = pb_grpc.DrafterStub(self._channel)
        # Propose with the request already serialized (serialize_request: the hidden states copied once)
        self._propose_bytes = self._channel.unary_unary("/drafter.v1.Drafter/Propose", request_serializer=None,
                                                        response_deserializer=pb.ProposeResponse.FromString)
        # ProposeStream with each message already serialized (ProposeSession: columns from 32 sequences, the hidden
        # states copied once, as a unary Propose sends them)
        self._propose_stream_bytes = self._channel.stream_stream(
            "/drafter.v1.Drafter/ProposeStream", request_serializer=None,
            response_deserializer=pb.ProposeResponse.FromString)
        # ProposeChunked with the messages already serialized (ChunkedRequest.messages)
        self._propose_chunked = self._channel.stream_unary("/drafter.v1.Drafter/ProposeChunked",
                                                           request_serializer=None,
                                                           response_deserializer=pb.ProposeResponse.FromString)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes is {chunk_bytes}; at least 1")
        if not 1 <= upload_streams <= 8:
            raise ValueError(f"upload_streams is {upload_streams}; 1 to 8")
        self.chunk_min_bytes = chunk_min_bytes
        self.chunk_bytes = chunk_bytes
        self.upload_streams = upload_streams
        self.upload_streams_min_bytes = upload_streams_min_bytes
        self.steps_chunked = 0  # steps sent by ProposeChunked
        self.steps_spread = 0  # ... of which over several calls (upload_streams)
        self._upload_rpcs: list = []  # ProposeChunked on each extra upload connection (opened when first needed)
        self._upload_channels: list = []
        self._max_upload_parts: int | None = None  # GetInfo.max_upload_parts, once asked
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._next_request_id = 1
        self._step_columns: bool | None = None  # GetInfo.step_columns_supported, once asked (propose_batch)
        # shared-memory data plane (enable_shared_memory)
        self.data_plane = "inline"  # "system" or "cuda" while a ring is registered
        self.steps_by_reference = 0  # steps whose hidden states went through the ring
        self.steps_inline = 0  # steps sent inline (no ring, step larger than a slot, or every slot busy)
        self.staging_seconds = 0.0  # time spent copying steps' hidden states into ring slots (the client's copy)
        self._ring: SlotRing | None = None
        self._ring_settings: dict | None = None
        self._own_regions: set[str] = set()  # registered with register_cuda_tensor, unregistered on close
        self._heartbeat: asyncio.Task | None = None
        # step channel (open_step_channel)
        self._step_channel: StepChannel | None = None
        self.steps_through_channel = 0  # propose() calls answered through the step channel
        self.steps_as_frames = 0  # of those, the ones sent as request frames (open_step_channel(frames=True))
        self.steps_through_grpc = 0  # ... and through a unary Propose
        # when the drafter is sick (docs/protocol.md, "When the drafter is sick")
        self.step_timeout_s = default_step_timeout_s() if step_timeout_s is _FROM_ENV else step_timeout_s
        self.raise_on_error = raise_on_error
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.fallback_steps = 0  # propose() calls answered "no drafts" (drafter sick, or the breaker open)
        self._channel_wanted: dict | None = None  # open_step_channel's arguments: reopened after a recovery
        self._reopening: asyncio.Task | None = None
        self._reopen_after = float("inf")  # when to retry reopening the step channel (inf: nothing to retry)
        self._unreleased: set[str] = set()  # ids of deferred releases

    async def __aenter__(self) -> "DrafterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the step channel, unregister the shared-memory ring and this client's regions, close the channel."""
        self.close_step_channel()
        if self._reopening is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reopening
        await self.disable_shared_memory()
        if self._own_regions:
            try:
                await self.unregister_shared_memory(sorted(self._own_regions))
            except DrafterError as e:  # the drafter's lease reclaims them
                log.info("unregistering %s: %s", sorted(self._own_regions), e)
        await self._stop_heartbeat()
        for ch in self._upload_channels:
            await ch.close()
        await self._channel.close()

    def _new_channel(self, options: list):
        if self._credentials is not None:
            return grpc.aio.secure_channel(self.target, self._credentials, options=options)
        return grpc.aio.insecure_channel(self.target, options=options)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the server's health says SERVING (the model is loaded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = await self._health.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"),
                                             timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"drafter at {self.target} not SERVING after {timeout_s}s")
            await asyncio.sleep(0.05)

    async def _call(self, rpc, request, timeout: float | None):
        try:
            return await rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise DrafterError(e.code(), e.details() or "") from None

    async def get_info(self, timeout: float | None = None) -> "pb.GetInfoResponse":
        """The drafter's model, method, limits and data planes (GetInfo)."""
        return await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout)

    def _request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    async def propose(self, steps: list[SequenceStep], hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                      timeout: float | None = None) -> ProposeResult:
        """One engine step for a batch (unary RPC, or the step channel when one is open). Per-sequence problems
        come back in ``result.sequences`` (``needs_resync`` where the drafter lacks part of a sequence's context).

        hidden_states: the whole batch's states packed, or None to take each step's; or a SharedTensorRef into a
        region the caller registered itself. With enable_shared_memory they go through the ring.
        timeout: this call's deadline in seconds (None: the client's step_timeout_s). When the drafter is sick (no
        reply by the deadline; UNAVAILABLE, INTERNAL or another code of FAULT_CODES; the circuit breaker open) the
        result is a fallback: no drafts, code 14 for every sequence, ``result.fallback`` True (with
        raise_on_error, DrafterError instead). The caller's errors (INVALID_ARGUMENT, ...) raise DrafterError.

        From COLUMNS_MIN_SEQUENCES (32) sequences, to a drafter with GetInfo.step_columns_supported, the step goes
        as the batch API's columns (the drafter decodes it without a message per sequence), when the steps share
        return_logprobs and top_k_probs; the answer is the same ProposeResult."""
        serialize, parse, timeout = await self._steps_codec(steps, timeout)
        return await self._step(
            lambda states, rid: serialize(states, rid, self._chunk_min_bytes()),
            lambda: self._stage(steps, hidden_states), hidden_states, parse,
            lambda reason: fallback_result(steps, reason), timeout,
            frame=(lambda rid: frame_from_steps(self.namespace, steps, hidden_states, rid),
                   lambda reply: _frame_result([s.sequence_id for s in steps], reply)))

    async def _steps_codec(self, steps: list[SequenceStep], timeout: float | None):
        """How a step of SequenceSteps is written and its reply read, for propose() and a ProposeSession alike:
        (serialize(states, request_id, chunk_min_bytes), parse(response) -> ProposeResult, the step's timeout left).
        From COLUMNS_MIN_SEQUENCES sequences that share return_logprobs and top_k_probs, to a drafter that takes
        columns, as columns; else as per-sequence messages."""
        columns, timeout = await self._columns_within(
            len(steps) >= COLUMNS_MIN_SEQUENCES and columns_can_carry(steps), timeout)
        if not columns:
            return (lambda states, rid, chunk_min_bytes: serialize_request(self.namespace, steps, states, rid,
                                                                           chunk_min_bytes)), parse_response, timeout
        ids = [s.sequence_id for s in steps]
        # (the columns are built when the step is serialized: not at all when it goes as a request frame)
        return ((lambda states, rid, chunk_min_bytes: serialize_steps_as_columns(
                    self.namespace, steps, steps_as_batch(steps), states, rid, chunk_min_bytes)),
                lambda resp: batch_as_result(parse_batch_response(resp, ids)), timeout)

    async def propose_batch(self, batch: StepBatch, timeout: float | None = None) -> BatchDrafts:
        """One engine step for a batch given as columns (drafter_client.batch.StepBatch), answered as columns
        (BatchDrafts): the same deadline, fallback and circuit breaker as propose(), without a Python object per
        sequence. From COLUMNS_MIN_SEQUENCES (32) sequences, to a drafter with GetInfo.step_columns_supported, the
        request goes as columns (asked once, again after a fault, within the step's deadline); else as messages;
        large inline states by ProposeChunked. batch.hidden_states may be a SharedTensorRef into a region the
        caller registered; with enable_shared_memory a tensor goes through the ring."""
        ids = batch.sequence_ids
        states = batch.hidden_states
        columns, timeout = await self._batch_columns(len(batch), timeout)
        return await self._step(
            lambda ref, rid: serialize_batch(self.namespace, batch, ref, rid, self._chunk_min_bytes(), columns),
            lambda: self._stage_states(states),
            states, lambda resp: parse_batch_response(resp, ids), lambda reason: fallback_batch(ids, reason),
            timeout, frame=(lambda rid: frame_from_batch(self.namespace, batch, rid),
                            lambda reply: parse_frame_reply(reply, ids)))

    async def _batch_columns(self, num_sequences: int, timeout: float | None) -> tuple[bool, float | None]:
        """Whether a StepBatch of this many sequences goes as columns (propose_batch, ProposeSession.send_batch), and
        the step's timeout left. (Below COLUMNS_MIN_SEQUENCES the per-sequence messages cost the host less:
        benchmarks/bench_request_codec.py.)"""
        return await self._columns_within(num_sequences >= COLUMNS_MIN_SEQUENCES, timeout)

    async def _columns_within(self, wanted: bool, timeout: float | None) -> tuple[bool, float | None]:
        """(whether a step that could go as columns (wanted) does, the step's timeout left): one deadline for the
        step, so that a first GetInfo (asked once, and again after a fault) comes out of the step's time."""
        timeout = self._step_timeout(timeout)
        if not wanted:
            return False, timeout
        deadline = time.monotonic() + timeout if timeout is not None else None
        columns = await self._columns_supported(timeout)
        return columns, (max(0.0, deadline - time.monotonic()) if deadline is not None else None)

    async def _columns_supported(self, timeout: float | None) -> bool:
        """Whether the drafter takes columnar requests (GetInfo.step_columns_supported), asked once and again after a
        fault (the drafter may come back as another version, a rollback); while it cannot be asked (the drafter is
        down), batches go as per-sequence messages, which every drafter takes."""
        if self._step_columns is None:
            if self.breaker.state != "closed":  # (a sick drafter: no extra call before the step's own)
                return False
            try:
                self._step_columns = (await self.get_info(timeout)).step_columns_supported
            except DrafterError:
                return False
        return self._step_columns

    async def _step(self, serialize, stage, hidden_states, parse, fallback, timeout: float | None, frame=None):
        """propose() and propose_batch(): stage the states (ring slot), serialize(states or slot ref, request id),
        send through the step channel or gRPC under the deadline, parse(response). A sick drafter gives
        fallback(reason) (raise_on_error: DrafterError); the caller's errors raise. frame: (build(request id) ->
        step_frame.FrameRequest or None, parse_frame(reply frame bytes)) for a step a channel that takes frames can
        carry that way (states not staged in a ring)."""
        if not self.breaker.allow():
            return self._without_drafter_do(fallback, *self._refusal_error())
        staged = None
        sent = answered = False
        try:
            staged = stage()
            result = _NOT_SENT
            if frame is not None and staged is None:
                sent = True
                result = await self._send_frame(*frame, parse, self._step_timeout(timeout))
                sent = answered = result is not _NOT_SENT
            if result is _NOT_SENT:
                payload = serialize(staged.ref if staged else hidden_states, self._request_id())
                sent = True
                resp = await self._send_step(payload, self._step_timeout(timeout))
                answered = True
                result = parse(resp)
        except DrafterError as e:
            answered = answered or e.code in ANSWERED_CODES
            return self._without_drafter_do(fallback, self._drafter_failed(e), e)
        except BaseException:  # cancelled, or the caller's bad input: no answer either way
            self.breaker.abandon()
            raise
        finally:
            if staged is not None:
                staged.done(answered or not sent)
        self._answered()
        return result

    def _step_timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.step_timeout_s

    def _chunk_min_bytes(self) -> int | None:
        """Inline states from this size go by ProposeChunked; a step that an open step channel can take goes there."""
        if self.chunk_min_bytes is None:
            return None
        ch = self._step_channel
        return self.chunk_min_bytes if ch is None else max(self.chunk_min_bytes, ch.request_capacity + 1)

    async def _send_frame(self, build, parse_frame, parse, timeout: float | None):
        """A step as a request frame through the open step channel, when it takes frames, is free, and the frame
        (build(request id); None: the step cannot go as one) fits it: the answer, parse_frame(reply frame) or, for a
        protobuf reply (a request-level error), parse(ProposeResponse). _NOT_SENT when the step did not go (then the
        caller sends it as protobuf)."""
        if self._step_channel is None or not self._step_channel.frames:
            return _NOT_SENT
        request = build(self._request_id())
        ch = self._claim_channel(request) if request is not None else None
        if ch is None:
            return _NOT_SENT
        reply = None
        with self._channel_errors():  # (releases the claim, however the call ends)
            reply = await ch.call(request, timeout)
        if reply is None:  # the drafter closed the channel before taking the request: protobuf, over gRPC
            return _NOT_SENT
        self.steps_through_channel += 1
        self.steps_as_frames += 1
        if step_frame.starts_with(reply, step_frame.REPLY_MAGIC):
            result = parse_frame(reply)
            ch.rehearse = functools.partial(parse_frame, reply)  # (the reply is a copy: StepChannel.rehearse)
            return result
        return parse(_channel_reply(reply))

    async def _send_step(self, payload: "bytes | DirectRequest | ChunkedRequest",
                         timeout: float | None) -> "pb.ProposeResponse":
        """Through the step channel when one is open and free and the request fits it; a large step by
        ProposeChunked; else a unary Propose. The deadline covers both (a step the channel could not take goes over
        gRPC with the time left)."""
        if isinstance(payload, ChunkedRequest):
            self.steps_through_grpc += 1
            return await self._send_chunked(payload, timeout)
        deadline = time.monotonic() + timeout if timeout is not None else None
        ch = self._claim_channel(payload)
        if ch is not None:
            reply = None
            with self._channel_errors():
                reply = await ch.call(payload, timeout)
            if reply is not None:
                self.steps_through_channel += 1
                return _channel_reply(reply)
        self.steps_through_grpc += 1
        left = max(0.0, deadline - time.monotonic()) if deadline is not None else None
        return await self._call(self._propose_bytes, bytes(payload), left)  # (grpc takes bytes)

    async def _send_chunked(self, payload: ChunkedRequest, timeout: float | None) -> "pb.ProposeResponse":
        """One ProposeChunked call (the chunks are copied lazily, while earlier ones travel); a drafter that has
        no ProposeChunked gets the step as one message, and every step after it too."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        try:
            parts = await self._upload_parts(payload, timeout)
            left = max(0.0, deadline - time.monotonic()) if deadline is not None else None
            if parts > 1:
                resp = await self._send_spread(payload, parts, left)
            else:
                resp = await self._call(self._propose_chunked, payload.messages(self.chunk_bytes), left)
        except DrafterError as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("the drafter at %s has no ProposeChunked (%s): large steps go in one message", self.target,
                     e.message)
            self.chunk_min_bytes = None
            left = max(0.0, deadline - time.monotonic()) if deadline is not None else None
            return await self._call(self._propose_bytes, bytes(payload.unary()), left)
        self.steps_chunked += 1
        return resp

    async def _upload_parts(self, payload: ChunkedRequest, timeout: float | None) -> int:
        """Over how many calls this upload goes: upload_streams from upload_streams_min_bytes, where the drafter
        allows that many (GetInfo.max_upload_parts, asked once and again after a fault); else 1."""
        if self.upload_streams == 1 or payload.nbytes < self.upload_streams_min_bytes:
            return 1
        if self._max_upload_parts is None:
            try:
                self._max_upload_parts = (await self.get_info(timeout)).max_upload_parts
            except DrafterError:
                return 1
        return max(1, min(self.upload_streams, self._max_upload_parts))

    async def _send_spread(self, payload: ChunkedRequest, parts: int, timeout: float | None) -> "pb.ProposeResponse":
        """One upload over ``parts`` ProposeChunked calls at once (proto: ProposeChunk.part): the request and the
        first part on the client's channel, each other part on a connection of its own. The first call's answer is
        the step's; the others are cancelled when it fails."""
        while len(self._upload_rpcs) < parts - 1:  # (a local subchannel pool: a TCP connection per channel)
            ch = self._new_channel(self._options + [("grpc.use_local_subchannel_pool", 1)])
            self._upload_channels.append(ch)
            self._upload_rpcs.append(ch.stream_unary("/drafter.v1.Drafter/ProposeChunked", request_serializer=None,
                                                     response_deserializer=pb.ProposeResponse.FromString))
        upload_id = uuid.uuid4().hex
        extras = [asyncio.ensure_future(self._call(
            rpc, payload.messages(self.chunk_bytes, pb.UploadPart(namespace=self.namespace, upload_id=upload_id,
                                                                  index=i, count=parts)), timeout))
            for i, rpc in enumerate(self._upload_rpcs[: parts - 1], start=1)]
        answered = False
        try:
            resp = await self._call(self._propose_chunked, payload.messages(
                self.chunk_bytes, pb.UploadPart(upload_id=upload_id, index=0, count=parts)), timeout)
            answered = True
        finally:
            if not answered:  # (after a step, every extra call has its bytes in and is answered)
                for f in extras:
                    f.cancel()
            await asyncio.gather(*extras, return_exceptions=True)
        self.steps_spread += 1
        return resp

    # ---- when the drafter is sick: fallback, circuit breaker (docs/protocol.md) ----

    def _drafter_failed(self, e: DrafterError) -> str:
        """A call failed. The caller's errors (codes outside FAULT_CODES) raise again: the drafter answered them.
        The drafter's faults open the circuit breaker; returns the reason."""
        if e.code not in FAULT_CODES:
            self._answered()
            raise e
        reason = f"{e.code.name}: {e.message}"
        # the drafter may come back as another version (a rollback): ask again whether it takes columnar requests
        self._step_columns = None
        self._max_upload_parts = None
        backoff = self.breaker.failure(reason)
        log.warning("the drafter at %s failed a call (%s): no drafts for %.2f s, then a probe (%d failures in a row)",
                    self.target, reason, backoff, self.breaker.failures)
        return reason

    def _without_drafter(self, steps: list[SequenceStep], reason: str, error: DrafterError) -> ProposeResult:
        """The step goes on without drafts: a fallback result, or the error with raise_on_error."""
        return self._without_drafter_do(lambda why: fallback_result(steps, why), reason, error)

    def _without_drafter_do(self, fallback, reason: str, error: DrafterError):
        self.fallback_steps += 1
        if self.raise_on_error:
            raise error
        return fallback(reason)

    def _refusal_error(self) -> "tuple[str, DrafterError]":
        reason = (f"circuit breaker open after {self.breaker.reason}; next probe in "
                  f"{self.breaker.retry_in_s:.2f} s")
        return reason, DrafterError(grpc.StatusCode.UNAVAILABLE, reason)

    def _refusal(self, steps: list[SequenceStep]) -> ProposeResult:
        """The answer while the circuit breaker is open: no drafts at once, without network I/O."""
        return self._without_drafter(steps, *self._refusal_error())

    def _answered(self) -> None:
        """The drafter answered a call: close the circuit breaker. After a recovery, reopen the step channel that
        was open before (a reopening that failed is retried at a later answer, REOPEN_RETRY_S later)."""
        recovered = self.breaker.success()
        if recovered:
            log.info("the drafter at %s answers again: drafting resumes", self.target)
        retry_due = time.monotonic() >= self._reopen_after  # (inf: nothing to retry)
        if (recovered or retry_due) and self._channel_wanted is not None and self._step_channel is None:
            self._reopen_step_channel_soon()

    def _reopen_step_channel_soon(self) -> None:
        if self._reopening is not None and not self._reopening.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (SyncDrafterClient's calling thread: a later call on the loop reopens it)
            return
        self._reopening = loop.create_task(self._reopen_step_channel(dict(self._channel_wanted)))

    async def _reopen_step_channel(self, settings: dict) -> None:
        """Open the step channel again with the arguments of the last open_step_channel (in the background)."""
        try:
            async with asyncio.timeout(10.0):  # (in this task: open_step_channel does not cancel it)
                ok = await self.open_step_channel(**settings)
        except (DrafterError, OSError, TimeoutError) as e:
            log.info("reopening the step channel to %s failed: %s", self.target, e)
            ok = False
        if ok:
            log.info("the step channel to %s is open again", self.target)
            self._reopen_after = float("inf")
        else:
            self._reopen_after = time.monotonic() + REOPEN_RETRY_S

    def _claim_channel(self, payload: "bytes | DirectRequest | step_frame.FrameRequest") -> "StepChannel | None":
        """The claimed step channel when the serialized request can go through it now; else None."""
        ch = self._step_channel
        if ch is None or not ch.try_claim():
            return None
        if len(payload) > ch.request_capacity:
            ch.unclaim()
            return None
        return ch

    @contextlib.contextmanager
    def _channel_errors(self):
        """Around a channel call: a channel the drafter closed before taking the request is dropped and the step
        goes over gRPC (nothing happened); a failed call drops it and raises the DrafterError of a unary call."""
        try:
            yield
        except StepChannelClosed:
            log.warning("the drafter at %s closed the step channel: steps go over gRPC", self.target)
            self._step_channel = None
        except StepChannelError as e:
            self._step_channel = None
            raise DrafterError(e.code, e.message) from None

    def propose_blocking(self, steps: list[SequenceStep], hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                         timeout: float | None = None) -> ProposeResult | None:
        """propose() through the open step channel on the calling thread: no event loop and no thread hand-off
        (SyncDrafterClient's fast path). Returns None, having done nothing, when the step cannot go through the
        channel now (none open, another call holds it, the request is larger than its area, or the drafter
        closed it before taking the request): then call propose(). Deadline, fallback and circuit breaker as in
        propose(): with the breaker open it answers "no drafts" at once."""
        ch = self._step_channel
        if ch is None or not ch.try_claim():
            return None
        if not self.breaker.allow():
            ch.unclaim()
            return self._refusal(steps)
        staged = None
        called = sent = answered = False
        try:
            staged = self._stage(steps, hidden_states)
            payload = (frame_from_steps(self.namespace, steps, hidden_states, self._request_id())
                       if ch.frames and staged is None else None)  # (a request frame where the channel takes one)
            if payload is None or len(payload) > ch.request_capacity:
                payload = serialize_request(self.namespace, steps, staged.ref if staged else hidden_states,
                                            self._request_id())
            if len(payload) > ch.request_capacity:
                self.breaker.abandon()
                return None
            called = sent = True  # (the call releases the claim, however it ends)
            reply = None
            with self._channel_errors():
                reply = ch.call_blocking(payload, self._step_timeout(timeout))
            if reply is None:  # the drafter closed the channel before taking the request
                sent = False
                self.breaker.abandon()
                return None
            answered = True
            self.steps_through_channel += 1
            self.steps_as_frames += isinstance(payload, step_frame.FrameRequest)
            if step_frame.starts_with(reply, step_frame.REPLY_MAGIC):
                parse_frame = functools.partial(_frame_result, [s.sequence_id for s in steps])
                result = parse_frame(reply)
                ch.rehearse = functools.partial(parse_frame, reply)  # (the reply is a copy: StepChannel.rehearse)
            else:
                result = _channel_reply(reply, parse=True)
        except DrafterError as e:
            answered = answered or e.code in ANSWERED_CODES
            return self._without_drafter(steps, self._drafter_failed(e), e)
        except BaseException:
            self.breaker.abandon()
            raise
        finally:
            if not called:
                ch.unclaim()
            if staged is not None:
                staged.done(answered or not sent)
        self._answered()
        return result

    async def open_step_channel(self, request_bytes: int = 16 * 2**20, reply_bytes: int = 2**20,
                                socket_path: str | None = None, spin_s: float = 0.05,
                                poll_s: float = 0.0001, frames: bool = True) -> bool:
        """Send propose() steps through a shared-memory step channel (same node only; docs/step_channel.md):
        the request and reply bytes go through a mailbox the drafter polls instead of a gRPC message each.

        request_bytes / reply_bytes: the largest serialized ProposeRequest / ProposeResponse the channel carries
        (larger ones, and calls made while the channel is busy with another, go over gRPC). With
        enable_shared_memory the request holds descriptors only, so a few hundred KiB suffice.
        socket_path: default GetInfo.step_channel_socket. spin_s / poll_s: while waiting for a reply this client
        busy-polls (yielding to the event loop) for spin_s, then every poll_s. frames: ask the drafter for request
        frames (docs/step_channel.md): a step of inline states without log-probabilities or top-N then goes as raw
        arrays, not a ProposeRequest (the same answer, less host work on both sides); a drafter that does not know
        them takes protobuf as before (``channel_frames`` says which).
        Returns False (and steps stay on gRPC) when the drafter has no channels or its socket cannot be reached
        (another node, a container without the socket's volume); raises DrafterError when the drafter refuses.
        A channel that a sick drafter broke is opened again, with these arguments, once the drafter answers."""
        settings = dict(request_bytes=request_bytes, reply_bytes=reply_bytes, socket_path=socket_path,
                        spin_s=spin_s, poll_s=poll_s, frames=frames)
        if self._reopening is not None and self._reopening is not asyncio.current_task():
            self._reopening.cancel()
        self._drop_step_channel()
        if socket_path is None:
            socket_path = (await self.get_info()).step_channel_socket
            if not socket_path:
                log.info("the drafter at %s has no step channels: steps go over gRPC", self.target)
                return False
        try:
            ch = await asyncio.get_running_loop().run_in_executor(
                None, lambda: StepChannel.open(socket_path, self.namespace, request_bytes, reply_bytes, spin_s,
                                               poll_s, token=self._token, frames=frames))
        except StepChannelError as e:
            raise DrafterError(e.code, e.message) from None
        except OSError as e:
            log.info("cannot open a step channel at %s (%s): steps go over gRPC", socket_path, e)
            return False
        self._step_channel = ch
        self._channel_wanted = settings
        return True

    def close_step_channel(self) -> None:
        """Back to a unary Propose per step (the drafter closes its end within 0.1 s)."""
        self._channel_wanted = None
        if self._reopening is not None:
            self._reopening.cancel()
        self._drop_step_channel()

    def _drop_step_channel(self) -> None:
        ch, self._step_channel = self._step_channel, None
        if ch is not None:
            ch.close()

    @property
    def channel_frames(self) -> bool:
        """True while the open step channel takes request frames (open_step_channel(frames=True), a drafter that
        knows them)."""
        return self.step_channel_open and self._step_channel.frames

    @property
    def step_channel_open(self) -> bool:
        """True while propose() can go through an open step channel."""
        return self._step_channel is not None and not self._step_channel.closed

    def stream(self) -> "ProposeSession":
        """A bidirectional session: one message per engine step, replies in order. Use ``async with``. Its
        propose() has the deadline, fallback and circuit breaker of this client's propose()."""
        return ProposeSession(self)

    def _new_stream(self):
        """A new ProposeStream call (ProposeSession opens one at its first send, and again after a break)."""
        return self._propose_stream_bytes(metadata=self._metadata)

    async def release(self, sequence_ids: list[str], timeout: float | None = None) -> ReleaseResult:
        """Free these sequences' drafter state (KV blocks); ids the drafter does not hold come back in not_found.

        timeout: default the client's step_timeout_s. When the drafter is sick (circuit breaker open, no reply in
        time, a code of FAULT_CODES) nothing raises (unless raise_on_error): the ids are kept and sent along with
        the next release that reaches the drafter, and the result says ``deferred``."""
        ids = list(sequence_ids)
        asked = set(ids)
        ids += sorted(self._unreleased - asked)[:MAX_DEFERRED_RELEASE_IDS]
        if not self.breaker.allow():
            reason = (f"circuit breaker open after {self.breaker.reason}; next probe in "
                      f"{self.breaker.retry_in_s:.2f} s")
            return self._defer_release(asked, reason, DrafterError(grpc.StatusCode.UNAVAILABLE, reason))
        try:
            r = await self._call(self._stub.Release, pb.ReleaseRequest(namespace=self.namespace, sequence_ids=ids),
                                 self._step_timeout(timeout))
        except DrafterError as e:
            return self._defer_release(asked, self._drafter_failed(e), e)
        except BaseException:
            self.breaker.abandon()
            raise
        self._answered()
        self._unreleased.difference_update(ids)
        return ReleaseResult(released=r.released, not_found=[i for i in r.not_found if i in asked])

    def _defer_release(self, ids: set[str], reason: str, error: DrafterError) -> ReleaseResult:
        self._unreleased.update(ids)
        if self.raise_on_error:
            raise error
        log.info("releasing %d sequences deferred: %s", len(ids), reason)
        return ReleaseResult(released=0, deferred=True, fallback_reason=reason)

    async def drain(self, grace_seconds: float = 0.0, timeout: float | None = None) -> "pb.DrainResponse":
        """Ask the drafter to drain (rollouts, preStop): it takes no new sequences, live ones keep drafting until
        released or grace_seconds (0: its --shutdown-grace-s) pass, then it exits. Needs a '*' token when the
        drafter checks tokens."""
        return await self._call(self._stub.Drain, pb.DrainRequest(grace_seconds=grace_seconds), timeout)

    # ---- the shared-memory data plane (docs/shared_memory.md) ----

    async def enable_shared_memory(self, max_step_tokens: int, dtype: torch.dtype = torch.bfloat16,
                                   kind: str = "auto", slots: int = 2, device: "torch.device | str | None" = None,
                                   width: int | None = None, lease_seconds: int = 0) -> str:
        """Send hidden states by reference, through a ring of ``slots`` shared-memory slots registered with the
        drafter, each holding ``max_step_tokens`` rows of ``width`` (default GetInfo.hidden_states_width) columns
        of ``dtype``: each step is one copy into the next free slot plus a descriptor in the message.

        kind: "system" (a /dev/shm segment; pinned when ``device`` is a GPU), "cuda" (a CUDA IPC buffer on
        ``device``), or "auto": CUDA IPC when ``device`` is a GPU and the drafter can map it, else host shared
        memory, else inline bytes (a drafter on another node, or with shared memory off).
        Returns the data plane now in use: "cuda", "system" or "inline". A step larger than a slot, or sent while
        every slot still waits for its reply, goes inline (counted in ``steps_inline``).
        """
        if kind not in ("auto", "system", "cuda"):
            raise ValueError(f"kind {kind!r}: choose auto, system or cuda")
        await self.disable_shared_memory()
        device = torch.device(device) if device is not None else None
        settings = dict(max_step_tokens=max_step_tokens, dtype=dtype, kind=kind, slots=slots, device=device,
                        width=width, lease_seconds=lease_seconds)
        info = await self.get_info()
        if kind == "auto":
            if not info.shared_memory_supported:
                log.info("the drafter at %s takes no shared memory: hidden states travel inline", self.target)
                return "inline"
            kinds = [pb.CUDA_IPC] if (device is not None and device.type == "cuda"
                                      and pb.CUDA_IPC in info.shared_memory_kinds) else []
            kinds.append(pb.SYSTEM)
        else:
            kinds = [pb.SYSTEM if kind == "system" else pb.CUDA_IPC]
        slot_bytes = max_step_tokens * (width or info.hidden_states_width) * dtype.itemsize
        for k in kinds:
            what = pb.SharedMemoryKind.Name(k)
            try:
                ring = SlotRing.create(k, slot_bytes, slots, device)
            except (OSError, RuntimeError) as e:  # no /dev/shm here, CUDA driver refused, ...
                if kind != "auto":
                    raise
                log.info("cannot allocate a %s ring here (%s): trying the next way", what, e)
                continue
            try:
                r = await self._call(self._stub.RegisterSharedMemory,
                                     ring.store.register_request(ring.name, self.namespace, lease_seconds), 30.0)
            except DrafterError as e:
                ring.close()
                if kind != "auto" or e.code not in FALLBACK_CODES:
                    raise
                log.info("the drafter at %s cannot map %s memory (%s): trying the next way", self.target, what, e)
                continue
            ring.store.registered()
            self._ring, self._ring_settings = ring, settings
            self.data_plane = "cuda" if k == pb.CUDA_IPC else "system"
            self._ensure_heartbeat(r.region.lease_seconds)
            log.info("hidden states to %s through %s shared memory: %d slots of %d bytes", self.target, what, slots,
                     ring.slot_bytes)
            return self.data_plane
        return "inline"

    async def disable_shared_memory(self) -> None:
        """Back to inline bytes: unregister the ring and free it (and stop the heartbeat, unless regions of
        register_cuda_tensor still need it)."""
        if not self._own_regions:
            await self._stop_heartbeat()
        ring, self._ring = self._ring, None
        self.data_plane = "inline"
        if ring is None:
            return
        try:
            await self._call(self._stub.UnregisterSharedMemory,
                             pb.UnregisterSharedMemoryRequest(namespace=self.namespace, names=[ring.name]), 5.0)
        except DrafterError as e:  # the drafter's lease reclaims it
            log.info("unregistering %r: %s", ring.name, e)
        ring.close()

    async def register_cuda_tensor(self, name: str, tensor: torch.Tensor,
                                   lease_seconds: int = 0) -> "pb.SharedMemoryRegion":
        """Register an engine-owned, contiguous GPU tensor as region ``name``; then send
        ``SharedTensorRef(name, byte_offset, dtype, shape)`` as hidden_states. The drafter can read the whole
        cudaMalloc allocation around the tensor (read-only); one region per allocation."""
        from drafter_client.protocol import cuda_driver  # (only where CUDA is in use)

        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("register_cuda_tensor takes a contiguous CUDA tensor")
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        base, _ = cuda_driver.address_range(index, tensor.data_ptr())
        req = pb.RegisterSharedMemoryRequest(
            namespace=self.namespace, name=name, byte_size=tensor.numel() * tensor.element_size(),
            cuda=pb.CudaSharedMemory(ipc_handle=cuda_driver.ipc_get_handle(index, base),
                                     offset=tensor.data_ptr() - base, device_id=index),
            lease_seconds=lease_seconds)
        r = await self._call(self._stub.RegisterSharedMemory, req, 30.0)
        self._own_regions.add(name)
        self._ensure_heartbeat(r.region.lease_seconds)
        return r.region

    async def unregister_shared_memory(self, names: list[str] | None = None) -> list[str]:
        """Unregister regions of this namespace (all of them when names is None); returns the names unmapped."""
        r = await self._call(self._stub.UnregisterSharedMemory,
                             pb.UnregisterSharedMemoryRequest(namespace=self.namespace, names=names or []), None)
        self._own_regions -= set(r.unregistered)
        return list(r.unregistered)

    async def shared_memory_status(self, names: list[str] | None = None) -> list["pb.SharedMemoryRegion"]:
        """This namespace's regions on the drafter (and a renewal of their leases)."""
        r = await self._call(self._stub.SharedMemoryStatus,
                             pb.SharedMemoryStatusRequest(namespace=self.namespace, names=names or []), None)
        return list(r.regions)

    def _stage(self, steps: list[SequenceStep], hidden_states) -> "_Staged | None":
        """Copy the batch's hidden states into a free ring slot (one copy); None: they go as given."""
        if not isinstance(hidden_states, SharedTensorRef):
            hidden_states = hidden_parts(steps, hidden_states) if self._ring is not None and steps else []
        return self._stage_states(hidden_states)

    def _stage_states(self, states: "SharedTensorRef | torch.Tensor | list[torch.Tensor]") -> "_Staged | None":
        """_stage for states given as a reference (nothing to copy), a tensor, or the tensors to stack in order."""
        if isinstance(states, SharedTensorRef):
            self.steps_by_reference += 1
            return None
        parts = [states] if isinstance(states, torch.Tensor) else states
        ring = self._ring
        slot = ring.acquire(sum(p.numel() * p.element_size() for p in parts)) if ring is not None and parts else None
        if slot is None:
            self.steps_inline += 1
            return None
        t0 = time.perf_counter()
        try:
            ref = ring.write(slot, parts)
            self.staging_seconds += time.perf_counter() - t0
        except BaseException:
            ring.release(slot)
            raise
        self.steps_by_reference += 1
        return _Staged(ring, slot, ref)

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            try:
                await self._heartbeat
            except asyncio.CancelledError:
                pass
            self._heartbeat = None

    def _ensure_heartbeat(self, lease_seconds: int) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            period = max(0.2, lease_seconds / 3)
            self._heartbeat = asyncio.get_running_loop().create_task(self._renew_leases(period))

    async def _renew_leases(self, period: float) -> None:
        """Renew this namespace's regions every period (a third of the lease); re-register a lost ring."""
        while True:
            await asyncio.sleep(period)
            try:
                r = await self._stub.SharedMemoryStatus(pb.SharedMemoryStatusRequest(namespace=self.namespace),
                                                        metadata=self._metadata,
                                                        timeout=period)
            except grpc.aio.AioRpcError as e:
                log.warning("shared-memory heartbeat to %s failed: %s", self.target, e.code().name)
                continue
            ring = self._ring
            if ring is not None and ring.name not in {x.name for x in r.regions}:
                log.warning("the drafter at %s no longer holds region %r (restarted, or the lease ran out): "
                            "registering a new ring", self.target, ring.name)
                self._ring, self.data_plane, self._heartbeat = None, "inline", None
                ring.close()
                try:
                    await self.enable_shared_memory(**self._ring_settings)
                except Exception as e:  # stay inline
                    log.warning("shared memory stays off: %s", e)
                return
