"""Where the host time of an in-process proposer step goes, by phase (a script, not a test): admission (touching
and admitting every sequence, pre-drafting's admission hook), the head's run (the step metadata, timed apart, the
forwards, the drafts' copy to the host: on CUDA it ends with the step's one synchronization), and the work after
it (outputs, pre-drafting bookkeeping, metrics). Admission and the work after the run are host work the device
waits for, at every batch size.

    python scripts/host_phases.py --preset tiny --device cpu --batches 1,64,256
    python scripts/host_phases.py --preset llama3-8b --device cuda --batches 1,128,256 --out gpu_out/host_phases.json

bench_step's random head and decode steps (bench_step.make_steps: m committed tokens, k drafts, fixed context);
medians over --iters steps after 3 warm-up steps. Prints a table, writes JSON (device, date, command) to --out.
"""
import argparse
import datetime
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_service.engine.step_metadata import StepMetadata  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--states-on-gpu", action="store_true",
                    help="the steps' hidden states already on the GPU (no staging through the host)")
    ap.add_argument("--out", default="bench_out/host_phases.json")
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    context = a.context or shape["context"]
    batches = [int(x) for x in a.batches.split(",")]
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, context + 64, device=a.device,
                                   kv_cache_tokens=(max(batches) + 8) * (context + 96), max_batch_seqs=4096)
        p = rt.proposer
        marks: dict[str, float] = {}
        admitted, run = p.predraft.on_step, p._run

        def on_step():  # proposer.step calls it right after admitting the batch
            marks["admitted"] = time.perf_counter()
            return admitted()

        def timed_run(batch):
            marks["run"] = time.perf_counter()
            try:
                return run(batch)
            finally:
                marks["ran"] = time.perf_counter()

        p.predraft.on_step, p._run = on_step, timed_run
        build = StepMetadata.build

        def timed_build(*args, **kw):  # the step metadata, inside the run (host work, then copies to the device)
            t0 = time.perf_counter()
            try:
                return build(*args, **kw)
            finally:
                marks["metadata"] = marks.get("metadata", 0.0) + time.perf_counter() - t0

        StepMetadata.build = staticmethod(timed_build)
        step = p.step
        phases: dict[str, list[float]] = {"step": [], "admission": [], "metadata": [], "run": [], "after": []}

        def timed_step(inputs):  # every step bench_in_process makes: the last --iters of a batch are its timed ones
            marks["metadata"] = 0.0
            t0 = time.perf_counter()
            try:
                return step(inputs)
            finally:
                t1 = time.perf_counter()
                for key, value in (("step", t1 - t0), ("admission", marks["admitted"] - t0),
                                   ("metadata", marks["metadata"]), ("run", marks["ran"] - marks["run"]),
                                   ("after", t1 - marks["ran"])):
                    phases[key].append(value)

        p.step = timed_step
        for batch in batches:
            for v in phases.values():
                v.clear()
            b.bench_in_process(rt, batch, context, a.m, a.k, a.iters,
                               shape["vocab_size"],  # (prefill, 3 warm-up steps, then --iters timed ones)
                               device if a.states_on_gpu else None)
            row = dict(batch=batch, **{f"{k}_ms": statistics.median(v[-a.iters:]) * 1e3 for k, v in phases.items()})
            rows.append(row)
            print(f"batch {batch:4d}: step {row['step_ms']:.3f} ms = admission {row['admission_ms']:.3f} + run "
                  f"{row['run_ms']:.3f} (of which step metadata {row['metadata_ms']:.3f}) + after "
                  f"{row['after_ms']:.3f} (+ the rest)", flush=True)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor()
                                                                                or platform.machine())
    result = dict(benchmark="host_phases", date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), device=f"{device.type}: {dev_name}", torch=torch.__version__,
        command=shlex.join([sys.executable, *sys.argv]), preset=a.preset, context=context, m=a.m, k=a.k,
        iters=a.iters, host_threads=torch.get_num_threads(), states_on_gpu=a.states_on_gpu, rows=rows)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
