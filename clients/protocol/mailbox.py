"""The step channel's mailbox: one shared-memory segment, a request doorbell and a reply doorbell.

The drafter creates the segment (a memfd sealed against shrinking and growing, so that no client can truncate it
under the drafter's mapping and crash it with SIGBUS) and hands its file descriptor to the client over a Unix
socket (step_channels.py). Both map it read-write. One request is in flight at a time.

  offset  field (u64 little-endian)  written by
  0       magic "DRFTSTP2"           drafter
  8       request_capacity           drafter
  16      reply_capacity             drafter
  24      flags                      drafter: bit 0 CHECKSUMS (crcs are written and checked; else both crcs are 0)
  64      request_seq                client: bumped (+1) after the request's bytes, length and crc are written
  72      request_len                client
  80      request_crc                client: crc32 over request_seq (8 bytes LE) then the request bytes, or 0
  88      request_sent_ns            client: CLOCK_MONOTONIC (time.monotonic_ns) just before it rang the doorbell;
                                     0 from clients before it (the drafter then takes the time it saw the request)
  96      request_head_seq           client, request frames only: the coming request_seq, set once the frame's
                                     bytes before its states and request_len are written, before the states
                                     (0 or stale from clients before it: the drafter then reads the frame at the
                                     doorbell, as always)
  128     state                      drafter: 1 open, 2 closed (it takes no more requests)
  136     taken_seq                  drafter: the last request_seq it read
  192     reply_seq                  drafter: the request_seq it answers, bumped after the reply is written
  200     reply_len                  drafter
  208     reply_crc                  drafter: crc32 over reply_seq then the reply bytes, or 0
  4096    request area               [request_capacity] bytes: a serialized drafter.v1.ProposeRequest
  4096 + request_capacity            [reply_capacity] bytes: a serialized drafter.v1.ProposeResponse

The doorbell words sit on their own cache lines. A writer stores the bytes, then the length (and crc), then the
doorbell. On x86-64 that order is the order every other core sees (stores are not reordered with other stores,
and glibc's memcpy fences its non-temporal stores), so a reader that sees the new doorbell sees the bytes behind
it. On weakly ordered CPUs (ARM, POWER) it may not: there the drafter turns CHECKSUMS on, the crc covers the
sequence number, and a reader that sees a new doorbell before the bytes finds a mismatch and reads again instead
of taking the previous message for the new one. (zlib's crc32 costs 0.2-0.25 ms per MiB on each side, which is why it is
not paid where the hardware already orders the stores.)

The head bell (request_head_seq) lets the drafter check a request frame's head while the client still copies its
states into the area (docs/step_channel.md, "Reading ahead"): a frame of 128 sequences carries 3 MiB of states, and
their copy takes about as long as the head's check. It rings only without CHECKSUMS (the crc covers the whole
request, which is not there yet) and is only a hint: the drafter takes the request at the doorbell, and uses what it
read ahead only when request_len is still what it was.
"""
import mmap
import platform
import time
import zlib
from dataclasses import dataclass
from typing import Callable

VERSION = 2  # of the step-channel hello and this layout (2: the flags word; crcs only with CHECKSUMS)
MAGIC = int.from_bytes(b"DRFTSTP2", "little")
HEADER_BYTES = 4096
OPEN, CLOSED = 1, 2
CHECKSUMS = 1  # flags bit

# word indices (offset // 8)
_MAGIC, _REQUEST_CAPACITY, _REPLY_CAPACITY, _FLAGS = 0, 1, 2, 3
_REQUEST_SEQ, _REQUEST_LEN, _REQUEST_CRC, _REQUEST_SENT_NS, _REQUEST_HEAD_SEQ = 8, 9, 10, 11, 12
_STATE, _TAKEN_SEQ = 16, 17
_REPLY_SEQ, _REPLY_LEN, _REPLY_CRC = 24, 25, 26


def checksums_needed() -> bool:
    """False where the CPU makes stores visible in program order (x86-64): the doorbell cannot overtake the bytes."""
    return platform.machine().lower() not in ("x86_64", "amd64")


def _crc(seq: int, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(seq.to_bytes(8, "little")))


@dataclass
class _Area:
    seq: int  # word index of the doorbell
    length: int
    crc: int
    start: int  # byte offset of the area
    capacity: int
    sent_ns: int | None = None  # word index of the writer's send time (the request area only)
    head_seq: int | None = None  # word index of the head bell (the request area only)


class Mailbox:
    """Typed access to a mapped mailbox (mm: a read-write mmap of the whole segment)."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.words = memoryview(mm)[:HEADER_BYTES].cast("Q")
        if self.words[_MAGIC] != MAGIC:
            raise ValueError("not a drafter step-channel mailbox of this version (bad magic)")
        self.checksums = bool(self.words[_FLAGS] & CHECKSUMS)
        req_cap, rep_cap = self.words[_REQUEST_CAPACITY], self.words[_REPLY_CAPACITY]
        if HEADER_BYTES + req_cap + rep_cap > len(mm):
            raise ValueError("mailbox capacities exceed the segment")
        self.request = _Area(_REQUEST_SEQ, _REQUEST_LEN, _REQUEST_CRC, HEADER_BYTES, req_cap, _REQUEST_SENT_NS,
                             _REQUEST_HEAD_SEQ)
        self.reply = _Area(_REPLY_SEQ, _REPLY_LEN, _REPLY_CRC, HEADER_BYTES + req_cap, rep_cap)

    @staticmethod
    def segment_bytes(request_capacity: int, reply_capacity: int) -> int:
        return HEADER_BYTES + request_capacity + reply_capacity

    @classmethod
    def initialize(cls, mm: mmap.mmap, request_capacity: int, reply_capacity: int, checksums: bool) -> "Mailbox":
        words = memoryview(mm)[:HEADER_BYTES].cast("Q")
        words[_REQUEST_CAPACITY], words[_REPLY_CAPACITY] = request_capacity, reply_capacity
        words[_FLAGS] = CHECKSUMS if checksums else 0
        words[_STATE] = OPEN
        words[_MAGIC] = MAGIC
        words.release()
        return cls(mm)

    def release(self) -> None:
        """Drop the views into the mapping (before mm.close())."""
        self.words.release()

    # ---- state ----

    @property
    def state(self) -> int:
        return self.words[_STATE]

    def close(self) -> None:
        self.words[_STATE] = CLOSED

    @property
    def taken_seq(self) -> int:
        return self.words[_TAKEN_SEQ]

    # ---- messages ----

    def doorbell(self, area: _Area) -> int:
        return self.words[area.seq]

    def write(self, area: _Area, seq: int, payload) -> None:
        """Write payload, its length and crc (0 without CHECKSUMS), then ring the doorbell with seq. payload: bytes,
        or an object that writes itself into a buffer of len(payload) bytes (write_into: a client's DirectRequest,
        whose states then go into the mapping in one copy)."""
        n = len(payload)
        if n > area.capacity:
            raise ValueError(f"{n} bytes do not fit the {area.capacity}-byte area")
        if hasattr(payload, "write_into"):
            with memoryview(self.mm) as whole, whole[area.start : area.start + n] as dest:
                if area.head_seq is not None and not self.checksums and getattr(payload, "head_first", False):
                    def head_written() -> None:  # (a request frame, between its head and its states)
                        self.words[area.length] = n
                        self.words[area.head_seq] = seq
                    payload.write_into(dest, head_written)
                else:
                    payload.write_into(dest)
                crc = _crc(seq, dest) if self.checksums else 0
        else:
            self.mm[area.start : area.start + n] = payload
            crc = _crc(seq, payload) if self.checksums else 0
        self.words[area.length] = n
        self.words[area.crc] = crc
        if area.sent_ns is not None:
            self.words[area.sent_ns] = time.monotonic_ns()
        self.words[area.seq] = seq

    def read(self, area: _Area, seq: int, into: "Callable[[int], memoryview] | None" = None) -> "bytes | memoryview | None":
        """The message behind doorbell seq, or None while its bytes do not match their crc yet (with CHECKSUMS) or
        the length is out of bounds (the writer is not done, or wrote garbage). into(n): a writable buffer of n bytes
        to copy the message into (the drafter's pinned host memory, for a large request whose states then go to the
        GPU without another copy), returned as the message; None: new bytes."""
        n = self.words[area.length]
        if n > area.capacity:
            return None
        if into is None:
            payload = self.mm[area.start : area.start + n]  # a copy: the writer may reuse the area after this
        else:
            payload = into(n)
            with memoryview(self.mm) as whole, whole[area.start : area.start + n] as src:
                payload[:] = src  # (one memcpy)
        if self.checksums and _crc(seq, payload) != self.words[area.crc]:
            return None
        return payload

    def view(self, area: _Area, seq: int) -> "memoryview | None":
        """Drafter: the message behind doorbell seq as a view of the mapping (no copy), or None as read() says. The
        view is valid until the writer reuses the area: a client writes its next request only after the reply to
        this one, so the drafter uses it until it replies (a client that writes sooner changes only its own step).
        While the view lives the mapping cannot be closed (mmap.close() raises BufferError: it is unmapped when the
        view is collected)."""
        n = self.words[area.length]
        if n > area.capacity:
            return None
        payload = memoryview(self.mm)[area.start : area.start + n]
        if self.checksums and _crc(seq, payload) != self.words[area.crc]:
            payload.release()
            return None
        return payload

    def head_bell(self) -> int:
        """Drafter: the request_seq whose request frame's head is in the area (request_head_seq; the states may still be
        coming): a hint, see the module docstring."""
        return self.words[_REQUEST_HEAD_SEQ]

    def request_sent_ns(self) -> int:
        """The last request's request_sent_ns (CLOCK_MONOTONIC when its client rang the doorbell; 0: none written)."""
        return self.words[_REQUEST_SENT_NS]

    def request_age_s(self, max_s: float) -> float | None:
        """Drafter: how long ago the client rang the request doorbell (its request_sent_ns), in [0, max_s]; None where
        the client wrote none (an older one) or a time that is no CLOCK_MONOTONIC of this host's within max_s (a
        client in another time namespace, or one that lies: the value only places the request's arrival)."""
        sent = self.request_sent_ns()
        if sent == 0:
            return None
        age = (time.monotonic_ns() - sent) * 1e-9
        return age if 0.0 <= age <= max_s else None

    def take(self, seq: int) -> None:
        """Drafter: mark request seq as read (a client that sees state CLOSED and taken_seq != its seq resends
        the request elsewhere: it was never looked at)."""
        self.words[_TAKEN_SEQ] = seq
