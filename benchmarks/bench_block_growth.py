"""The host cost of a decode step's KV block growth (a script, not a test).

The other step benchmarks re-send the same positions every step, so no sequence ever takes a new KV block. In serving
the contexts grow: at batch 128, m = 3 committed tokens a step and 16-token blocks, some 24 sequences cross a block
boundary every step. Here Proposer.step_batch runs over contexts that advance as an engine's decode loop moves them
(bench_step.AdvancingStep, sequence i starting i % block_size positions back so that the crossings spread over the
steps), with the growing sequences' blocks taken in two ways, alternating in rounds in one process:

  one call        the default: SequenceTable.grow_rows, one allocation and one array write for the step
  one at a time   the way before it: _make_room and SequenceTable.resize for each growing sequence (the proposer's
                  _growth_fits made to decline, which sends a step there when the pool or a share must make room)

Per batch size and way: the step's wall time (the mean of --iters steps; median and spread over the rounds), the
resize's own time per step (Proposer._resize_columns, timed around each call) and the sequences resized per step (the
same steps both ways). Prints a table, writes JSON (device, date, command) to --out.

    python benchmarks/bench_block_growth.py --preset tiny --device cpu --batches 32,128
    python benchmarks/bench_block_growth.py --preset llama3-8b-eagle3 --engine-applies-fc --device cuda \\
        --states-on-gpu --batches 1,8,32,128,256 --out gpu_out/block_growth.json
"""
import argparse
import datetime
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402

WAYS = ("one call", "one at a time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--context", type=int, default=None, help="default: the preset's")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--mixed-m", action="store_true", help="sequence i commits 1 + i %% m tokens a step")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40, help="timed steps per round and way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=1024, help="positions the contexts advance before going back")
    ap.add_argument("--states-on-gpu", action="store_true", help="the steps' hidden states on the GPU")
    ap.add_argument("--engine-applies-fc", action="store_true", help="EAGLE-3 presets: the engine applies the fc")
    ap.add_argument("--out", default="bench_out/block_growth.json")
    a = ap.parse_args(argv)
    shape = b.PRESETS[a.preset]
    context = a.context or shape["context"]
    batches = [int(x) for x in a.batches.split(",")]
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    result = dict(benchmark="block_growth", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name(device)}" if cuda else "cpu",
                  torch=torch.__version__, command=shlex.join(["benchmarks/bench_block_growth.py", *sys.argv[1:]]),
                  preset=a.preset, context=context, m=a.m, mixed_m=a.mixed_m, k=a.k, iters=a.iters, rounds=a.rounds,
                  states_on_gpu=a.states_on_gpu, engine_applies_fc=a.engine_applies_fc, rows=[], complete=False)
    with tempfile.TemporaryDirectory() as tmp:
        max_len = context + 64 + a.window + 64
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, max_len, device=a.device,
                                   kv_cache_tokens=max(200_000, (max(batches) + 8) * max_len),
                                   engine_applies_fc=a.engine_applies_fc)
        proposer = rt.proposer
        resizes: list[tuple[float, int]] = []  # (seconds, sequences resized) of each _resize_columns call
        resize_columns, growth_fits = proposer._resize_columns, proposer._growth_fits

        def timed_resize(b_, seqs, rows, needed, blocks, have, idx, **kwargs):
            t0 = time.perf_counter()
            try:
                return resize_columns(b_, seqs, rows, needed, blocks, have, idx, **kwargs)
            finally:
                resizes.append((time.perf_counter() - t0, idx.shape[0]))

        proposer._resize_columns = timed_resize
        ways = {"one call": growth_fits, "one at a time": lambda *args: None}
        print(f"{result['device']}, {a.preset}, context {context}, m {'1..' if a.mixed_m else ''}{a.m}, k {a.k}, "
              f"{a.iters} steps x {a.rounds} rounds per way", flush=True)
        print("| batch | way | step ms (median [min, max] over rounds) | resize us / step | sequences resized / step |")
        print("| ---: | --- | --- | ---: | ---: |")
        for batch in batches:
            decode = b.prefilled_decode(rt, batch, context, a.m, a.k, shape["vocab_size"], mixed_m=a.mixed_m,
                                        states_device=device if a.states_on_gpu else None)
            inputs = b.to_batch_input(decode)
            step = b.AdvancingStep(proposer.step_batch, inputs, a.window, stagger=proposer.block_size)
            rounds = {way: [] for way in WAYS}
            for r in range(a.rounds):
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    proposer._growth_fits = ways[way]
                    step.rewind()
                    for _ in range(5):
                        step(inputs)
                    if cuda:
                        torch.cuda.synchronize()
                    resizes.clear()
                    times = []
                    for _ in range(a.iters):
                        t0 = time.perf_counter()
                        step(inputs)
                        times.append(time.perf_counter() - t0)
                    rounds[way].append(dict(step_ms=statistics.fmean(times) * 1e3,
                                            step_median_ms=statistics.median(times) * 1e3,
                                            resize_us=sum(s for s, _ in resizes) / a.iters * 1e6,
                                            resized=sum(n for _, n in resizes) / a.iters))
            step.rewind()  # (checks that the last step committed its tokens)
            proposer._growth_fits = growth_fits
            for s in decode:
                proposer.table.release("bench", s.sequence_id)
            row = dict(batch=batch, rounds=rounds, median={})
            for way in WAYS:
                steps = [x["step_ms"] for x in rounds[way]]
                med = dict(step_ms=statistics.median(steps), resize_us=statistics.median(x["resize_us"] for x in
                                                                                       rounds[way]),
                           resized=statistics.median(x["resized"] for x in rounds[way]))
                row["median"][way] = med
                print(f"| {batch} | {way} | {med['step_ms']:.3f} [{min(steps):.3f}, {max(steps):.3f}] | "
                      f"{med['resize_us']:.1f} | {med['resized']:.1f} |", flush=True)
            result["rows"].append(row)
            write_json(a.out, result, say=False)  # (after each batch size: a run stopped by a time limit keeps it)
    result["complete"] = True
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
