"""A/B of the CPU paged attention on the in-process step: the working tree's against a git revision's (a script).

The proposer of a random tiny head (bench_step's presets) runs the same decode step with ops.paged_attention taken
from the working tree and from `git show REV:kernels/paged_attention.py`, alternating within each round, so that
the shared machine's drift hits both alike. Prints per batch size each round's median step time of both.

    python scripts/attention_ab.py --rev HEAD~1 --batches 1,32,128 --threads 1
"""
import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_kernels import ops  # noqa: E402
from drafter_kernels import paged_attention as current  # noqa: E402


def revision_module(rev: str, tmp: pathlib.Path):
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:kernels/paged_attention.py"], check=True,
                            capture_output=True, text=True).stdout
    path = tmp / "paged_attention_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("paged_attention_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD~1")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    if a.steps < 3:
        ap.error("--steps must be at least 3 (the first two of each round are warm-ups)")
    torch.set_num_threads(a.threads)
    shape = b.PRESETS[a.preset]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        old = revision_module(a.rev, tmp)
        variants = {a.rev: old.paged_attention_batched, "working tree": current.paged_attention_batched}
        batches = [int(x) for x in a.batches.split(",")]
        rt = b.random_head_runtime(tmp, shape, a.context + 64, device="cpu",
                                   kv_cache_tokens=(max(batches) + 8) * (a.context + 96), max_batch_seqs=4096)
        print(f"{a.preset}, context {a.context}, m=3, k=5, {a.threads} thread(s); ms per step, median of "
              f"{a.steps - 2} steps per round", flush=True)
        for batch in batches:
            decode = b.prefilled_decode(rt, batch, a.context, 3, 5, shape["vocab_size"])
            inputs = b.to_inputs(decode)
            times = {name: [] for name in variants}
            for _ in range(a.rounds):
                for name, fn in variants.items():
                    ops.paged_attention = ops._dispatch(current.paged_attention_ref, current.paged_attention_triton,
                                                        cpu=fn)
                    ts = []
                    for _ in range(a.steps):
                        t0 = time.perf_counter()
                        rt.proposer.step(inputs)
                        ts.append(time.perf_counter() - t0)
                    times[name].append(statistics.median(ts[2:]) * 1e3)
            print(f"batch {batch:4d}: " + "; ".join(f"{name} {' '.join(f'{t:.2f}' for t in v)}"
                                                     for name, v in times.items()), flush=True)
            for s in inputs:
                rt.proposer.table.release("bench", s.sequence_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
