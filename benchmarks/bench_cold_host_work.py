"""The host work around a step channel's step, warm and cold (a script, not a test).

A step through a channel costs the engine and the drafter four pieces of Python work: the client packs a request
frame, the drafter reads and checks it, the drafter encodes the reply frame, the client parses it
(drafter_client.protocol.step_frame, the product's own functions). In a serving process each piece runs once per
step, after something else has run for milliseconds (a GPU step, a spin waiting for the other side), not back to
back as a micro-benchmark runs it. This script times each piece, one call at a time, after:

  warm          the same piece, run just before (a micro-benchmark's number)
  spin          a 4 ms busy wait in Python (what a waiting side does)
  32MB read     a read of 32 MB (what a step does to the caches, roughly)
  rehearsed     a 4 ms busy wait during which the same piece is run again every 0.2 ms (StepChannel.rehearse does
                this for the client's reply parse)
  loop X ms     (--idle-ms X,...) a plain Python loop of X ms that reads no clock and touches no memory of its own:
                whether the piece turns cold with the time since it last ran, whatever ran meanwhile
  sleep X ms    (--idle-ms) time.sleep(X ms): the core idle meanwhile

One decode step of B sequences, m = 3, k = 5, bf16 states W wide. Medians of --calls calls per cell, rounds
alternated. Prints a table, writes JSON.

    python benchmarks/bench_cold_host_work.py --batches 1,8,32
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
from drafter_client import SequenceStep  # noqa: E402
from drafter_client.batch import batch_as_result, frame_from_steps, parse_frame_reply  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client.protocol import step_frame  # noqa: E402
from drafter_service.engine.batch_io import BatchOutput  # noqa: E402
from drafter_service.engine.proposer import large_enough_for_columns  # noqa: E402
from drafter_service.engine.step_io import StepOutput  # noqa: E402
from drafter_service.transport.servicer import frame_reply  # noqa: E402
from drafter_service.transport.validation import Limits, parse_frame  # noqa: E402

PIECES = ("client pack", "drafter parse", "drafter reply", "client parse")


def pieces(batch: int, width: int) -> dict:
    """The four pieces of one step of this size, as functions of no argument."""
    m, k, vocab = 3, 5, 128256
    limits = Limits(hidden_states_width=width, vocab_size=vocab, max_draft_tokens=16, max_request_tokens=1 << 16,
                    max_request_seqs=1024)
    states = torch.randn(batch * m, width).to(torch.bfloat16)
    steps = [SequenceStep(f"seq-{i}", 100 + i, torch.tensor([1, 2, 3]), states[i * m:(i + 1) * m], 7, k)
             for i in range(batch)]
    request = frame_from_steps("engine-0", steps, None, 1)
    buf = bytearray(len(request))
    outputs = [StepOutput(drafts=[5, 6, 7, 8, 9], accepted_drafts=2, committed_length=103 + i) for i in range(batch)]
    reply = frame_reply(BatchOutput.from_outputs(outputs), 1)
    ids = [s.sequence_id for s in steps]
    columnar = large_enough_for_columns(batch, batch * m)

    def pack():
        frame_from_steps("engine-0", steps, None, 1).write_into(memoryview(buf))

    def parse():
        parse_frame(step_frame.read_request(memoryview(buf)), limits, columnar)

    def encode():
        frame_reply(BatchOutput.from_outputs(outputs), 1)

    def parse_reply():
        batch_as_result(parse_frame_reply(reply, ids))
    pack()
    return dict(zip(PIECES, (pack, parse, encode, parse_reply)))


def spin(seconds: float, rehearse=None) -> None:
    start = last = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        if rehearse is not None and now - last > 0.0002:
            rehearse()
            last = time.perf_counter()


def busy_loop(iterations: int) -> None:
    x = 0
    for i in range(iterations):
        x += i


def loop_iterations(seconds: float) -> int:
    """busy_loop iterations that take about `seconds` here."""
    t = time.perf_counter()
    busy_loop(200_000)
    return max(1, int(seconds / ((time.perf_counter() - t) / 200_000)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-ms", default="",
                    help="also time each piece after a plain Python loop and after a sleep of each of these many ms "
                         "(e.g. 1,4,16)")
    ap.add_argument("--out", default="bench_out/cold_host_work.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    junk = np.ones(32 << 20, dtype=np.uint8)
    before = {"warm": lambda f: f(), "spin": lambda f: spin(0.004), "32MB read": lambda f: junk.sum(),
              "rehearsed": lambda f: spin(0.004, f)}
    for ms in (float(x) for x in a.idle_ms.split(",") if x):
        n = loop_iterations(ms / 1e3)
        before[f"loop {ms:g} ms"] = lambda f, n=n: busy_loop(n)
        before[f"sleep {ms:g} ms"] = lambda f, s=ms / 1e3: time.sleep(s)
    conditions = list(before)  # (in the order above)
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        fns = pieces(batch, a.width)
        cells = {(p, c): [] for p in PIECES for c in conditions}
        for _ in range(a.rounds):
            for p, f in fns.items():
                for c in conditions:
                    times = []
                    for _ in range(a.calls):
                        before[c](f)
                        t = time.perf_counter()
                        f()
                        times.append(time.perf_counter() - t)
                    cells[(p, c)].append(statistics.median(times) * 1e6)
        for p in PIECES:
            rows.append(dict(batch=batch, piece=p, **{f"{c}_us": statistics.median(cells[(p, c)]) for c in conditions},
                             **{f"{c}_spread_us": [min(cells[(p, c)]), max(cells[(p, c)])] for c in conditions}))
    result = dict(benchmark="bench_cold_host_work", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
                  python=platform.python_version(), torch=torch.__version__, width=a.width, calls=a.calls,
                  rounds=a.rounds, conditions=conditions, command=" ".join(sys.argv), rows=rows)
    write_json(a.out, result, say=False)
    print(f"{result['device']}, {result['date']}; width {a.width}; microseconds per call, median of {a.rounds} "
          f"rounds of {a.calls} calls")
    print(f"{'batch':>5} {'piece':<14}" + "".join(f"{c:>12}" for c in conditions) + f"{'cold/warm':>11}")
    for r in rows:
        cold = max(r["spin_us"], r["32MB read_us"]) / r["warm_us"]
        print(f"{r['batch']:>5} {r['piece']:<14}" + "".join(f"{r[c + '_us']:12.1f}" for c in conditions)
              + f"{cold:10.1f}x")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
