"""The client's copy of a step's states into a step channel's mailbox, on one thread or split over two (a script, not
a test). messages.write_rows copies the states of a request frame (and of a DirectRequest) with memmove; from
PARALLEL_COPY_MIN_BYTES it copies the second half on a helper thread while the calling thread copies the first.
Both ways, alternated in rounds:

  one thread    PARALLEL_COPY_MIN_BYTES set above every size here
  split         the default threshold (sizes under it are copied on one thread either way)

Each size is a decode step of B sequences, m = 3 rows each, bf16 states W wide (4096: EAGLE-1 8B; 12288: EAGLE-3
8B), given as one slice per sequence of a batch tensor (one memmove range) or, with --scattered, as a tensor of its
own per sequence. The destination is a memfd mapping, as a mailbox is. Four source batches are used in turn, so that
a copy does not find its source in the cache. Prints a table, writes JSON.

    python benchmarks/bench_parallel_copy.py --out docs/bench/parallel_copy_h100host.json
"""
import argparse
import datetime
import mmap
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client import messages  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="12288x8,4096x128,12288x32,4096x256,12288x128,12288x256",
                    help="WIDTHxBATCH,...")
    ap.add_argument("--scattered", action="store_true", help="a tensor of its own per sequence")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default="bench_out/parallel_copy.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = 3
    default = messages.PARALLEL_COPY_MIN_BYTES
    rows = []
    for shape in a.shapes.split(","):
        width, batch = (int(x) for x in shape.split("x"))
        sources = []
        for _ in range(4):
            if a.scattered:
                sources.append([torch.randn(m, width).to(torch.bfloat16) for _ in range(batch)])
            else:
                whole = torch.randn(batch * m, width).to(torch.bfloat16)
                sources.append([whole[i * m:(i + 1) * m] for i in range(batch)])
        nbytes = batch * m * width * 2
        fd = os.memfd_create("bench-parallel-copy")
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        os.close(fd)
        dest = memoryview(mm)
        want = torch.cat(sources[0]).view(-1).view(torch.uint8)

        def copy(threshold: int, parts) -> float:
            messages.PARALLEL_COPY_MIN_BYTES = threshold
            t = time.perf_counter()
            messages.write_rows(parts, dest)
            return time.perf_counter() - t

        ways = {"one thread": 1 << 62, "split": default}
        try:
            for threshold in ways.values():  # (warm-up, and each way checked once)
                copy(threshold, sources[0])
                assert bytes(dest) == bytes(want.numpy())
            per_round = {w: [] for w in ways}
            for _ in range(a.rounds):
                for way, threshold in ways.items():
                    per_round[way].append(statistics.median(
                        copy(threshold, sources[i % 4]) for i in range(a.reps)) * 1e3)
        finally:
            messages.PARALLEL_COPY_MIN_BYTES = default
            dest.release()
            mm.close()
        row = dict(width=width, batch=batch, mbytes=nbytes / 1e6, split=nbytes >= default,
                   **{f"{w}_ms": statistics.median(v) for w, v in per_round.items()},
                   **{f"{w}_spread_ms": [min(v), max(v)] for w, v in per_round.items()})
        rows.append(row)
    result = dict(benchmark="bench_parallel_copy", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  python=platform.python_version(), torch=torch.__version__, scattered=a.scattered,
                  threshold_bytes=default, rounds=a.rounds, reps=a.reps, rows=rows)
    write_json(a.out, result, say=False)
    print(f"{result['device']}, {result['date']}; {'scattered' if a.scattered else 'one batch tensor'}; "
          f"ms per copy, median of {a.rounds} rounds [min, max]; split from {default >> 20} MiB")
    print(f"{'shape':>10} {'MB':>6} {'one thread':>22} {'split':>22} {'GB/s one / split':>18}")
    for r in rows:
        one, split = r["one thread_ms"], r["split_ms"]
        print(f"{r['width']:>5}x{r['batch']:<4} {r['mbytes']:6.2f} {one:8.3f} [{r['one thread_spread_ms'][0]:.3f}, "
              f"{r['one thread_spread_ms'][1]:.3f}] {split:8.3f} [{r['split_spread_ms'][0]:.3f}, "
              f"{r['split_spread_ms'][1]:.3f}] {r['mbytes'] / one:8.1f} / {r['mbytes'] / split:.1f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
