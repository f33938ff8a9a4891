"""What pre-drafting costs the drafter's step where it falls back (a script, not a test; docs/predraft.md).

At a large batch the odds check (drafter_service/engine/predraft_odds.py) refuses every step batch: no pass runs, a
step keeps nothing for one. What is left of pre-drafting is bookkeeping per sequence at admission and after the step.
This script measures it in-process: two sets of B sequences on one proposer, one stepping without pre-drafting and
one asking for F branches, their steps alternated. Every step commits a random number of the drafts plus a bonus
token (random target states), as a verification would, so prepared branches would mostly miss. Passes run between
steps whenever the drafter has work (as the scheduler runs them when idle; timed apart, not in the step). Prints,
per batch size, the median step time of each set, their ratio and the passes that ran; writes JSON.

    python benchmarks/bench_predraft_fallback.py --device cuda --batches 1,16,64,128 --out docs/bench/predraft_fallback_h200.json
"""
import argparse
import datetime
import os
import pathlib
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.config import ServerConfig  # noqa: E402
from drafter_service.engine.step_io import StepInput  # noqa: E402
from drafter_service.runtime import build_runtime  # noqa: E402

MODELS = pathlib.Path(__file__).resolve().parent.parent / "models"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(MODELS / "eagle3"))
    ap.add_argument("--target", default=str(MODELS / "target"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--budget", type=int, default=8, help="F of the pre-drafting set")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed steps of each set per batch size")
    ap.add_argument("--min-all-hit", type=float, default=None, help="--predraft-min-all-hit (default: the server's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kw = {} if args.min_all_hit is None else {"predraft_min_all_hit": args.min_all_hit}
    rt = build_runtime(ServerConfig(model=args.head, target_model=args.target, device=args.device,
                                    kv_cache_tokens=1 << 18, max_model_len=2048, **kw))
    proposer, width, vocab = rt.proposer, rt.limits.hidden_states_width, rt.limits.vocab_size
    pd = proposer.predraft
    rng, k = random.Random(0), args.k
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        state = {}  # (set, i) -> [committed length C, next token, drafts]

        def steps(name: str, budget: int, first: bool) -> list[StepInput]:
            out = []
            for i in range(B):
                key = (name, i)
                if first:
                    m, p = 64, 0
                    tokens = [rng.randrange(vocab) for _ in range(m)]
                    nxt = rng.randrange(vocab)
                else:
                    C, x, drafts = state[key]
                    a = rng.randint(0, k)
                    tokens, p = [x] + drafts[:a], C
                    nxt = rng.randrange(vocab)
                state[key] = [p + len(tokens), nxt, None]
                out.append(StepInput(f"b{B}", f"{name}{i}", p, torch.tensor(tokens), torch.randn(len(tokens), width),
                                     nxt, k, predraft_branches=budget))
            return out

        def run(name: str, budget: int, first: bool = False) -> float:
            batch = steps(name, budget, first)
            t0 = time.perf_counter()
            outs = proposer.step(batch)
            dt = time.perf_counter() - t0
            for i, o in enumerate(outs):
                assert o.code == 0, o.message
                state[(name, i)][2] = list(o.drafts)
            return dt

        run("off", 0, True)
        run("on", args.budget, True)
        passes0, refused0 = pd.counters.passes, pd.counters.refused_by_odds
        times = {"off": [], "on": []}
        pass_s = []
        for it in range(args.steps + 5):
            for name, budget in (("off", 0), ("on", args.budget)) if it % 2 == 0 else (("on", args.budget), ("off", 0)):
                dt = run(name, budget)
                if it >= 5:
                    times[name].append(dt)
                if pd.has_work():
                    t0 = time.perf_counter()
                    pd.prepare(lambda: False)
                    pass_s.append(time.perf_counter() - t0)
        off, on = statistics.median(times["off"]) * 1e3, statistics.median(times["on"]) * 1e3
        row = {"batch": B, "budget": args.budget, "step_ms_off_p50": off, "step_ms_on_p50": on, "on_over_off": on / off,
               "step_ms_off_p10_p90": [float(x) * 1e3 for x in statistics.quantiles(times["off"], n=10)[::8]],
               "step_ms_on_p10_p90": [float(x) * 1e3 for x in statistics.quantiles(times["on"], n=10)[::8]],
               "passes": pd.counters.passes - passes0, "refused_by_odds": pd.counters.refused_by_odds - refused0,
               "pass_ms_mean": statistics.fmean(pass_s) * 1e3 if pass_s else None,
               "hit_rate_estimate": pd.odds.hit_rate}
        rows.append(row)
        print(f"batch {B:4d} F {args.budget}: step p50 {off:7.3f} ms without pre-drafting, {on:7.3f} ms with "
              f"({on / off:.3f}x); passes {row['passes']}, refused by the odds {row['refused_by_odds']}, "
              f"hit-rate estimate {pd.odds.hit_rate:.2f}", flush=True)
        for name in ("off", "on"):
            for i in range(B):
                proposer.table.release(f"b{B}", f"{name}{i}")
    now = datetime.datetime.now(datetime.timezone.utc)
    dev = torch.device(args.device)
    result = {"benchmark": "predraft_fallback", "date": now.isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/bench_predraft_fallback.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "cpus": os.cpu_count(), "device": args.device,
                          "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
              "min_all_hit": pd.odds.min_all_hit, "rows": rows}
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
