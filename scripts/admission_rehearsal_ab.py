"""Is the in-process step's host work before its launches slow because it runs cold? An A/B probe (CUDA only; a
script, not a test).

A greedy step from columns (Proposer.step_batch, first-step graphs) spends ~0.07 ms on admission and ~0.04 ms on
the record before its first launch on the H200 hosts of docs/performance.md, where the same Python run back to back
on the dev CPU takes less. Host work that last ran a millisecond ago costs 1.5-3x its warm time on these VMs
(bench_cold_host_work.py), and between two steps the step thread waits ~1 ms for the GPU. If the admission were
cold for that reason, re-running its arithmetic while the GPU drafts would make the next step's admission shorter.

"on" arm: after the step's own meanwhile work (the acceptance count, run while the GPU drafts), a dry run of the
admission's array arithmetic on the step's own columns and table rows: the checks, k, the blocks, the block-table
gather, the first-step graph's rule, and the record's numpy fields written into a scratch buffer (never the pinned
record, whose copy may be in flight). It writes nothing the proposer reads: the same numpy calls as
Proposer._step_columns and FirstStepRecord.write, on the same arrays, which is what "warm" would need. "off" arm: the
step as it is. The arms alternate round by round in one process (the host's per-process draw is the same for both);
per round and batch size: the mean wall of 20 steps, then profile_step's --phases split of 30 steps.

    python scripts/admission_rehearsal_ab.py --preset llama3-8b-eagle3 --engine-applies-fc --batches 1,8,32 --out F

Run it in several processes (each draws its own host speed). Prints each round and the medians; JSON to --out.
"""
import argparse
import contextlib
import datetime
import io
import pathlib
import platform
import statistics
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_client.benchmarks.report import write_json  # noqa: E402

SCRATCH_SEQS, SCRATCH_ROWS_PER_SEQ, SCRATCH_TABLE_WIDTH = 256, 8, 64


def scratch_record() -> dict[str, np.ndarray]:
    """Host int32 fields shaped as FirstStepRecord's (first_step_record.py), for the dry run to write into."""
    n = SCRATCH_SEQS
    sizes = dict(header=2, start_positions=n, qsl=n + 1, next_tokens=n, draft_steps=n,
                 token_ids=SCRATCH_ROWS_PER_SEQ * n, block_tables=n * SCRATCH_TABLE_WIDTH)
    return {name: np.zeros(size, dtype=np.int32) for name, size in sizes.items()}


def dry_admission(p, batch, rows: np.ndarray, rec: dict[str, np.ndarray]) -> None:
    """The numpy and torch calls of Proposer._step_columns' admission (Proposer._admit_columns itself, which changes
    nothing) and of FirstStepRecord.write, on the step's columns and table rows, with every result dropped (rows: the
    batch's table rows, looked up once beforehand). The record's fields go into a scratch copy: during the GPU wait
    the record's own copy may still be in flight (Proposer.rehearse_columns skips it then)."""
    nonzero = np.count_nonzero
    p._fast_path_applies(batch)
    R = p.table.rows
    C, k, _, blocks, have = p._admit_columns(batch, rows)
    a = batch.arrays
    start, m = a.start_positions, a.num_tokens
    nonzero(blocks != have)
    torch.from_numpy(k)
    tables = R.block_tables_np[rows, : int(blocks.max())]
    nonzero(a.temperatures > 0)
    p.decode_graphs.first_step_plan(C, m, k, prefill_chunks=True)
    B, w = tables.shape
    T = a.token_ids.shape[0]
    rec["header"][0], rec["header"][1] = B, w
    rec["start_positions"][:B] = start
    rec["qsl"][0] = 0
    np.cumsum(m, out=rec["qsl"][1 : B + 1])
    rec["next_tokens"][:B] = a.next_tokens
    np.subtract(k, 1, out=rec["draft_steps"][:B], casting="unsafe")
    rec["token_ids"][:T] = a.token_ids
    rec["block_tables"][: B * w].reshape(B, w)[:] = tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b-eagle3", choices=sorted(b.PRESETS))
    ap.add_argument("--engine-applies-fc", action="store_true")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="bench_out/admission_rehearsal_ab.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("admission_rehearsal_ab.py needs a GPU: the step it times replays CUDA graphs", file=sys.stderr)
        return 2
    import profile_step as ps  # (scripts/: its step setup, wall timing and --phases split)
    from drafter_service.engine import proposer as proposer_mod

    shape = b.PRESETS[a.preset]
    batches = [int(x) for x in a.batches.split(",")]
    if max(batches) > SCRATCH_SEQS:
        ap.error(f"--batches: at most {SCRATCH_SEQS}")
    state: dict = dict(on=False)
    plain_meanwhile = proposer_mod._Drafts.run_meanwhile

    def run_meanwhile(drafts):
        had_work = drafts.meanwhile is not None
        plain_meanwhile(drafts)
        if had_work and state["on"]:
            dry_admission(state["proposer"], state["batch"], state["rows"], state["scratch"])

    proposer_mod._Drafts.run_meanwhile = run_meanwhile
    result = dict(benchmark="admission_rehearsal_ab", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}",
                  command=" ".join(["scripts/admission_rehearsal_ab.py", *sys.argv[1:]]), preset=a.preset,
                  engine_applies_fc=a.engine_applies_fc, rounds=a.rounds, rows=[])
    setup = argparse.Namespace(context=a.context, m=3, k=5, mixed_m=True, states_on_gpu=True, columns=True,
                               advance=False)
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, a.context + 64, device="cuda",
                                   kv_cache_tokens=max(200_000, (max(batches) + 8) * (a.context + 96)),
                                   cuda_graphs=True, engine_applies_fc=a.engine_applies_fc)
        p = rt.proposer
        state.update(proposer=p, scratch=scratch_record())
        prepared = {batch: ps.prepare(rt, setup, shape, batch) for batch in batches}
        for r in range(a.rounds):
            for on in (False, True):
                for batch, (_, inputs, step) in prepared.items():
                    _, rows = p.table.touch_batch(inputs.namespaces, inputs.sequence_ids, p.clock(), p._step_serial)
                    state.update(on=on, batch=inputs, rows=rows)
                    for _ in range(5):
                        step(inputs)
                    mean, median = ps.time_wall(step, inputs)
                    text = io.StringIO()
                    with contextlib.redirect_stdout(text):
                        ps.print_phases(rt, step, inputs, batch)
                    phases = text.getvalue().strip()
                    result["rows"].append(dict(round=r, rehearsal=on, batch=batch, wall_mean_ms=mean * 1e3,
                                               wall_median_ms=median * 1e3, phases=phases))
                    split = phases[phases.find("admit"): phases.find("; wall")]
                    print(f"round {r} rehearsal {'on ' if on else 'off'} batch {batch}: wall {mean * 1e3:.3f} ms "
                          f"(median step {median * 1e3:.3f}) | {split}", flush=True)
    proposer_mod._Drafts.run_meanwhile = plain_meanwhile
    result["summary"] = []
    for batch in batches:
        for on in (False, True):
            walls = [x["wall_mean_ms"] for x in result["rows"] if x["batch"] == batch and x["rehearsal"] == on]
            row = dict(batch=batch, rehearsal=on, wall_ms_median=statistics.median(walls), wall_ms_min=min(walls),
                       wall_ms_max=max(walls))
            result["summary"].append(row)
            print(f"batch {batch} rehearsal {'on ' if on else 'off'}: wall {row['wall_ms_median']:.3f} ms, median of "
                  f"{len(walls)} rounds [{row['wall_ms_min']:.3f}, {row['wall_ms_max']:.3f}]")
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
