"""The in-process proposer step on the CPU at a few batch sizes (a script, not a test): bench_step's random head,
one torch thread, median of 50 decode steps (5 rounds of 10) per batch size; --profile N: cProfile of 10 steps at
the largest batch, the N functions with the most own time. Run it from two checkouts in turn to compare commits
(separate processes: the allocator's state of one does not bias the other).

    python scripts/cpu_step_scale.py --batches 1,128 --context 256
"""
import argparse
import cProfile
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as bs  # noqa: E402
from drafter_service.config import ServerConfig  # noqa: E402
from drafter_service.runtime import build_runtime  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(bs.PRESETS))
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape, batches = bs.PRESETS[a.preset], [int(b) for b in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        head, target = bs.write_random_head(pathlib.Path(tmp), shape, a.context + 64)
        rt = build_runtime(ServerConfig(model=str(head), target_model=str(target), device="cpu", dtype="float32",
                                        kv_cache_tokens=(max(batches) + 8) * (a.context + 96),
                                        max_model_len=a.context + 64, max_batch_seqs=4096))
        width = rt.limits.hidden_states_width
        for b in batches:
            prefill, decode = bs.make_steps(b, a.context, a.m, a.k, width, shape["vocab_size"], seed=b)
            for c in range(0, b, 8):
                rt.proposer.step(bs.to_inputs(prefill[c : c + 8]))
            inputs = bs.to_inputs(decode)
            for _ in range(3):
                rt.proposer.step(inputs)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                rt.proposer.step(inputs)
                times.append(time.perf_counter() - t0)
            print(f"batch {b}: median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f}", flush=True)
            if a.profile and b == max(batches):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    rt.proposer.step(inputs)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
            for s in inputs:
                rt.proposer.table.release("bench", s.sequence_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
