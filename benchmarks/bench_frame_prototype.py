"""How much a raw columns frame could save over protobuf on a step channel (a script, not a test; issue #13).

A PROTOTYPE, not a format the product speaks. Through a step channel the request and reply are protobuf messages
(docs/step_channel.md); on the H100 hosts their encoding and decoding, in Python on both sides, is most of what the
channel adds to the in-process step at batch 1-32 (docs/performance.md, eighth session). This script sizes what a
frame of raw little-endian arrays would cost instead, against the protobuf forms of bench_request_codec.py, in one
process, alternated in rounds:

  request frame   a fixed header (counts, width, request id), then [4, B] int64 columns (start positions, num
                  tokens, next tokens, num drafts), [T] int64 token ids, the sequence ids and the namespace as
                  UTF-8, and the [T, W] bf16 states; the client writes it into the buffer in place (numpy / torch
                  views), the drafter reads it as views, with the range checks parse_propose makes on columns
                  (positions, counts, next tokens, draft counts, token ids, distinct ids) and a BatchInput's tensors
  reply frame     a header, then [4, B] int64 (status codes, draft counts, accepted drafts, committed lengths) and the
                  flat drafts; the client reads it into BatchDrafts

What it leaves out, and a real format would need: sampling columns (temperatures, seeds), pre-drafting budgets,
status messages for failed sequences, request-level errors, shared-memory references, a version. Those add a few
fields to both sides. Phases and forms as in bench_request_codec.py:

    python benchmarks/bench_frame_prototype.py --batches 1,8,32,128
"""
import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_request_codec import PHASES, make_step, one_round, print_table, summary_row  # noqa: E402
from drafter_client.batch import BatchDrafts  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.runtime import keep_large_blocks_in_heap  # noqa: E402
from drafter_service.transport.validation import Limits  # noqa: E402

PROTOBUF_FORMS = ("rows", "batch-rows", "batch-cols")
REQUEST_MAGIC, REPLY_MAGIC = 0x46524D31, 0x52504C31
HEADER = np.dtype([("magic", "<u4"), ("n", "<u4"), ("t", "<u4"), ("w", "<u4"), ("request_id", "<u8"),
                   ("ids_bytes", "<u4"), ("namespace_bytes", "<u4")])
REPLY_HEADER = np.dtype([("magic", "<u4"), ("n", "<u4"), ("drafts", "<u4"), ("pad", "<u4"), ("request_id", "<u8")])


def _up8(x: int) -> int:
    return (x + 7) & ~7


def frame_size(n: int, t: int, w: int, ids: bytes, namespace: bytes) -> int:
    return HEADER.itemsize + 32 * n + 8 * t + _up8(len(ids)) + _up8(len(namespace)) + 2 * t * w


def write_request(buf: bytearray, namespace: bytes, ids: bytes, n: int, columns: np.ndarray, tokens: np.ndarray,
                  states: torch.Tensor, request_id: int) -> int:
    """columns: [4, n] int64 (p, m, next token, k); tokens: [T] int64; states: [T, W] bf16. Returns the size."""
    t, w = states.shape
    h = np.zeros((), HEADER)
    h["magic"], h["n"], h["t"], h["w"], h["request_id"] = REQUEST_MAGIC, n, t, w, request_id
    h["ids_bytes"], h["namespace_bytes"] = len(ids), len(namespace)
    view = memoryview(buf)
    at = HEADER.itemsize
    view[:at] = h.tobytes()
    np.frombuffer(buf, np.int64, 4 * n, at).reshape(4, n)[:] = columns
    at += 32 * n
    np.frombuffer(buf, np.int64, t, at)[:] = tokens
    at += 8 * t
    view[at : at + len(ids)] = ids
    at = _up8(at + len(ids))
    view[at : at + len(namespace)] = namespace
    at = _up8(at + len(namespace))
    torch.frombuffer(buf, dtype=torch.bfloat16, count=t * w, offset=at).view(t, w).copy_(states)
    return at + 2 * t * w


def read_request(buf: bytearray, size: int, limits: Limits) -> dict:
    """The frame's columns as tensors (states a view of buf), checked as parse_propose checks columns."""
    if size < HEADER.itemsize:
        raise ValueError("frame: shorter than its header")
    h = np.frombuffer(buf, HEADER, 1)[0]
    n, t, w = int(h["n"]), int(h["t"]), int(h["w"])
    if h["magic"] != REQUEST_MAGIC or w != limits.hidden_states_width or n > limits.max_request_seqs:
        raise ValueError("frame: not a request of this drafter")
    ids_bytes, ns_bytes = int(h["ids_bytes"]), int(h["namespace_bytes"])
    if frame_size(n, t, w, b"\0" * ids_bytes, b"\0" * ns_bytes) != size:
        raise ValueError("frame: its counts do not add up to its size")
    at = HEADER.itemsize
    p, m, nxt, k = np.frombuffer(buf, np.int64, 4 * n, at).reshape(4, n)
    at += 32 * n
    tokens = np.frombuffer(buf, np.int64, t, at)
    at += 8 * t
    ids = bytes(memoryview(buf)[at : at + ids_bytes]).decode().split("\0")
    at = _up8(at + ids_bytes)
    namespace = bytes(memoryview(buf)[at : at + ns_bytes]).decode()
    at = _up8(at + ns_bytes)
    if len(ids) != n or len(set(ids)) != n or int(m.sum()) != t:
        raise ValueError("frame: sequence ids or token counts do not match")
    vocab = limits.vocab_size
    if n and (p.min() < 0 or m.min() < 1 or nxt.min() < 0 or nxt.max() >= vocab or k.min() < 0
              or k.max() > limits.max_draft_tokens):
        raise ValueError("frame: a column out of range")
    if t and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError("frame: a token id outside the vocabulary")
    states = torch.frombuffer(buf, dtype=torch.bfloat16, count=t * w, offset=at).view(t, w)
    return dict(namespace=namespace, sequence_ids=ids, start_positions=torch.from_numpy(p.copy()),
                num_tokens=torch.from_numpy(m.copy()), next_tokens=torch.from_numpy(nxt.copy()),
                num_drafts=torch.from_numpy(k.copy()), token_ids=torch.from_numpy(tokens.copy()), hidden_states=states,
                temperatures=torch.zeros(n), seeds=torch.zeros(n, dtype=torch.int64))


def write_reply(buf: bytearray, columns: np.ndarray, drafts: np.ndarray, request_id: int) -> int:
    """columns: [4, n] int64 (code, num drafts, accepted, committed length); drafts: the flat draft ids."""
    n, d = columns.shape[1], drafts.shape[0]
    h = np.zeros((), REPLY_HEADER)
    h["magic"], h["n"], h["drafts"], h["request_id"] = REPLY_MAGIC, n, d, request_id
    memoryview(buf)[: REPLY_HEADER.itemsize] = h.tobytes()
    out = np.frombuffer(buf, np.int64, 4 * n + d, REPLY_HEADER.itemsize)
    out[: 4 * n] = columns.reshape(-1)
    out[4 * n :] = drafts
    return REPLY_HEADER.itemsize + 8 * (4 * n + d)


def read_reply(buf: bytearray, sequence_ids: list[str]) -> BatchDrafts:
    n = len(sequence_ids)
    h = np.frombuffer(buf, REPLY_HEADER, 1)[0]
    d = int(h["drafts"])
    if h["magic"] != REPLY_MAGIC or h["n"] != n:
        raise ValueError("reply frame: not the answer to this step")
    a = np.frombuffer(buf, np.int64, 4 * n + d, REPLY_HEADER.itemsize).copy()
    codes, counts, accepted, lengths = a[: 4 * n].reshape(4, n)
    if int(counts.sum()) != d:
        raise ValueError("reply frame: draft counts do not add up")
    return BatchDrafts(sequence_ids=list(sequence_ids), codes=torch.from_numpy(codes.astype(np.int32)),
                       num_drafts=torch.from_numpy(counts), draft_token_ids=torch.from_numpy(a[4 * n :]),
                       accepted_drafts=torch.from_numpy(accepted), committed_lengths=torch.from_numpy(lengths),
                       needs_resync=torch.zeros(n, dtype=torch.bool), messages={}, request_id=int(h["request_id"]),
                       predrafted=torch.zeros(n, dtype=torch.bool))


def frame_round(cols, outputs, limits: Limits, reps: int) -> dict[str, float]:
    """One round of the frame's four phases (as one_round times the protobuf forms)."""
    ids = cols.sequence_ids
    n, t = len(ids), cols.token_ids.shape[0]
    k = np.full(n, cols.num_drafts, dtype=np.int64)
    drafts = np.array([d for o in outputs for d in o.drafts], dtype=np.int64)
    request = bytearray(frame_size(n, t, cols.hidden_states.shape[1], "\0".join(ids).encode(), b"bench"))
    reply = bytearray(REPLY_HEADER.itemsize + 8 * (4 * n + drafts.shape[0]))
    times = {p: [] for p in PHASES}
    for _ in range(reps):
        t0 = time.perf_counter()
        columns = np.stack([cols.start_positions.numpy(), cols.num_tokens.numpy(), cols.next_tokens.numpy(), k])
        size = write_request(request, b"bench", "\0".join(ids).encode(), n, columns, cols.token_ids.numpy(),
                             cols.hidden_states, 1)
        t1 = time.perf_counter()
        got = read_request(request, size, limits)
        t2 = time.perf_counter()
        answer = np.stack([np.zeros(n, np.int64), got["num_drafts"].numpy(), np.ones(n, np.int64),
                           (got["start_positions"] + got["num_tokens"]).numpy()])
        write_reply(reply, answer, drafts, 1)
        t3 = time.perf_counter()
        read_reply(reply, ids)
        t4 = time.perf_counter()
        for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[p].append(dt)
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench_out/frame_prototype.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    keep_large_blocks_in_heap()
    limits = Limits(hidden_states_width=a.width, vocab_size=128256, max_draft_tokens=8, max_request_tokens=1 << 20,
                    max_request_seqs=4096)
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        steps, cols, outputs = make_step(batch, a.m, a.k, a.width, 128256)
        rounds = {f: [] for f in (*PROTOBUF_FORMS, "frame")}
        for _ in range(a.rounds):  # (the forms alternated within each round)
            for form in PROTOBUF_FORMS:
                rounds[form].append(one_round(form, steps, cols, outputs, limits, a.reps))
            rounds["frame"].append(frame_round(cols, outputs, limits, a.reps))
        rows.extend(summary_row(batch, form, got) for form, got in rounds.items())
    result = dict(benchmark="bench_frame_prototype", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
                  python=platform.python_version(), torch=torch.__version__, m=a.m, k=a.k, width=a.width,
                  rounds=a.rounds, reps=a.reps, command=" ".join(sys.argv), rows=rows)
    out = write_json(a.out, result, say=False)
    print(f"{result['device']}, {result['date']}; m={a.m}, k={a.k}, width {a.width}; ms per step, median of "
          f"{a.rounds} rounds (frame: the prototype; the others: protobuf, as bench_request_codec.py)")
    print_table(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
