"""Is the in-process step slower once a torch.profiler session has run in the process? (CUDA only.)

    python scripts/profiler_after_effect.py --preset llama3-8b-eagle3 --engine-applies-fc --out F.json

profile_step.py times a step's wall and, under torch.profiler, its GPU kernel time; until the twenty-second session
each round's wall time came after the previous rounds' (and batch sizes') profiler sessions. This script measures
what such a session leaves behind: the step's wall time (columns from the engine, states on the GPU, mixed m, the
mean of 20 steps, the median of 10 such blocks) at each batch size before any session and after each of two, and
the host time of one small CUDA op (x.add_(1) while the GPU is kept busy: its launch only). It also counts the
garbage collector's runs during the timed steps (gc.callbacks): a collection inside a step would be host time the
drafter-serve process, which freezes its start-up heap (gc.freeze), might not see.
Prints a line per (state, batch) and writes JSON (device, date, command, rows).
"""
import argparse
import datetime
import gc
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402

BLOCKS, STEPS = 10, 20


class CollectorClock:
    """The garbage collector's runs and their time, by generation, while counting."""

    def __init__(self):
        self.runs: dict[int, list] = {}
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            entry = self.runs.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - self._start


def step_wall_ms(step, inputs) -> tuple[float, float, float]:
    """(median, min, max) over BLOCKS blocks of the mean wall time of STEPS steps, ms."""
    means = []
    for _ in range(BLOCKS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step(inputs)
        means.append((time.perf_counter() - t0) / STEPS * 1e3)
    return statistics.median(means), min(means), max(means)


def small_op_host_us(x: torch.Tensor, n: int = 200) -> float:
    """Median host time of x.add_(1) with the GPU busy (torch.cuda._sleep ahead of it): the launch alone, us."""
    torch.cuda._sleep(int(1e8))
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        x.add_(1)
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b-eagle3")
    ap.add_argument("--engine-applies-fc", action="store_true")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=2, help="profiler sessions, each followed by the timings")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("profiler_after_effect.py needs CUDA (it times the CUDA path); none here")
        return 2
    shape = b.PRESETS[a.preset]
    result = dict(benchmark="profiler_after_effect", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}", torch=torch.__version__,
                  command=" ".join(["scripts/profiler_after_effect.py", *sys.argv[1:]]), preset=a.preset,
                  engine_applies_fc=a.engine_applies_fc, context=a.context, m=a.m, k=a.k, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        batches = [int(x) for x in a.batches.split(",")]
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, a.context + 64, device="cuda",
                                   kv_cache_tokens=max(200_000, (sum(batches) + 8) * (a.context + 64)),  # every batch
                                   cuda_graphs=True, engine_applies_fc=a.engine_applies_fc)
        inputs_by_batch = {}
        for batch in batches:
            decode = b.prefilled_decode(rt, batch, a.context, a.m, a.k, shape["vocab_size"], mixed_m=True,
                                        states_device="cuda")
            inputs_by_batch[batch] = b.to_batch_input(decode)
        step = rt.proposer.step_batch
        x = torch.zeros(1, device="cuda")
        collector = CollectorClock()

        def timings(state: str) -> None:
            for batch, inputs in inputs_by_batch.items():
                for _ in range(5):
                    step(inputs)
                collector.runs.clear()
                med, lo, hi = step_wall_ms(step, inputs)
                op_us = small_op_host_us(x)
                runs = {g: dict(runs=n, ms=round(s * 1e3, 3)) for g, (n, s) in sorted(collector.runs.items())}
                result["rows"].append(dict(state=state, batch=batch, step_wall_ms=med, step_wall_ms_min=lo,
                                           step_wall_ms_max=hi, small_op_host_us=op_us, gc_runs=runs))
                print(f"{state:30s} batch {batch:3d}: step wall (mean of {STEPS}) median {med:.3f} ms "
                      f"[{lo:.3f}, {hi:.3f}]; x.add_(1) host {op_us:.1f} us; collections during the "
                      f"{BLOCKS * STEPS} steps: {runs or 'none'}", flush=True)

        timings("before any profiler session")
        timings("before any profiler session, again")
        for i in range(1, a.sessions + 1):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step(inputs_by_batch[batches[0]])
            prof.key_averages()  # (as profile_step reads it)
            timings(f"after profiler session {i}")
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
