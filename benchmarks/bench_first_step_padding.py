"""When a mixed-m batch's first draft step should replay its padded graph and when it should run eagerly (a script,
not a test; issue #13, "CUDA graphs at every batch size that serves").

A greedy step whose sequences bring m_i committed tokens each replays a first-step graph padded to the batch's
largest m, M (cuda_graphs.py): B' x M rows (B' the padded batch size) where the batch has T = sum m_i real rows. The
drafter takes the graph when B' x M <= max(2 T, FIRST_STEP_SMALL_ROWS) and runs the first step eagerly otherwise (its
metadata built on the host, its kernels launched one by one): a guess from FLOP counts until this script. With k
drafts a sequence brings 1 to k + 1 tokens (the accepted drafts and the bonus token), so a batch where most accepted
nothing and a few accepted everything pads to 3-6x its rows.

For each batch size and m distribution, the in-process step from columns (Proposer.step_batch, the states on the
GPU, the random 8B-shaped head of bench_step) is timed three ways, alternating over --rounds rounds:

  rule    the drafter as it is (which path the rule picks is printed: graph, packed (a packed first-step graph,
          where the padded one is refused: --first-step-graph-rows) or eager)
  graph   the padded first-step graph forced (the rule's row budget lifted)
  packed  the packed first-step graph forced (DecodeGraphs.packed_plan: the step's rows, then padding rows to the
          next row bucket)
  eager   the eager first step forced (the decode steps still replay their graphs)

Distributions (m of sequence i, k = --k drafts): "low" m = k + 1 for every eighth sequence, 1 for the others (a
batch that mostly rejected its drafts; padded/real about 3.7x at k = 5), "spread" m = 1 + i mod (k + 1) (1.7x),
"uniform" m = 3 (1x). Prints a table (median ms per step and the spread over rounds) and writes JSON.

    python benchmarks/bench_first_step_padding.py --preset llama3-8b-eagle3 --batches 32,64,128,256 --rounds 3 \\
        --out docs/bench/first_step_padding.json
"""
import argparse
import contextlib
import dataclasses
import datetime
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_service.engine import cuda_graphs  # noqa: E402

WAYS = ("rule", "graph", "packed", "eager")


def m_of(dist: str, i: int, k: int) -> int:
    if dist == "low":
        return k + 1 if i % 8 == 0 else 1
    if dist == "spread":
        return 1 + i % (k + 1)
    if dist == "uniform":
        return 3
    raise ValueError(dist)


@contextlib.contextmanager
def forced(way: str):
    """DecodeGraphs.first_step_plan decides as `way` says inside (rule: as it is)."""
    original = cuda_graphs.DecodeGraphs.first_step_plan
    small_rows, over_packed = cuda_graphs.FIRST_STEP_SMALL_ROWS, cuda_graphs.PADDED_OVER_PACKED_MAX
    if way == "graph":  # (the row budgets lifted, against the step's rows and the packed graph's; the rest stays)
        cuda_graphs.FIRST_STEP_SMALL_ROWS = cuda_graphs.PADDED_OVER_PACKED_MAX = 1 << 30
    elif way == "packed":
        cuda_graphs.DecodeGraphs.first_step_plan = lambda self, C, m, k, **kw: self.packed_plan(len(m), int(m.sum()))
    elif way == "eager":
        cuda_graphs.DecodeGraphs.first_step_plan = lambda self, *a, **kw: None
    try:
        yield
    finally:
        cuda_graphs.DecodeGraphs.first_step_plan = original
        cuda_graphs.FIRST_STEP_SMALL_ROWS, cuda_graphs.PADDED_OVER_PACKED_MAX = small_rows, over_packed


def time_steps(rt, batch_input, iters: int) -> tuple[float, int, int]:
    """(median ms per step over iters steps, how many of them replayed a first-step graph, how many a packed one)."""
    graphs = rt.proposer.decode_graphs
    before, packed_before = graphs.first_steps_run, graphs.packed_first_steps_run
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rt.proposer.step_batch(batch_input)  # (ends with the step's one synchronization: the drafts' copy)
        times.append(time.perf_counter() - t0)
    return (statistics.median(times) * 1e3, graphs.first_steps_run - before,
            graphs.packed_first_steps_run - packed_before)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b-eagle3", choices=sorted(b.PRESETS))
    ap.add_argument("--batches", default="32,64,128,256")
    ap.add_argument("--dists", default="low,spread,uniform")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-applies-fc", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this script times CUDA graphs: it needs a GPU")
    shape = b.PRESETS[a.preset]
    dists = a.dists.split(",")
    result = dict(benchmark="bench_first_step_padding", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}", torch=torch.__version__,
                  command=" ".join(["benchmarks/bench_first_step_padding.py", *sys.argv[1:]]), preset=a.preset,
                  context=a.context, k=a.k, iters=a.iters, rounds=a.rounds, engine_applies_fc=a.engine_applies_fc,
                  first_step_small_rows=cuda_graphs.FIRST_STEP_SMALL_ROWS, rows=[], complete=False)
    print(f"{result['device']}, {a.preset}, context {a.context}, k = {a.k}; ms per step, median of {a.rounds} rounds "
          f"[min, max]; 'rule': what the drafter does now (its path in parentheses)")
    print(f"{'batch':>5} {'dist':>8} {'rows':>5} {'padded':>6}  {'rule':>22} {'graph':>20} {'packed':>20} "
          f"{'eager':>20}")
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, a.context + 64, device="cuda",
                                   kv_cache_tokens=max(200_000, 300 * (a.context + 64)),
                                   engine_applies_fc=a.engine_applies_fc)
        M = a.k + 1
        for batch in [int(x) for x in a.batches.split(",")]:
            decode = b.prefilled_decode(rt, batch, a.context, M, a.k, shape["vocab_size"])
            for dist in dists:
                ms = [m_of(dist, i, a.k) for i in range(batch)]
                steps = [b.last_tokens(s, m) for s, m in zip(decode, ms)]
                steps = [dataclasses.replace(s, hidden_states=s.hidden_states.cuda()) for s in steps]
                batch_input = b.to_batch_input(steps)
                rows = sum(ms)
                padded = cuda_graphs.padded_batch_size(batch, rt.proposer.decode_graphs.first_sizes) * max(ms)
                times = {w: [] for w in WAYS}
                graphed = {w: 0 for w in WAYS}
                packed = {w: 0 for w in WAYS}
                for way in WAYS:  # warm-up, each way (a first use compiles nothing new, but allocations settle)
                    with forced(way):
                        time_steps(rt, batch_input, 3)
                for _ in range(a.rounds):
                    for way in WAYS:
                        with forced(way):
                            ms, n, n_packed = time_steps(rt, batch_input, a.iters)
                        times[way].append(ms)
                        graphed[way] += n
                        packed[way] += n_packed
                med = {w: statistics.median(times[w]) for w in WAYS}
                rule_path = "packed" if packed["rule"] else "graph" if graphed["rule"] else "eager"
                every = a.rounds * a.iters
                assert graphed["graph"] == every and packed["graph"] == 0 and graphed["eager"] == 0, graphed
                assert packed["packed"] == every, packed
                cell = lambda w: f"{med[w]:.3f} [{min(times[w]):.3f}, {max(times[w]):.3f}]"  # noqa: E731
                print(f"{batch:>5} {dist:>8} {rows:>5} {padded:>6}  {cell('rule') + ' (' + rule_path + ')':>22} "
                      f"{cell('graph'):>20} {cell('packed'):>20} {cell('eager'):>20}", flush=True)
                result["rows"].append(dict(batch=batch, dist=dist, rows=rows, padded_rows=padded, rule_path=rule_path,
                                           ms=times, median_ms=med))
                if a.out:
                    write_json(a.out, result, say=False)
            for s in decode:
                rt.proposer.table.release("bench", s.sequence_id)
    result["complete"] = True
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
