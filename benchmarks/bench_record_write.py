"""The host time of a graph step's record write (engine/first_step_record.py), piece by piece (a script, not a test).

A greedy step whose first step replays a CUDA graph writes its raw columns into the record's pinned host copy and
sends the used prefix to the device in one non_blocking copy, before the GPU can start. Per batch size B (m = 1..3
committed tokens per sequence, k = 5, a block table of 65 blocks):

  write               FirstStepRecord.write, then synchronized() (what a step does)
  numpy part          the same write into a CPU record (no copy: the numpy assignments alone)
  copy, sliced        the prefix copy with its host and device views sliced for the call
  copy, kept views    the same copy of views made once (what write does since the twelfth session)
  event record        a CUDA event recorded on the current stream, the stream looked up (what write did before)

Each piece is called --iters times in a row (hot caches: a real step runs it cold, after the GPU wait, and slower),
five times; the table gives the median per call in microseconds. Prints a table, writes JSON (device, date, command).

    python benchmarks/bench_record_write.py --out docs/bench/record_write_pieces.json
"""
import argparse
import datetime
import pathlib
import shlex
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.engine.first_step_record import FirstStepRecord  # noqa: E402


def per_call_us(fn, iters: int) -> float:
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default="bench_out/record_write_pieces.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_record_write: needs a CUDA device (the record's copy and event are CUDA calls)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    width = 65
    record = FirstStepRecord(256, 2048, 70, dev)
    cpu_record = FirstStepRecord(256, 2048, 70, torch.device("cpu"))
    event = torch.cuda.Event()
    rows = []
    for B in [int(x) for x in a.batches.split(",")]:
        m = np.array([1 + i % 3 for i in range(B)], dtype=np.int64)
        p, nxt, k = np.full(B, 1000, dtype=np.int64), np.arange(B, dtype=np.int64), np.full(B, 5, dtype=np.int64)
        tokens, tables = np.arange(int(m.sum()), dtype=np.int64), np.zeros((B, width), dtype=np.int32)
        used = record._tables_at + B * width
        src, dst = record.host[:used], record.on_device[:used]

        def write():
            record.write(p, m, nxt, k, tokens, tables)
            record.synchronized()

        pieces = {
            "write": write,
            "numpy part": lambda: cpu_record.write(p, m, nxt, k, tokens, tables),
            "copy, sliced": lambda: record.on_device[:used].copy_(record.host[:used], non_blocking=True),
            "copy, kept views": lambda: dst.copy_(src, non_blocking=True),
            "event record": lambda: event.record(torch.cuda.current_stream(dev)),
        }
        rows.append(dict(batch=B, **{name: per_call_us(fn, a.iters) for name, fn in pieces.items()}))
    names = [key for key in rows[0] if key != "batch"]
    print(f"{'batch':>5}  " + "  ".join(f"{n:>16}" for n in names) + "   (us per call, hot)")
    for r in rows:
        print(f"{r['batch']:>5}  " + "  ".join(f"{r[n]:>16.1f}" for n in names))
    device = f"cuda: {torch.cuda.get_device_name()}"
    out = write_json(a.out, dict(benchmark="record_write_pieces", date=datetime.datetime.now().isoformat(timespec="seconds"),
                                 device=device, command=" ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
                                 args=vars(a), rows=rows))
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
