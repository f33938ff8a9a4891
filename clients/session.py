"""A ProposeStream session: the engine keeps one bidirectional stream open and sends one message per step."""
import asyncio
from collections import deque

import grpc
import torch

from drafter_client.messages import DrafterError, ProposeResult, SequenceStep, build_request, parse_response


class ProposeSession:
    """``send`` may be called several times before ``recv``: replies come back in send order.
    A request the server refuses as a whole raises DrafterError from the matching ``recv``; the stream stays open.
    With the client's shared-memory ring enabled, each message's slot is given back when its reply arrives.
    """

    def __init__(self, client, call):
        self._client = client
        self._call = call
        self._lock = asyncio.Lock()
        self._in_flight: deque = deque()  # per message sent and not yet answered: its ring slot (_Staged) or None

    async def __aenter__(self) -> "ProposeSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def send(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None) -> int:
        """Write one step's request on the stream; returns its request id. Raises DrafterError when the stream broke."""
        staged = self._client._stage(steps, hidden_states)
        try:
            req = build_request(self._client.namespace, steps, staged.ref if staged else hidden_states,
                                self._client._request_id())
        except BaseException:
            if staged is not None:
                staged.done(answered=True)  # never sent
            raise
        self._in_flight.append(staged)
        try:
            await self._call.write(req)
        except grpc.aio.AioRpcError as e:
            self._abandon()
            raise DrafterError(e.code(), e.details() or "") from None
        return req.request_id

    async def recv(self) -> ProposeResult:
        """The reply to the oldest unanswered send(); raises DrafterError for a refused request or a closed stream."""
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self._abandon()
            raise DrafterError(e.code(), e.details() or "") from None
        if resp is grpc.aio.EOF:
            self._abandon()
            code = await self._call.code()
            raise DrafterError(code, (await self._call.details()) or "stream closed by the server")
        if self._in_flight:
            staged = self._in_flight.popleft()
            if staged is not None:
                staged.done(answered=True)
        return parse_response(resp)

    def _abandon(self) -> None:
        """The stream broke: messages still unanswered may yet be read by the drafter, so retire their slots."""
        while self._in_flight:
            staged = self._in_flight.popleft()
            if staged is not None:
                staged.done(answered=False)

    async def propose(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None) -> ProposeResult:
        """send + recv, safe to call from several tasks (each waits its turn)."""
        async with self._lock:
            await self.send(steps, hidden_states)
            return await self.recv()

    async def close(self) -> None:
        """End the stream (half-close, then cancel); slots of unanswered messages are retired."""
        try:
            await self._call.done_writing()
        except grpc.aio.AioRpcError:
            pass
        self._call.cancel()
        self._abandon()
