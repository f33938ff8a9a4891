"""Several engines through step channels at once, their steps merged by the drafter (a script, not a test).

A drafter serves several engines; when their steps wait for the step thread together, it runs them as one batch
(scheduler.py; a merged batch keeps each request's states apart, batch_io.BatchInput.cat). This script starts a
drafter-serve subprocess on bench_step's random head, then, for each engine count N, N engine processes of B / N
sequences each (namespaces of their own, a step channel each, the batch API: propose_batch). Every step, the
engines wait at a barrier and send their decode step at once (m committed tokens, k drafts, fixed context). It
reports per N:

  engine ms      the median over steps of the slowest engine's propose_batch (the engines' step time)
  seqs/batch     the drafter's mean sequences per batch over the timed steps (/metrics: B when every step merged)
  worker ms      the drafter's mean step-thread time per batch (/metrics drafter_step_seconds)
  spread ms      how far apart the engines called propose_batch in a step (median over steps: max - min of their
                 time.monotonic(); the merge window must cover that to merge them)
  rang ms, p90   the same for when their requests rang the drafter's doorbell (each mailbox's request_sent_ns, after
                 the client packed the request): the arrivals the merge window compares
  waits/step     merge-window waits per engine step (/metrics drafter_merge_window_waits_total), and the share of
                 them that ended with every engine waited for queued (drafter_merge_window_complete_total)
  late/step      batch starts per engine step that left such engines out without a wait, the first request having
                 waited the window already while the step thread was busy (drafter_merge_window_late_total)

N = 1 is one engine with all B sequences (the same work in one request). The proposer's own step at batch B in this
process, as columns, comes first for reference. --merge-windows runs the whole set once per drafter --merge-window-us
value (a drafter of its own each; 0: no waits). --jitter-ms J delays each engine's send by a random 0..J ms every
step: engines out of step, whose steps merge only by chance. Prints a table and writes JSON (device, date, command).

    python benchmarks/bench_merged_engines.py --preset tiny --device cpu --batch 32 --engines 1,2,4
    python benchmarks/bench_merged_engines.py --preset llama3-8b-eagle3 --device cuda --batch 128 --engines 1,2,4 \
        --merge-windows 0,300
"""
import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import pathlib
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as bs  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client.engine.sidecar_process import free_port  # noqa: E402


def engine_main(index: int, sock: str, batch: int, context: int, m: int, k: int, width: int, vocab: int,
                iters: int, jitter_s: float, barriers, results) -> None:
    """One engine: its sequences' prefill and 3 warm-up steps, then (the parent reads the drafter's metrics between
    the two start barriers) the timed decode steps, each after the step barrier."""
    try:
        results.put((index, asyncio.run(_engine(index, sock, batch, context, m, k, width, vocab, iters, jitter_s,
                                                barriers))))
    except BaseException as e:  # (the parent reports it; broken barriers free the others)
        for b in barriers:
            b.abort()
        results.put((index, f"{type(e).__name__}: {e}"))


async def _engine(index, sock, batch, context, m, k, width, vocab, iters, jitter_s,
                  barriers) -> tuple[list[float], list[float], list[float]]:
    """(seconds of each timed propose_batch, time.monotonic() as each was called, and as its request rang the
    drafter's doorbell (the mailbox's request_sent_ns, after the client packed it): comparable across processes)"""
    from drafter_client import DrafterClient

    prefill, decode = bs.make_steps(batch, context, m, k, width, vocab, seed=1000 + index)
    async with DrafterClient(f"unix:{sock}", namespace=f"engine-{index}", step_timeout_s=None) as c:
        await c.wait_ready(600)
        for chunk in range(0, batch, 8):
            r = await c.propose(prefill[chunk : chunk + 8])
            assert all(s.ok for s in r.sequences), r.sequences[0].message
        assert await c.open_step_channel(request_bytes=max(16 << 20, 4 * batch * m * width)), "no step channel"
        step = bs.as_step_batch(decode)
        ready, go, each_step = barriers
        rng = random.Random(index)
        wait = lambda b: asyncio.get_running_loop().run_in_executor(None, b.wait, 600)  # noqa: E731
        times, sent, rang = [], [], []
        for i in range(iters + 3):
            if i == 3:  # (warmed up: the parent reads the metrics now)
                await wait(ready)
                await wait(go)
            await wait(each_step)
            if jitter_s:  # (engines out of step: each sends after a random delay of its own, drawn every step)
                await asyncio.sleep(rng.uniform(0, jitter_s))
            sent.append(time.monotonic())
            t0 = time.perf_counter()
            r = await c.propose_batch(step)
            times.append(time.perf_counter() - t0)
            rang.append(c._step_channel.box.request_sent_ns() * 1e-9)
            assert not r.fallback and int(r.codes.abs().sum()) == 0, r.fallback_reason
        assert c.steps_through_channel == iters + 3, "every step should have gone through the channel"
        await c.release([s.sequence_id for s in decode])
    return times[3:], sent[3:], rang[3:]


def scrape(port: int) -> dict[str, float]:
    v = bs.metric_values(port)
    return {key: v[key] for key in ("drafter_step_seconds_sum", "drafter_step_seconds_count",
                                    "drafter_batch_sequences_sum", "drafter_batch_sequences_count",
                                    "drafter_merge_window_waits_total", "drafter_merge_window_complete_total",
                                    "drafter_merge_window_late_total")}


def run_engines(n: int, sock: str, port: int, a, width: int, vocab: int) -> dict:
    """n engine processes of a.batch / n sequences each; their step times, and the drafter's batches (/metrics over
    the timed steps)."""
    ctx = mp.get_context("spawn")
    barriers, results = (ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Barrier(n)), ctx.Queue()
    per = a.batch // n
    procs = [ctx.Process(target=engine_main, args=(i, sock, per, a.context, a.m, a.k, width, vocab, a.iters,
                                                   a.jitter_ms / 1e3,
                                                   barriers, results)) for i in range(n)]
    for p in procs:
        p.start()
    barriers[0].wait(900)  # every engine warmed up
    before = scrape(port)
    barriers[1].wait(60)
    got = {}
    while len(got) < n:
        index, value = results.get(timeout=900)
        got[index] = value
    for p in procs:
        p.join(60)
    failed = [v for v in got.values() if isinstance(v, str)]
    if failed:
        raise RuntimeError(f"an engine failed: {failed[0]}")
    after = scrape(port)
    steps = sorted(max(got[i][0][j] for i in range(n)) for j in range(a.iters))  # the slowest engine of each step

    def spread(column: int) -> list[float]:
        """Per step, sorted: how far apart the engines' times of that column were (max - min over the engines)."""
        return sorted(max(got[i][column][j] for i in range(n)) - min(got[i][column][j] for i in range(n))
                      for j in range(a.iters))

    p90 = lambda values: values[int(0.9 * (len(values) - 1))]  # noqa: E731 (of a sorted list)
    # how far apart the engines called propose_batch in each step (the barrier's release and each one's jitter), and
    # how far apart their requests reached the drafter's doorbell (what the merge window sees)
    spreads, rung = spread(1), spread(2)
    d = {key: after[key] - before[key] for key in after}
    return dict(engines=n, sequences_per_engine=per, engine_ms=statistics.median(steps) * 1e3,
                send_spread_ms=statistics.median(spreads) * 1e3, send_spread_ms_p90=p90(spreads) * 1e3,
                doorbell_spread_ms=statistics.median(rung) * 1e3, doorbell_spread_ms_p90=p90(rung) * 1e3,
                engine_ms_p90=p90(steps) * 1e3,
                seqs_per_batch=d["drafter_batch_sequences_sum"] / d["drafter_batch_sequences_count"],
                worker_ms=d["drafter_step_seconds_sum"] / d["drafter_step_seconds_count"] * 1e3,
                waits_per_step=d["drafter_merge_window_waits_total"] / a.iters,
                late_per_step=d["drafter_merge_window_late_total"] / a.iters,
                waits_complete=(d["drafter_merge_window_complete_total"] / d["drafter_merge_window_waits_total"]
                                if d["drafter_merge_window_waits_total"] else None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(bs.PRESETS), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32, help="sequences in all, split evenly over the engines")
    ap.add_argument("--engines", default="1,2,4", help="engine counts to run (each divides --batch)")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="each engine sends its step a random 0..J ms after the barrier (drawn every step): engines "
                         "out of step, which the merge window should rarely wait for")
    ap.add_argument("--merge-windows", default="300",
                    help="drafter --merge-window-us values, a drafter each (comma-separated; 0: no waits)")
    ap.add_argument("--drafter-flag", action="append", default=[],
                    help="an extra drafter-serve flag, e.g. --drafter-flag=--no-step-channel-read-ahead")
    ap.add_argument("--out", default="bench_out/merged_engines.json")
    a = ap.parse_args()
    shape = bs.PRESETS[a.preset]
    a.context = a.context or shape["context"]
    counts = [int(x) for x in a.engines.split(",")]
    windows = [int(x) for x in a.merge_windows.split(",")]
    if any(a.batch % n for n in counts):
        ap.error(f"every engine count must divide --batch {a.batch}")
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        from drafter_service.runtime import build_runtime

        kv_tokens = (a.batch + 8) * (a.context + 96)
        cfg = bs.random_head_config(tmp, shape, a.context + 64, device=a.device, dtype=dtype,
                                    kv_cache_tokens=kv_tokens, max_batch_seqs=4096)
        head, target = cfg.model, cfg.target_model
        rt = build_runtime(cfg)
        width, vocab = rt.limits.hidden_states_width, shape["vocab_size"]
        in_process = bs.bench_in_process(rt, a.batch, a.context, a.m, a.k, a.iters, vocab, columns=True)
        print(f"in-process step, batch {a.batch}, as columns: {in_process * 1e3:.2f} ms", flush=True)
        del rt
        if a.device == "cuda":
            torch.cuda.empty_cache()
        for window in windows:
            sock, port = str(tmp / f"drafter-{window}.sock"), free_port()
            cmd = [sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model", str(target),
                   "--listen", f"unix:{sock}", "--device", a.device, "--dtype", dtype, "--kv-cache-tokens",
                   str(kv_tokens), "--max-model-len", str(a.context + 64), "--max-batch-seqs", "4096", "--log-level",
                   "WARNING", "--metrics-port", str(port), "--merge-window-us", str(window), *a.drafter_flag]
            server = subprocess.Popen(cmd)
            try:
                for n in counts:
                    print(f"merge window {window} us, {n} engine(s) of {a.batch // n} sequences ...", flush=True)
                    row = run_engines(n, sock, port, a, width, vocab)
                    row["merge_window_us"] = window
                    row["over_in_process"] = row["engine_ms"] / (in_process * 1e3)
                    rows.append(row)
                    print(f"  engine {row['engine_ms']:.2f} ms (p90 {row['engine_ms_p90']:.2f}), "
                          f"{row['seqs_per_batch']:.1f} sequences per batch, worker {row['worker_ms']:.2f} ms, "
                          f"{row['waits_per_step']:.2f} merge-window waits per step, {row['late_per_step']:.2f} late", flush=True)
            finally:
                server.terminate()
                server.wait(60)
    device = (f"cuda: {torch.cuda.get_device_name()}" if a.device == "cuda" else
              f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"\n{a.preset}, batch {a.batch} in all, m = {a.m}, k = {a.k}, jitter {a.jitter_ms} ms, {device}")
    print(f"{'window us':>9} {'engines':>8} {'engine ms':>10} {'p90':>8} {'seqs/batch':>11} {'worker ms':>10} "
          f"{'/ in-process':>13} {'spread ms':>10} {'rang ms':>8} {'rang p90':>9} {'waits/step':>11} {'complete':>9} "
          f"{'late/step':>10}")
    for r in rows:
        complete = "-" if r["waits_complete"] is None else f"{r['waits_complete']:.2f}"
        print(f"{r['merge_window_us']:>9} {r['engines']:>8} {r['engine_ms']:>10.2f} {r['engine_ms_p90']:>8.2f} "
              f"{r['seqs_per_batch']:>11.1f} {r['worker_ms']:>10.2f} {r['over_in_process']:>13.2f} "
              f"{r['send_spread_ms']:>10.3f} {r['doorbell_spread_ms']:>8.3f} {r['doorbell_spread_ms_p90']:>9.3f} "
              f"{r['waits_per_step']:>11.2f} {complete:>9} {r['late_per_step']:>10.2f}")
    out = write_json(a.out, dict(benchmark="merged_engines", date=datetime.datetime.now().isoformat(timespec="seconds"),
                                 device=device, command=" ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
                                 args=vars(a), in_process_ms=in_process * 1e3, rows=rows))
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
