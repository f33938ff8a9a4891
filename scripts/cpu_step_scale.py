"""The in-process proposer step on the CPU at a few batch sizes (a script, not a test): bench_step's random head and
its in-process measurement (bench_step.bench_in_process: prefill, 3 warm-up steps, median of --iters decode steps),
one torch thread. Run it from two checkouts in turn to compare commits (separate processes: the allocator's state of
one does not bias the other); `python -m cProfile -s tottime scripts/cpu_step_scale.py` shows where the host time
goes.

    python scripts/cpu_step_scale.py --batches 1,128 --context 256 [--columns]
"""
import argparse
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as bs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(bs.PRESETS))
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--columns", action="store_true",
                    help="the step as columns (Proposer.step_batch), as bench_step's 'as columns' figure")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape, batches = bs.PRESETS[a.preset], [int(b) for b in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rt = bs.random_head_runtime(pathlib.Path(tmp), shape, a.context + 64, device="cpu",
                                    kv_cache_tokens=(max(batches) + 8) * (a.context + 96), max_batch_seqs=4096)
        for b in batches:
            t = bs.bench_in_process(rt, b, a.context, a.m, a.k, a.iters, shape["vocab_size"], columns=a.columns)
            print(f"batch {b}: median {t * 1e3:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
