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

One upload may also be spread over several calls at once, each on a connection of its own (ProposeChunk.part):
the call with the request makes the staging tensor and registers it (UploadRegistry, by namespace and upload id),
each extra call fills its byte range of it (SpreadUpload), and the step runs once every part is in. A part that
fails fails the upload; the other calls then stop.
"""
import asyncio
import collections
from dataclasses import dataclass

import grpc
import torch

from drafter_client.protocol import pb
from drafter_client.protocol.wire import TORCH_DTYPE, dtype_name
from drafter_service.transport.validation import (HIDDEN_DTYPES, Limits, RequestError, check_states_width,
                                                  committed_rows, invalid)

# What the server reads of a refused upload before it answers (drain_refused): at most this much, for at most this long
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 2.0

# ProposeChunk's fields (proto/drafter/v1/drafter.proto)
_REQUEST, _OFFSET, _DATA, _PART = 1, 2, 3, 4
# Most uploads of one namespace whose extra calls may wait for their first call at once (UploadRegistry.join)
MAX_WAITING_UPLOADS = 16
MAX_UPLOAD_ID_CHARS = 128
MAX_ENDED_UPLOADS = 1024  # ended uploads remembered, so that an extra call coming after its upload ended ends at once


@dataclass
class Chunk:
    """One ProposeChunk as parse_chunk read it. data is a view of the received message (no copy)."""

    request: "pb.ProposeRequest | None"
    offset: int
    data: memoryview
    error: str = ""  # a message that does not parse: the handler answers INVALID_ARGUMENT with this
    part: "pb.UploadPart | None" = None  # first chunk of a call of an upload spread over several calls

    @property
    def namespace(self) -> str | None:
        """The namespace of the call (first chunk: the request's, or an extra call's part's), for the auth
        interceptor's check; None on later chunks."""
        if self.request is not None:
            return self.request.namespace
        return self.part.namespace if self.part is not None else None


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
    request, offset, data, part = None, 0, buf[0:0], None
    try:
        for field, wire, _, i, j in wire_fields(buf):
            if wire == 0:
                if field == _OFFSET:
                    offset = _varint(buf, i)[0]
                elif field in (_REQUEST, _DATA, _PART):
                    raise ValueError(f"field {field} has wire type 0")
            elif wire == 2:
                if field == _REQUEST:  # (a repeated message field merges, as protobuf does)
                    request = request or pb.ProposeRequest()
                    request.MergeFromString(buf[i:j])
                elif field == _DATA:
                    data = buf[i:j]
                elif field == _PART:
                    part = part or pb.UploadPart()
                    part.MergeFromString(buf[i:j])
                elif field == _OFFSET:
                    raise ValueError("field 2 (offset) is length-delimited")
    except Exception as e:  # (ValueError, protobuf's DecodeError)
        return Chunk(None, 0, buf[0:0], error=f"a ProposeChunk that does not parse: {e}")
    return Chunk(request, offset, data, part=part)


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
    check_states_width(shape[1], limits, "hidden_states")
    return torch.empty(shape, dtype=TORCH_DTYPE[t.dtype], pin_memory=pin)


async def receive_states(first: Chunk, chunks, staging: torch.Tensor) -> None:
    """Copy the first chunk's data and the chunks after it (an async iterator of Chunk) into ``staging``, in
    order, each byte once (an upload in one call). Raises RequestError naming the first chunk that breaks the
    rules; the caller bounds the time."""
    flat = staging.view(-1).view(torch.uint8)  # [nbytes] view of the staging tensor (contiguous, fresh)
    await receive_range(first, chunks, flat, 0, flat.numel())


async def receive_range(first: Chunk, chunks, flat: torch.Tensor, lo: int, hi: int, where: str = "",
                        aborted=None) -> None:
    """Copy the first chunk's data and the chunks after it into bytes [lo, hi) of ``flat`` (the staging tensor's
    [nbytes] uint8 view), in order from lo, each byte once. where: how messages name the call ("part 2: ");
    aborted(): raises when the upload failed elsewhere (another call of it), checked before each copy. Raises
    RequestError naming the first chunk that breaks the rules; the caller bounds the time."""
    nbytes = flat.numel()
    end_of = "its shape and dtype make" if (lo, hi) == (0, nbytes) else f"its part is bytes [{lo}, {hi}) of"
    ends = f"{nbytes} bytes" if (lo, hi) == (0, nbytes) else "hidden_states"
    if first.offset != lo:
        raise invalid(f"{where}chunk 0 starts at byte {first.offset} of hidden_states; expected {lo}")
    received = lo + len(first.data)
    if received > hi:
        raise invalid(f"{where}chunk 0 ends at byte {received} of hidden_states; {end_of} {ends}")
    if received > lo:
        flat[lo:received].copy_(torch.frombuffer(first.data, dtype=torch.uint8))
    index = 0
    async for chunk in chunks:
        index += 1
        if aborted is not None:
            aborted()
        if chunk.error:
            raise invalid(f"{where}chunk {index}: {chunk.error}")
        if chunk.request is not None:
            raise invalid(f"{where}chunk {index} has a request; only the first chunk carries it")
        if chunk.part is not None:
            raise invalid(f"{where}chunk {index} has a part; only the first chunk carries it")
        n = len(chunk.data)
        if n == 0:
            raise invalid(f"{where}chunk {index} has no data; only the first chunk may be empty")
        if chunk.offset != received:
            raise invalid(f"{where}chunk {index} starts at byte {chunk.offset} of hidden_states; expected {received} "
                          "(chunks come in order, without gaps or overlaps)")
        if received + n > hi:
            raise invalid(f"{where}chunk {index} ends at byte {received + n} of hidden_states; {end_of} {ends}")
        flat[received : received + n].copy_(torch.frombuffer(chunk.data, dtype=torch.uint8))
        received += n
    if received != hi:
        raise invalid(f"{where}the upload ended after {received - lo} of the {hi - lo} bytes of "
                      + ("hidden_states" if (lo, hi) == (0, nbytes) else f"its part [{lo}, {hi})"))


def first_chunk_error(chunk: "Chunk | None", max_parts: int) -> "RequestError | None":
    """What is wrong with the first message of a ProposeChunked call, if anything (an extra call of an upload
    spread over several: its part; its offset is checked against its part's range by receive_range). max_parts:
    --max-upload-parts."""
    if chunk is None:
        return invalid("ProposeChunked got no message; the first chunk carries the request")
    if chunk.error:
        return invalid(f"chunk 0: {chunk.error}")
    part = chunk.part
    if part is not None:
        if max_parts < 2:
            return invalid("this drafter takes every upload in one call (--max-upload-parts 1, "
                           "GetInfo.max_upload_parts); send no part")
        if not 2 <= part.count <= max_parts:
            return invalid(f"part.count is {part.count}; an upload spreads over 2 to {max_parts} calls "
                           "(GetInfo.max_upload_parts)")
        if part.index >= part.count:
            return invalid(f"part.index is {part.index}; part.count is {part.count}")
        if not 0 < len(part.upload_id) <= MAX_UPLOAD_ID_CHARS:
            return invalid(f"part.upload_id has {len(part.upload_id)} characters; 1 to {MAX_UPLOAD_ID_CHARS}")
        if part.index > 0:
            if chunk.request is not None:
                return invalid(f"chunk 0 of part {part.index} has a request; only the call with part.index 0 "
                               "carries it")
            return None
        if chunk.request is not None and part.namespace and part.namespace != chunk.request.namespace:
            return invalid(f"part.namespace is {part.namespace!r}; the request's is {chunk.request.namespace!r}")
    if chunk.request is None:
        return invalid("chunk 0 has no request; the first chunk carries the ProposeRequest")
    if chunk.offset != 0:
        return invalid(f"chunk 0 starts at byte {chunk.offset} of hidden_states; expected 0")
    return None


class SpreadUpload:
    """An upload spread over several ProposeChunked calls, while the call with the request (index 0) runs: the
    staging tensor the calls fill, and what each extra call has done. Used on the event loop only."""

    def __init__(self, flat: torch.Tensor, count: int):
        self.flat = flat  # [nbytes] uint8 view of the staging tensor
        self.count = count
        loop = asyncio.get_running_loop()
        self.parts_in = {i: loop.create_future() for i in range(1, count)}  # result: that call's bytes are all in
        self.claimed: set[int] = set()
        self.failure: "RequestError | None" = None  # set when the upload failed: its calls stop

    def claim(self, index: int, count: int) -> None:
        """An extra call joins: its count must be the first call's and its index free; else the upload fails."""
        error = None
        if count != self.count:
            error = invalid(f"part {index}: part.count is {count}; the upload's first call says {self.count}")
        elif index in self.claimed:
            error = invalid(f"part {index} of the upload came twice")
        if error is not None:
            self.fail(error)
            raise error
        self.claimed.add(index)

    def check_alive(self) -> None:
        """An extra call's check before each copy: ABORTED once the upload failed elsewhere."""
        if self.failure is not None:
            raise RequestError(grpc.StatusCode.ABORTED, f"the upload failed elsewhere: {self.failure.message}")

    def check_parts(self) -> None:
        """The first call's check before each copy: an extra call's failure, as it is (the step's answer)."""
        if self.failure is not None:
            raise self.failure

    def part_done(self, index: int, error: "RequestError | None" = None) -> None:
        """Extra call ``index`` has all its bytes in (error None), or failed: then the upload fails."""
        if error is not None:
            self.fail(error)
        elif not self.parts_in[index].done():
            self.parts_in[index].set_result(None)

    async def all_parts(self) -> None:
        """Until every extra call's bytes are in; raises the first failure (its message names its part)."""
        for fut in self.parts_in.values():
            await fut
        if self.failure is not None:
            raise self.failure

    def fail(self, error: RequestError) -> None:
        """The upload cannot run (a part failed, or its first call failed or is done): extra calls still reading
        stop, and all_parts raises error."""
        if self.failure is None:
            self.failure = error
        for fut in self.parts_in.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # (retrieved: a failure nobody awaits any more is not logged)


class UploadRegistry:
    """The uploads spread over several calls that are in flight, by (namespace, upload_id), so that their extra
    calls find the staging tensor their first call made. An extra call that comes before its first call waits for
    it (join; at most MAX_WAITING_UPLOADS uploads per namespace, within the caller's time limit). Event loop only."""

    def __init__(self, max_waiting: int = MAX_WAITING_UPLOADS):
        self.max_waiting = max_waiting
        self.uploads: dict[tuple[str, str], SpreadUpload] = {}
        self.waiting: dict[tuple[str, str], asyncio.Future] = {}  # result: the SpreadUpload (or its refusal)
        self.waiters: dict[tuple[str, str], int] = {}  # extra calls waiting on each of those futures
        # why each of the last MAX_ENDED_UPLOADS uploads ended (an extra call that comes later ends with it)
        self.ended: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def open(self, namespace: str, upload_id: str, flat: torch.Tensor, count: int) -> SpreadUpload:
        key = (namespace, upload_id)
        if key in self.uploads:
            raise invalid(f"upload {upload_id!r} is already in flight in namespace {namespace!r} (part.upload_id "
                          "must be unique among a namespace's uploads in flight)")
        self.ended.pop(key, None)  # (an id used again)
        upload = self.uploads[key] = SpreadUpload(flat, count)
        fut = self.waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(upload)
        return upload

    def refuse(self, namespace: str, upload_id: str, error: RequestError) -> None:
        """The first call was refused before open: extra calls waiting for it, or coming later, end now."""
        why = f"the upload's first call was refused: {error.message}"
        self._ended((namespace, upload_id), why)
        fut = self.waiting.pop((namespace, upload_id), None)
        if fut is not None and not fut.done():
            fut.set_exception(RequestError(grpc.StatusCode.ABORTED, why))
            fut.exception()

    def _ended(self, key: tuple[str, str], why: str) -> None:
        self.ended[key] = why
        self.ended.move_to_end(key)
        while len(self.ended) > MAX_ENDED_UPLOADS:
            self.ended.popitem(last=False)

    def close(self, namespace: str, upload_id: str, error: RequestError) -> None:
        """The first call is done (stepped or failed): the upload leaves; extra calls still reading end with
        ABORTED naming error."""
        upload = self.uploads.pop((namespace, upload_id), None)
        if upload is not None:
            upload.fail(error)
            self._ended((namespace, upload_id), f"the upload has ended: {error.message}")

    async def join(self, namespace: str, upload_id: str) -> SpreadUpload:
        """The upload of an extra call; waits for its first call (the caller bounds the time)."""
        key = (namespace, upload_id)
        upload = self.uploads.get(key)
        if upload is not None:
            return upload
        if key in self.ended:
            raise RequestError(grpc.StatusCode.ABORTED, self.ended[key])
        fut = self.waiting.get(key)
        if fut is None:
            if sum(1 for ns, _ in self.waiting if ns == namespace) >= self.max_waiting:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"namespace {namespace!r} has {self.max_waiting} uploads whose extra calls wait "
                                   "for their first call; at most that many")
            fut = self.waiting[key] = asyncio.get_running_loop().create_future()
            self.waiters[key] = 0
        self.waiters[key] += 1
        try:
            return await asyncio.shield(fut)
        finally:
            self.waiters[key] -= 1
            if self.waiters[key] == 0:  # the last extra call waiting for it gives up (or got it)
                del self.waiters[key]
                if self.waiting.get(key) is fut:
                    del self.waiting[key]
                    fut.cancel()


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
