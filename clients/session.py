"""A ProposeStream session: the engine keeps one bidirectional stream open and sends one message per step."""
import asyncio

import grpc
import torch

from .client import DrafterError, ProposeResult, SequenceStep, build_request, parse_response


class ProposeSession:
    """``send`` may be called several times before ``recv``: replies come back in send order.
    A request the server refuses as a whole raises DrafterError from the matching ``recv``; the stream stays open.
    """

    def __init__(self, client, call):
        self._client = client
        self._call = call
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> "ProposeSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def send(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None) -> int:
        req = build_request(self._client.namespace, steps, hidden_states, self._client._request_id())
        try:
            await self._call.write(req)
        except grpc.aio.AioRpcError as e:
            raise DrafterError(e.code(), e.details() or "") from None
        return req.request_id

    async def recv(self) -> ProposeResult:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise DrafterError(e.code(), e.details() or "") from None
        if resp is grpc.aio.EOF:
            code = await self._call.code()
            raise DrafterError(code, (await self._call.details()) or "stream closed by the server")
        return parse_response(resp)

    async def propose(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None) -> ProposeResult:
        """send + recv, safe to call from several tasks (each waits its turn)."""
        async with self._lock:
            await self.send(steps, hidden_states)
            return await self.recv()

    async def close(self) -> None:
        try:
            await self._call.done_writing()
        except grpc.aio.AioRpcError:
            pass
        self._call.cancel()
