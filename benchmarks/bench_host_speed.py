"""How much a host's speed for small Python work moves from one process to the next (a script, not a test).

The in-process step's host work (admission, the record, the launches) is a few hundred small Python and numpy
operations; on the VM hosts of docs/performance.md it ran 2x slower in some processes than in others of the same
script (twenty-third session). This script asks the same of the host alone, with no drafter code: --processes fresh
interpreters, one after the other, each timing two loops of small work (--rounds rounds of --iters calls each):

  python   eight dict lookups summed (the interpreter alone)
  numpy    a fancy index, an add and a cumsum over small int64 arrays (numpy's per-call overhead)

and prints, per process, each loop's median and fastest round in microseconds per call; then the spread over the
processes (the slowest median over the fastest). A quiet host gives a spread near 1; where it is far from 1, a host
side A/B of a few microseconds needs many processes per arm (docs/performance.md, Method). JSON to --out.

    python benchmarks/bench_host_speed.py --processes 12 --out bench_out/host_speed.json
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

KINDS = ("python", "numpy")


def child(rounds: int, iters: int) -> dict:
    """In this process: each loop's per-round microseconds per call."""
    import numpy as np

    table = {f"s{i}": i for i in range(256)}
    keys = [f"s{i}" for i in range(8)]
    values = np.arange(64, dtype=np.int64)
    index = np.array([3, 7, 11, 19, 23, 31, 40, 50])

    def python_work():
        return sum(table[k] for k in keys)

    def numpy_work():
        return int(np.cumsum(values[index] + 1)[-1])

    out = {}
    for kind, work in (("python", python_work), ("numpy", numpy_work)):
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                work()
            per_round.append((time.perf_counter() - t0) / iters * 1e6)
        out[kind] = per_round
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--out", default="bench_out/host_speed.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # (one process's loops: JSON on stdout)
    a = ap.parse_args(argv)
    if a.processes < 1 or a.rounds < 1 or a.iters < 1:
        ap.error("--processes, --rounds and --iters must be >= 1")
    if a.child:
        print(json.dumps(child(a.rounds, a.iters)))
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from drafter_client.benchmarks.report import write_json

    rows = []
    print(f"{'process':>7} " + " ".join(f"{kind + ' us (median / fastest)':>28}" for kind in KINDS), flush=True)
    for p in range(a.processes):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(a.rounds),
                               "--iters", str(a.iters)], capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        row = {"process": p + 1}
        for kind in KINDS:
            row[kind] = dict(median_us=statistics.median(got[kind]), fastest_us=min(got[kind]), rounds_us=got[kind])
        rows.append(row)
        print(f"{p + 1:>7} " + " ".join(f"{row[k]['median_us']:>17.3f} / {row[k]['fastest_us']:>8.3f}" for k in KINDS),
              flush=True)
    spread = {kind: max(r[kind]["median_us"] for r in rows) / min(r[kind]["median_us"] for r in rows) for kind in KINDS}
    print("spread over the processes (slowest median / fastest median): "
          + ", ".join(f"{kind} {spread[kind]:.2f}x" for kind in KINDS))
    write_json(a.out, dict(benchmark="host_speed", host=platform.node(), cpu_count=os.cpu_count(),
                           device=f"cpu: {platform.machine()}, {os.cpu_count()} cores",
                           date=datetime.datetime.now().isoformat(timespec="seconds"),
                           command=shlex.join([sys.executable, *sys.argv]), processes=a.processes, rounds=a.rounds,
                           iters=a.iters, spread=spread, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
