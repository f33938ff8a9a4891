"""The host cost of the eager work around a graph-replayed step (a script, not a test): what the GPU waits for
before the first-step graph of a batch-B decode step (m rows each) can start.

  metadata, step buffers    build_step_metadata_columns with the proposer's MetadataBuffers (packing in place, the
                            views of a layout made once)
  metadata, new buffers     the same with a new host buffer, pin_memory copy, device buffer and views every step
  record + states in        what a step whose first step replays a graph does instead of both metadata variants:
                            its columns into the graphs' record and the record's copy (first_step_record.py), and
                            the states' copy into the graphs' fs_states (the rows are built inside the graph)
  columns step, run stubbed Proposer.step_batch of a decode step of known sequences (tiny random head, context 1024)
                            with the draft run replaced by a stub that returns fixed drafts: the columns path's own
                            host work around the run (table lookups, checks, acceptance count, metadata, the
                            sequences' state after the step, metrics), all of it host work the GPU waits for but the
                            acceptance count (a step of 64 rows or fewer takes the per-sequence path instead)
  steps, run stubbed        the same step as StepInputs through Proposer.step (the per-sequence path: unary requests,
                            small steps), its run stubbed the same way

--only-steps times the two stubbed steps alone (they call only Proposer's public methods, so the same script times an
older tree: run it from that tree's root). The runtime's objects are frozen out of the garbage collector's reach after
it is built, as drafter-serve does (gc.freeze).

Each variant is called --iters times in a row; the host time per call is measured without synchronizing inside the
loop (launches only, as in a step), then the loop's total with a synchronize at its end. The variants alternate in
--rounds rounds; the table gives the median over rounds and the spread. Prints a table, writes JSON.

    python benchmarks/bench_step_host_ops.py --device cuda --batches 32,128,256 --out docs/bench/step_host_ops.json
"""
import argparse
import datetime
import gc
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client.benchmarks import bench_step  # noqa: E402
from drafter_service.engine import step_metadata as sm  # noqa: E402
from drafter_service.engine.first_step_record import FirstStepRecord  # noqa: E402


def make_step(B: int, m: int, width: int, table_width: int, device: torch.device, gen: torch.Generator):
    """A decode step's columns (numpy, as BatchInput.arrays; states on the device as an engine in the process holds
    them)."""
    T = B * m
    return dict(
        start_positions=np.full(B, 1021, dtype=np.int64), num_tokens=np.full(B, m, dtype=np.int64),
        token_ids=torch.randint(0, 32000, (T,), generator=gen).numpy(),
        hidden_states=torch.randn(T, width, generator=gen).to(device=device, dtype=torch.bfloat16),
        next_tokens=torch.randint(0, 32000, (B,), generator=gen).numpy(), num_drafts=np.full(B, 5, dtype=np.int64),
        block_tables=torch.randint(0, 5000, (B, table_width), generator=gen, dtype=torch.int32).numpy(),
        temperatures=np.zeros(B, dtype=np.float32), seeds=np.zeros(B, dtype=np.int64),
        top_ks=np.zeros(B, dtype=np.int64), block_size=16, device=device)


def record_and_states(step: dict, table_width: int, device: torch.device):
    """The graph path's host work before the replay: the step's columns into a record, the states into a buffer."""
    B, T = step["num_tokens"].shape[0], step["token_ids"].shape[0]
    bs = -(-B // 16) * 16
    record = FirstStepRecord(bs, bs * int(step["num_tokens"].max()), table_width, device)
    states = torch.zeros_like(step["hidden_states"])

    def run():
        record.write(step["start_positions"], step["num_tokens"], step["next_tokens"], step["num_drafts"],
                     step["token_ids"], step["block_tables"])
        states[:T].copy_(step["hidden_states"], non_blocking=True)
    return run


def stubbed_step(rt, B: int, m: int, k: int, context: int, columns: bool):
    """A function running a decode step of B known sequences with the draft run stubbed: Proposer.step_batch on the
    step's columns (columns), else Proposer.step on its StepInputs."""
    p = rt.proposer
    prefill, decode = bench_step.make_steps(B, context, m, k, rt.limits.hidden_states_width, rt.limits.vocab_size,
                                            seed=B)
    for i in range(0, B, 8):
        assert all(o.code == 0 for o in p.step(bench_step.to_inputs(prefill[i : i + 8])))
    batch = bench_step.to_batch_input(decode) if columns else bench_step.to_inputs(decode)
    drafts = torch.randint(0, rt.limits.vocab_size, (B, k))

    def run_stub(md, sp, out, predrafting):  # (in place of Proposer._draft_sequential: nothing runs on the device)
        out.set_host_rows(drafts.clone(), list(range(B)), [k] * B)
        return out

    def step():
        p._draft_sequential = run_stub
        try:
            out = p.step_batch(batch) if columns else p.step(batch)
        finally:
            del p._draft_sequential  # (the class's method again)
        if columns:
            step.path = "columns" if out.outputs is None else "per-sequence"  # (which path step_batch took)
        else:
            assert out[0].code == 0, out[0].message

    step.path = "columns" if columns else "per-sequence"
    return step


def time_calls(fn, iters: int, sync) -> tuple[float, float]:
    """(host us per call, launches only; us per call with the device's work, a sync at the end)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--width", type=int, default=4096, help="hidden states columns (4096: EAGLE-1 8B)")
    ap.add_argument("--table-width", type=int, default=70, help="block-table columns (1088 tokens / 16)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only-steps", action="store_true", help="time the two stubbed steps alone (an older tree too)")
    ap.add_argument("--out", default="bench_out/step_host_ops.json")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.set_num_threads(1)  # (the drafter's host side on CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    context = 1024
    with tempfile.TemporaryDirectory() as tmp:
        batches = [int(x) for x in a.batches.split(",")]
        rt = bench_step.random_head_runtime(pathlib.Path(tmp), bench_step.PRESETS["tiny"], context + 64,
                                            device=a.device, kv_cache_tokens=(max(batches) + 8) * (context + 96),
                                            max_batch_seqs=4096, cuda_graphs=False)
    gc.collect()
    gc.freeze()
    for B in batches:
        variants = {}
        if not a.only_steps:
            step = make_step(B, a.m, a.width, a.table_width, device, torch.Generator().manual_seed(B))
            buffers = sm.MetadataBuffers(device)
            columns = dict(step, hidden_states=[step["hidden_states"]])  # (the states as BatchInput.states() gives them)
            variants["metadata, step buffers"] = lambda: sm.build_step_metadata_columns(**columns, buffers=buffers)
            variants["metadata, new buffers"] = lambda: sm.build_step_metadata_columns(**columns)
            variants["record + states in"] = record_and_states(step, a.table_width, device)
        variants["columns step, run stubbed"] = stubbed_step(rt, B, a.m, 5, context, columns=True)
        variants["steps, run stubbed"] = stubbed_step(rt, B, a.m, 5, context, columns=False)
        results = {name: [] for name in variants}
        for name, fn in variants.items():  # warm-up (compiles)
            for _ in range(5):
                fn()
        sync()
        for _ in range(a.rounds):
            for name, fn in variants.items():
                results[name].append(time_calls(fn, a.iters, sync))
        for name, runs in results.items():
            host = [r[0] for r in runs]
            total = [r[1] for r in runs]
            path = getattr(variants[name], "path", "")
            rows.append(dict(batch=B, variant=name + (f" ({path})" if path else ""), host_us=statistics.median(host),
                             host_us_min=min(host), host_us_max=max(host), with_device_us=statistics.median(total)))
    print(f"{'batch':>5}  {'variant':<41} {'host us/call':>12} {'spread':>15} {'with device us':>15}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['variant']:<41} {r['host_us']:>12.1f} "
              f"{r['host_us_min']:>7.1f}-{r['host_us_max']:<7.1f} {r['with_device_us']:>15.1f}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    write_json(a.out, dict(script="benchmarks/bench_step_host_ops.py", device=name, cpu_count=os.cpu_count(),
                           date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv),
                           torch=torch.__version__, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
