"""Issue #13's targets against measured figures: one table from the benchmarks' JSON (a script, not a test).

    python scripts/batch_scale_targets.py \
        --bench eagle1=docs/bench/bench_step_..._eagle1_....json --bench eagle3=docs/bench/..._eagle3_fc_....json \
        --profile eagle1=docs/bench/profile_step_..._eagle1_....json --profile eagle3=... \
        --cpu-bench docs/bench/bench_step_tiny_cpu_....json --demo docs/bench/demo_cpu_....json [--demo ...] \
        --out docs/bench/batch_scale_targets_....json

Reads, per head, a GPU run of `bench_step --batches 1,8,32,64,128,256 --rounds N --rounds-only --grpc-floor` and one
or more of `scripts/profile_step.py --columns --states-on-gpu --rounds N --out F` (the same --engine-applies-fc for
both; several --profile for one head: runs in separate processes, see "kernel" below),
and a CPU run of `bench_step --preset tiny --device cpu --batches 1,32,128 --rounds N` (not --rounds-only: the
single pass gives the CPU's batch-128 / batch-1 figure). Prints the table (markdown) and writes it as JSON. What each target
reads:

  kernel      profile_step: the in-process step's wall time over its GPU kernel time, median of the rounds, per batch
              (a JSON without "wall_timed", from before the twenty-second session, is said to be biased high: its
              walls were timed after profiler sessions). With several runs for one head, the median of the runs'
              figures and their range: on a VM host each process draws its own host speed (the host work the GPU
              waits for moved 0.11-0.33 ms between processes of one script on one H200 host, twenty-third session),
              so one process's figure is one draw
  floor       bench_step's single pass at batch 128: the in-process step from columns with the states on the GPU
              (an engine holding its batch as tensors) over the floor; the per-sequence step beside it
  channel     bench_step's rounds: the step channel over the in-process step (per-sequence API against
              Proposer.step) and the batch API through it over the in-process step from columns (Proposer.step_batch)
  unary       bench_step's rounds at batch 128: the batch API by unary gRPC over the in-process step from columns,
              and the unary path's floor (--grpc-floor: the same bytes through a bare grpc.aio server)
  cpu-scale   the CPU run: the in-process step at batch 128 over batch 1 (single pass, and the rounds' medians)
  cpu-worker  the CPU run's rounds: the drafter's own step (its step worker's time per batch, read from its /metrics,
              for the batch API through the channel) over the in-process step from columns, means over the same steps,
              round by round; the median of the rounds (a JSON from before the twenty-fourth session: the single
              pass's channel worker over the in-process step, minutes apart)
  cpu-channel the CPU run's rounds: the step channel over the in-process step at batch 1 and 128
  demo        `drafter-demo --json F` runs (one --demo each): each run's speedup (the median of its alternated
              rounds) and whether its output was the plain greedy output in every run

Ratios are medians: a target is "met" at a batch size when the median is within it (the demo's: when it is at least
the target, in every run given).
"""
import argparse
import datetime
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

KERNEL_MAX = 1.15  # in-process wall time / GPU kernel time, every batch size
FLOOR_MAX = 1.5  # in-process / floor at batch 128
CHANNEL_MAX = 1.10  # step channel / in-process, every batch size
UNARY_MAX = 1.5  # unary gRPC / in-process at batch 128
CPU_SCALE_MAX = 8.0  # CPU in-process batch 128 / batch 1
CPU_WORKER_MAX = 1.2  # CPU: the drafter's own step / the in-process step
CPU_CHANNEL_MAX = 1.3  # CPU: step channel / in-process at batch 1 and 128
DEMO_MIN = 1.2  # drafter-demo on a 2-core CPU: speculative / plain tokens per second
# bench_step's rounds (since the twenty-fourth session): the drafter's own step, like for like with the in-process step
ROUNDS_WORKER = "drafter_step_batch_api_over_in_process_columns"


def load(path: str) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def by_batch(run: dict) -> dict[int, dict]:
    return {row["batch"]: row for row in run["rows"]}


def verdict(values: dict[int, float], limit: float) -> str:
    """'yes' when every batch size's value is within limit, 'no' when none is, else the sizes where it is."""
    ok = [b for b, v in values.items() if v <= limit]
    if len(ok) == len(values):
        return "yes"
    if not ok:
        return "no"
    return "at batch " + ", ".join(str(b) for b in ok)


def fmt(values: dict[int, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values.values()) + " at batch " + " / ".join(str(b) for b in values)


def kernel_row(head: str, profiles: list[dict]) -> dict:
    """The kernel target from one or more profile_step runs of one head (each its own process): per batch size, the
    median over the runs of each run's median ratio; with several runs, their range beside it."""
    per_run = [{b: r["median"]["wall_over_kernel"] for b, r in by_batch(run).items()} for run in profiles]
    batches = [b for b in per_run[0] if all(b in run for run in per_run)]
    ratios = {b: statistics.median(run[b] for run in per_run) for b in batches}
    idle = [r["median"]["idle_ms"] for run in profiles for r in run["rows"]]
    # (a run from before the twenty-second session timed its walls after profiler sessions, which leave the
    # process's CUDA calls slower: its ratios are high by 35-300 us per step)
    biased = "" if all(run.get("wall_timed") for run in profiles) else "; walls timed after profiler sessions: biased high"
    figures = fmt(ratios)
    if len(profiles) > 1:
        spread = " / ".join(f"{min(run[b] for run in per_run):.2f}-{max(run[b] for run in per_run):.2f}" for b in batches)
        figures += f", each the median of {len(profiles)} processes (their range: {spread})"
    first = profiles[0]
    return dict(target=f"in-process <= {KERNEL_MAX}x its GPU kernel time", head=head, values=ratios,
                figures=figures + f" (GPU idle {min(idle):.2f}-{max(idle):.2f} ms per step{biased})",
                met=verdict(ratios, KERNEL_MAX), source=first.get("command", ""), device=first.get("device", ""),
                date=first.get("date", ""), processes=len(profiles))


def gpu_rows(head: str, bench: dict | None, profiles: list[dict]) -> list[dict]:
    rows = [kernel_row(head, profiles)] if profiles else []
    if bench is None:
        return rows
    rows_by_batch = by_batch(bench)
    source = dict(source=bench.get("command", ""), device=bench.get("device", ""), date=bench.get("date", ""))
    at128 = rows_by_batch.get(128)
    if at128 is not None:
        best = at128["in_process_columns_states_on_gpu_ms"] / at128["floor_ms"]
        rows.append(dict(target=f"in-process <= {FLOOR_MAX}x the floor at batch 128", head=head, values={128: best},
                         figures=f"{best:.2f} from columns with the states on the GPU "
                                 f"({at128['in_process_over_floor']:.2f} per sequence, states staged)",
                         met="yes" if best <= FLOOR_MAX else "no", **source))
    rounds = {b: r["rounds_median"] for b, r in rows_by_batch.items() if r.get("rounds_median")}
    if rounds:
        per_seq = {b: m["channel_over_in_process"] for b, m in rounds.items()}
        batch_api = {b: m["channel_batch_api_over_in_process_columns"] for b, m in rounds.items()}
        worst = {b: max(per_seq[b], batch_api[b]) for b in rounds}
        rows.append(dict(target=f"step channel <= {CHANNEL_MAX:.2f}x in-process", head=head, values=worst,
                         figures=f"per-sequence API {fmt(per_seq)}; batch API {fmt(batch_api)}",
                         met=verdict(worst, CHANNEL_MAX), **source))
        m128 = rounds.get(128)
        if m128 is not None:
            unary = m128["unary_batch_api_over_in_process_columns"]
            floor = m128.get("unary_floor_over_in_process_columns")
            rows.append(dict(target=f"unary gRPC <= {UNARY_MAX}x in-process at batch 128", head=head,
                             values={128: unary},
                             figures=f"{unary:.2f}" + (f" (the same bytes through a bare grpc.aio server alone: "
                                                       f"{floor:.2f})" if floor is not None else ""),
                             met="yes" if unary <= UNARY_MAX else (
                                 "no: below gRPC Python's floor" if floor is not None and floor > UNARY_MAX
                                 else "no"), **source))
    return rows


def cpu_rows(run: dict) -> list[dict]:
    rows_by_batch = by_batch(run)
    source = dict(source=run.get("command", ""), device=run.get("device", ""), date=run.get("date", ""))
    rows = []
    one, big = rows_by_batch.get(1), rows_by_batch.get(128)
    if one is not None and big is not None:
        single = big["in_process_ms"] / one["in_process_ms"]
        text = f"{single:.2f} single pass"
        if one.get("rounds") and big.get("rounds"):
            med = statistics.median
            text += f", {med(big['rounds']['in_process_ms']) / med(one['rounds']['in_process_ms']):.2f} over the rounds"
        rows.append(dict(target=f"CPU: in-process batch 128 <= {CPU_SCALE_MAX:g}x batch 1", head="tiny",
                         values={128: single}, figures=text, met="yes" if single <= CPU_SCALE_MAX else "no", **source))
    rounds_worker = {b: r["rounds_median"][ROUNDS_WORKER] for b, r in rows_by_batch.items()
                     if ROUNDS_WORKER in (r.get("rounds_median") or {})}
    worker = rounds_worker or {b: r["channel_worker_over_in_process"] for b, r in rows_by_batch.items()
                               if r.get("channel_worker_over_in_process") is not None}
    if worker:
        how = ("the median of the rounds (the batch API's step inside the drafter over the in-process step from "
               "columns, means over the same steps)" if rounds_worker else "single pass")
        rows.append(dict(target=f"CPU: the drafter's own step <= {CPU_WORKER_MAX}x the in-process step", head="tiny",
                         values=worker, figures=f"{fmt(worker)} ({how})", met=verdict(worker, CPU_WORKER_MAX),
                         **source))
    channel = {b: r["rounds_median"]["channel_over_in_process"] for b, r in rows_by_batch.items()
               if b in (1, 128) and r.get("rounds_median")}
    if channel:
        rows.append(dict(target=f"CPU: step channel <= {CPU_CHANNEL_MAX}x in-process at batch 1 and 128", head="tiny",
                         values=channel, figures=fmt(channel), met=verdict(channel, CPU_CHANNEL_MAX), **source))
    return rows


def demo_rows(runs: list[dict]) -> list[dict]:
    """One row over `drafter-demo --json` runs: values keyed by the run's number (1, 2, ...)."""
    speedups = {i + 1: run["speedup"] for i, run in enumerate(runs)}
    same = [run.get("identical_to_plain") for run in runs]
    rounds = sorted({len(run["rounds"]) for run in runs})
    good = [i for i, v in speedups.items() if v >= DEMO_MIN]
    if False in same:
        met = "no: the output differed from plain greedy decoding"
    else:
        met = "yes" if len(good) == len(runs) else ("no" if not good else f"in {len(good)} runs of {len(runs)}")
    figures = (" / ".join(f"{v:.2f}" for v in speedups.values()) + f" in {len(runs)} run(s), each the median of "
               + "/".join(map(str, rounds)) + " alternated rounds; output "
               + ("identical to plain greedy in every run" if all(same) else "not compared (sampling)"))
    last = runs[-1]
    return [dict(target=f"drafter-demo >= {DEMO_MIN}x plain decoding, same output", head=last.get("head", ""),
                 values=speedups, figures=figures, met=met, source=last.get("command", ""),
                 device=last.get("device", ""), date=last.get("date", ""))]


def pairs(items: list[str], what: str) -> dict[str, list[dict]]:
    """HEAD=PATH items: each head's JSON runs, in the order given."""
    out: dict[str, list[dict]] = {}
    for item in items:
        head, sep, path = item.partition("=")
        if not sep or not head or not path:
            raise SystemExit(f"{what} wants HEAD=PATH, got {item!r}")
        out.setdefault(head, []).append(load(path))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", action="append", default=[],
                    help="HEAD=bench_step JSON (GPU, --rounds, --grpc-floor); one per head")
    ap.add_argument("--profile", action="append", default=[],
                    help="HEAD=profile_step.py --out JSON; repeat a head for runs in separate processes")
    ap.add_argument("--cpu-bench", default=None, help="bench_step JSON of the tiny preset on a CPU, with --rounds")
    ap.add_argument("--demo", action="append", default=[], help="a `drafter-demo --json` run (repeat for several)")
    ap.add_argument("--out", default=None, help="JSON file for the table")
    a = ap.parse_args(argv)
    benches, profiles = pairs(a.bench, "--bench"), pairs(a.profile, "--profile")
    several = [head for head, runs in benches.items() if len(runs) > 1]
    if several:
        ap.error(f"--bench: one run per head ({', '.join(several)} given more)")
    rows = []
    for head in dict.fromkeys([*benches, *profiles]):
        rows += gpu_rows(head, benches.get(head, [None])[0], profiles.get(head, []))
    if a.cpu_bench:
        rows += cpu_rows(load(a.cpu_bench))
    if a.demo:
        rows += demo_rows([load(path) for path in a.demo])
    if not rows:
        ap.error("nothing to read: give --bench, --profile, --cpu-bench or --demo")
    print("| target | head | figures (medians) | met | device, date |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['target']} | {r['head']} | {r['figures']} | {r['met']} | {r['device']}, {r['date'][:10]} |")
    if a.out:
        from drafter_client.benchmarks.report import write_json

        write_json(a.out, dict(benchmark="batch_scale_targets", date=datetime.datetime.now().isoformat(timespec="seconds"),
                               command=" ".join(["scripts/batch_scale_targets.py", *(sys.argv[1:] if argv is None else argv)]),
                               rows=[dict(r, values={str(b): v for b, v in r["values"].items()}) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
