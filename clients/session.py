"""A ProposeStream session: the engine keeps one bidirectional stream open and sends one message per step."""
import asyncio
from collections import deque

import grpc
import torch

from drafter_client.batch import BatchDrafts, StepBatch, fallback_batch, parse_batch_response, serialize_batch
from drafter_client.messages import (DrafterError, ProposeResult, SequenceStep, fallback_result, hidden_parts,
                                     parse_response)
from drafter_client.shm_ring import SharedTensorRef


class ProposeSession:
    """``propose`` is one engine step on the stream, with the client's step deadline, circuit breaker and fallback
    (like DrafterClient.propose: a sick drafter gives a "no drafts" result, not an exception); a stream that broke
    or missed a deadline is replaced by a new one at the next call. ``propose_batch`` is the same for the batch API
    (a StepBatch in, BatchDrafts out, as DrafterClient.propose_batch): an engine that reaches the drafter by gRPC
    only saves a call's setup per step on the stream (docs/performance.md, "The batch API on a ProposeStream").

    ``send`` / ``send_batch`` and ``recv`` are the raw calls for pipelining: sends may come several before ``recv``,
    replies come back in send order (each parsed as its send's kind); they have no deadline and raise DrafterError
    (a request the server refuses as a whole raises from the matching ``recv`` and the stream stays open; a broken
    stream raises, and the next send opens a new one). With the client's shared-memory ring enabled, each message's
    slot is given back when its reply arrives. A stream carries a step as one message; ``propose`` and
    ``propose_batch`` send a step whose inline states reach the client's chunk_min_bytes (2 MiB) by
    ProposeChunked instead (DrafterClient's own call), the faster way for such steps; the raw sends never do.
    """

    def __init__(self, client, call=None):
        self._client = client
        self._call = call  # None: a stream is opened at the next send
        self._lock = asyncio.Lock()
        # per message sent and not yet answered: (its ring slot (_Staged) or None, how to parse its reply)
        self._in_flight: deque = deque()
        self.streams_opened = 0 if call is None else 1  # (more than 1: streams replaced after a break)

    async def __aenter__(self) -> "ProposeSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _stream(self):
        if self._call is None:
            self._call = self._client._new_stream()
            self.streams_opened += 1
        return self._call

    async def send(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None) -> int:
        """Write one step's request on the stream; returns its request id. Raises DrafterError when the stream broke.
        As propose() sends a unary step: from COLUMNS_MIN_SEQUENCES sequences, to a drafter that takes columns, as
        columns; inline states copied once into the message (serialize_request)."""
        client = self._client
        serialize, parse, _ = await client._steps_codec(steps, None)
        staged = client._stage(steps, hidden_states)
        # (no chunks on a stream)
        return await self._send(lambda rid: serialize(staged.ref if staged else hidden_states, rid, None), staged,
                                parse)

    async def send_batch(self, batch: StepBatch) -> int:
        """send() for the batch API: one StepBatch (its reply, from recv(), is BatchDrafts); as columns from
        COLUMNS_MIN_SEQUENCES sequences to a drafter that takes them, as DrafterClient.propose_batch sends it."""
        client = self._client
        columns, _ = await client._batch_columns(len(batch), None)
        staged = client._stage_states(batch.hidden_states)
        ids = batch.sequence_ids
        return await self._send(
            lambda rid: serialize_batch(client.namespace, batch, staged.ref if staged else None, rid, None, columns),
            staged, lambda resp: parse_batch_response(resp, ids))

    async def _send(self, serialize, staged, parse) -> int:
        """Write serialize(request id) (bytes or a DirectRequest) on the stream; recv() reads its reply with parse."""
        request_id = self._client._request_id()
        try:
            data = bytes(serialize(request_id))
        except BaseException:
            if staged is not None:
                staged.done(answered=True)  # never sent
            raise
        call = self._stream()
        self._in_flight.append((staged, parse))
        try:
            await call.write(data)
        except grpc.aio.AioRpcError as e:
            self._broken()
            raise DrafterError(e.code(), e.details() or "") from None
        except asyncio.InvalidStateError as e:  # the call already ended
            self._broken()
            raise DrafterError(grpc.StatusCode.UNAVAILABLE, f"the stream ended: {e}") from None
        return request_id

    async def recv(self) -> ProposeResult:
        """The reply to the oldest unanswered send(); raises DrafterError for a refused request or a closed stream."""
        call = self._call
        if call is None:
            raise DrafterError(grpc.StatusCode.UNAVAILABLE, "the stream broke: no reply will come")
        try:
            resp = await call.read()
        except grpc.aio.AioRpcError as e:
            self._broken()
            raise DrafterError(e.code(), e.details() or "") from None
        except asyncio.InvalidStateError as e:
            self._broken()
            raise DrafterError(grpc.StatusCode.UNAVAILABLE, f"the stream ended: {e}") from None
        if resp is grpc.aio.EOF:
            code = await call.code()
            details = (await call.details()) or "stream closed by the server"
            self._broken()
            raise DrafterError(code if code != grpc.StatusCode.OK else grpc.StatusCode.UNAVAILABLE, details)
        staged, parse = self._in_flight.popleft() if self._in_flight else (None, parse_response)
        if staged is not None:
            staged.done(answered=True)
        return parse(resp)

    def _broken(self) -> None:
        """The stream cannot be used any more (it broke, or a reply is late): cancel it, and retire the slots of the
        messages still unanswered (the drafter may yet read them). The next send opens a new stream."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        while self._in_flight:
            staged, _ = self._in_flight.popleft()
            if staged is not None:
                staged.done(answered=False)

    async def propose(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None,
                      timeout: float | None = None) -> ProposeResult:
        """send + recv, safe to call from several tasks (each waits its turn), under the client's step deadline
        (timeout: None for its step_timeout_s) and circuit breaker. A sick drafter (no reply in time, a broken
        stream, a code of FAULT_CODES) gives a fallback result: no drafts, ``result.fallback`` True (with the
        client's raise_on_error, DrafterError); the caller's errors raise DrafterError."""
        if not isinstance(hidden_states, SharedTensorRef) and self._large(hidden_parts(steps, hidden_states)):
            return await self._client.propose(steps, hidden_states, timeout)
        return await self._guarded(lambda: self.send(steps, hidden_states),
                                   lambda why: fallback_result(steps, why), timeout)

    async def propose_batch(self, batch: StepBatch, timeout: float | None = None) -> BatchDrafts:
        """propose() for the batch API: send_batch + recv under the same deadline, circuit breaker and fallback (a
        sick drafter: BatchDrafts with every code UNAVAILABLE and ``fallback`` True)."""
        if isinstance(batch.hidden_states, torch.Tensor) and self._large([batch.hidden_states]):
            return await self._client.propose_batch(batch, timeout)
        ids = batch.sequence_ids
        return await self._guarded(lambda: self.send_batch(batch), lambda why: fallback_batch(ids, why), timeout)

    def _large(self, parts: list[torch.Tensor]) -> bool:
        """Whether a step's inline states reach the client's ProposeChunked threshold (chunk_min_bytes, and no ring
        to stage them, nothing of this session in flight): propose() and propose_batch() send such a step by the
        client's own call, in chunks copied into pinned memory, not as one stream message (at batch 128 of an 8B
        head, 3 MiB, one stream message took 9.7 ms per step against 8.1 by ProposeChunked; docs/performance.md)."""
        client = self._client
        threshold = client._chunk_min_bytes()
        if threshold is None or client._ring is not None or self._in_flight:
            return False
        return sum(p.numel() * p.element_size() for p in parts) >= threshold

    async def _guarded(self, send, fallback, timeout: float | None):
        client = self._client
        async with self._lock:
            if not client.breaker.allow():
                return client._without_drafter_do(fallback, *client._refusal_error())
            limit = client._step_timeout(timeout)
            try:
                result = await asyncio.wait_for(self._exchange(send), limit)
            except asyncio.TimeoutError:
                self._broken()  # the late reply would answer the next request
                e = DrafterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply on the stream within {limit} s")
                return client._without_drafter_do(fallback, client._drafter_failed(e), e)
            except DrafterError as e:
                return client._without_drafter_do(fallback, client._drafter_failed(e), e)
            except BaseException:  # cancelled, or the caller's bad input
                if self._in_flight:
                    self._broken()
                client.breaker.abandon()
                raise
        client._answered()
        return result

    async def _exchange(self, send):
        await send()
        return await self.recv()

    async def close(self) -> None:
        """End the stream (half-close, then cancel); slots of unanswered messages are retired."""
        call = self._call
        if call is not None:
            try:
                await asyncio.wait_for(call.done_writing(), 1.0)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError):
                pass
        self._broken()
