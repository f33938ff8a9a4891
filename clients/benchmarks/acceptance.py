"""Benchmark: acceptance of a draft head through the sidecar, measured by the reference engine at k = 1..K.

    python -m drafter_client.benchmarks.acceptance                           # bundled EAGLE-1, k = 1..6, CPU/GPU
    python -m drafter_client.benchmarks.acceptance --prompts stdlib --count 24   # held-out stdlib files instead

The sidecar runs as a child process (drafter-serve on a Unix socket); the engine runs the target (Hugging Face)
in this process, all prompts as one batch, greedy unless --temperature. Per k: mean acceptance length (1 +
accepted / drafts, vLLM's definition), per-position acceptance (accepted at position i / drafts), the conditional
acceptance (position i accepted given i-1 was), tokens/s with speculation and of plain decoding of the same target
(prefill included; the median of --repeats runs). Prints a table and writes JSON (command, machine, date) to --out.
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

import torch

from drafter_client.client import DrafterClient
from drafter_client.engine.reference_engine import ReferenceEngine, SpecConfig
from drafter_client.engine.sidecar_process import MODELS, SidecarProcess
from drafter_client.engine.target import TargetModel
from drafter_client.benchmarks.prompts import HELDOUT_LIKE, stdlib_heldout_prefixes
from drafter_client.benchmarks.report import write_json


def conditional(per_position: list[float]) -> list[float]:
    out, prev = [], 1.0
    for r in per_position:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return out


async def measure(address: str, target: TargetModel, ids: list[list[int]], ks: list[int],
                  max_new_tokens: int, temperature: float, repeats: int) -> dict:
    async with DrafterClient(address, namespace="bench-acceptance", step_timeout_s=None) as drafter:
        info = await drafter.get_info()
        engine = ReferenceEngine(target, drafter, info)
        base_cfg = SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature)
        warm = SpecConfig(max_new_tokens=4, num_drafts=ks[0], temperature=temperature)
        await engine.generate_plain(ids, warm)  # one-time costs out of the timings
        await engine.generate(ids, warm)
        plain_runs = [await engine.generate_plain(ids, base_cfg) for _ in range(repeats)]
        plain, plain_s = plain_runs[0], statistics.median(r.elapsed_s for r in plain_runs)
        rows = []
        for k in ks:
            cfg = SpecConfig(max_new_tokens=max_new_tokens, num_drafts=k, temperature=temperature)
            runs = [await engine.generate(ids, cfg) for _ in range(repeats)]  # same seed: same tokens each time
            r, elapsed = runs[0], statistics.median(x.elapsed_s for x in runs)
            a = r.acceptance
            rows.append({
                "k": k, "drafts": a.num_drafts, "draft_tokens": a.num_draft_tokens,
                "accepted_tokens": a.num_accepted_tokens, "mean_acceptance_length": a.mean_acceptance_length,
                "per_position_acceptance": a.per_position_acceptance,
                "conditional_acceptance": conditional(a.per_position_acceptance),
                "generated_tokens": r.num_tokens, "target_forwards": r.target_forwards,
                "elapsed_s": elapsed, "elapsed_s_runs": [x.elapsed_s for x in runs],
                "tokens_per_s": r.num_tokens / elapsed, "speedup_vs_plain": plain_s / elapsed,
                "identical_to_plain": r.tokens == plain.tokens if temperature == 0 else None,
            })
        return {"drafter": {"model": info.model_name, "method": info.method, "device": info.device,
                            "dtype": info.model_dtype},
                "plain": {"generated_tokens": plain.num_tokens, "target_forwards": plain.target_forwards,
                          "elapsed_s": plain_s, "elapsed_s_runs": [x.elapsed_s for x in plain_runs],
                          "tokens_per_s": plain.num_tokens / plain_s},
                "by_k": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--head", default=str(MODELS / "eagle1"), help="draft head directory")
    ap.add_argument("--target", default=str(MODELS / "target"), help="target model directory (HF Llama)")
    ap.add_argument("--ks", default="1,2,3,4,5,6", help="comma-separated k values")
    ap.add_argument("--prompts", choices=["builtin", "stdlib"], default="builtin",
                    help="builtin: prompts.HELDOUT_LIKE; stdlib: prefixes of held-out stdlib files")
    ap.add_argument("--count", type=int, default=24, help="with --prompts stdlib: how many files")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting; tokens/s from the median")
    ap.add_argument("--device", default=None, help="cpu or cuda for the target and the sidecar (default: cuda "
                                                   "when present)")
    ap.add_argument("--out", default="bench_out/acceptance.json")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    load_before = os.getloadavg()  # the timings mean little on a busy machine: the JSON keeps the load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(pathlib.Path(args.target) / "tokenizer.json"))
    if args.prompts == "builtin":
        texts, sources = HELDOUT_LIKE, [f"prompts.HELDOUT_LIKE[{i}]" for i in range(len(HELDOUT_LIKE))]
    else:
        texts, sources = stdlib_heldout_prefixes(args.count)
        if not texts:
            print("no held-out stdlib files found", file=sys.stderr)
            return 1
    ids = [tokenizer.encode(t).ids for t in texts]
    target = TargetModel.load(args.target, device=device)
    with SidecarProcess(args.head, args.target, device=device,
                        extra_args=["--max-draft-tokens", str(max(8, max(ks)))]) as sidecar:
        result = asyncio.run(measure(sidecar.address, target, ids, ks, args.max_new_tokens, args.temperature,
                                     args.repeats))

    print(f"head {args.head} ({result['drafter']['method']}, sidecar on {result['drafter']['device']}), target on "
          f"{device}; {len(ids)} prompts ({args.prompts}, {min(map(len, ids))}-{max(map(len, ids))} tokens) in one "
          f"batch, {args.max_new_tokens} new tokens each, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")
    p = result["plain"]
    print(f"plain decoding: {p['tokens_per_s']:.1f} tok/s ({p['target_forwards']} target forwards)")
    print(f"{'k':>2} {'drafts':>6} {'mean acc len':>12} {'tok/s':>7} {'speedup':>7} {'fwds':>5}  per-position "
          f"acceptance")
    for r in result["by_k"]:
        print(f"{r['k']:>2} {r['drafts']:>6} {r['mean_acceptance_length']:>12.3f} {r['tokens_per_s']:>7.1f} "
              f"{r['speedup_vs_plain']:>6.2f}x {r['target_forwards']:>5}  "
              + " ".join(f"{x:.3f}" for x in r["per_position_acceptance"]))
    if args.temperature == 0 and not all(r["identical_to_plain"] for r in result["by_k"]):
        print("WARNING: a speculative output differs from plain greedy decoding", file=sys.stderr)

    out = {
        "benchmark": "acceptance",
        "command": shlex.join(["python", "-m", "drafter_client.benchmarks.acceptance",
                               *(sys.argv[1:] if argv is None else argv)]),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "device": device,
                    "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None},
        "head": args.head, "target": args.target, "prompts": args.prompts, "prompt_sources": sources,
        "prompt_tokens": [len(i) for i in ids], "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(), **result,
    }
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
