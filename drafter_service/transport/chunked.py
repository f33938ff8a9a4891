"""ProposeChunked: one engine step whose hidden states arrive in chunks on a client stream (docs/protocol.md).

A 32 MiB prefill in one gRPC message is slow (docs/performance.md, "Large steps over TCP"): the message is
received whole before anything else happens, and is copied several times on the way (gRPC's slices into one
bytes object, protobuf's parse, the Tensor.raw accessor). In chunks of about 1 MiB the client's copy, the
transfer and the server's copy into the staging tensor overlap, and each byte is copied once here: out of the
received message straight into the staging tensor (parse_chunk reads ProposeChunk by hand; only the small first
chunk's request goes through protobuf).

Everything a client sends is untrusted. The request is checked whole (parse_propose) before any data is accepted,
the staging tensor is sized by the checked header (so at most max_request_tokens * width * itemsize bytes), the
bytes of all uploads in flight are capped per namespace and for the server (StagingBudget), chunks must come in
order without gaps or overlaps and add up to exactly the tensor's size, and an upload has a time limit.
"""
import asyncio
from dataclasses import dataclass

import grpc
import torch

from drafter_client.protocol import pb
from drafter_client.protocol.wire import TORCH_DTYPE, dtype_name
from drafter_service.transport.validation import HIDDEN_DTYPES, Limits, RequestError, committed_rows, invalid

# What the server reads of a refused upload before it answers (drain_refused): at most this much, for at most this long
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 2.0

# ProposeChunk's fields (proto/drafter/v1/drafter.proto)
_REQUEST, _OFFSET, _DATA = 1, 2, 3


@dataclass
class Chunk:
    """One ProposeChunk as parse_chunk read it. data is a view of the received message (no copy)."""

    request: "pb.ProposeRequest | None"
    offset: int
    data: memoryview
    error: str = ""  # a message that does not parse: the handler answers INVALID_ARGUMENT with this

    @property
    def namespace(self) -> str | None:
        """The request's namespace (first chunk), for the auth interceptor's check; None on later chunks."""
        return self.request.namespace if self.request is not None else None


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    """(value, next index) of the varint at buf[i]; raises ValueError when it is cut or longer than 10 bytes."""
    value = shift = 0
    for j in range(i, min(i + 10, len(buf))):
        b = buf[j]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, j + 1
        shift += 7
    raise ValueError(f"a varint at byte {i} is cut or too long")


def wire_fields(buf: memoryview, start: int = 0, end: int | None = None):
    """(field number, wire type, key start, value start, value end) of each protobuf field in buf[start:end], in
    order: values are located, not read (a varint's bytes are buf[value start:value end]). ValueError for a field
    that is cut, or of a wire type this protocol does not use (groups)."""
    end = len(buf) if end is None else end
    i = start
    while i < end:
        key_start = i
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:  # varint
            _, j = _varint(buf, i)
        elif wire == 2:  # length-delimited
            n, i = _varint(buf, i)
            j = i + n
            if j > end:
                raise ValueError(f"field {field} claims {n} bytes; {end - i} are left")
        elif wire == 1:  # 64-bit
            j = i + 8
        elif wire == 5:  # 32-bit
            j = i + 4
        else:
            raise ValueError(f"wire type {wire} (field {field}) is not supported")
        if j > end:
            raise ValueError("the message is cut")
        yield field, wire, key_start, i, j
        i = j


def parse_chunk(message: bytes) -> Chunk:
    """Read one ProposeChunk off the wire: data as a view of ``message``, request parsed by protobuf. Unknown
    fields are skipped (as protobuf does); a malformed message gives a Chunk with ``error`` set (never raises:
    gRPC would answer a deserializer's exception with a bare INTERNAL)."""
    buf = memoryview(message)
    request, offset, data = None, 0, buf[0:0]
    try:
        for field, wire, _, i, j in wire_fields(buf):
            if wire == 0:
                if field == _OFFSET:
                    offset = _varint(buf, i)[0]
                elif field in (_REQUEST, _DATA):
                    raise ValueError(f"field {field} has wire type 0")
            elif wire == 2:
                if field == _REQUEST:  # (a repeated message field merges, as protobuf does)
                    request = request or pb.ProposeRequest()
                    request.MergeFromString(buf[i:j])
                elif field == _DATA:
                    data = buf[i:j]
                elif field == _OFFSET:
                    raise ValueError("field 2 (offset) is length-delimited")
    except Exception as e:  # (ValueError, protobuf's DecodeError)
        return Chunk(None, 0, buf[0:0], error=f"a ProposeChunk that does not parse: {e}")
    return Chunk(request, offset, data)


class StagingBudget:
    """Bytes of the staging tensors of all chunked uploads in flight: at most ``per_namespace`` for one namespace,
    ``total`` for the server. An upload that would pass either gets RESOURCE_EXHAUSTED at once (it never waits, so
    one client's uploads cannot hold up another's). Used on the event loop only (no lock)."""

    def __init__(self, total: int, per_namespace: int):
        self.total, self.per_namespace = total, per_namespace
        self.in_flight = 0
        self.by_namespace: dict[str, int] = {}

    def acquire(self, namespace: str, nbytes: int) -> None:
        mine = self.by_namespace.get(namespace, 0)
        if mine + nbytes > self.per_namespace:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"hidden_states of {nbytes} bytes: namespace {namespace!r} has {mine} bytes of "
                               f"chunked uploads in flight, at most {self.per_namespace} "
                               "(--max-chunked-bytes-per-namespace)")
        if self.in_flight + nbytes > self.total:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"hidden_states of {nbytes} bytes: the drafter has {self.in_flight} bytes of chunked "
                               f"uploads in flight, at most {self.total} (--max-chunked-bytes); retry later")
        self.in_flight += nbytes
        self.by_namespace[namespace] = mine + nbytes

    def release(self, namespace: str, nbytes: int) -> None:
        self.in_flight -= nbytes
        left = self.by_namespace[namespace] - nbytes
        if left:
            self.by_namespace[namespace] = left
        else:
            del self.by_namespace[namespace]


def staging_tensor(req: "pb.ProposeRequest", limits: Limits, pin: bool = False) -> torch.Tensor:
    """The uninitialized [rows, width] tensor the chunks fill, after checking the header's hidden_states (dtype,
    rank, width, rows = the steps' num_tokens, no inline data) so that its size is bounded by the limits. pin: in
    pinned host memory (a CUDA drafter: the states then go to the GPU in one DMA, host_staging.py)."""
    t = req.hidden_states
    if t.dtype not in HIDDEN_DTYPES:
        raise invalid(f"hidden_states.dtype is {dtype_name(t.dtype)}; accepted: "
                      f"{', '.join(dtype_name(d) for d in HIDDEN_DTYPES)}")
    which = t.WhichOneof("data")
    if which is not None:
        raise invalid(f"hidden_states.{which} is set in a ProposeChunked request; its bytes come in the chunks' "
                      "data (give only dtype and shape)")
    shape = list(t.shape)
    if len(shape) != 2:
        raise invalid(f"hidden_states.shape is {shape}; expected 2 dimensions")
    total = committed_rows(req)
    if total > limits.max_request_tokens:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the steps carry {total} committed tokens; at most {limits.max_request_tokens} per "
                           "request (send long prompts in chunks)")
    if shape[0] != total:
        raise invalid(f"hidden_states has {shape[0]} rows; the steps' num_tokens add up to {total}")
    if shape[1] != limits.hidden_states_width:
        raise invalid(f"hidden_states has {shape[1]} columns; this model takes {limits.hidden_states_width} "
                      "(GetInfo.hidden_states_width)")
    return torch.empty(shape, dtype=TORCH_DTYPE[t.dtype], pin_memory=pin)


async def receive_states(first: Chunk, chunks, staging: torch.Tensor) -> None:
    """Copy the first chunk's data and the chunks after it (an async iterator of Chunk) into ``staging``, in
    order, each byte once. Raises RequestError naming the first chunk that breaks the rules; the caller bounds
    the time."""
    flat = staging.view(-1).view(torch.uint8)  # [nbytes] view of the staging tensor (contiguous, fresh)
    nbytes = flat.numel()
    received = len(first.data)  # (first_chunk_error checked that it starts at 0)
    if received > nbytes:
        raise invalid(f"chunk 0 ends at byte {received} of hidden_states; its shape and dtype make {nbytes} bytes")
    if received:
        flat[:received].copy_(torch.frombuffer(first.data, dtype=torch.uint8))
    index = 0
    async for chunk in chunks:
        index += 1
        if chunk.error:
            raise invalid(f"chunk {index}: {chunk.error}")
        if chunk.request is not None:
            raise invalid(f"chunk {index} has a request; only the first chunk carries it")
        n = len(chunk.data)
        if n == 0:
            raise invalid(f"chunk {index} has no data; only the first chunk may be empty")
        if chunk.offset != received:
            raise invalid(f"chunk {index} starts at byte {chunk.offset} of hidden_states; expected {received} "
                          "(chunks come in order, without gaps or overlaps)")
        if received + n > nbytes:
            raise invalid(f"chunk {index} ends at byte {received + n} of hidden_states; its shape and dtype make "
                          f"{nbytes} bytes")
        flat[received : received + n].copy_(torch.frombuffer(chunk.data, dtype=torch.uint8))
        received += n
    if received != nbytes:
        raise invalid(f"the upload ended after {received} of the {nbytes} bytes of hidden_states")


def first_chunk_error(chunk: "Chunk | None") -> "RequestError | None":
    """What is wrong with the first message of a ProposeChunked stream, if anything."""
    if chunk is None:
        return invalid("ProposeChunked got no message; the first chunk carries the request")
    if chunk.error:
        return invalid(f"chunk 0: {chunk.error}")
    if chunk.request is None:
        return invalid("chunk 0 has no request; the first chunk carries the ProposeRequest")
    if chunk.offset != 0:
        return invalid(f"chunk 0 starts at byte {chunk.offset} of hidden_states; expected 0")
    return None


async def drain_refused(chunks, max_bytes: int = DRAIN_MAX_BYTES, max_s: float = DRAIN_MAX_S) -> bool:
    """Read and drop what is left of a refused upload, until the client half-closes (True) or max_bytes / max_s run
    out (False: the answer goes now). A server that answers a client stream while the client still writes races
    those writes, and grpcio's asyncio client then reports INTERNAL "Internal error from Core" in place of the
    server's status (grpc/grpc#36066), which a client takes for a drafter fault; answered after the last chunk, the
    refusal arrives with its own code and message. Nothing read is kept (chunk data are views of the message)."""
    seen = 0
    try:
        async with asyncio.timeout(max_s):
            async for chunk in chunks:
                seen += len(chunk.data)
                if seen > max_bytes:
                    return False
    except TimeoutError:
        return False
    return True
