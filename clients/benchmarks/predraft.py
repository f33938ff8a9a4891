"""Benchmark: pre-drafting (docs/predraft.md) end to end, with the reference engine and a real target.

    python -m drafter_client.benchmarks.predraft                        # bundled EAGLE-3 head, CPU or GPU
    python -m drafter_client.benchmarks.predraft --head models/eagle1 --budgets 0,4,8,16 --batches 1,4

The sidecar runs as a child process (drafter-serve on a Unix socket, metrics on a local port); the engine runs the
bundled target (Hugging Face) in this process. For each batch size B the prompts (prompts.HELDOUT_LIKE + DEMO) run in
groups of B, greedy: plain decoding (no speculation), then speculative decoding with k drafts at each pre-drafting
budget F (0 = plain speculative decoding). Per setting: tokens/s (all groups, prefill included; median of
--repeats), mean acceptance length, the acceptance length of the drafts served from prepared branches, the hit rate
(answered sequence-steps served from prepared drafts), the engine's wait for the drafter per step (p50 / p99 over
every decode step: from sending the step to holding the drafts), and the drafter's own pass counts (/metrics:
passes finished and stopped, steps that missed or found nothing prepared). Prints a table, writes JSON (command,
machine, date) and a PNG plot (when matplotlib is installed) beside it.

On a CPU the drafter and the target share the cores: a preparation pass slows the target's verification it overlaps.
"""
import argparse
import asyncio
import datetime
import os
import pathlib
import platform
import shlex
import statistics
import sys
import urllib.request

import torch

from drafter_client.benchmarks.prompts import DEMO, HELDOUT_LIKE
from drafter_client.benchmarks.report import write_json
from drafter_client.client import DrafterClient
from drafter_client.engine.reference_engine import ReferenceEngine, SpecConfig
from drafter_client.engine.sidecar_process import MODELS, SidecarProcess, free_port
from drafter_client.engine.target import TargetModel

COUNTERS = ("drafter_predraft_hits_total", "drafter_predraft_misses_total", "drafter_predraft_unprepared_total",
            "drafter_predraft_passes_total", "drafter_predraft_passes_stopped_total",
            "drafter_predraft_branches_prepared_total", "drafter_predraft_pass_seconds_total",
            "drafter_predraft_passes_skipped_total", "drafter_predraft_refused_by_odds_total")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(values.get(name, 0.0)) for name in COUNTERS}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run_setting(engine: ReferenceEngine, groups: list[list[list[int]]], cfg: SpecConfig, plain: bool) -> dict:
    """One pass over every group (plain decoding, or speculative with cfg): totals, and the per-step waits of the
    decode steps (not the prefill's)."""
    tokens, elapsed, waits, outputs = 0, 0.0, [], []
    answered = predrafted = drafts = accepted = pre_drafts = pre_accepted = 0
    for ids in groups:
        r = await (engine.generate_plain(ids, cfg) if plain else engine.generate(ids, cfg))
        tokens += r.num_tokens
        elapsed += r.elapsed_s
        outputs += r.tokens
        if r.acceptance is not None:
            a = r.acceptance
            waits += r.draft_waits_s[1:]  # (the first request carries the prompts: a prefill, not a decode step)
            answered, predrafted = answered + a.answered_steps, predrafted + a.predrafted_steps
            drafts, accepted = drafts + a.num_drafts, accepted + a.num_accepted_tokens
            pre_drafts, pre_accepted = pre_drafts + a.predrafted_drafts, pre_accepted + a.predrafted_accepted_tokens
    return {"tokens": tokens, "elapsed_s": elapsed, "waits_s": waits, "outputs": outputs,
            "answered_steps": answered, "predrafted_steps": predrafted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "predrafted_acceptance_length": 1 + pre_accepted / pre_drafts if pre_drafts else None}


async def measure(address: str, metrics_port: int, target: TargetModel, prompts: list[list[int]], batches: list[int],
                  budgets: list[int], k: int, max_new_tokens: int, repeats: int, transport: str) -> dict:
    async with DrafterClient(address, namespace="bench-predraft", step_timeout_s=None) as drafter:
        info = await drafter.get_info()
        if not info.predraft_supported:
            raise SystemExit(f"the drafter's {info.method} head does not pre-draft (GetInfo.predraft_supported)")
        if transport == "channel" and not await drafter.open_step_channel():
            raise SystemExit("the drafter has no step channel (docs/step_channel.md)")
        engine = ReferenceEngine(target, drafter, info, use_stream=transport == "stream")
        warm = SpecConfig(max_new_tokens=4, num_drafts=k, predraft_branches=max(budgets))
        await engine.generate(prompts[:1], warm)  # one-time costs out of the timings
        await engine.generate_plain(prompts[:1], warm)
        rows = []
        for B in batches:
            tiled = prompts * -(-B // len(prompts))  # (a batch larger than the prompts repeats them)
            groups = [tiled[i : i + B] for i in range(0, max(B, len(prompts)), B)]
            plain_cfg = SpecConfig(max_new_tokens=max_new_tokens)
            await engine.generate_plain(groups[0], SpecConfig(max_new_tokens=32))  # untimed (as below)
            plain_runs = [await run_setting(engine, groups, plain_cfg, plain=True) for _ in range(repeats)]
            plain_s = statistics.median(r["elapsed_s"] for r in plain_runs)
            plain_tps = plain_runs[0]["tokens"] / plain_s
            plain_out = plain_runs[0]["outputs"]
            rows.append({"batch": B, "budget": None, "tokens_per_s": plain_tps, "speedup_vs_plain": 1.0,
                         "elapsed_s_runs": [r["elapsed_s"] for r in plain_runs]})
            print(f"batch {B:3d} plain decoding: {plain_tps:7.1f} tok/s", flush=True)
            for F in budgets:
                cfg = SpecConfig(max_new_tokens=max_new_tokens, num_drafts=k, predraft_branches=F)
                # untimed: the first steps of a new batch size or budget compile kernel specializations
                await engine.generate(groups[0], SpecConfig(max_new_tokens=32, num_drafts=k, predraft_branches=F))
                before = scrape(metrics_port)
                runs = [await run_setting(engine, groups, cfg, plain=False) for _ in range(repeats)]
                after = scrape(metrics_port)
                r = runs[0]
                elapsed = statistics.median(x["elapsed_s"] for x in runs)
                waits = [w for x in runs for w in x["waits_s"]]
                answered = sum(x["answered_steps"] for x in runs)
                row = {"batch": B, "budget": F, "tokens_per_s": r["tokens"] / elapsed,
                       "speedup_vs_plain": plain_s / elapsed, "elapsed_s_runs": [x["elapsed_s"] for x in runs],
                       "mean_acceptance_length": r["mean_acceptance_length"],
                       "predrafted_acceptance_length": r["predrafted_acceptance_length"],
                       "hit_rate": sum(x["predrafted_steps"] for x in runs) / answered if answered else 0.0,
                       "wait_ms_p50": percentile(waits, 0.5) * 1e3, "wait_ms_p99": percentile(waits, 0.99) * 1e3,
                       "wait_ms_mean": statistics.fmean(waits) * 1e3 if waits else None, "decode_steps": len(waits),
                       "identical_to_plain": all(x["outputs"] == plain_out for x in runs),
                       "drafter": {name.removeprefix("drafter_predraft_").removesuffix("_total"):
                                   after[name] - before[name] for name in COUNTERS}}
                d = row["drafter"]
                passes = d["passes"] + d["passes_stopped"]
                row["pass_ms_mean"] = d["pass_seconds"] / passes * 1e3 if passes else None
                rows.append(row)
                pre = row["predrafted_acceptance_length"]
                print(f"batch {B:3d} F {F:3d}: {row['tokens_per_s']:7.1f} tok/s ({row['speedup_vs_plain']:.2f}x), "
                      f"acceptance {row['mean_acceptance_length']:.2f} (served branches "
                      f"{'-' if pre is None else f'{pre:.2f}'}), hit rate {row['hit_rate']:.2f}, wait p50/p99 "
                      f"{row['wait_ms_p50']:.2f}/{row['wait_ms_p99']:.2f} ms; passes {d['passes']:.0f} finished "
                      f"{d['passes_stopped']:.0f} stopped {d['passes_skipped']:.0f} skipped "
                      f"{d['refused_by_odds']:.0f} refused by the odds, "
                      f"{row['pass_ms_mean'] or 0:.2f} ms each; misses {d['misses']:.0f}, unprepared "
                      f"{d['unprepared']:.0f}; identical {row['identical_to_plain']}", flush=True)
        return {"drafter": {"model": info.model_name, "method": info.method, "device": info.device,
                            "dtype": info.model_dtype}, "transport": transport, "rows": rows}


def plot(result: dict, path: pathlib.Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.8))
    for B in sorted({r["batch"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["batch"] == B and r["budget"] is not None]
        F = [r["budget"] for r in rows]
        ax1.plot(F, [r["wait_ms_p50"] for r in rows], "o-", label=f"batch {B} p50")
        ax1.plot(F, [r["wait_ms_p99"] for r in rows], "x--", label=f"batch {B} p99")
        ax2.plot(F, [r["hit_rate"] for r in rows], "o-", label=f"batch {B}")
        ax3.plot(F, [r["speedup_vs_plain"] for r in rows], "o-", label=f"batch {B}")
    ax1.set(xlabel="pre-drafting budget F (0 = off)", ylabel="engine's wait for drafts (ms)", yscale="log")
    ax2.set(xlabel="pre-drafting budget F", ylabel="hit rate", ylim=(0, 1))
    ax3.set(xlabel="pre-drafting budget F", ylabel="speedup over plain decoding")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    d = result["drafter"]
    fig.suptitle(f"pre-drafting, {d['method']} head on {d['device']}, {result['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--head", default=str(MODELS / "eagle3"), help="draft head directory (a sequential head)")
    ap.add_argument("--target", default=str(MODELS / "target"), help="target model directory (HF Llama)")
    ap.add_argument("--budgets", default="0,4,8,16,32", help="pre-drafting budgets F (0 = off)")
    ap.add_argument("--batches", default="1,4", help="sequences per engine batch")
    ap.add_argument("-k", "--num-drafts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--transport", choices=["channel", "stream", "unary"], default="channel",
                    help="how the engine sends its steps: a shared-memory step channel (same node), a ProposeStream, "
                         "or one Propose per step")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--drafter-device", default=None,
                    help="the sidecar's GPU when not --device's, e.g. cuda:1: the drafter on a GPU of its own, the "
                         "target on cuda:0 (the sidecar then sees only that GPU, CUDA_VISIBLE_DEVICES, as in a "
                         "container of its own)")
    ap.add_argument("--drafter-flag", action="append", default=[],
                    help="an extra drafter-serve flag, e.g. --drafter-flag=--no-predraft-cycle-check (repeatable)")
    ap.add_argument("--out", default=None, help="JSON path (default bench_out/predraft_<device>.json)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    budgets = [int(x) for x in args.budgets.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    env = {}
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # (as drafter-demo: half the cores each)
        threads = max(1, (os.cpu_count() or 2) // 2)
        env["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(pathlib.Path(args.target) / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in HELDOUT_LIKE + DEMO]
    target = TargetModel.load(args.target, device=device)
    port = free_port()
    load_before = os.getloadavg()
    drafter_device = device
    if args.drafter_device and args.drafter_device != device:
        index = torch.device(args.drafter_device).index
        if index is not None:  # (its own GPU, seen as its only one)
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        drafter_device = "cuda"
    with SidecarProcess(args.head, args.target, device=drafter_device, env=env,
                        extra_args=["--metrics-port", str(port), "--max-draft-tokens", str(max(8, args.num_drafts)),
                                    *args.drafter_flag]
                        ) as sidecar:
        result = asyncio.run(measure(sidecar.address, port, target, prompts, batches, budgets, args.num_drafts,
                                     args.max_new_tokens, args.repeats, args.transport))
        if os.environ.get("DRAFTER_STALL_TRACE_S"):  # (debugging: the sidecar dumped the stacks of its slow steps)
            print(sidecar.log_tail(int(os.environ.get("DRAFTER_STALL_TRACE_LINES", "400"))))
        decisions = [line for line in sidecar.log_tail(100000).splitlines()
                     if "pre-drafting on for" in line or "pre-drafting off for" in line]
        for line in decisions:  # the odds and cycle checks' decisions (docs/predraft.md)
            print("drafter:", line)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = {"benchmark": "predraft",
           "command": shlex.join(["python", "-m", "drafter_client.benchmarks.predraft",
                                  *(sys.argv[1:] if argv is None else argv)]),
           "date": now.isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "cpus": os.cpu_count(), "device": device,
                       "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
                       "drafter_device": args.drafter_device or device},
           "head": args.head, "target": args.target, "prompts": len(prompts), "num_drafts": args.num_drafts,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "drafter_flags": args.drafter_flag,
           "cycle_check_decisions": decisions,
           "load_average_before": load_before, "load_average_after": os.getloadavg(), **result}
    path = write_json(args.out or f"bench_out/predraft_{device.split(':')[0]}.json", out)
    png = plot(out, path.with_suffix(".png"))
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
