"""What a sampling step costs against a greedy one, with its decode steps replayed from the sampled decode graphs and
run by the eager loop (a script, not a test; issue #13, "CUDA graphs at every batch size that serves").

A step asks for sampled drafts when some sequence has a temperature above 0, log q (return_logprobs) or the top-N of
q (top_k_probs, which exact rejection sampling at T > 0 needs: docs/sampling.md). Its first draft step runs eagerly;
its decode steps replay the sampled decode graphs (cuda_graphs.py: one per padded batch size and top-N width 0, 16,
the cap), or with --no-sampled-step-graphs the eager decode loop (the way before them, which also read max N and the
temperatures back from the device at every draft step). For each batch size the in-process step
(Proposer.step_batch, the random 8B-shaped head of bench_step, context --context, m = 3, k = --k, the states on the
GPU) is timed in every setting below, both ways, alternating over --rounds rounds:

  greedy           T = 0 (the greedy graphs; the floor of the others)
  T                T = 0.7 for every sequence
  T + log q        and return_logprobs
  T + log q + top N   and top_k_probs = N for each N of --tops

Prints a table (median ms per step, the spread over rounds) and writes JSON (device, date, command).

    python benchmarks/bench_sampled_steps.py --preset llama3-8b-eagle3 --batches 1,8,32,128 --rounds 3 \\
        --out docs/bench/sampled_steps.json
"""
import argparse
import contextlib
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
from drafter_service.engine.batch_io import BatchInput  # noqa: E402

WAYS = ("graphs", "eager")


def settings_of(tops: list[int]) -> list[tuple[str, float, bool, int]]:
    """(name, temperature, log q, N) of each setting timed."""
    return [("greedy", 0.0, False, 0), ("T", 0.7, False, 0), ("T + log q", 0.7, True, 0),
            *((f"T + log q + top {n}", 0.7, True, n) for n in tops)]


def sampled_input(steps, temperature: float, logprobs: bool, top_n: int) -> BatchInput:
    """The decode steps as one BatchInput with these sampling settings (seed i for sequence i)."""
    n = len(steps)
    return BatchInput.from_lists(
        "bench", [s.sequence_id for s in steps], [s.start_position for s in steps], [len(s.token_ids) for s in steps],
        torch.cat([torch.as_tensor(s.token_ids, dtype=torch.int64) for s in steps]),
        torch.cat([s.hidden_states for s in steps]), [int(s.next_token) for s in steps], [s.num_drafts for s in steps],
        [temperature] * n, list(range(n)), [logprobs] * n, [top_n] * n, [0] * n)


@contextlib.contextmanager
def way(graphs, name: str):
    """The sampled decode graphs as they are (graphs) or refused (eager: the eager decode loop)."""
    original = graphs.sampled_width
    if name == "eager":
        graphs.sampled_width = lambda top_n: None
    try:
        yield
    finally:
        graphs.sampled_width = original


def time_steps(rt, batch_input, iters: int) -> tuple[float, int]:
    """(median ms per step over iters steps, how many replayed the sampled decode graphs)."""
    graphs = rt.proposer.decode_graphs
    before = graphs.sampled_steps_run
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = rt.proposer.step_batch(batch_input)  # (ends with the step's synchronization: the drafts' copy)
        times.append(time.perf_counter() - t0)
        assert not [o.message for o in out.to_outputs() if o.code]
    return statistics.median(times) * 1e3, graphs.sampled_steps_run - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b-eagle3", choices=sorted(b.PRESETS))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tops", default="8,64", help="the top-N sizes timed (comma-separated)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-applies-fc", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this script times CUDA graphs: it needs a GPU")
    shape = b.PRESETS[a.preset]
    settings = settings_of([int(x) for x in a.tops.split(",") if x])
    m = 3
    result = dict(benchmark="bench_sampled_steps", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}", torch=torch.__version__,
                  command=" ".join(["benchmarks/bench_sampled_steps.py", *sys.argv[1:]]), preset=a.preset,
                  context=a.context, m=m, k=a.k, iters=a.iters, rounds=a.rounds,
                  engine_applies_fc=a.engine_applies_fc, rows=[], complete=False)
    print(f"{result['device']}, {a.preset}, context {a.context}, m = {m}, k = {a.k}; ms per step, median of "
          f"{a.rounds} rounds [min, max]; the decode steps replayed from the sampled graphs and run eagerly")
    print("| batch | setting | graphs ms | eager ms | eager / graphs | graphs / greedy |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, a.context + 64, device="cuda",
                                   kv_cache_tokens=max(200_000, 300 * (a.context + 64)),
                                   engine_applies_fc=a.engine_applies_fc)
        graphs = rt.proposer.decode_graphs
        for batch in [int(x) for x in a.batches.split(",")]:
            decode = b.prefilled_decode(rt, batch, a.context, m, a.k, shape["vocab_size"], states_device="cuda")
            greedy_ms = None
            for name, temperature, logprobs, top_n in settings:
                batch_input = sampled_input(decode, temperature, logprobs, top_n)
                times = {w: [] for w in WAYS}
                sampled = {w: 0 for w in WAYS}
                for w in WAYS:  # warm-up (a first use compiles nothing new, but allocations settle)
                    with way(graphs, w):
                        time_steps(rt, batch_input, 3)
                for _ in range(a.rounds):
                    for w in WAYS:
                        with way(graphs, w):
                            ms, n = time_steps(rt, batch_input, a.iters)
                        times[w].append(ms)
                        sampled[w] += n
                med = {w: statistics.median(times[w]) for w in WAYS}
                greedy = name == "greedy"
                assert sampled["eager"] == 0 and sampled["graphs"] == (0 if greedy else a.rounds * a.iters), sampled
                greedy_ms = med["graphs"] if greedy else greedy_ms
                cell = lambda w: f"{med[w]:.3f} [{min(times[w]):.3f}, {max(times[w]):.3f}]"  # noqa: E731
                print(f"| {batch} | {name} | {cell('graphs')} | {cell('eager')} | {med['eager'] / med['graphs']:.2f}x "
                      f"| {med['graphs'] / greedy_ms:.2f}x |", flush=True)
                result["rows"].append(dict(batch=batch, setting=name, temperature=temperature, logprobs=logprobs,
                                           top_n=top_n, ms=times, median_ms=med))
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
