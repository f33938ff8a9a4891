"""Host work of one engine step's request and reply, per wire form (a script, not a test).

For each batch size, one decode step (m committed tokens per sequence, k drafts, hidden states [B*m, W] bf16) is
taken through the four host-side phases that surround the proposer, in one process, with no network:

  client pack    the engine's step -> request bytes  (what DrafterClient serializes before sending)
  server parse   request bytes -> the proposer's inputs, every check included (read_request, parse_propose)
  server reply   the proposer's outputs -> reply bytes  (DrafterServicer.encode_propose)
  client parse   reply bytes -> what the engine reads  (ProposeResult / BatchDrafts)

in four forms:

  message       the request built and serialized by protobuf, one SequenceStep message per sequence (what a
                ProposeStream session sent before it serialized its messages as propose() does; a client built
                on the generated code alone sends this)
  rows          propose(list[SequenceStep]): one SequenceStep message per sequence, SequenceResult per sequence
  batch-rows    propose_batch(StepBatch) to a drafter without columnar requests: messages written from columns
  batch-cols    propose_batch(StepBatch) to a drafter with GetInfo.step_columns_supported: ProposeRequest.columns
                and ProposeResponse.result_columns, tensors both ways (no message per sequence)
  steps-cols    propose(list[SequenceStep]) of 32 sequences or more to such a drafter: the steps go as columns
                (steps_as_batch, serialize_steps_as_columns), each step's states copied from where the engine gave
                them; the reply comes back as one ProposeResult per sequence (batch_as_result)

Client pack includes the states' one copy into the request's buffer (a step channel's mailbox: here a buffer of
the request's size), which a request with large states makes when it is written (DirectRequest.write_into).
--scattered-states gives each sequence's states as a slice of a tensor of its own (--context rows each, as an
engine's per-sequence buffers would hold them: cold in cache, no two adjacent); by default they are slices of one
batch tensor, which the client copies in one piece.

Timings alternate the forms within each round (median over rounds of the per-round median); the machine's noise is
shown by the spread over rounds. Prints a table, writes JSON.

    python benchmarks/bench_request_codec.py                       # batch 1, 32, 128, 256; width 4096
    python benchmarks/bench_request_codec.py --batches 128 --width 64
"""
import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client import SequenceStep, StepBatch  # noqa: E402
from drafter_client.batch import (batch_as_result, parse_batch_response, serialize_batch,  # noqa: E402
                                  serialize_steps_as_columns, steps_as_batch)
from drafter_client.messages import build_request, parse_response, serialize_request  # noqa: E402
from drafter_client.protocol import pb  # noqa: E402
from drafter_service.engine.proposer import large_enough_for_columns  # noqa: E402
from drafter_service.engine.step_io import StepOutput  # noqa: E402
from drafter_service.transport.servicer import build_column_response, build_response  # noqa: E402
from drafter_service.runtime import keep_large_blocks_in_heap  # noqa: E402
from drafter_service.transport.received_request import read_request  # noqa: E402
from drafter_service.transport.validation import Limits, parse_propose  # noqa: E402

FORMS = ("message", "rows", "batch-rows", "batch-cols", "steps-cols")
PHASES = ("client pack", "server parse", "server reply", "client parse")


def make_step(batch: int, m: int, k: int, width: int, vocab: int, scattered_rows: int = 0):
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch, m + 1), generator=g)
    hidden = torch.randn(batch * m, width, generator=g).to(torch.bfloat16)
    if scattered_rows:  # each sequence's states: the last m rows of a tensor of its own
        own = [torch.randn(scattered_rows, width, generator=g).to(torch.bfloat16) for _ in range(batch)]
        for b in range(batch):
            own[b][-m:] = hidden[b * m:(b + 1) * m]
        parts = [t[-m:] for t in own]
    else:
        parts = [hidden[b * m:(b + 1) * m] for b in range(batch)]
    steps = [SequenceStep(f"seq-{b}", 1000, tokens[b, :m], parts[b], int(tokens[b, m]), k) for b in range(batch)]
    cols = StepBatch(sequence_ids=[s.sequence_id for s in steps], start_positions=torch.full((batch,), 1000),
                     num_tokens=torch.full((batch,), m), token_ids=tokens[:, :m].reshape(-1), hidden_states=hidden,
                     next_tokens=tokens[:, m].clone(), num_drafts=k)
    outputs = [StepOutput(drafts=torch.randint(0, vocab, (k,), generator=g).tolist(), accepted_drafts=1,
                          committed_length=1000 + m) for _ in range(batch)]
    return steps, cols, outputs


def one_round(form: str, steps, cols, outputs, limits: Limits, reps: int) -> dict[str, float]:
    ids = cols.sequence_ids
    times = {p: [] for p in PHASES}
    for _ in range(reps):
        t0 = time.perf_counter()
        if form == "message":  # protobuf builds and serializes the whole message (ProposeStream before 471563f)
            data = build_request("bench", steps, None, 1).SerializeToString()
        elif form == "rows":
            data = serialize_request("bench", steps, None, 1)
        elif form == "steps-cols":
            data = serialize_steps_as_columns("bench", steps, steps_as_batch(steps), None, 1)
        else:
            data = serialize_batch("bench", cols, request_id=1, columns=form in ("batch-cols", "steps-cols"))
        if hasattr(data, "write_into"):  # (the states' one copy, into the request's buffer)
            buf = memoryview(bytearray(len(data)))
            data.write_into(buf)
            data = buf
        t1 = time.perf_counter()
        received = read_request(data)  # as the server reads Propose, ProposeStream and channel requests
        req = received.request
        # (as the servicer parses: a greedy request of messages that the proposer would run from columns is decoded
        # as columns, DrafterServicer.steps_as_columns; on a drafter without first-step graphs, from 8 sequences)
        parse_propose(req, limits, None, None, received.states, columnar=True,
                      steps_as_columns=lambda n, rows: n > 1 and large_enough_for_columns(n, rows))
        t2 = time.perf_counter()
        resp = (build_column_response(outputs, 1) if req.HasField("columns")
                else build_response(outputs, [s.sequence_id for s in req.steps], 1)).SerializeToString()
        t3 = time.perf_counter()
        reply = pb.ProposeResponse.FromString(resp)
        if form in ("message", "rows"):
            parse_response(reply)
        elif form == "steps-cols":
            batch_as_result(parse_batch_response(reply, ids))
        else:
            parse_batch_response(reply, ids)
        t4 = time.perf_counter()
        for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[p].append(dt)
    return {p: statistics.median(v) for p, v in times.items()}


def summary_row(batch: int, form: str, rounds: list[dict[str, float]]) -> dict:
    """One form's row of the table: each phase's median over the rounds (ms), its spread, and their total."""
    row = dict(batch=batch, form=form)
    for p in PHASES:
        values = [r[p] * 1e3 for r in rounds]
        row[p] = statistics.median(values)
        row[p + " spread"] = [min(values), max(values)]
    row["total"] = sum(row[p] for p in PHASES)
    return row


def print_table(rows: list[dict]) -> None:
    """The rows (summary_row) as a table, each total also against the "rows" form's of its batch."""
    print(f"{'batch':>5} {'form':>10} " + " ".join(f"{p:>13}" for p in PHASES) + f" {'total':>8} {'vs rows':>8}")
    base = {r["batch"]: r["total"] for r in rows if r["form"] == "rows"}
    for r in rows:
        print(f"{r['batch']:>5} {r['form']:>10} " + " ".join(f"{r[p]:>13.3f}" for p in PHASES)
              + f" {r['total']:>8.3f} {r['total'] / base[r['batch']]:>8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--m", type=int, default=3, help="committed tokens per sequence")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--width", type=int, default=4096, help="hidden-state columns (Llama-3.1-8B EAGLE-1: 4096)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--scattered-states", action="store_true",
                    help="each sequence's states in a tensor of its own (--context rows), not slices of one tensor")
    ap.add_argument("--context", type=int, default=1024, help="rows of each sequence's own tensor (--scattered-states)")
    ap.add_argument("--out", default="bench_out/request_codec.json")
    ap.add_argument("--no-tune-malloc", action="store_true",
                    help="leave glibc's malloc thresholds alone (the drafter tunes them at start, as here by default: "
                         "messages of many MiB then cost no page faults)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tuned = not a.no_tune_malloc and keep_large_blocks_in_heap()
    limits = Limits(hidden_states_width=a.width, vocab_size=128256, max_draft_tokens=8, max_request_tokens=1 << 20,
                    max_request_seqs=4096)
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        steps, cols, outputs = make_step(batch, a.m, a.k, a.width, 128256,
                                         a.context if a.scattered_states else 0)
        rounds = {f: [] for f in FORMS}
        for _ in range(a.rounds):
            for form in FORMS:
                rounds[form].append(one_round(form, steps, cols, outputs, limits, a.reps))
        for form in FORMS:
            row = summary_row(batch, form, rounds[form])
            rows.append(row)
            print(f"batch {batch:4d} {form:10s} " + "  ".join(f"{p} {row[p]:.3f}" for p in PHASES)
                  + f"  total {row['total']:.3f} ms", flush=True)
    result = dict(benchmark="bench_request_codec", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
                  python=platform.python_version(), torch=torch.__version__, m=a.m, k=a.k, width=a.width,
                  rounds=a.rounds, reps=a.reps, malloc_tuned=tuned, scattered_states=a.scattered_states,
                  command=" ".join(sys.argv), rows=rows)
    out = write_json(a.out, result, say=False)
    print(f"\n{result['device']}, {result['date']}; m={a.m}, k={a.k}, width {a.width}; ms per step, median of "
          f"{a.rounds} rounds")
    print_table(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
