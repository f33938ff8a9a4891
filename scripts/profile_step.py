"""Profile one in-process engine step on CUDA (torch.profiler): GPU kernel time by kernel vs wall time.

    python scripts/profile_step.py --preset llama3-8b --batches 1,128    # prints a table per batch size
    python scripts/profile_step.py --batches 128 --host-profile         # + the python functions by own time
    python scripts/profile_step.py --batches 128 --states-on-gpu        # the steps' hidden states already on the GPU
    python scripts/profile_step.py --batches 128 --columns --gaps       # Proposer.step_batch; where the GPU idles
    python scripts/profile_step.py --batches 128 --columns --phases     # the step's host phases, no profiler
    python scripts/profile_step.py --batches 8 --columns --timeline     # every GPU activity of one step, and the
                                                                        # cost of the graphs' kernel boundaries
    python scripts/profile_step.py --batches 128 --columns --mixed-m    # steps of 1..m committed tokens each
    python scripts/profile_step.py --batches 128 --columns --advance    # contexts that grow as in serving
    python scripts/profile_step.py --preset llama3-8b-eagle3 --engine-applies-fc --columns --states-on-gpu \
        --batches 1,8,32,64,128,256 --rounds 3 --out gpu_out/profile_step.json   # the JSON batch_scale_targets.py reads

By default the steps' target hidden states are host tensors (as a sidecar receives them: the step stages them through
pinned memory); --states-on-gpu gives them on the GPU, as an engine in the drafter's own process holds them.

By default every step re-sends the same positions (a fixed context: no sequence ever needs a new KV block). With
--advance (columns only) each step starts where the last one ended, as an engine's decode loop does: the contexts
grow by m a step and each sequence takes a new block every block_size / m steps (at batch 128, m = 3 and 16-token
blocks, some 24 sequences a step), which is host work a serving step does and the fixed-context step does not
(sequence i starts i % block_size positions back, so that they do not all cross a block boundary on the same step).
The positions go back to the first step's before each timed phase (a rollback, which the protocol allows), so that
every phase times the same contexts (1024 + up to 3 x 20 at the default); they also go back after ADVANCE_WINDOW
positions (bench_step.AdvancingStep).

Per batch size, --rounds times: the wall time of 20 steps (no profiler) and the GPU kernel time of 5 steps under
torch.profiler (the sum of the GPU activities' own time); the ratio wall / kernel time is #13's "in-process <= 1.15x
the GPU kernel time of the step". Every wall time (and --phases) is taken first, round by round over all batch
sizes, before the process runs any profiler session: after one, the process's CUDA calls stay slower (+35-300 us per
step at batch 1-128 on an H200 and an H100; scripts/profiler_after_effect.py), which the wall times of every round but
the first carried until the twenty-second session. --out writes each round's figures and their medians as JSON
(device, date, command; "walls_ms" once the wall times are in; beside each round's mean step, its median step,
"step_median_ms": how much a slow spell of the host added to the mean, which the ratio uses).
"""
import argparse
import cProfile
import datetime
import pathlib
import platform
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402

PROFILED_STEPS = 5  # steps under torch.profiler per round: the kernel time of a step is their mean
ADVANCE_WINDOW = 1024  # --advance: how far the positions move on before they go back to the first step's


def rewind(step) -> None:
    """An --advance step (bench_step.AdvancingStep) back to its first positions (before each timed phase); nothing
    for any other step."""
    if isinstance(step, b.AdvancingStep):
        step.rewind()


def profiled_steps(step, inputs, n: int):
    """n steps under torch.profiler, each in a record_function range: (the profiler's events, the steps' (start, end)
    on the host clock, in order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            with torch.profiler.record_function("engine_step"):
                step(inputs)
    events = prof.events()
    return events, sorted((e.time_range.start, e.time_range.end) for e in events
                          if e.name == "engine_step" and e.device_type == torch.autograd.DeviceType.CPU)


def is_gpu_activity(event) -> bool:
    """A kernel, copy or memset. (The record_function range shows on the GPU timeline too, spanning the step's
    activities: not an activity. Counting it hid every idle interval until 2026-11-26.)"""
    return event.device_type == torch.autograd.DeviceType.CUDA and event.name != "engine_step"


def print_gaps(step, inputs, batch: int, n: int = 10) -> None:
    """Medians over n steps of: the step's wall time, the time from its start to its first GPU activity (kernel,
    copy or memset), the GPU's idle time between its first and last activity, and from the last activity to the
    step's return."""
    events, steps = profiled_steps(step, inputs, n)
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events if is_gpu_activity(e))
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


def print_timeline(step, inputs, batch: int, n: int = 5) -> None:
    """Every GPU activity of the last of n profiled steps, in order: its start from the step's start, its duration,
    the idle time before it (since the previous activity ended) and its name; then the gaps summed by the kernel
    that follows them. Shows what the GPU does between kernels inside the replayed graphs."""
    import collections

    events, steps = profiled_steps(step, inputs, n)
    s0, s1 = steps[-1]
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if is_gpu_activity(e) and e.time_range.end > s0 and e.time_range.start < s1)
    launches = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and s0 <= e.time_range.start < s1
                and e.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync")]
    print(f"--- batch {batch}: timeline of one step ({len(gpu)} GPU activities, step {(s1 - s0) / 1e3:.3f} ms; "
          f"host launches: " + ", ".join(f"{name} x{c}" for name, c in
                                        collections.Counter(e.name for e in launches).items()) + ") ---")
    print("    start_us    dur_us    gap_us  name")
    end, gaps, durs = s0, collections.Counter(), 0.0
    count = collections.Counter()
    for a, b_, name in gpu:
        gap = max(0.0, a - end)
        short = name if len(name) <= 70 else name[:67] + "..."
        print(f"  {a - s0:10.1f} {b_ - a:9.1f} {gap:9.1f}  {short}")
        gaps[short] += gap
        count[short] += 1
        durs += b_ - a
        end = max(end, b_)
    total_gap = sum(gaps.values())
    print(f"--- batch {batch}: {len(gpu)} activities, {durs / 1e3:.3f} ms of their own time, {total_gap / 1e3:.3f} ms "
          f"idle between/before them ({total_gap / max(1, len(gpu)):.1f} us per activity); idle before each kind: ---")
    for name, g in gaps.most_common(15):
        print(f"  {g:9.1f} us over {count[name]:3d}  {name}")


def replay_rate(graphs, batch: int, n: int = 50) -> None:
    """Without the profiler: one decode-step graph replayed n times back to back (the GPU never waits for the host),
    timed with CUDA events, against the kernel time of one replay under the profiler. The difference is what the
    boundaries between the graph's kernels cost."""
    if graphs is None:
        return
    from drafter_service.engine.cuda_graphs import padded_batch_size

    bs = padded_batch_size(batch, graphs.sizes)
    if bs is None or bs not in graphs.graphs:
        return
    with torch.inference_mode():
        graphs.steps_left.zero_()  # every row masked: no KV write
    for _ in range(3):
        graphs._replay(bs)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graphs._replay(bs)
    stop.record()
    torch.cuda.synchronize()
    per_replay = start.elapsed_time(stop) / n
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graphs._replay(bs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("Memcpy")]
    own = sum(e.time_range.end - e.time_range.start for e in kernels) / n / 1e3
    print(f"--- batch {batch}: one decode-step graph (padded batch {bs}) replayed {n} times: {per_replay:.3f} ms per "
          f"replay, kernels {own:.3f} ms ({len(kernels) // n} per replay): {(per_replay - own) * 1e3:.1f} us between "
          f"them, {(per_replay - own) * 1e3 / max(1, len(kernels) // n):.2f} us per kernel ---", flush=True)
    # the decode steps as chains (cuda_graphs.DECODE_CHAIN_LENGTHS) against as many single replays, alternated
    for length in getattr(graphs, "chain_lengths", ()):  # (a tree before the chains: none)
        chain = graphs.chains.get((bs, length))
        if chain is None:
            continue
        singles, chains = [], []
        for _ in range(3):
            for times, run in ((singles, lambda: [graphs._replay(bs) for _ in range(length)]), (chains, chain.replay)):
                run()
                start.record()
                for _ in range(n):
                    run()
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop) / n)
        single, chained = statistics.median(singles), statistics.median(chains)
        print(f"--- batch {batch}: {length} decode steps (padded batch {bs}), back to back, median of 3 x {n}: "
              f"{length} single-step replays {single:.3f} ms, one chain {chained:.3f} ms: "
              f"{(single - chained) * 1e3 / length:.1f} us less per step ---", flush=True)


def print_phases(rt, step, inputs, batch: int, n: int = 30) -> None:
    """Without the profiler: the host phases of n steps of the graph path, from timestamps taken by thin wrappers
    (about a microsecond each) at the stage boundaries of a step, medians in ms:
      admit     step start -> step metadata (table lookups, checks, block resizes)
      metadata  the step's columns into the graphs' record and its copy (first_step_record.py; a tree from before
                it: build_step_metadata_columns, or StepMetadata.build on the per-sequence path: the packing and
                the one metadata copy)
      copy-in   metadata -> the first graph launch: the states' copy into the graphs' fs_states (before the record:
                mostly the rows' load kernel, load_first_step_rows)
      launch    the first-step and decode graph replays (launches only: the GPU runs behind)
      meanwhile the host work run while the GPU drafts (the acceptance count)
      wait      the step's one synchronization: the GPU still running
      after     drafts on the host -> the step returns (the sequences' state, the reply, metrics)
    The host work the GPU waits for is admit + metadata + copy-in before the GPU starts, and after."""
    from drafter_service.engine import cuda_graphs, proposer as proposer_mod

    graphs = rt.proposer.decode_graphs
    if graphs is None:
        return
    marks: list[tuple[str, float]] = []
    clock = time.perf_counter

    def wrap(owner, name, before, after=None):
        original = getattr(owner, name)
        raw = vars(owner).get(name)  # (what to put back: a classmethod as such; None: an instance's method)

        def wrapped(*args, **kwargs):
            marks.append((before, clock()))
            try:
                return original(*args, **kwargs)
            finally:
                if after:
                    marks.append((after, clock()))
        setattr(owner, name, wrapped)
        return owner, name, raw

    undo = [wrap(proposer_mod, "build_step_metadata_columns", "metadata", "metadata_end"),
            wrap(proposer_mod.StepMetadata, "build", "metadata", "metadata_end"),  # (the per-sequence path)
            wrap(graphs, "_replay_first", "launch"),
            wrap(proposer_mod._Drafts, "run_meanwhile", "meanwhile", "meanwhile_end"),
            wrap(proposer_mod._Drafts, "set_host_rows", "after")]
    if hasattr(graphs, "record"):  # (the graph path builds no step metadata: its record is what the host packs)
        undo.append(wrap(graphs.record, "write", "metadata", "metadata_end"))
    if hasattr(cuda_graphs.ops, "load_first_step_rows"):  # (the one launch that loads the rows: part of copy-in)
        undo.append(wrap(cuda_graphs.ops, "load_first_step_rows", "rows_in", "rows_in_end"))
    rows = []
    try:
        for _ in range(n):
            marks.clear()
            t0 = clock()
            step(inputs)
            t1 = clock()
            first = {}
            for name, t in marks:
                first.setdefault(name, t)
            if not all(x in first for x in ("metadata", "launch", "after")):
                continue
            # (no acceptance count to run meanwhile, as on the per-sequence path on the CPU: a zero-length phase)
            meanwhile = first.get("meanwhile", first["after"])
            meanwhile_end = first.get("meanwhile_end", first["after"])
            rows.append(dict(admit=first["metadata"] - t0, metadata=first["metadata_end"] - first["metadata"],
                             copy_in=first["launch"] - first["metadata_end"], launch=meanwhile - first["launch"],
                             meanwhile=meanwhile_end - meanwhile, wait=first["after"] - meanwhile_end,
                             after=t1 - first["after"], wall=t1 - t0,
                             rows_in=first["rows_in_end"] - first["rows_in"] if "rows_in" in first else 0.0))
    finally:
        for owner, name, raw in undo:
            if raw is None:
                delattr(owner, name)  # (the instance attribute hid the class's method)
            else:
                setattr(owner, name, raw)
    if not rows:
        print(f"--- batch {batch}: phases: the step did not replay the first-step graph ---")
        return
    med = {key: statistics.median(r[key] for r in rows) * 1e3 for key in rows[0]}
    host = med["admit"] + med["metadata"] + med["copy_in"] + med["after"]
    print(f"--- batch {batch}: phases (median of {len(rows)} steps, no profiler, ms): " +
          " + ".join(f"{key} {med[key]:.3f}" for key in ("admit", "metadata", "copy_in", "launch", "meanwhile",
                                                          "wait", "after")) +
          f" (of copy-in, the rows' load kernel {med['rows_in']:.3f})"
          f"; wall {med['wall']:.3f}; host work the GPU waits for (admit + metadata + copy-in + after) {host:.3f} ---",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--mixed-m", action="store_true",
                    help="sequence i re-sends 1 + i %% m committed tokens (mixed m, as after varying acceptance) "
                         "instead of m each")
    ap.add_argument("--advance", action="store_true",
                    help="with --columns: each step starts where the last one ended (contexts and block tables grow "
                         "as in serving) instead of re-sending the same positions")
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
    ap.add_argument("--phases", action="store_true",
                    help="also split the step's host time into phases with timestamps, without the profiler")
    ap.add_argument("--timeline", action="store_true",
                    help="also print every GPU activity of one step with the idle time before it")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run cProfile over 50 steps and print the python functions by own and by cumulative time "
                         "(host work)")
    ap.add_argument("--engine-applies-fc", action="store_true",
                    help="EAGLE-3 presets: the drafter runs with engine_applies_fc (--engine-applies-fc), its steps' "
                         "states the fc's [T, H] output, as bench_step --engine-applies-fc")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each batch size this many times (wall time and kernel time each round; the medians "
                         "and the spread go to --out)")
    ap.add_argument("--out", default=None, help="JSON file for the figures (per batch: each round's and the medians)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    shape = b.PRESETS[a.preset]
    if a.advance and not a.columns:
        ap.error("--advance is for --columns steps")
    if a.engine_applies_fc and shape.get("method") != "eagle3":
        ap.error(f"--engine-applies-fc is for EAGLE-3 presets; {a.preset} is not one")
    result = dict(benchmark="profile_step", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}", torch=torch.__version__,
                  command=" ".join(["scripts/profile_step.py", *sys.argv[1:]]), preset=a.preset, context=a.context,
                  m=a.m, mixed_m=a.mixed_m, k=a.k, columns=a.columns, advance=a.advance, states_on_gpu=a.states_on_gpu,
                  engine_applies_fc=a.engine_applies_fc, cuda_graphs=not a.no_cuda_graphs, rounds=a.rounds, rows=[],
                  wall_timed="before any profiler session", complete=False)
    with tempfile.TemporaryDirectory() as tmp:
        max_len = a.context + 64 + (ADVANCE_WINDOW + 64 if a.advance else 0)
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, max_len, device="cuda",
                                   kv_cache_tokens=max(200_000, 300 * max_len),  # 256 sequences fit
                                   cuda_graphs=not a.no_cuda_graphs, cpu_threads=a.cpu_threads,
                                   engine_applies_fc=a.engine_applies_fc)
        batches = [int(x) for x in a.batches.split(",")]
        # Every batch's sequences prefilled up front (make_steps names them b0, b1, ...: a batch's decode step runs
        # over the first B of them, each re-sending its last m tokens at the same context, whichever prefill wrote
        # them last), so that the rounds can go over the batch sizes in turn.
        prepared = {batch: prepare(rt, a, shape, batch) for batch in batches}
        # Phase 1, before any torch.profiler session in this process: the wall times (and --phases). A profiler
        # session leaves the process's CUDA calls slower after it ends (H200 and H100, torch 2.11: a small op's
        # launch +2-4 us, the step's wall +35-300 us at batch 1-128; scripts/profiler_after_effect.py, twenty-second
        # session), which every round after the first used to carry. Round r times every batch size before round
        # r + 1, so that a slow spell of the host lands on one round of several sizes, not on all rounds of one.
        walls = {batch: [] for batch in batches}
        step_medians = {batch: [] for batch in batches}  # (beside the mean: the median step of each round's 20)
        for _ in range(a.rounds):
            for batch in batches:
                _, inputs, step = prepared[batch]
                rewind(step)
                for _ in range(5):  # (the step before was another batch's)
                    step(inputs)
                mean, median = time_wall(step, inputs)
                walls[batch].append(mean * 1e3)
                step_medians[batch].append(median * 1e3)
        if a.phases:
            for batch in batches:
                _, inputs, step = prepared[batch]
                rewind(step)
                for _ in range(5):
                    step(inputs)
                print_phases(rt, step, inputs, batch)
        if a.out:  # (a run stopped by a time limit in phase 2 keeps these)
            result["walls_ms"] = {str(k): v for k, v in walls.items()}
            write_json(a.out, result, say=False)
        # Phase 2: the kernel times under the profiler, then what else uses it (or cProfile)
        for batch in batches:
            _, inputs, step = prepared[batch]
            rewind(step)
            for _ in range(5):
                step(inputs)
            kernels = []
            for r in range(a.rounds):
                events = profiled_kernels(step, inputs)
                gpu_total = sum(e.self_device_time_total for e in events) / PROFILED_STEPS / 1e3  # ms per step
                kernels.append(gpu_total)
                wall = walls[batch][r]
                print(f"\n=== batch {batch} ({torch.get_num_threads()} host threads, "
                      f"{'columns (step_batch)' if a.columns else 'StepInputs (step)'}, "
                      f"{'m = 1..' if a.mixed_m else 'm = '}{a.m}, states on the "
                      f"{'GPU' if a.states_on_gpu else 'host'}"
                      f"{', fc by the engine' if a.engine_applies_fc else ''}"
                      f"{', contexts advancing' if a.advance else ''}"
                      f"{f', round {r + 1} of {a.rounds}' if a.rounds > 1 else ''}): wall {wall:.2f} ms/step, "
                      f"GPU kernel time {gpu_total:.2f} ms/step, "
                      f"idle GPU {wall - gpu_total:.2f} ms ===")
                if r == 0:
                    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
            ratios = [w / k for w, k in zip(walls[batch], kernels)]
            result["rows"].append(dict(
                batch=batch, wall_ms=walls[batch], step_median_ms=step_medians[batch], kernel_ms=kernels,
                wall_over_kernel=ratios,
                median=dict(wall_ms=statistics.median(walls[batch]), kernel_ms=statistics.median(kernels),
                            idle_ms=statistics.median(w - k for w, k in zip(walls[batch], kernels)),
                            wall_over_kernel=statistics.median(ratios),
                            step_median_over_kernel=statistics.median(
                                w / k for w, k in zip(step_medians[batch], kernels))),
                top_kernels=[dict(name=e.key, ms_per_step=e.self_device_time_total / PROFILED_STEPS / 1e3)
                             for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]]))
            if a.rounds > 1:
                print(f"--- batch {batch}: wall / GPU kernel time over {a.rounds} rounds: median "
                      f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] (the median step / "
                      f"kernel time {result['rows'][-1]['median']['step_median_over_kernel']:.3f}) ---", flush=True)
            if a.out:  # (after each batch size: a run stopped by a time limit keeps what it measured)
                write_json(a.out, result, say=False)
            if a.gaps:
                print_gaps(step, inputs, batch)
            if a.timeline:
                print_timeline(step, inputs, batch)
                replay_rate(rt.proposer.decode_graphs, batch)
            if a.host_profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    step(inputs)
                prof.disable()
                print(f"--- batch {batch}: python functions by own time over 50 steps (cProfile adds overhead; "
                      f"the step's wait for the GPU is the synchronize call) ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(40)
                print(f"--- batch {batch}: the same by cumulative time ---")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        if a.advance:
            taken = {batch: prepared[batch][2].steps for batch in batches}
            print(f"--- advancing: steps per batch size {taken}; KV blocks in use at the end "
                  f"{rt.kv.pool.num_blocks - rt.kv.pool.num_free} of {rt.kv.pool.num_blocks} ---", flush=True)
            result["advanced_steps"] = {str(k): v for k, v in taken.items()}
        for s in prepared[max(batches)][0]:  # (the largest batch names every sequence)
            rt.proposer.table.release("bench", s.sequence_id)
    if a.out:
        result["complete"] = True
        write_json(a.out, result)
    return 0


def prepare(rt, a, shape: dict, batch: int):
    """The batch's sequences prefilled (context - m tokens each) and its decode step built: (the decode steps, the
    step's inputs, the step function). (Each phase warms the step up before it times it.)"""
    decode = b.prefilled_decode(rt, batch, a.context, a.m, a.k, shape["vocab_size"], mixed_m=a.mixed_m,
                                states_device="cuda" if a.states_on_gpu else None)
    inputs, step = b.to_inputs(decode), rt.proposer.step
    if a.columns:
        inputs, step = b.to_batch_input(decode), rt.proposer.step_batch
    if a.advance:
        step = b.AdvancingStep(step, inputs, ADVANCE_WINDOW, stagger=rt.proposer.block_size)
    return decode, inputs, step


def time_wall(step, inputs, n: int = 20) -> tuple[float, float]:
    """The wall time of one step in seconds, no profiler: (the mean of n steps, the median one). The ratio uses the
    mean; the median beside it shows how much of the mean a slow spell of the host added."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(inputs)
        times.append(time.perf_counter() - t0)
    return sum(times) / n, statistics.median(times)


def profiled_kernels(step, inputs):
    """torch.profiler's key_averages over PROFILED_STEPS steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step(inputs)
    return prof.key_averages()


if __name__ == "__main__":
    sys.exit(main())
