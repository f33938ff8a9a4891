"""Does the host side of one engine step depend on where it runs? Three checks on the in-process proposer.

    python scripts/step_host_effects.py --preset llama3-8b --out docs/bench/step_host_effects_h200.json

A drafter runs Proposer.step on its step thread, on inputs parsed from a request, next to an engine process that
busy-waits for the reply. Each of those could make the same step slower than the in-process benchmark measures:

1. thread: the step on the main thread vs on a second thread (as the drafter's step thread);
2. inputs: the bench's own tensors vs StepInputs parsed from the serialized request (views of the message bytes),
   parsed once or parsed again before every step (as the drafter does: the parse runs right before the step);
3. neighbour: the step pinned to one CPU while a busy-looping process runs on each other CPU in turn (on a VM, two
   vCPUs may share a physical core on the host although the guest sees no SMT).

Prints median ms per step (and the median parse us where parsed) for each; batch 1 decode steps (m committed
tokens, k drafts, fixed context) on CUDA.
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.client import build_request  # noqa: E402
from drafter_client.protocol import pb  # noqa: E402
from drafter_service.transport.validation import parse_propose  # noqa: E402

WARMUP = 10


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times[WARMUP:]) * 1e3, 4)


def busy_process(cpu: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=300, help="steps per case (checks 1 and 2)")
    ap.add_argument("--neighbour-iters", type=int, default=150, help="steps per (cpu, neighbour) pair (check 3)")
    ap.add_argument("--cpus", default="2,9", help="CPUs to pin the step to in check 3")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    context = shape["context"]
    result = dict(benchmark="step_host_effects", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  preset=a.preset, m=a.m, k=a.k, context=context, cpus=os.cpu_count(),
                  command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]))
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, context + 64, device=a.device, kv_cache_tokens=200_000)
        if a.device.startswith("cuda"):
            result["gpu"] = torch.cuda.get_device_name()
        prefill, decode = b.make_steps(1, context, a.m, a.k, rt.limits.hidden_states_width, shape["vocab_size"], 1)
        rt.proposer.step(b.to_inputs(prefill))
        bench_inputs = b.to_inputs(decode)
        payload = build_request("bench", decode, request_id=1).SerializeToString()

        def parse():
            return parse_propose(pb.ProposeRequest.FromString(payload), rt.limits)

        def run(inputs=None, parse_each=False, n=a.iters):
            steps, parses = [], []
            for _ in range(n + WARMUP):
                if parse_each:
                    t0 = time.perf_counter()
                    inputs = parse()
                    parses.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = rt.proposer.step(inputs)
                steps.append(time.perf_counter() - t0)
                assert out[0].code == 0 and len(out[0].drafts) == a.k, out[0].message
            return dict(step_ms=median_ms(steps), parse_us=round(median_ms(parses) * 1e3, 1) if parses else None)

        def on_thread(**kw):
            box = {}
            t = threading.Thread(target=lambda: box.update(r=run(**kw)))
            t.start()
            t.join()
            return box["r"]

        cases = [("main thread", lambda: run(bench_inputs)), ("second thread", lambda: on_thread(inputs=bench_inputs)),
                 ("main thread again", lambda: run(bench_inputs)), ("parsed once", lambda: run(parse())),
                 ("parsed before every step", lambda: run(parse_each=True))]
        result["cases"] = {}
        for name, fn in cases:
            result["cases"][name] = r = fn()
            print(f"{name:<28} step {r['step_ms']:.3f} ms" + (f", parse {r['parse_us']:.1f} us" if r["parse_us"]
                                                              else ""), flush=True)

        all_cpus = sorted(os.sched_getaffinity(0))
        result["neighbours"] = {}
        for cpu in [int(c) for c in a.cpus.split(",") if int(c) in all_cpus]:
            os.sched_setaffinity(0, {cpu})
            row = {}
            for other in [None] + [c for c in all_cpus if c != cpu]:
                busy = busy_process(other) if other is not None else None
                time.sleep(0.2)
                try:
                    row["none" if other is None else str(other)] = run(parse_each=True, n=a.neighbour_iters)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
            os.sched_setaffinity(0, set(all_cpus))
            result["neighbours"][str(cpu)] = row
            alone = row["none"]["step_ms"]
            worst = max(row, key=lambda c: row[c]["step_ms"])
            print(f"step pinned to cpu {cpu}: alone {alone:.3f} ms; a busy process on cpu "
                  + ", ".join(f"{c}: {r['step_ms']:.3f}" for c, r in row.items() if c != "none")
                  + f" (slowest next to cpu {worst}: +{(row[worst]['step_ms'] - alone) * 1e3:.0f} us, parse "
                  f"{row[worst]['parse_us']:.1f} us vs {row['none']['parse_us']:.1f})", flush=True)
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
