"""The messages of one engine step as the client library shows them (SequenceStep in, ProposeResult out), and
their packing into / out of the protocol's ProposeRequest / ProposeResponse. Shared by the unary client
(client.py), the stream session (session.py) and the step channel path; imports only the protocol."""
import concurrent.futures
import ctypes
import os
import threading
from dataclasses import dataclass, field

import grpc
import torch

from drafter_client.protocol import pb
from drafter_client.protocol.wire import WIRE_DTYPE, decode_tensor, encode_tensor, tensor_field_head, varint
from drafter_client.shm_ring import SharedTensorRef


# Codes of a failed call that are the drafter's or the transport's fault, never the caller's: propose() and release()
# answer "no drafts" / "deferred" instead of raising (unless the client has raise_on_error), and the circuit breaker
# opens. NOT_FOUND at the request level is a shared-memory region the drafter no longer holds (it restarted, or the
# region's lease ran out); the client re-registers its own ring. Every other code (INVALID_ARGUMENT,
# PERMISSION_DENIED, UNAUTHENTICATED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, OUT_OF_RANGE, ALREADY_EXISTS,
# UNIMPLEMENTED) is the caller's request or deployment at fault: it raises DrafterError (docs/protocol.md, "When the
# drafter is sick").
FAULT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                         grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND})
# Per-sequence statuses after which the drafter lacks part of the sequence's context (unknown: evicted, released or
# the drafter restarted; a gap: it missed steps; INTERNAL: it dropped the failed step's positions): the sequence's
# SequenceDrafts says needs_resync.
RESYNC_CODES = frozenset({grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0],
                          grpc.StatusCode.INTERNAL.value[0]})
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]  # 14: the code of every sequence of a fallback result


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
    # F > 0: while the engine verifies this step's drafts, the drafter prepares the next step's drafts for up to F
    # likely outcomes; a matching next step is answered at once (SequenceDrafts.predrafted; docs/predraft.md)
    predraft_branches: int = 0


@dataclass
class SequenceDrafts:
    """The drafter's answer for one sequence of a step. code != 0: no drafts this step (decode without them).
    needs_resync: the drafter lacks part of this sequence's context; send its next step from position 0 (every
    committed token with its hidden state), or stop drafting for it (docs/protocol.md, "When the drafter is sick")."""

    sequence_id: str
    code: int  # 0 = OK; otherwise a gRPC status code number (5 unknown sequence, 8 pool full, 9 gap, 11 too long,
    #            14 no answer from the drafter: a fallback result, or a draining drafter refusing new sequences)
    message: str
    drafts: torch.Tensor  # [k] int64 target token ids (empty when code != 0)
    logprobs: torch.Tensor | None  # [k] float32 when asked for
    accepted_drafts: int  # how many of the previous step's drafts the engine committed
    committed_length: int
    top_k_ids: torch.Tensor | None = None  # [k, N] int64 target ids of q's top N (-1 padding), when asked for
    top_k_probs: torch.Tensor | None = None  # [k, N] float32 their probabilities under q
    needs_resync: bool = False  # code in RESYNC_CODES (5 unknown, 9 gap, 13 internal)
    predrafted: bool = False  # answered from drafts prepared during the previous step's verification

    @property
    def ok(self) -> bool:
        """True when the drafter drafted for this sequence (code 0)."""
        return self.code == 0


@dataclass
class ProposeResult:
    """One step's answer, a SequenceDrafts per step sent, in order. fallback: the drafter was not asked (circuit
    breaker open) or did not answer (deadline, UNAVAILABLE, a server fault): every sequence has code 14 and no
    drafts, and fallback_reason says why; decode this step without speculation."""

    sequences: list[SequenceDrafts]
    draft_token_ids: torch.Tensor  # [sum k] all drafts, in step order
    request_id: int = 0
    fallback: bool = False
    fallback_reason: str = ""  # e.g. "DEADLINE_EXCEEDED: ..." or "circuit breaker open (...)"

    def padded(self, fill: int = -1) -> torch.Tensor:
        """Drafts as [B, max k] int64, short rows filled with ``fill``."""
        k = max((s.drafts.numel() for s in self.sequences), default=0)
        out = torch.full((len(self.sequences), k), fill, dtype=torch.int64)
        for i, s in enumerate(self.sequences):
            out[i, : s.drafts.numel()] = s.drafts
        return out


@dataclass
class ReleaseResult:
    """released: how many ids the drafter freed (ids of earlier deferred releases included); not_found: the ids of
    this call it did not hold; deferred: True when the drafter was sick and the ids wait for the next release that
    reaches it (fallback_reason says why)."""

    released: int
    not_found: list[str] = field(default_factory=list)
    deferred: bool = False
    fallback_reason: str = ""


def build_request(namespace: str, steps: list[SequenceStep],
                  hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                  request_id: int = 0) -> "pb.ProposeRequest":
    """Pack a batch into one ProposeRequest: all token ids in one tensor, all hidden states in another (inline
    bytes, or a reference into a registered shared-memory region)."""
    req = _request_without_states(namespace, steps, request_id)
    _set_states(req, hidden_states, None if isinstance(hidden_states, SharedTensorRef)
                else hidden_parts(steps, hidden_states))
    return req


def _set_states(req: "pb.ProposeRequest", hidden_states: "torch.Tensor | SharedTensorRef | None",
                parts: "list[torch.Tensor] | None") -> None:
    """Fill req.hidden_states through protobuf: the reference (a descriptor: small), or parts stacked."""
    if isinstance(hidden_states, SharedTensorRef):
        req.hidden_states.CopyFrom(hidden_states.to_pb())
    else:
        encode_tensor(parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, 0),
                      into=req.hidden_states)


# Inline hidden states from this size up are copied into the serialized request directly (serialize_request).
DIRECT_STATES_MIN_BYTES = 1 << 16
_HIDDEN_STATES_FIELD = 4  # ProposeRequest.hidden_states (proto/drafter/v1/drafter.proto)


def serialize_request(namespace: str, steps: list[SequenceStep],
                      hidden_states: "torch.Tensor | SharedTensorRef | None" = None, request_id: int = 0,
                      chunk_min_bytes: int | None = None) -> "bytes | DirectRequest | ChunkedRequest":
    """build_request(...).SerializeToString(), with large inline hidden states copied once, from the caller's
    tensors straight to where the request goes (a DirectRequest: bytes(it) for gRPC, or written into a step
    channel's mailbox). (build_request then SerializeToString copies them four times: torch.cat, tobytes, into
    the message, out of it; at batch 256 of an 8B head, 6 MiB of states, that was most of the client's time.) The
    message is the request's other fields serialized by protobuf, followed by the hidden_states field written by
    hand: Tensor{dtype, shape, raw} (the wire format lets a field come after the others; the drafter parses the
    same message).
    chunk_min_bytes: inline states of at least this many bytes give a ChunkedRequest instead (ProposeChunked);
    None: never."""
    parts = None if isinstance(hidden_states, SharedTensorRef) else hidden_parts(steps, hidden_states)
    return serialize_with_states(_request_without_states(namespace, steps, request_id), hidden_states, parts,
                                 chunk_min_bytes)


def serialize_with_states(req: "pb.ProposeRequest", hidden_states: "torch.Tensor | SharedTensorRef | None",
                          parts: "list[torch.Tensor] | None",
                          chunk_min_bytes: int | None = None) -> "bytes | DirectRequest | ChunkedRequest":
    """req (every field but hidden_states) serialized with the hidden states: parts (the [rows, W] tensors to
    stack, in order) written by hand when they are large and alike (a DirectRequest: copied once, when the request
    is written where it goes), else through protobuf.
    States of chunk_min_bytes or more (when given) come back as a ChunkedRequest, for ProposeChunked."""
    alike = _alike_rows(parts) if parts else None
    nbytes = alike[0] * alike[1] * parts[0].element_size() if alike is not None else 0
    if nbytes < DIRECT_STATES_MIN_BYTES:
        _set_states(req, hidden_states, parts)
        return req.SerializeToString()
    if chunk_min_bytes is not None and nbytes >= chunk_min_bytes:
        return ChunkedRequest(req, parts)
    return DirectRequest(req, parts, alike)


def _alike_rows(parts: list[torch.Tensor]) -> tuple[int, int] | None:
    """(rows, W) when every part is a [rows_i, W] tensor of one wire dtype and one W; None otherwise. (One pass, a
    shape and a dtype read per part: at batch 128 such checks cost more than the copy they decide on.)"""
    first = parts[0]
    dtype, shape = first.dtype, first.shape
    if dtype not in WIRE_DTYPE or len(shape) != 2:
        return None
    width, rows = shape[1], 0
    for p in parts:
        shape = p.shape
        if len(shape) != 2 or shape[1] != width or p.dtype != dtype:
            return None
        rows += shape[0]
    return rows, width


def one_block(tensors: list[torch.Tensor]) -> "torch.Tensor | None":
    """The tensors as one view when they are consecutive row ranges of one memory block (an engine's batch tensor
    sliced per sequence; the drafter's received request, read as one tensor): contiguous, alike in dtype and row
    shape, each starting where the one before it ends. None otherwise (or for no tensors). The client writes such
    parts in one copy (write_rows); the drafter sends them to the GPU in one DMA (host_staging.py)."""
    if not tensors:
        return None
    first = tensors[0]
    row_shape, dtype = first.shape[1:], first.dtype
    at = first.data_ptr()
    rows = 0
    for t in tensors:
        if t.dtype != dtype or t.shape[1:] != row_shape or t.data_ptr() != at or not t.is_contiguous():
            return None
        at += t.numel() * t.element_size()
        rows += t.shape[0]
    if first.untyped_storage().data_ptr() != tensors[-1].untyped_storage().data_ptr():  # (one allocation)
        return None
    shape = (rows, *row_shape)
    return torch.as_strided(first, shape, torch.empty(shape, device="meta").stride())


# From this many bytes, write_rows splits its copy in two: the first half on the calling thread, the second on a
# helper thread at the same time (ctypes.memmove releases the GIL). One thread of the H100 hosts (16 vCPUs) copies
# about 10 GB/s, two about 15-20 (2.36 MB: 0.21 -> 0.16 ms, 9.4 MB 0.84 -> 0.48, 18.9 MB 1.97 -> 1.06; at 0.6 MB the
# hand-off made it slower, 0.028 -> 0.057). Through a step channel, EAGLE-3 states of batch 256 (18.9 MB) were
# packed 0.6-1.0 ms faster, batch 128 (9.4 MB) within the noise, and at batch 32 (2.36 MB) the drafter's step ran
# 0.13-0.22 ms longer after a split copy: hence 8 MiB (docs/performance.md, ninth session).
PARALLEL_COPY_MIN_BYTES = 8 << 20
# (the process that made it, the helper thread's pool): made on the first large copy, and again in a child process
# after a fork (the parent's thread does not exist there)
_copy_helper: "tuple[int, concurrent.futures.ThreadPoolExecutor] | None" = None
_copy_helper_lock = threading.Lock()


def _helper() -> "concurrent.futures.ThreadPoolExecutor":
    global _copy_helper
    with _copy_helper_lock:
        if _copy_helper is None or _copy_helper[0] != os.getpid():
            _copy_helper = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="drafter-client-copy"))
        return _copy_helper[1]


def _cpus() -> int:
    """The CPUs this process may run on (its affinity: a container or an engine may pin it to fewer than the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def _copy_runs(runs: list[tuple[int, int, int]]) -> None:
    for to, frm, n in runs:
        ctypes.memmove(to, frm, n)


def _halves(runs: list[tuple[int, int, int]], total: int) -> tuple[list, list]:
    """runs ((to, from, bytes) copies) cut at half of their total bytes (a run that straddles it, in two)."""
    first, second, done, half = [], [], 0, total // 2
    for to, frm, n in runs:
        if done >= half:
            second.append((to, frm, n))
        elif done + n <= half:
            first.append((to, frm, n))
        else:
            k = half - done
            first.append((to, frm, k))
            second.append((to + k, frm + k, n - k))
        done += n
    return first, second


def write_rows(parts: list[torch.Tensor], dest: memoryview) -> None:
    """The parts' bytes (tensors of one dtype, any device), one after another, into dest (a writable byte buffer of
    exactly their size): the client's one copy of a step's states. Parts that lie one after another in memory (an
    engine's batch tensor sliced per sequence) go in one copy; otherwise one memmove per part. From
    PARALLEL_COPY_MIN_BYTES, in a process that may run on more than one CPU, the copy is split between this thread
    and a helper thread (an engine that wants every copy on its calling thread sets PARALLEL_COPY_MIN_BYTES higher).
    No torch op per part and none that runs on the caller's intra-op pool: waking that pool cost an engine process
    with torch's default 16 threads, on a 16-vCPU H200 VM shared with the drafter, 38 ms a step (torch.cat of EAGLE-3
    states, batch 16-64; docs/performance.md). One pass over the parts reads each one's address and size (host
    parts need no copy first, device parts are copied to the host): at batch 128 that pass, not the copy, was most
    of the client's packing."""
    keep = []  # (parts copied to the host or made contiguous: alive until their bytes are copied)
    spans = []  # (address, bytes) of each part
    for p in parts:
        if not p.is_cpu:
            p = p.detach().cpu()
            keep.append(p)
        elif not p.is_contiguous():
            p = p.contiguous()
            keep.append(p)
        spans.append((p.data_ptr(), p.numel() * p.element_size()))
    total = sum(n for _, n in spans)
    if total != len(dest):
        raise ValueError(f"the parts hold {total} bytes; the buffer {len(dest)}")
    if not total:
        return
    target = torch.frombuffer(dest, dtype=torch.uint8)  # (only for its address: dest stays exported meanwhile)
    helping = None
    try:
        runs = []  # (to, from, bytes): parts one after another in memory are one run
        at = target.data_ptr()
        start, end = spans[0][0], spans[0][0]
        for ptr, n in spans:
            if ptr != end:
                runs.append((at, start, end - start))
                at += end - start
                start = ptr
            end = ptr + n
        runs.append((at, start, end - start))
        if total >= PARALLEL_COPY_MIN_BYTES and _cpus() > 1:  # (on one CPU the two halves would take turns)
            first, second = _halves(runs, total)
            try:
                helping = _helper().submit(_copy_runs, second)
                runs = first
            except RuntimeError:  # (the interpreter is shutting down: no new work for threads) all on this one
                pass
        _copy_runs(runs)
    finally:
        if helping is not None:
            helping.result()  # (before the buffer and the parts may go)
        del target


def _states_field_head(dtype: torch.dtype, rows: int, width: int, raw_len: int | None) -> bytes:
    """ProposeRequest.hidden_states [rows, width] written by hand up to its raw_len bytes of data (None: no data, a
    ProposeChunked header's: the states come in the chunks)."""
    return tensor_field_head(_HIDDEN_STATES_FIELD, WIRE_DTYPE[dtype], (rows, width), raw_len)


class DirectRequest:
    """A serialized ProposeRequest whose inline states are copied once, straight to where the request goes: a step
    channel's mailbox (write_into: no intermediate buffer), or bytes for gRPC (bytes(request)). len() is its size in
    bytes; the bytes are the other fields as protobuf serializes them, then the hidden_states field written by hand.
    The parts are read when it is written: the caller keeps them unchanged until then."""

    def __init__(self, req: "pb.ProposeRequest", parts: list[torch.Tensor], rows_width: tuple[int, int] | None = None):
        self.parts = parts  # [rows, W] tensors alike in dtype and width, stacked in order as the states
        self.rows, self.width = rows_width or _alike_rows(parts)  # (rows_width: _alike_rows(parts), known already)
        self.dtype = parts[0].dtype
        self.raw_len = self.rows * self.width * parts[0].element_size()
        self.head = req.SerializeToString() + _states_field_head(self.dtype, self.rows, self.width, self.raw_len)

    def __len__(self) -> int:
        return len(self.head) + self.raw_len

    def write_into(self, buf) -> None:
        """Write the request into buf (a writable buffer of exactly len(self) bytes): the one copy of the states."""
        start = len(self.head)
        buf[:start] = self.head
        with memoryview(buf) as whole, whole[start : start + self.raw_len] as dest:
            write_rows(self.parts, dest)

    def __bytes__(self) -> bytes:
        buf = bytearray(len(self))
        self.write_into(buf)
        return bytes(buf)


# ProposeChunked (docs/protocol.md): steps whose inline states reach this size go in chunks of CHUNK_BYTES
# (docs/performance.md, "Large steps over TCP": 0.5-2 MiB chunks measured alike, 256 KiB and 4 MiB slower; from
# 2 MiB of states the chunked call clearly beats one message, at 1 MiB it is about even).
CHUNKED_MIN_BYTES = 2 << 20
CHUNK_BYTES = 1 << 20
# A ProposeChunked upload from this size is spread over DrafterClient's upload_streams connections (when more than
# one). Not below: a batch-128 decode step of an 8B head (3 MiB) took as long over two connections as over one on an
# H200 host (7.32 against 7.32 ms, EAGLE-1 8.94 against 8.65; scripts/rpc_timeline.py --upload-streams 1,2, clients
# taking turns; docs/performance.md)
UPLOAD_PARTS_MIN_BYTES = 8 << 20
# ProposeChunk's fields (proto/drafter/v1/drafter.proto)
_CHUNK_REQUEST_KEY = bytes([1 << 3 | 2])  # request = 1 (message)
_CHUNK_OFFSET_KEY = bytes([2 << 3])  # offset = 2 (varint)
_CHUNK_DATA_KEY = bytes([3 << 3 | 2])  # data = 3 (bytes)


def upload_part_range(nbytes: int, count: int, index: int) -> tuple[int, int]:
    """Bytes [lo, hi) of hidden_states that call ``index`` of an upload spread over ``count`` ProposeChunked calls
    carries (proto/drafter/v1/drafter.proto, ProposeChunk): ceil(nbytes / count) each, the last ones shorter or
    empty."""
    per = -(-nbytes // count)
    lo = min(index * per, nbytes)
    return lo, min(lo + per, nbytes)


class ChunkedRequest:
    """A step for ProposeChunked: the request without its states (sent first, with hidden_states' dtype and shape),
    then the states' bytes in chunks. The states are gathered into one host tensor only where they are not one
    already (several parts, another device); each chunk is then one copy, into the message's bytes."""

    def __init__(self, req: "pb.ProposeRequest", parts: list[torch.Tensor]):
        self.req = req
        self.parts = parts
        first = parts[0]
        self.dtype = first.dtype
        self.shape = (sum(p.shape[0] for p in parts), first.shape[1])
        self.nbytes = self.shape[0] * self.shape[1] * first.element_size()
        self._flat: torch.Tensor | None = None  # flat_states(), once gathered

    def __len__(self) -> int:
        return self.nbytes  # (about the request's size: a step channel takes it only if it fits)

    def header(self, part: "pb.UploadPart | None" = None) -> bytes:
        """The first ProposeChunk: the request, hidden_states with dtype and shape and no data (and the part of an
        upload spread over several calls: index 0). The request is serialized once, its hidden_states field (dtype
        and shape) written after it by hand, as DirectRequest writes it, and the lot put in the chunk's field 1 by
        hand (a CopyFrom of the request and a nested message cost ~10% of a batch-128 header)."""
        body = self.req.SerializeToString() + _states_field_head(self.dtype, *self.shape, None)
        head = _CHUNK_REQUEST_KEY + varint(len(body)) + body
        return head if part is None else head + pb.ProposeChunk(part=part).SerializeToString()

    def flat_states(self) -> torch.Tensor:
        """The states as one contiguous host tensor of bytes ([nbytes] uint8): a view where they are one already.
        Gathered once (the calls of an upload spread over several share it)."""
        if self._flat is None:
            p = self.parts[0]
            if len(self.parts) != 1 or p.device.type != "cpu" or not p.is_contiguous():
                flat = torch.empty(self.nbytes, dtype=torch.uint8)
                write_rows(self.parts, memoryview(flat.numpy()))
                self._flat = flat
            else:
                self._flat = p.detach().view(-1).view(torch.uint8)
        return self._flat

    def messages(self, chunk_bytes: int = CHUNK_BYTES, part: "pb.UploadPart | None" = None):
        """One call's messages, serialized: the header, then ProposeChunk{offset, data} of chunk_bytes each (the last
        one shorter). Lazy: a chunk is copied when gRPC asks for it. part: this call's part of an upload spread over
        part.count calls (bytes upload_part_range(...) only; an extra call's first message carries the part and
        its first chunk, no request)."""
        lo, hi = (0, self.nbytes) if part is None else upload_part_range(self.nbytes, part.count, part.index)
        extra = part is not None and part.index > 0
        if not extra:
            yield self.header(part)
        flat = self.flat_states().numpy()  # (uint8: numpy takes it; a memoryview of it is then zero-copy)
        view = memoryview(flat)
        starts = range(lo, hi, chunk_bytes)
        if extra and not starts:  # (an empty extra part: its first message alone)
            starts = [lo]
        for start in starts:
            data = view[start : min(start + chunk_bytes, hi)]
            # bytes + buffer: one copy of the data into the message
            chunk = _CHUNK_OFFSET_KEY + varint(start) + _CHUNK_DATA_KEY + varint(len(data)) + data
            if extra and start == lo:  # (fields of one message may come in any order: the part, then offset and data)
                chunk = pb.ProposeChunk(part=part).SerializeToString() + chunk
            yield chunk

    def unary(self) -> DirectRequest:
        """The same step as one ProposeRequest (a drafter without ProposeChunked)."""
        req = pb.ProposeRequest()
        req.CopyFrom(self.req)
        return DirectRequest(req, self.parts)


def flat_token_ids(steps: list[SequenceStep]) -> tuple[list[int], torch.Tensor]:
    """(num_tokens per step, every step's token ids one after another as one int64 CPU tensor)."""
    if all(isinstance(s.token_ids, list) for s in steps):  # plain lists: one tensor for the whole batch
        return [len(s.token_ids) for s in steps], torch.tensor([t for s in steps for t in s.token_ids],
                                                                dtype=torch.int64)
    ids = [s.token_ids for s in steps]
    if all(type(t) is torch.Tensor for t in ids):  # tensors: one cat, whose result tells whether they were 1-D host
        try:  # tensors (a cat of 2-D ones is 2-D; of 0-D ones, or of several devices, an error)
            flat = torch.cat(ids)
        except (RuntimeError, TypeError):
            flat = None
        if flat is not None and flat.dim() == 1 and flat.is_cpu:
            return [t.shape[0] for t in ids], flat.to(dtype=torch.int64)
    ids = [torch.as_tensor(s.token_ids, dtype=torch.int64).reshape(-1).cpu() for s in steps]
    return [t.numel() for t in ids], torch.cat(ids)


def _request_without_states(namespace: str, steps: list[SequenceStep], request_id: int) -> "pb.ProposeRequest":
    """The request's fields but the hidden states."""
    counts, flat_ids = flat_token_ids(steps)
    greedy = pb.SamplingParams()  # the default: left unset in the message
    req = pb.ProposeRequest(
        namespace=namespace, request_id=request_id,
        steps=[pb.SequenceStep(sequence_id=s.sequence_id, start_position=s.start_position, num_tokens=n,
                               next_token=int(s.next_token), num_drafts=s.num_drafts,
                               predraft_branches=s.predraft_branches,
                               sampling=greedy if not (s.temperature or s.seed or s.return_logprobs or s.top_k_probs)
                               else pb.SamplingParams(temperature=s.temperature, seed=s.seed,
                                                      return_logprobs=s.return_logprobs, top_k_probs=s.top_k_probs))
               for s, n in zip(steps, counts)])
    encode_tensor(flat_ids, into=req.token_ids)
    return req


def hidden_parts(steps: list[SequenceStep], hidden_states: torch.Tensor | None) -> list[torch.Tensor]:
    """The batch's hidden states as the tensors the caller gave: the packed one, or one per step."""
    if hidden_states is not None:
        return [hidden_states]
    if any(s.hidden_states is None for s in steps):
        raise ValueError("pass hidden_states per step or packed for the whole batch, not a mix")
    return [s.hidden_states for s in steps]


def parse_response(resp: "pb.ProposeResponse") -> ProposeResult:
    """Decode a ProposeResponse into a ProposeResult (drafts split per sequence); raises DrafterError for a
    request-level error in the reply, INTERNAL when its draft counts do not add up."""
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
    results = resp.results
    counts = [res.num_drafts for res in results]
    if sum(counts) != flat.numel():
        raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply's num_drafts add up to {sum(counts)}, but it holds "
                                                     f"{flat.numel()} draft ids")
    drafts = [flat] if len(counts) == 1 else flat.split(counts)
    lps = lps.split(counts) if lps is not None else [None] * len(counts)
    top_ids = top_ids.split(counts) if top_ids is not None else [None] * len(counts)
    top_probs = top_probs.split(counts) if top_probs is not None else [None] * len(counts)
    seqs = []
    for res, d, lp, ti, tp in zip(results, drafts, lps, top_ids, top_probs):
        status = res.status
        seqs.append(SequenceDrafts(
            sequence_id=res.sequence_id, code=status.code, message=status.message, drafts=d, logprobs=lp,
            accepted_drafts=res.accepted_drafts, committed_length=res.committed_length, top_k_ids=ti,
            top_k_probs=tp, needs_resync=status.code in RESYNC_CODES, predrafted=res.predrafted))
    return ProposeResult(sequences=seqs, draft_token_ids=flat, request_id=resp.request_id)


def fallback_result(steps: list[SequenceStep], reason: str, request_id: int = 0) -> ProposeResult:
    """The "no drafts" answer to a step the drafter was not asked or did not answer: code 14 (UNAVAILABLE) and no
    drafts for every sequence, fallback=True with the reason."""
    empty = torch.empty(0, dtype=torch.int64)
    seqs = [SequenceDrafts(sequence_id=s.sequence_id, code=UNAVAILABLE, message=reason, drafts=empty, logprobs=None,
                           accepted_drafts=0, committed_length=0) for s in steps]
    return ProposeResult(sequences=seqs, draft_token_ids=empty, request_id=request_id, fallback=True,
                         fallback_reason=reason)


def _status_code(code: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c
    return grpc.StatusCode.UNKNOWN
