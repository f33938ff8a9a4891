"""A decode batch that sequences join and leave every step, as under continuous batching (a script, not a test).

At batch 128 with outputs of a few hundred tokens and ~3 tokens committed a step, about one sequence finishes and one
starts every step: most steps of a serving engine bring a new sequence's prompt (its first step, at position 0)
beside the others' decode steps. Here --batch live sequences decode over contexts that advance (prefilled to
--context, each step starting where the last one ended, m = 3 committed tokens, k drafts), and Proposer.step_batch
runs three kinds of step, one after the other, so that the three see the same population and the same minute of the
host:

  columns        --arrivals new sequences join the step (--prompt tokens each), as many live ones finish after it
                 (Release): the step starts them from its columns (Proposer._start_sequences), the default; on CUDA
                 its first step replays a packed first-step graph where the rows fit --first-step-graph-rows
  eager first    the same, the packed first-step graph refused (the way before it: the first step's metadata built
                 on the host, its forward launched eagerly; the decode steps still replay their graphs)
  per sequence   the same kind of step with the columns made to decline a new sequence (the way before
                 _start_sequences: the whole step per sequence)
  decode only    the live sequences alone, nobody joining or leaving

With --prompt-chunks C a new sequence's prompt comes in C chunks over C steps, the chunks before the last with k = 0
(no drafts: vLLM's chunked prefill of a long prompt), beside the others' decodes; the decode-only steps leave the
chunking sequences out (they wait a step).

Per kind: the step's wall time (mean and median over --steps steps of that kind), how many steps the columns path
ran and how many replayed a packed first step, and for the columns steps their phases (medians, ms, from the
proposer's phase marks): admit (step start to the blocks taken: lookups, checks, starting the new sequences, growth),
to launch (the step's metadata or the first-step graph's record, the copies and the launches, up to the work done
while the GPU drafts), to sync (that work, then the wait for the drafts) and after (the sequences' state, metrics).
On the CPU the draft runs before that work: the split means little there. The columns and per-sequence steps draft
the same (tests/test_step_batch.py); here only time is measured.
Prints a table, writes JSON (device, date, command) to --out.

    python benchmarks/bench_arrivals.py --preset tiny --device cpu --batch 32
    python benchmarks/bench_arrivals.py --preset llama3-8b-eagle3 --engine-applies-fc --device cuda --states-on-gpu \\
        --batch 128 --prompt 128 --out gpu_out/arrivals.json
"""
import argparse
import cProfile
import datetime
import pathlib
import platform
import pstats
import shlex
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.engine.batch_io import BatchInput  # noqa: E402

KINDS = ("columns", "eager first", "per sequence", "decode only")
PHASES = ("admit", "to_launch", "to_sync", "after")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="32,128", help="live sequences (the batch before the arrivals)")
    ap.add_argument("--context", type=int, default=None, help="the live sequences' context at the start "
                                                                "(default: the preset's)")
    ap.add_argument("--prompt", type=int, default=128, help="a new sequence's prompt: its first step's tokens")
    ap.add_argument("--arrivals", type=int, default=1, help="new sequences per step (as many finish after it)")
    ap.add_argument("--prompt-chunks", type=int, default=1,
                    help="a new sequence's prompt comes in this many chunks over as many steps (k = 0 before the last)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each kind")
    ap.add_argument("--states-on-gpu", action="store_true", help="the steps' hidden states on the GPU")
    ap.add_argument("--engine-applies-fc", action="store_true", help="EAGLE-3 presets: the engine applies the fc")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run the columns kind's steps under cProfile (after the timed ones, over the same "
                         "population) and print the Python functions by cumulative and by own time")
    ap.add_argument("--out", default="bench_out/arrivals.json")
    a = ap.parse_args(argv)
    shape = b.PRESETS[a.preset]
    context = a.context or shape["context"]
    batches = [int(x) for x in a.batches.split(",")]
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    m, k, vocab = 3, a.k, shape["vocab_size"]
    warm = 3
    result = dict(benchmark="arrivals", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name(device)}" if cuda else "cpu",
                  torch=torch.__version__, command=shlex.join(["benchmarks/bench_arrivals.py", *sys.argv[1:]]),
                  preset=a.preset, context=context, prompt=a.prompt, prompt_chunks=a.prompt_chunks,
                  arrivals=a.arrivals, m=m, k=k, steps=a.steps, states_on_gpu=a.states_on_gpu,
                  engine_applies_fc=a.engine_applies_fc, rows=[], complete=False)
    # every step of the run advances the live contexts by m: room for all of them, and for the new ones' prompts
    steps_in_all = len(KINDS) * (a.steps + warm)
    max_len = context + m * (steps_in_all + (a.steps if a.host_profile else 0) + 2) + a.prompt + 64
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, max_len, device=a.device,
                                   kv_cache_tokens=(max(batches) + 2 * a.arrivals + 8) * (max_len + 64),
                                   engine_applies_fc=a.engine_applies_fc)
        proposer = rt.proposer
        width = rt.limits.hidden_states_width
        start_sequences = proposer._start_sequences
        declines = lambda *args: None  # noqa: E731  (the per-sequence way)
        graphs = proposer.decode_graphs
        plan_first_step = graphs.first_step_plan if graphs is not None else None

        def unpacked_plan(*args, **kwargs):  # (the eager first step where a packed graph would replay)
            plan = plan_first_step(*args, **kwargs)
            return None if plan is not None and plan.packed else plan
        gen = torch.Generator().manual_seed(0)
        if not 1 <= a.prompt_chunks <= a.prompt:
            ap.error("--prompt-chunks must be in [1, --prompt]")
        chunk_sizes = [a.prompt // a.prompt_chunks] * (a.prompt_chunks - 1)
        chunk_sizes.append(a.prompt - sum(chunk_sizes))  # (the last chunk takes the remainder)
        rows_max = max(batches) * m + a.arrivals * a.prompt_chunks * max(chunk_sizes)
        states = torch.randn(rows_max, width, generator=gen).to(torch.bfloat16 if cuda else torch.float32)
        if a.states_on_gpu:
            states = states.to(device)
        tokens = torch.randint(0, vocab, (rows_max,), generator=gen)
        print(f"{result['device']}, {a.preset}, context {context} (advancing), {a.arrivals} new sequence(s) of "
              f"{a.prompt} tokens a step ({a.prompt_chunks} chunk(s)), k {k}, {a.steps} steps of each kind", flush=True)
        print("| batch | kind | step ms (mean) | step ms (median) | from columns | packed first step "
              "| admit / to launch / to sync / after ms |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
        for batch in batches:
            decode = b.prefilled_decode(rt, batch, context, m, k, vocab)
            live = {s.sequence_id: s.start_position for s in decode}  # id -> its next step's start position
            chunking: dict[str, int] = {}  # id -> chunks of its prompt sent so far (new sequences, mid-prompt)
            serial = 0
            times = {kind: [] for kind in KINDS}
            columns = {kind: 0 for kind in KINDS}
            packed = {kind: 0 for kind in KINDS}
            phases = {kind: [] for kind in KINDS}  # (columns steps only)
            prof = cProfile.Profile() if a.host_profile else None
            for i in range(steps_in_all + (a.steps if prof else 0)):
                kind = KINDS[i % len(KINDS)] if i < steps_in_all else "columns"  # (then the profiled steps)
                new = [] if kind == "decode only" else [f"new{batch}_{serial + j}" for j in range(a.arrivals)]
                serial += len(new)
                prompting = {} if kind == "decode only" else {**chunking, **{sid: 0 for sid in new}}  # id -> chunk
                ids = [*live, *prompting]
                ms = [m] * len(live) + [chunk_sizes[c] for c in prompting.values()]
                starts = [*live.values(), *[sum(chunk_sizes[:c]) for c in prompting.values()]]
                ks = [k] * len(live) + [k if c == a.prompt_chunks - 1 else 0 for c in prompting.values()]
                T = sum(ms)
                step = BatchInput.from_lists(
                    "bench", ids, starts, ms, tokens[:T], states[:T],
                    [1] * len(ids), ks, [0.0] * len(ids), [0] * len(ids), [False] * len(ids),
                    [0] * len(ids), [0] * len(ids))
                proposer._start_sequences = declines if kind == "per sequence" else start_sequences
                if graphs is not None:
                    graphs.first_step_plan = unpacked_plan if kind == "eager first" else plan_first_step
                before = proposer.columns_steps_run
                packed_before = graphs.packed_first_steps_run if graphs is not None else 0
                if cuda:
                    torch.cuda.synchronize()
                proposer.phase_marks = marks = {}
                profiled = prof is not None and i >= steps_in_all
                if profiled:
                    prof.enable()
                t0 = time.perf_counter()
                out = proposer.step_batch(step)
                t1 = time.perf_counter()
                if profiled:
                    prof.disable()
                proposer.phase_marks = None
                seconds = t1 - t0
                failed = [o.message for o in out.to_outputs() if o.code]
                assert not failed, failed[:3]
                if warm * len(KINDS) <= i < steps_in_all:
                    times[kind].append(seconds)
                    columns[kind] += proposer.columns_steps_run - before
                    packed[kind] += (graphs.packed_first_steps_run if graphs is not None else 0) - packed_before
                    if {"admitted", "launched", "synced"} <= marks.keys():
                        phases[kind].append(dict(admit=marks["admitted"] - t0,
                                                 to_launch=marks["launched"] - marks["admitted"],
                                                 to_sync=marks["synced"] - marks["launched"],
                                                 after=t1 - marks["synced"]))
                for sid in live:
                    live[sid] += m
                for sid, c in prompting.items():  # (a prompt's last chunk sent: the sequence decodes from now on)
                    if c == a.prompt_chunks - 1:
                        chunking.pop(sid, None)
                        live[sid] = a.prompt
                    else:
                        chunking[sid] = c + 1
                for sid in list(live)[: len(new)]:  # the oldest finish: the batch stays at `batch`
                    del live[sid]
                    proposer.table.release("bench", sid)
            proposer._start_sequences = start_sequences
            if graphs is not None:
                graphs.first_step_plan = plan_first_step
            if prof is not None:
                print(f"--- batch {batch}: {a.steps} columns steps with arrivals under cProfile (it adds overhead), by "
                      f"cumulative time ---")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
                print(f"--- batch {batch}: the same by own time ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            for sid in [*live, *chunking]:
                proposer.table.release("bench", sid)
            row = dict(batch=batch, kinds={})
            for kind in KINDS:
                x = times[kind]
                split = ({name: statistics.median(ph[name] for ph in phases[kind]) * 1e3 for name in PHASES}
                         if phases[kind] else None)
                row["kinds"][kind] = dict(step_ms_mean=statistics.fmean(x) * 1e3, step_ms_median=statistics.median(x)
                                          * 1e3, steps=len(x), from_columns=columns[kind],
                                          packed_first_steps=packed[kind], phases_ms=split)
                r = row["kinds"][kind]
                shown = " / ".join(f"{split[name]:.3f}" for name in PHASES) if split else "-"
                print(f"| {batch} | {kind} | {r['step_ms_mean']:.3f} | {r['step_ms_median']:.3f} | "
                      f"{r['from_columns']} of {r['steps']} | {r['packed_first_steps']} | {shown} |", flush=True)
            result["rows"].append(row)
            write_json(a.out, result, say=False)  # (after each batch size: a run stopped by a time limit keeps it)
    result["complete"] = True
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
