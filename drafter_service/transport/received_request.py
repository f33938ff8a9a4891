"""A ProposeRequest off the wire, its inline hidden states left as a view of the received bytes.

protobuf copies a bytes field twice on its way to a tensor: into the parsed message, then out of it (the
``Tensor.raw`` accessor builds a new bytes object). In a large step nearly all of the request is
``hidden_states.raw`` (an EAGLE-3 8B step of batch 256: 18.9 of 18.9 MB), so read_request finds that field by hand
and gives the rest of the message (a few KB) to protobuf; the states then become a tensor over the received bytes
without a copy (the proposer's copy into pinned memory, on its way to the device, is their first). A request with
anything unexpected (hidden_states twice, raw twice or beside shm, a malformed field) goes to protobuf whole, which
gives the same message, or the same DecodeError, as before.

Which requests are scanned: those of MIN_SCAN_BYTES (64 KiB) or more, and the scan gives up (protobuf then takes the
message whole) after max(MIN_SCAN_FIELDS, len // SCAN_BYTES_PER_FIELD) top-level fields. A field costs the scan about
1 us (pure Python), as much as copying some 10-40 KB three times, so a request with many small fields (one
SequenceStep per sequence, little state per row) is not worth it; a columnar request (StepColumns: five top-level
fields) always is. Through a step channel on an H100 host (docs/performance.md, eighth session), the drafter's parse
and step of a 770 KiB EAGLE-1 batch-32 step took 0.12-0.75 ms less than with the 1 MiB threshold before; 72-192 KiB
steps the same within the noise.

A message that is shared memory (a step channel's mailbox, read in place) is copied before protobuf parses any of it:
only the states stay a view, so a client rewriting its mailbox during the parse changes only its own states.

Used for Propose, ProposeStream messages (server.py registers read_request as their deserializer) and step-channel
requests (step_channels.py).
"""
import itertools
from dataclasses import dataclass

from drafter_client.protocol import pb
from drafter_service.transport.chunked import wire_fields

_HIDDEN_STATES = 4  # ProposeRequest.hidden_states (proto/drafter/v1/drafter.proto)
_RAW, _SHM = 3, 4  # Tensor.raw, Tensor.shm
_TENSOR_FIELDS = 4  # at most this many fields in a hidden_states Tensor worth scanning
# Smaller requests go to protobuf whole (the module's docstring says why these numbers).
MIN_SCAN_BYTES = 64 << 10
MIN_SCAN_FIELDS = 8
SCAN_BYTES_PER_FIELD = 16 << 10


@dataclass
class ReceivedRequest:
    request: "pb.ProposeRequest"
    # hidden_states.raw, when read_request took it out of the message (request.hidden_states then holds its dtype and
    # shape only); None: the states, if any, are in request.hidden_states as protobuf parsed them
    states: memoryview | None = None

    @property
    def namespace(self) -> str:
        """(For the auth interceptor, which checks the namespace of every decoded request.)"""
        return self.request.namespace


def _split_states(buf: memoryview) -> "tuple[bytes, bytes, memoryview] | None":
    """(the request's bytes without hidden_states, the Tensor's bytes without raw, raw) when the message has one
    hidden_states field holding one raw field and no shm; None otherwise (or when malformed)."""
    budget = max(MIN_SCAN_FIELDS, len(buf) // SCAN_BYTES_PER_FIELD)
    try:
        found = []
        for i, f in enumerate(wire_fields(buf)):
            if i == budget:  # (many small fields: protobuf is cheaper)
                return None
            if f[0] == _HIDDEN_STATES:
                found.append(f)
        if len(found) != 1 or found[0][1] != 2:  # (a message field is length-delimited; else protobuf decides)
            return None
        _, _, key_start, start, end = found[0]
        inner = list(itertools.islice(wire_fields(buf, start, end), _TENSOR_FIELDS + 1))
    except ValueError:
        return None
    if len(inner) > _TENSOR_FIELDS:  # (a Tensor has dtype, shape and raw: more is repeated fields, protobuf's job)
        return None
    raws = [f for f in inner if f[0] == _RAW]
    if len(raws) != 1 or raws[0][1] != 2 or any(f[0] == _SHM for f in inner):
        return None
    _, _, raw_key, raw_start, raw_end = raws[0]
    rest = bytes(buf[:key_start]) + bytes(buf[end:])  # (the states field is last as the client library writes it)
    tensor = bytes(buf[start:raw_key]) + bytes(buf[raw_end:end])
    return rest, tensor, buf[raw_start:raw_end]


def read_request(message: bytes) -> ReceivedRequest:
    """The request in ``message`` (bytes, or a memoryview of shared memory) with large inline states as a view of it
    (see the module's docstring). Raises protobuf's DecodeError for a message protobuf cannot parse."""
    if len(message) >= MIN_SCAN_BYTES:
        split = _split_states(memoryview(message))
        if split is not None:
            rest, tensor, raw = split
            request = pb.ProposeRequest.FromString(rest)
            request.hidden_states.MergeFromString(tensor)  # dtype and shape (nothing else is left in it)
            return ReceivedRequest(request, raw)
    return ReceivedRequest(pb.ProposeRequest.FromString(message if isinstance(message, bytes) else bytes(message)))


def as_received(request: "ReceivedRequest | pb.ProposeRequest") -> ReceivedRequest:
    """A handler's request as a ReceivedRequest (a servicer called in-process may be given a plain message)."""
    return request if isinstance(request, ReceivedRequest) else ReceivedRequest(request)
