"""Are slow step-channel runs a matter of where the threads run? Samples the CPU of the client's thread and of the
drafter's busiest thread (its step thread) during batch-1 channel steps, over several fresh drafters.

    python scripts/channel_placement.py --preset llama3-8b --device cuda --runs 6 --out placement.json

Per run: median ms per channel step, the CPUs each side ran on (from /proc/<pid>/task/<tid>/stat, field 39, sampled
every 10 steps) and how many samples found both on the same CPU.
"""
import argparse
import asyncio
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def thread_stats(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (cpu last run on, utime + stime ticks) for every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[int(tid)] = (int(fields[36]), int(fields[11]) + int(fields[12]))  # processor, utime + stime
    return out


def own_cpu() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


async def one_run(address: str, server_pid: int, shape: dict, a) -> dict:
    from drafter_client import DrafterClient
    from drafter_client.benchmarks import bench_step as b

    async with DrafterClient(address, namespace="placement", step_timeout_s=None) as c:
        await c.wait_ready(900)
        info = await c.get_info()
        prefill, decode = b.make_steps(1, a.context, a.m, a.k, info.hidden_states_width, shape["vocab_size"], seed=1)
        assert (await c.propose(prefill)).sequences[0].ok
        assert await c.open_step_channel()
        times, samples = [], []
        before = thread_stats(server_pid)
        for i in range(a.iters):
            t0 = time.perf_counter()
            r = await c.propose(decode)
            times.append(time.perf_counter() - t0)
            assert r.sequences[0].ok
            if i % 10 == 9:
                samples.append((own_cpu(), thread_stats(server_pid)))
        after = thread_stats(server_pid)
        c.close_step_channel()
        await c.release([s.sequence_id for s in decode])
    busiest = max(after, key=lambda t: after[t][1] - before.get(t, (0, 0))[1])  # the step thread
    client_cpus = [s[0] for s in samples]
    step_cpus = [s[1][busiest][0] for s in samples if busiest in s[1]]
    return dict(median_ms=statistics.median(times[10:]) * 1e3, client_cpus=sorted(set(client_cpus)),
                step_thread_cpus=sorted(set(step_cpus)),
                same_cpu_samples=sum(x == y for x, y in zip(client_cpus, step_cpus)), samples=len(samples))


def main() -> int:
    from drafter_client.benchmarks import bench_step as b
    from drafter_client.engine.sidecar_process import SidecarProcess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    a.context = shape["context"]
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), preset=a.preset, device=a.device,
                  cpus=os.cpu_count(), command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]), runs=[])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        head, target = b.write_random_head(tmp / "model", shape, a.context + 64)
        flags = ["--dtype", "bfloat16" if a.device.startswith("cuda") else "float32", "--kv-cache-tokens",
                 str(4 * (a.context + 64)), "--max-batch-seqs", "8", "--log-level", "WARNING"]
        for run in range(a.runs):
            with SidecarProcess(head, target, a.device, flags, ready_timeout_s=900,
                                env={"PYTHONPATH": os.pathsep.join(sys.path)}) as sidecar:
                r = asyncio.run(one_run(sidecar.address, sidecar.proc.pid, shape, a))
            result["runs"].append(r)
            print(f"run {run}: {r['median_ms']:.3f} ms/step; client on cpus {r['client_cpus']}, drafter step thread "
                  f"on {r['step_thread_cpus']}, same cpu in {r['same_cpu_samples']}/{r['samples']} samples",
                  flush=True)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
