"""Step frames: an engine step and its answer as raw little-endian arrays, for step channels (docs/step_channel.md).

Through a step channel a request and its reply are normally a serialized ProposeRequest / ProposeResponse. Encoding
and decoding those in Python, on both sides, is most of what a channel adds to the in-process step at batch 1-32 on
the H100 hosts (docs/performance.md, eighth session). A frame carries the common step, greedy or sampled drafts of
inline states without log-probabilities or top-N, as a fixed header followed by arrays. Each side reads and writes
those arrays as numpy views, with no Python object per field or per sequence. A channel speaks frames when both
ends say so in its hello; anything a frame cannot carry still goes as protobuf on the same channel. The two are told
apart by the first byte: a frame starts with "D" (0x44), which as a protobuf key would be field 8 with the
end-group wire type, which no message starts with.

Request frame (REQUEST_MAGIC), every section starting at a multiple of 8 bytes:

  header         magic, n sequences, t committed tokens, w state columns, the states' dtype (a drafter.v1.DType
                 number), flags (0), request_id, the bytes of the sequence ids and of the namespace, 8 reserved bytes
  columns        [6, n] int64: start_positions, num_tokens, next_tokens, num_drafts, seeds (the uint64 seed's bits),
                 predraft_branches
  temperatures   [n] float32
  id_lengths     [n] int32: each sequence id's UTF-8 bytes
  token_ids      [t] int64
  ids            the sequence ids' UTF-8 bytes, one after another
  namespace      UTF-8
  states         [t, w] in the dtype: the committed tokens' target hidden states, in sequence order

Reply frame (REPLY_MAGIC):

  header         magic, n, d draft ids, the bytes of the problems, request_id, 8 reserved bytes
  columns        [5, n] int64: status codes, num_drafts, accepted_drafts, committed_lengths, predrafted
  drafts         [d] int64: each sequence's drafts, in order (none for a failed sequence)
  problems       JSON {"index": "message"} of the sequences whose code is not 0 (absent when none failed)

Everything but the drafts is known before the step's kernels finish: the drafter encodes it while the GPU drafts
(reply_head) and appends the drafts after.

read_request and read_reply check the frame's structure (magic, sizes that add up to its length exactly, a known
dtype) and copy everything but the states out of the buffer (a client may write its mailbox again at any time: the
drafter checks and uses its own copies). Whether the values make sense (ids, positions, vocabulary, the state
width) is the drafter's check (validation.parse_frame), the same as for a columnar ProposeRequest.
"""
import itertools
import json
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from drafter_client.protocol import pb

REQUEST_MAGIC = b"DFQ1"
REPLY_MAGIC = b"DFR1"
VERSION = 1  # the hello's "frames" value both ends must give
# magic, n, t, w, dtype, flags, request_id, ids_bytes, namespace_bytes, reserved (struct: a numpy structured scalar's
# field reads cost about a microsecond each)
REQUEST_HEADER = struct.Struct("<4sIIIIIQIIQ")
# magic, n, drafts, problems_bytes, request_id, reserved
REPLY_HEADER = struct.Struct("<4sIIIQQ")
REQUEST_COLUMNS = ("start_positions", "num_tokens", "next_tokens", "num_drafts", "seeds", "predraft_branches")
STATE_DTYPES = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16}
DTYPE_NUMBERS = {v: k for k, v in STATE_DTYPES.items()}
ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
MAX_COUNT = 1 << 28  # sequences or tokens a header may claim (far above any drafter's limits; keeps sizes small ints)


class FrameError(ValueError):
    """A frame whose structure is wrong; str(e) says what."""


def _up8(x: int) -> int:
    return (x + 7) & ~7


def starts_with(buf, magic: bytes) -> bool:
    """Whether buf (bytes, or a memoryview) holds a frame of this magic (a request or a reply frame)."""
    return len(buf) >= 4 and bytes(buf[:4]) == magic


def request_size(n: int, t: int, w: int, itemsize: int, ids_bytes: int, namespace_bytes: int) -> int:
    return (REQUEST_HEADER.size + 48 * n + _up8(4 * n) + _up8(4 * n) + 8 * t + _up8(ids_bytes)
            + _up8(namespace_bytes) + t * w * itemsize)


@dataclass
class RequestFrame:
    """A request frame as the drafter reads it: the arrays are its own copies, the states a view of the buffer."""

    namespace: str
    request_id: int
    sequence_ids: list[str]
    columns: dict[str, np.ndarray]  # REQUEST_COLUMNS -> [n] int64
    temperatures: np.ndarray  # [n] float32
    token_ids: np.ndarray  # [t] int64
    states: torch.Tensor  # [t, w]


class FrameRequest:
    """A request frame to write (the client's side): len() is its size in bytes, write_into(dest) writes it into a
    buffer of exactly that size (a step channel's mailbox: Mailbox.write), with the states written by
    write_states(view of their section), so that they are copied once, straight from the engine's tensors."""

    def __init__(self, namespace: str, request_id: int, sequence_ids: list[str], columns: np.ndarray,
                 temperatures: np.ndarray, token_ids: np.ndarray, rows: int, width: int, dtype: torch.dtype,
                 write_states: Callable[[memoryview], None]):
        """columns: [6, n] int64 in REQUEST_COLUMNS order; temperatures: [n] float32; token_ids: [rows] int64."""
        self.encoded_ids = [s.encode() for s in sequence_ids]
        self.namespace = namespace.encode()
        self.request_id, self.columns, self.temperatures, self.token_ids = request_id, columns, temperatures, token_ids
        self.n, self.rows, self.width, self.dtype = len(sequence_ids), rows, width, dtype
        self.write_states = write_states
        self.ids = b"".join(self.encoded_ids)
        self.size = request_size(self.n, rows, width, ITEMSIZE[dtype], len(self.ids), len(self.namespace))

    def __len__(self) -> int:
        return self.size

    head_first = True  # (Mailbox.write: write_into calls head_written between the head and the states)

    def write_into(self, dest: memoryview, head_written: Callable[[], None] | None = None) -> None:
        """head_written: called once everything before the states is in dest (a mailbox's head bell)."""
        n, t = self.n, self.rows
        # everything before the states as one bytes object, written with one slice assignment (a numpy view per
        # section cost more than the sections' bytes at small batches)
        pad = lambda b: b + bytes(-len(b) % 8)  # noqa: E731
        head = b"".join((
            REQUEST_HEADER.pack(REQUEST_MAGIC, n, t, self.width, DTYPE_NUMBERS[self.dtype], 0, self.request_id,
                                len(self.ids), len(self.namespace), 0),
            np.ascontiguousarray(self.columns, dtype="<i8").tobytes(),
            pad(np.ascontiguousarray(self.temperatures, dtype="<f4").tobytes()),
            pad(np.array([len(s) for s in self.encoded_ids], dtype="<i4").tobytes()),
            np.ascontiguousarray(self.token_ids, dtype="<i8").tobytes(), pad(self.ids), pad(self.namespace)))
        at = len(head)
        dest[:at] = head
        if head_written is not None:
            head_written()
        self.write_states(dest[at : self.size])

    def __bytes__(self) -> bytes:
        buf = bytearray(self.size)
        self.write_into(memoryview(buf))
        return bytes(buf)


def read_request(buf, with_states: bool = True) -> RequestFrame:
    """The request frame in buf (bytes, or a memoryview of shared memory); raises FrameError when its structure is
    wrong. Everything but the states is copied out of buf first. with_states False: buf is a frame cut before its
    states (without_states: the drafter's rehearsal of its last request), whose states come back as a [t, w] tensor
    of zeros that takes no memory (stride 0)."""
    size = len(buf)
    if size < REQUEST_HEADER.size:
        raise FrameError(f"frame: {size} bytes, shorter than its {REQUEST_HEADER.size}-byte header")
    magic, n, t, w, dtype_number, flags, request_id, ids_bytes, namespace_bytes, _ = REQUEST_HEADER.unpack_from(buf)
    if magic != REQUEST_MAGIC:
        raise FrameError("frame: not a request frame")
    dtype = STATE_DTYPES.get(dtype_number)
    if dtype is None:
        raise FrameError(f"frame: states dtype {dtype_number}; FLOAT32, FLOAT16 or BFLOAT16")
    if flags:
        raise FrameError(f"frame: flags {flags}; this drafter knows none")
    if max(n, t, w, ids_bytes, namespace_bytes) > MAX_COUNT:
        raise FrameError("frame: a count in its header is out of range")
    itemsize = ITEMSIZE[dtype]
    states_bytes = t * w * itemsize if with_states else 0
    want = request_size(n, t, w, itemsize, ids_bytes, namespace_bytes) - t * w * itemsize + states_bytes
    if want != size:
        raise FrameError(f"frame: its header describes {want} bytes; it has {size}")
    head = bytearray(buf[REQUEST_HEADER.size : size - states_bytes])  # (all but the states: a copy)
    at = 0
    cols = np.frombuffer(head, np.int64, 6 * n, at).reshape(6, n)
    at += 48 * n
    temperatures = np.frombuffer(head, np.float32, n, at)
    at += _up8(4 * n)
    lengths = np.frombuffer(head, np.int32, n, at)
    at += _up8(4 * n)
    token_ids = np.frombuffer(head, np.int64, t, at)
    at += 8 * t
    id_lengths = lengths.tolist()  # (python lists: at a few sequences a numpy reduction costs more)
    if n and (min(id_lengths) < 0 or sum(id_lengths) != ids_bytes):
        raise FrameError(f"frame: the sequence ids' lengths do not add up to {ids_bytes} bytes")
    try:
        ids_blob = bytes(head[at : at + ids_bytes])
        ends = list(itertools.accumulate(id_lengths))
        sequence_ids = [ids_blob[a:b].decode() for a, b in zip([0, *ends], ends)]
        at += _up8(ids_bytes)
        namespace = bytes(head[at : at + namespace_bytes]).decode()
    except UnicodeDecodeError:
        raise FrameError("frame: a sequence id or the namespace is not UTF-8") from None
    if not with_states:
        states = torch.zeros(1, dtype=dtype).expand(t * w)
    elif t * w:
        states = torch.frombuffer(buf, dtype=dtype, count=t * w, offset=size - states_bytes)
    else:
        states = torch.empty(0, dtype=dtype)
    return RequestFrame(namespace=namespace, request_id=request_id, sequence_ids=sequence_ids,
                        columns=dict(zip(REQUEST_COLUMNS, cols)), temperatures=temperatures,
                        token_ids=token_ids, states=states.view(t, w))


def rehearsal_pause(seconds: float, every: float, duty: float) -> float:
    """How long both ends wait after a rehearsal (a re-parse of their last frame while they wait, to keep that code
    warm: the client's StepChannel, the drafter's ChannelSet.rehearse) that took `seconds`: at least `every`, and long
    enough that rehearsals take at most `duty` of the time (a rehearsal of d, then a pause of d * (1 / duty - 1))."""
    return max(every, seconds * (1 / duty - 1))


def without_states(buf, frame: RequestFrame) -> bytes:
    """A copy of the request frame in buf (read as frame) cut before its states: read_request(..., with_states=False)
    reads it back."""
    return bytes(buf[: len(buf) - frame.states.numel() * frame.states.element_size()])


@dataclass
class ReplyFrame:
    request_id: int
    codes: np.ndarray  # [n] int32
    num_drafts: np.ndarray  # [n] int64
    accepted_drafts: np.ndarray  # [n] int64
    committed_lengths: np.ndarray  # [n] int64
    predrafted: np.ndarray  # [n] bool
    draft_token_ids: np.ndarray  # [sum num_drafts] int64
    messages: dict[int, str]  # the failed sequences' messages, by index


def reply_head(request_id: int, columns: np.ndarray, num_drafts: int, messages: dict[int, str]) -> tuple[bytes, bytes]:
    """(the reply frame's bytes before its drafts, its bytes after them): everything a step knows before its drafts
    (the drafter encodes it while the GPU drafts). columns: [5, n] int64 (codes, num_drafts, accepted_drafts,
    committed_lengths, predrafted); num_drafts: the draft ids to come; messages: index -> message of the sequences
    whose code is not 0."""
    problems = json.dumps({str(i): m for i, m in messages.items()}).encode() if messages else b""
    head = REPLY_HEADER.pack(REPLY_MAGIC, columns.shape[1], num_drafts, len(problems), request_id, 0)
    return head + np.ascontiguousarray(columns, dtype="<i8").tobytes(), problems


def write_reply(request_id: int, columns: np.ndarray, drafts: np.ndarray, messages: dict[int, str]) -> bytes:
    """A whole reply frame (reply_head's two pieces around the [d] int64 drafts)."""
    head, tail = reply_head(request_id, columns, drafts.shape[0], messages)
    return head + np.ascontiguousarray(drafts, dtype="<i8").tobytes() + tail


def read_reply(buf, n: int) -> ReplyFrame:
    """The reply frame in buf, the answer to a step of n sequences; FrameError when it is not one."""
    size = len(buf)
    if size < REPLY_HEADER.size:
        raise FrameError(f"reply frame: {size} bytes, shorter than its header")
    magic, got_n, d, problems_bytes, request_id, _ = REPLY_HEADER.unpack_from(buf)
    if magic != REPLY_MAGIC or got_n != n:
        raise FrameError(f"reply frame: answers {got_n} sequences of {n}")
    if REPLY_HEADER.size + 8 * (5 * n + d) + problems_bytes != size:
        raise FrameError("reply frame: its header does not describe its size")
    body = np.frombuffer(bytearray(buf[REPLY_HEADER.size : REPLY_HEADER.size + 8 * (5 * n + d)]), np.int64)
    codes, counts, accepted, lengths, predrafted = body[: 5 * n].reshape(5, n)
    if int(counts.sum()) != d:
        raise FrameError(f"reply frame: num_drafts add up to {int(counts.sum())}, but it holds {d} draft ids")
    messages = {}
    if problems_bytes:
        try:
            messages = {int(i): str(m) for i, m in json.loads(bytes(buf[size - problems_bytes :])).items()}
        except (ValueError, AttributeError):
            raise FrameError("reply frame: its problems are not a JSON object of messages") from None
    return ReplyFrame(request_id=request_id, codes=codes.astype(np.int32), num_drafts=counts,
                      accepted_drafts=accepted, committed_lengths=lengths, predrafted=predrafted != 0,
                      draft_token_ids=body[5 * n :], messages=messages)
