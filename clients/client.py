"""Async client: one engine step per call (Propose), a streaming session (ProposeStream), Release, GetInfo."""
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.rpc import pb, pb_grpc
from drafter_service.wire import decode_tensor, encode_tensor

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class DrafterError(Exception):
    """A request the drafter refused as a whole; ``code`` is the grpc.StatusCode, ``message`` names the field."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class SequenceStep:
    """One sequence's part of an engine step.

    token_ids: the committed tokens x[p .. p+m-1] the target just processed ([m] ints).
    hidden_states: their target hidden states [m, GetInfo.hidden_states_width] (fp32/fp16/bf16, any device);
        may be None when the caller passes the whole batch's states packed to ``propose(hidden_states=...)``.
    next_token: x[p+m], the bonus token (or the first token of the next prefill chunk).
    num_drafts: k, 0 for a prefill chunk.
    """

    sequence_id: str
    start_position: int
    token_ids: torch.Tensor | list[int]
    hidden_states: torch.Tensor | None
    next_token: int
    num_drafts: int
    temperature: float = 0.0
    seed: int = 0
    return_logprobs: bool = False
    top_k_probs: int = 0  # N > 0: the reply describes each draft's distribution by its top N (docs/sampling.md)


@dataclass
class SequenceDrafts:
    sequence_id: str
    code: int  # 0 = OK; otherwise a gRPC status code number (5 unknown sequence, 8 pool full, 9 gap, 11 too long)
    message: str
    drafts: torch.Tensor  # [k] int64 target token ids (empty when code != 0)
    logprobs: torch.Tensor | None  # [k] float32 when asked for
    accepted_drafts: int  # how many of the previous step's drafts the engine committed
    committed_length: int
    top_k_ids: torch.Tensor | None = None  # [k, N] int64 target ids of q's top N (-1 padding), when asked for
    top_k_probs: torch.Tensor | None = None  # [k, N] float32 their probabilities under q

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass
class ProposeResult:
    sequences: list[SequenceDrafts]
    draft_token_ids: torch.Tensor  # [sum k] all drafts, in step order
    request_id: int = 0

    def padded(self, fill: int = -1) -> torch.Tensor:
        """Drafts as [B, max k] int64, short rows filled with ``fill``."""
        k = max((s.drafts.numel() for s in self.sequences), default=0)
        out = torch.full((len(self.sequences), k), fill, dtype=torch.int64)
        for i, s in enumerate(self.sequences):
            out[i, : s.drafts.numel()] = s.drafts
        return out


@dataclass
class ReleaseResult:
    released: int
    not_found: list[str] = field(default_factory=list)


def build_request(namespace: str, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None,
                  request_id: int = 0) -> "pb.ProposeRequest":
    """Pack a batch into one ProposeRequest: all token ids in one tensor, all hidden states in another."""
    ids = [torch.as_tensor(s.token_ids, dtype=torch.int64).reshape(-1) for s in steps]
    if hidden_states is None:
        if any(s.hidden_states is None for s in steps):
            raise ValueError("pass hidden_states per step or packed for the whole batch, not a mix")
        hidden_states = torch.cat([s.hidden_states for s in steps]) if steps else torch.empty(0, 0)
    req = pb.ProposeRequest(
        namespace=namespace, request_id=request_id,
        steps=[pb.SequenceStep(sequence_id=s.sequence_id, start_position=s.start_position, num_tokens=t.numel(),
                               next_token=int(s.next_token), num_drafts=s.num_drafts,
                               sampling=pb.SamplingParams(temperature=s.temperature, seed=s.seed,
                                                          return_logprobs=s.return_logprobs,
                                                          top_k_probs=s.top_k_probs))
               for s, t in zip(steps, ids)])
    req.token_ids.CopyFrom(encode_tensor(torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)))
    req.hidden_states.CopyFrom(encode_tensor(hidden_states))
    return req


def parse_response(resp: "pb.ProposeResponse") -> ProposeResult:
    if resp.HasField("error") and resp.error.code != 0:
        raise DrafterError(_status_code(resp.error.code), resp.error.message)
    flat = decode_tensor(resp.draft_token_ids, "draft_token_ids", (pb.INT64,), 1).clone()
    lps = None
    if resp.HasField("draft_logprobs"):
        lps = decode_tensor(resp.draft_logprobs, "draft_logprobs", (pb.FLOAT32,), 1).clone()
    top_ids = top_probs = None
    if resp.HasField("draft_top_k_ids"):
        top_ids = decode_tensor(resp.draft_top_k_ids, "draft_top_k_ids", (pb.INT64,), 2).clone()
        top_probs = decode_tensor(resp.draft_top_k_probs, "draft_top_k_probs", (pb.FLOAT32,), 2).clone()
    seqs, r = [], 0
    for res in resp.results:
        k = res.num_drafts
        seqs.append(SequenceDrafts(
            sequence_id=res.sequence_id, code=res.status.code, message=res.status.message, drafts=flat[r : r + k],
            logprobs=None if lps is None else lps[r : r + k], accepted_drafts=res.accepted_drafts,
            committed_length=res.committed_length, top_k_ids=None if top_ids is None else top_ids[r : r + k],
            top_k_probs=None if top_probs is None else top_probs[r : r + k]))
        r += k
    return ProposeResult(sequences=seqs, draft_token_ids=flat, request_id=resp.request_id)


def _status_code(code: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c
    return grpc.StatusCode.UNKNOWN


class DrafterClient:
    """Async client over TCP (``host:port``) or a Unix socket (``unix:/path``). One per engine process."""

    def __init__(self, target: str, namespace: str = "", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.target = target
        self.namespace = namespace
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)])
        self._stub = pb_grpc.DrafterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._next_request_id = 1

    async def __aenter__(self) -> "DrafterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the server's health says SERVING (the model is loaded)."""
        import asyncio
        import time

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
            return await rpc(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise DrafterError(e.code(), e.details() or "") from None

    async def get_info(self, timeout: float | None = None) -> "pb.GetInfoResponse":
        return await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout)

    def _request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    async def propose(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None,
                      timeout: float | None = None) -> ProposeResult:
        """One engine step for a batch (unary RPC). Per-sequence problems come back in ``result.sequences``."""
        req = build_request(self.namespace, steps, hidden_states, self._request_id())
        return parse_response(await self._call(self._stub.Propose, req, timeout))

    def stream(self) -> "ProposeSession":
        """A bidirectional session: one message per engine step, replies in order. Use ``async with``."""
        from .session import ProposeSession

        return ProposeSession(self, self._stub.ProposeStream())

    async def release(self, sequence_ids: list[str], timeout: float | None = None) -> ReleaseResult:
        r = await self._call(self._stub.Release, pb.ReleaseRequest(namespace=self.namespace,
                                                                   sequence_ids=list(sequence_ids)), timeout)
        return ReleaseResult(released=r.released, not_found=list(r.not_found))
