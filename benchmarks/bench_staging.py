"""A step's target hidden states from host tensors to the device, by how many threads fill the pinned buffer (a
script, not a test). 1 thread is the drafter's own path (host_staging.rows_to_device: one cat on the step thread);
n > 1 splits the sequences over n threads (torch releases the GIL while it copies), each part's copy to the device
queued as soon as that part is filled, a variant the drafter does not use (it was slower on the H200 VM,
docs/performance.md) and that lives here to be measured on other hosts. One decode step of B sequences, m = 3 rows
each, bf16 states W wide (4096: EAGLE-1 8B; 12288: EAGLE-3 8B), one host tensor per sequence (as the proposer gets
them). Times the call until the device holds the rows (a CUDA synchronize; without CUDA the copy is pageable ->
CPU, for a smoke run). The thread counts are alternated in rounds. Prints a table, writes JSON.

    python benchmarks/bench_staging.py --device cuda --out docs/bench/staging_h100.json
"""
import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.engine.host_staging import rows_to_device  # noqa: E402


def threaded_to_device(tensors: list[torch.Tensor], device: torch.device, pool: ThreadPoolExecutor,
                       threads: int) -> torch.Tensor:
    """torch.cat(tensors) on the device, the pinned buffer filled by `threads` threads of pool, a group of whole
    sequences each; group c's copy to the device is queued once it is filled (overlapping the later fills)."""
    pin = device.type == "cuda"
    sizes = [t.shape[0] for t in tensors]
    host = torch.empty((sum(sizes), *tensors[0].shape[1:]), dtype=tensors[0].dtype, pin_memory=pin)
    cuts = [len(tensors) * c // threads for c in range(threads + 1)]
    rows = [sum(sizes[:i]) for i in cuts]
    filled = [pool.submit(torch.cat, tensors[i:j], out=host[a:b])
              for i, j, a, b in zip(cuts, cuts[1:], rows, rows[1:])]
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    for fill, a, b in zip(filled, rows, rows[1:]):
        fill.result()
        out[a:b].copy_(host[a:b], non_blocking=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x128,4096x256,12288x128,12288x256", help="WIDTHxBATCH,...")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench_out/staging.json")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as the host side of a CUDA step runs (runtime.py)
    device = torch.device(a.device)
    pin = device.type == "cuda"
    thread_counts = [int(x) for x in a.threads.split(",")]
    pools = {t: ThreadPoolExecutor(t) for t in thread_counts if t > 1}
    rows = []
    for shape in a.shapes.split(","):
        width, batch = (int(x) for x in shape.split("x"))
        m = 3
        hidden = torch.randn(batch * m, width).to(torch.bfloat16)
        per_seq = [hidden[i * m:(i + 1) * m] for i in range(batch)]
        want = torch.cat(per_seq)

        def once(threads: int) -> tuple[float, torch.Tensor]:
            t0 = time.perf_counter()
            out = (rows_to_device(per_seq, device) if threads == 1
                   else threaded_to_device(per_seq, device, pools[threads], threads))
            if pin:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            return dt, out

        times = {t: [] for t in thread_counts}
        for t in thread_counts:  # warm-up, and every variant checked once
            _, out = once(t)
            assert torch.equal(out.cpu(), want)
        for _ in range(a.rounds):
            for t in thread_counts:
                times[t].append(statistics.median(once(t)[0] for _ in range(a.reps)) * 1e3)
        row = dict(width=width, batch=batch, mbytes=want.numel() * 2 / 1e6,
                   **{f"threads_{t}_ms": statistics.median(v) for t, v in times.items()},
                   **{f"threads_{t}_spread_ms": [min(v), max(v)] for t, v in times.items()})
        rows.append(row)
        print(f"W={width:5d} B={batch:4d} {row['mbytes']:5.1f} MB: " + ", ".join(
            f"{t} thr {statistics.median(v):.3f} ms ({min(v):.3f}-{max(v):.3f})" for t, v in times.items()),
              flush=True)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    result = dict(benchmark="bench_staging", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=gpu or f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  pinned=pin, torch=torch.__version__, command=" ".join(sys.argv), rounds=a.rounds, reps=a.reps,
                  rows=rows)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
