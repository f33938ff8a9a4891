"""Proposer.step with StepInputs (from the columns from STEP_INPUTS_AS_COLUMNS_MIN sequences) against
Proposer.step_per_sequence and Proposer.step_batch with a prebuilt BatchInput, in-process on CUDA, three alternating
rounds of 20 steps per batch size (8, 32, 128, 256), host states; the three must draft the same. An EAGLE-3 preset runs
with the fc applied by the engine.

    python scripts/step_inputs_ab.py llama3-8b-eagle3 out.json [8,32,64,128,256 [2]]

The optional third argument lists the batch sizes; the fourth sets STEP_INPUTS_AS_COLUMNS_MIN for the run (2: step()
builds the columns at every size, to see where that pays).
"""
import datetime
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch
sys.path.insert(0, str(pathlib.Path.cwd()))
from drafter_client.benchmarks import bench_step as b
from drafter_service.config import ServerConfig
from drafter_service.runtime import build_runtime
preset, out = sys.argv[1], sys.argv[2]
batches = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8, 32, 128, 256]
if len(sys.argv) > 4:  # the smallest step Proposer.step builds columns for (to find the threshold: 2)
    import drafter_service.engine.proposer as proposer_module
    proposer_module.STEP_INPUTS_AS_COLUMNS_MIN = int(sys.argv[4])
extra = dict(engine_applies_fc=True) if preset.endswith("eagle3") else {}
shape = b.PRESETS[preset]; ctx = shape["context"]
res = {"preset": preset, "gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
       "rows": []}
with tempfile.TemporaryDirectory() as tmp:
    head, target = b.write_random_head(pathlib.Path(tmp), shape, ctx + 64)
    rt = build_runtime(ServerConfig(model=str(head), target_model=str(target), device="cuda", dtype="bfloat16",
                                    kv_cache_tokens=300 * (ctx + 96), max_model_len=ctx + 64, max_batch_seqs=512, **extra))
    width = rt.limits.hidden_states_width
    for batch in batches:
        prefill, decode = b.make_steps(batch, ctx, 3, 5, width, shape["vocab_size"], seed=batch)
        for i in range(0, batch, 8):
            assert all(o.code == 0 for o in rt.proposer.step(b.to_inputs(prefill[i:i + 8])))
        inputs, cols = b.to_inputs(decode), b.to_batch_input(decode)
        arms = {"step_per_sequence": lambda: rt.proposer.step_per_sequence(inputs), "step": lambda: rt.proposer.step(inputs),
                "step_batch": lambda: rt.proposer.step_batch(cols)}
        got = {k: [] for k in arms}
        for rnd in range(3):
            for k, f in arms.items():
                ts = []
                for _ in range(23):
                    t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
                got[k].append(statistics.median(ts[3:]) * 1e3)
        ref = [o.drafts for o in rt.proposer.step_per_sequence(inputs)]
        assert ref == [o.drafts for o in rt.proposer.step(inputs)] == [o.drafts for o in rt.proposer.step_batch(cols).to_outputs()]
        row = {"batch": batch, **{k: v for k, v in got.items()}}
        res["rows"].append(row)
        print(f"{preset} batch {batch}: " + ", ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)} ms" for k, v in got.items()), flush=True)
        for s in decode:
            rt.proposer.table.release("bench", s.sequence_id)
pathlib.Path(out).write_text(json.dumps(res, indent=1))
