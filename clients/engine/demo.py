"""`drafter-demo`: speculative decoding end to end with the bundled models.

Starts the sidecar (drafter-serve) as a child process on the bundled EAGLE head (CUDA when present, else CPU),
waits for health SERVING, runs the reference engine (Hugging Face target + the sidecar as drafter) on a few code
prompts as one batch, then plain decoding of the same target as the baseline, and prints the generated code, the
acceptance figures and tokens/s with and without speculation; writes a chart of acceptance by draft position
(PNG, when matplotlib is installed). The sidecar gets SIGTERM at the end, and on Ctrl-C.
"""
import argparse
import asyncio
import dataclasses
import datetime
import os
import pathlib
import platform
import shlex
import sys

import torch

from drafter_client.benchmarks.prompts import DEMO
from drafter_client.cli_help import HelpFormatter
from drafter_client.client import DrafterClient, DrafterError
from drafter_client.engine.reference_engine import GenerationResult, ReferenceEngine, SpecConfig, StepInfo
from drafter_client.engine.sidecar_process import MODELS, SidecarError, SidecarProcess
from drafter_client.engine.target import TargetModel
from drafter_client.engine_fc import EngineFc

HEADS = {"eagle1": "EAGLE-1", "eagle3": "EAGLE-3"}
DEFAULT_CHART = pathlib.Path("out") / "drafter-demo" / "acceptance.png"  # out/ is in .gitignore


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="drafter-demo", description=__doc__.split("\n\n")[1],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--head", choices=sorted(HEADS), default="eagle3",
                    help="bundled draft head (models/HEAD); eagle3 drafts over a 2048-token vocabulary, so its step "
                         "is cheaper than eagle1's full-vocabulary one (docs/demo.md)")
    ap.add_argument("--models", default=str(MODELS), help="directory holding target/ and the heads")
    ap.add_argument("-k", "--num-drafts", type=int, default=3, help="drafts per sequence per step")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5,
                    help="timed pairs of runs, speculative and plain, alternated (which of the two goes first "
                         "alternates too); the speedup printed is the middle round's: on a busy machine one run "
                         "of ~1 s is moved by whatever else runs then, the median of alternated pairs much less")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = speculative sampling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several; default: 3 code "
                                                                     "prompts)")
    ap.add_argument("--predraft-branches", type=int, default=0,
                    help="> 0: the sidecar prepares each step's drafts for up to this many verification outcomes "
                         "while the target verifies (docs/predraft.md)")
    ap.add_argument("--step-channel", action=argparse.BooleanOptionalAction, default=True,
                    help="send the steps through a shared-memory step channel, the same-node path "
                         "(docs/step_channel.md); --no-step-channel: one gRPC stream (ProposeStream) for the steps")
    ap.add_argument("--engine-applies-fc", action="store_true",
                    help="eagle3: the sidecar runs with --engine-applies-fc and this engine applies the head's fc to "
                         "its three layers' states before sending them (a third of the bytes; docs/methods.md)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present) for both processes")
    ap.add_argument("--sidecar-flag", action="append", default=[], metavar="FLAG",
                    help="an extra drafter-serve flag for the sidecar, e.g. --sidecar-flag=--step-channel-rehearse-"
                         "after-s=0 (repeatable; the JSON records them)")
    ap.add_argument("--chart", default=str(DEFAULT_CHART),
                    help="PNG of acceptance by draft position (its folder is made); '' for none")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the run's figures as JSON (device, date, command, every round's tok/s and "
                         "speedup, their median, the acceptance, whether the output matched plain greedy): what "
                         "scripts/batch_scale_targets.py --demo reads")
    return ap.parse_args(argv)


class Progress:
    """A live counter on a terminal (one line rewritten), one line per step otherwise."""

    def __init__(self, label: str, total: int):
        self.label = label
        self.total = total
        self.live = sys.stdout.isatty()

    def __call__(self, info: StepInfo) -> None:
        done = sum(info.generated)
        accepted = " ".join(str(info.accepted[i]) for i in sorted(info.accepted))
        line = (f"[{self.label}] step {info.step:3d}  tokens {done:4d}/{self.total}  "
                f"{done / info.elapsed_s:7.1f} tok/s" + (f"  accepted this step: {accepted}" if accepted else ""))
        if self.live:
            print("\r" + line.ljust(100), end="", flush=True)
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.live:
            print()


def write_chart(path: str, per_position: list[float], title: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib to get one)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    positions = list(range(1, len(per_position) + 1))
    bars = ax.bar(positions, per_position, color="#4C72B0")
    ax.bar_label(bars, fmt="%.2f")
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"chart: {out.resolve()}"


async def run_engine(args: argparse.Namespace, address: str, device: str, target_dir: pathlib.Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    target = TargetModel.load(str(target_dir), device=device)
    prompts = args.prompt or DEMO
    ids = [tokenizer.encode(p).ids for p in prompts]
    cfg = SpecConfig(max_new_tokens=args.max_new_tokens, num_drafts=args.num_drafts, temperature=args.temperature,
                     seed=args.seed, predraft_branches=args.predraft_branches)
    total = cfg.max_new_tokens * len(ids)
    async with DrafterClient(address, namespace="drafter-demo") as drafter:
        info = await drafter.get_info()
        channel = args.step_channel and await drafter.open_step_channel()
        print(f"drafter: {info.model_name} ({info.method}) on {info.device} {info.model_dtype}; target: "
              f"{target_dir} on {device}; {len(ids)} prompts in one batch, k = {cfg.num_drafts}, "
              f"{'greedy' if cfg.temperature == 0 else f'temperature {cfg.temperature}'}, "
              f"{cfg.max_new_tokens} new tokens each; steps through "
              f"{'a shared-memory step channel' if channel else 'a gRPC stream (ProposeStream)'}")
        args.target_parameters = sum(p.numel() for p in target.model.parameters())
        # with a step channel, each step is a propose() that the channel takes (a stream would bypass it)
        # (in the drafter's dtype: the GEMM it would have run)
        engine_fc = (EngineFc.from_head(args.head_dir, device=device, dtype=info.model_dtype)
                     if info.engine_applies_fc else None)
        engine = ReferenceEngine(target, drafter, info, use_stream=not channel, engine_fc=engine_fc)
        warm = dataclasses.replace(cfg, max_new_tokens=4)  # first calls pay one-time costs: keep them out of timing
        await engine.generate(ids, warm)
        await engine.generate_plain(ids, warm)
        rounds = []
        for i in range(args.rounds):
            shown = i == 0  # (progress for the first round's runs; one line for each later round)
            got = {}
            for kind in (("speculative", "plain") if i % 2 == 0 else ("plain", "speculative")):
                progress = Progress(f"{kind:11s}", total) if shown else None
                run = engine.generate if kind == "speculative" else engine.generate_plain
                got[kind] = await run(ids, cfg, on_step=progress)
                if progress is not None:
                    progress.end()
            rounds.append((got["speculative"], got["plain"]))
            if args.rounds > 1:
                print(f"round {i + 1}/{args.rounds} ({'speculative first' if i % 2 == 0 else 'plain first'}): "
                      f"speculative {got['speculative'].tokens_per_s:.1f} tok/s, plain "
                      f"{got['plain'].tokens_per_s:.1f} tok/s: {speedup_of(rounds[-1]):.2f}x", flush=True)
        args.channel_steps, args.grpc_steps = drafter.steps_through_channel, drafter.steps_through_grpc
    report(args, prompts, tokenizer, rounds, cfg)
    if args.json:
        write_run_json(args, device, rounds, cfg)


def write_run_json(args, device: str, rounds: list[tuple[GenerationResult, GenerationResult]],
                   cfg: SpecConfig) -> None:
    from drafter_client.benchmarks.report import write_json

    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    speedups = [speedup_of(r) for r in rounds]
    acc = rounds[0][0].acceptance
    write_json(args.json, dict(
        benchmark="drafter_demo", date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=f"{device}: {name}, {os.cpu_count()} cores", torch=torch.__version__,
        command=" ".join(shlex.quote(x) for x in sys.argv), head=args.head, k=cfg.num_drafts,
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, prompts=len(rounds[0][0].tokens),
        step_channel=bool(args.channel_steps), sidecar_flags=args.sidecar_flag,
        mean_acceptance_length=acc.mean_acceptance_length,
        rounds=[dict(speculative_first=i % 2 == 0, speculative_tokens_per_s=s.tokens_per_s,
                     plain_tokens_per_s=p.tokens_per_s, speedup=x) for i, ((s, p), x) in enumerate(zip(rounds, speedups))],
        speedup=speedups[middle_round(rounds)],  # (the middle round's, as printed)
        identical_to_plain=identical_to_plain(rounds) if cfg.temperature == 0 else None))


def speedup_of(pair: tuple[GenerationResult, GenerationResult]) -> float:
    spec, plain = pair
    return spec.tokens_per_s / plain.tokens_per_s


def identical_to_plain(rounds: list[tuple[GenerationResult, GenerationResult]]) -> bool:
    """Whether every round's speculative output and plain output are the first round's speculative output (greedy)."""
    first = rounds[0][0].tokens
    return all(s.tokens == p.tokens == first for s, p in rounds)


def middle_round(rounds: list[tuple[GenerationResult, GenerationResult]]) -> int:
    """The index of the middle round by speedup (the lower middle one for an even count): the one printed."""
    return sorted(range(len(rounds)), key=lambda i: speedup_of(rounds[i]))[(len(rounds) - 1) // 2]


def report(args, prompts: list[str], tokenizer, rounds: list[tuple[GenerationResult, GenerationResult]],
           cfg: SpecConfig) -> None:
    """rounds: (speculative, plain) per timed round. The code and the acceptance are the first round's speculative
    run's; the speed is the middle round's by speedup (the lower middle one for an even count)."""
    spec = rounds[0][0]
    acc = spec.acceptance
    print("\n== generated code (speculative) ==")
    for i, (prompt, tokens) in enumerate(zip(prompts, spec.tokens)):
        print(f"--- prompt {i + 1} ---\n{prompt}{tokenizer.decode(tokens)}")
    print(f"\n== acceptance ({HEADS[args.head]} head, k = {cfg.num_drafts}) ==")
    print(f"mean acceptance length: {acc.mean_acceptance_length:.2f}  (1 + {acc.num_accepted_tokens} accepted "
          f"tokens / {acc.num_drafts} drafts, as vLLM counts it)")
    print("per-position acceptance: " + "  ".join(f"{i + 1}: {r:.2f}"
                                                   for i, r in enumerate(acc.per_position_acceptance)))
    if cfg.predraft_branches:
        print(f"pre-drafting ({cfg.predraft_branches} branches): {acc.predrafted_steps} of {acc.answered_steps} "
              f"drafter answers were prepared during the verification (hit rate {acc.predraft_hit_rate:.2f}); "
              f"acceptance length of those drafts {acc.predrafted_acceptance_length:.2f}")
    middle = middle_round(rounds)
    spec_m, plain_m = rounds[middle]
    print("\n== speed (all prompts, prefill included" +
          (f"; round {middle + 1} of {len(rounds)}, the middle one by speedup) ==" if len(rounds) > 1 else ") =="))
    for name, r in (("speculative", spec_m), ("plain", plain_m)):
        print(f"{name:12s} {r.num_tokens:5d} tokens in {r.elapsed_s:6.2f} s = {r.tokens_per_s:7.1f} tok/s, "
              f"{r.target_forwards} target forwards")
    speedups = [speedup_of(r) for r in rounds]
    print(f"speedup: {speedups[middle]:.2f}x" + (
        f" (median of {len(rounds)} alternated rounds: {', '.join(f'{x:.2f}x' for x in speedups)})"
        if len(rounds) > 1 else ""))
    if args.channel_steps or args.grpc_steps:  # (a ProposeStream's steps are counted by neither)
        print(f"drafter steps: {args.channel_steps} through the step channel, {args.grpc_steps} by unary gRPC")
    explain_speed(spec_m, plain_m, acc.mean_acceptance_length, cfg.num_drafts, args.target_parameters)
    if cfg.temperature == 0:
        print(f"speculative output identical to plain greedy decoding: {'yes' if identical_to_plain(rounds) else 'NO'}"
              + (f" (every run of the {len(rounds)} rounds)" if len(rounds) > 1 else ""))
    if args.chart:
        title = (f"{HEADS[args.head]} head, k = {cfg.num_drafts}: mean acceptance length "
                 f"{acc.mean_acceptance_length:.2f}")
        print(write_chart(args.chart, acc.per_position_acceptance, title))


def explain_speed(spec: GenerationResult, plain: GenerationResult, acceptance_length: float, k: int,
                  target_parameters: int) -> None:
    """Where a step's time goes, and, when speculation lost, why."""
    plain_ms = plain.elapsed_s / plain.target_forwards * 1e3
    spec_steps = max(1, spec.target_forwards - 1)
    wait_ms = spec.draft_wait_s / spec_steps * 1e3
    target_ms = (spec.elapsed_s - spec.draft_wait_s) / spec.target_forwards * 1e3
    print(f"per step: plain {plain_ms:.1f} ms for 1 token; speculative {target_ms:.1f} ms of target work over "
          f"{k + 1} tokens + {wait_ms:.1f} ms waiting for drafts, for {acceptance_length:.2f} tokens")
    if spec.tokens_per_s < plain.tokens_per_s:
        print(f"why speculation is slower here: speculative decoding pays when one target forward costs far more "
              f"than a draft round trip and verifying {k + 1} tokens costs about as much as decoding 1 (a large "
              f"target on a GPU is memory-bound). This target has only {target_parameters / 1e6:.1f}M "
              f"parameters: a forward is compute- and overhead-bound, so verifying {k + 1} tokens costs "
              f"{target_ms / plain_ms:.1f}x one token, and the drafter's round trip ({wait_ms:.1f} ms) is "
              f"{wait_ms / plain_ms:.1f}x a plain step. With a real target (billions of parameters) both ratios "
              f"fall toward 1 and 0 (docs/performance.md).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        print("drafter-demo: --rounds must be 1 or more", file=sys.stderr)
        return 2
    models = pathlib.Path(args.models)
    head_dir, target_dir = models / args.head, models / "target"
    for d in (head_dir, target_dir):
        if not (d / "config.json").is_file():
            print(f"drafter-demo: {d} is not a model directory (no config.json)", file=sys.stderr)
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = {}
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Two busy processes on one CPU: give each half the cores, or their thread pools fight over them (with
        # two threads each on a 2-core machine, single runs were up to 15x slower; docs/demo.md).
        threads = max(1, (os.cpu_count() or 2) // 2)
        env["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        print(f"CPU: {threads} thread(s) for the sidecar and {threads} for the engine", flush=True)
    if args.engine_applies_fc and args.head != "eagle3":
        print("drafter-demo: --engine-applies-fc is for the eagle3 head (an fc over three target layers)",
              file=sys.stderr)
        return 2
    args.head_dir = head_dir
    sidecar = SidecarProcess(head_dir, target_dir, device=device, env=env,
                             extra_args=(["--engine-applies-fc"] if args.engine_applies_fc else []) + args.sidecar_flag)
    print(f"starting the sidecar: {' '.join(sidecar.command())}", flush=True)
    code = 0
    try:
        sidecar.start()
        print(f"sidecar SERVING at {sidecar.address}", flush=True)
        asyncio.run(run_engine(args, sidecar.address, device, target_dir))
    except SidecarError as e:
        print(f"drafter-demo: {e}", file=sys.stderr)
        code = 1
    except (DrafterError, RuntimeError, ValueError) as e:
        print(f"drafter-demo: {e}\nthe sidecar's log ends with:\n{sidecar.log_tail()}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("\ndrafter-demo: interrupted", file=sys.stderr)
        code = 130
    finally:
        exit_code = sidecar.close()
        if exit_code is not None:
            how = "stopped with SIGTERM" if sidecar.terminated else "had exited by itself"
            print(f"sidecar {how}, exit code {exit_code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
