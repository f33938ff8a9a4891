"""Profile one in-process engine step on CUDA (torch.profiler): GPU kernel time by kernel vs wall time.

    python scripts/profile_step.py --preset llama3-8b --batches 1,128    # prints a table per batch size
    python scripts/profile_step.py --batches 128 --host-profile         # + the python functions by own time
    python scripts/profile_step.py --batches 128 --states-on-gpu        # the steps' hidden states already on the GPU
    python scripts/profile_step.py --batches 128 --columns --gaps       # Proposer.step_batch; where the GPU idles

By default the steps' target hidden states are host tensors (as a sidecar receives them: the step stages them through
pinned memory); --states-on-gpu gives them on the GPU, as an engine in the drafter's own process holds them.
"""
import dataclasses
import argparse
import cProfile
import pathlib
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_service.config import ServerConfig  # noqa: E402
from drafter_service.runtime import build_runtime  # noqa: E402


def print_gaps(step, inputs, batch: int, n: int = 10) -> None:
    """Medians over n steps of: the step's wall time, the time from its start to its first GPU activity (kernel,
    copy or memset), the GPU's idle time between its first and last activity, and from the last activity to the
    step's return."""
    import statistics

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            with torch.profiler.record_function("engine_step"):
                step(inputs)
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "engine_step")
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    rows = []
    for s0, s1 in steps:
        spans = [(max(a, s0), min(b_, s1)) for a, b_ in gpu if b_ > s0 and a < s1]
        if not spans:
            continue
        busy, end = 0.0, spans[0][0]
        for a, b_ in spans:  # union of the activity intervals
            if b_ > end:
                busy += b_ - max(a, end)
                end = b_
        first, last = spans[0][0], max(b_ for _, b_ in spans)
        rows.append((s1 - s0, first - s0, (last - first) - busy, s1 - last, busy))
    if not rows:
        print(f"--- batch {batch}: no GPU activity inside the steps' ranges ---")
        return
    med = [statistics.median(r[i] for r in rows) / 1e3 for i in range(5)]
    print(f"--- batch {batch}: gaps (median of {len(rows)} steps, ms): wall {med[0]:.3f} = before the first GPU "
          f"activity {med[1]:.3f} + idle between activities {med[2]:.3f} + GPU busy {med[4]:.3f} + after the last "
          f"{med[3]:.3f} ---", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads for the host side (0: the server's "
                    "default on CUDA, 1)")
    ap.add_argument("--states-on-gpu", action="store_true",
                    help="the steps' hidden states on the GPU (no staging through the host)")
    ap.add_argument("--columns", action="store_true",
                    help="call Proposer.step_batch with the step as columns (batch_io.BatchInput), as an engine in the "
                         "drafter's process would, instead of Proposer.step with one StepInput per sequence")
    ap.add_argument("--gaps", action="store_true",
                    help="also split the GPU's idle time of a step: before its first kernel (host work before the "
                         "launches), between its kernels, and after its last one (host work after the sync)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run cProfile over 10 steps and print the python functions by own time (host work)")
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    with tempfile.TemporaryDirectory() as tmp:
        head, target = b.write_random_head(pathlib.Path(tmp), shape, a.context + 64)
        cfg = ServerConfig(model=str(head), target_model=str(target), device="cuda", dtype="bfloat16",
                           kv_cache_tokens=max(200_000, 300 * (a.context + 64)),  # 256 sequences fit
                           max_model_len=a.context + 64, max_batch_seqs=512,
                           cuda_graphs=not a.no_cuda_graphs, cpu_threads=a.cpu_threads)
        rt = build_runtime(cfg)
        width = rt.limits.hidden_states_width
        for batch in [int(x) for x in a.batches.split(",")]:
            prefill, decode = b.make_steps(batch, a.context, a.m, a.k, width, shape["vocab_size"], seed=batch)
            for i in range(0, batch, 8):
                rt.proposer.step(b.to_inputs(prefill[i : i + 8]))
            if a.states_on_gpu:
                decode = [dataclasses.replace(s, hidden_states=s.hidden_states.cuda()) for s in decode]
            inputs = b.to_inputs(decode)
            step = rt.proposer.step
            if a.columns:
                inputs, step = b.to_batch_input(decode), rt.proposer.step_batch
            for _ in range(5):
                step(inputs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 20
            for _ in range(n):
                step(inputs)
            wall = (time.perf_counter() - t0) / n
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step(inputs)
            events = prof.key_averages()
            gpu_total = sum(e.self_device_time_total for e in events) / 5 / 1e3  # ms per step
            print(f"\n=== batch {batch} ({torch.get_num_threads()} host threads, "
                  f"{'columns (step_batch)' if a.columns else 'StepInputs (step)'}, states on the "
                  f"{'GPU' if a.states_on_gpu else 'host'}): wall {wall * 1e3:.2f} ms/step, "
                  f"GPU kernel time {gpu_total:.2f} ms/step, "
                  f"idle GPU {wall * 1e3 - gpu_total:.2f} ms ===")
            print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
            if a.gaps:
                print_gaps(step, inputs, batch)
            if a.host_profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    step(inputs)
                prof.disable()
                print(f"--- batch {batch}: python functions by own time over 10 steps (cProfile adds overhead) ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            for s in decode:
                rt.proposer.table.release("bench", s.sequence_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
