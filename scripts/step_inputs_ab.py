"""Proposer.step with StepInputs (from the columns from STEP_INPUTS_AS_COLUMNS_MIN sequences) against
Proposer.step_per_sequence and Proposer.step_batch with a prebuilt BatchInput, in-process on CUDA, three alternating
rounds of 20 steps per batch size, host states; the three must draft the same. An EAGLE-3 preset runs with the fc
applied by the engine. Prints a line per batch size and writes JSON (device, date, rows).

    python scripts/step_inputs_ab.py llama3-8b-eagle3 out.json [8,32,64,128,256 [2]]

The optional third argument lists the batch sizes (default 8,32,128,256); the fourth sets STEP_INPUTS_AS_COLUMNS_MIN
for the run (2: step() builds the columns at every size, to see where that pays).
"""
import datetime
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402
from drafter_service.config import ServerConfig  # noqa: E402
from drafter_service.runtime import build_runtime  # noqa: E402
import drafter_service.engine.proposer as proposer_module  # noqa: E402

ROUNDS, STEPS, WARMUP = 3, 20, 3


def median_ms(step) -> float:
    times = []
    for _ in range(STEPS + WARMUP):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:]) * 1e3


def main() -> int:
    preset, out = sys.argv[1], sys.argv[2]
    batches = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8, 32, 128, 256]
    if len(sys.argv) > 4:
        proposer_module.STEP_INPUTS_AS_COLUMNS_MIN = int(sys.argv[4])
    extra = dict(engine_applies_fc=True) if preset.endswith("eagle3") else {}
    shape = b.PRESETS[preset]
    context = shape["context"]
    result = {"benchmark": "step_inputs_ab", "preset": preset, "gpu": torch.cuda.get_device_name(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "step_inputs_as_columns_min": proposer_module.STEP_INPUTS_AS_COLUMNS_MIN, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        head, target = b.write_random_head(pathlib.Path(tmp), shape, context + 64)
        rt = build_runtime(ServerConfig(model=str(head), target_model=str(target), device="cuda", dtype="bfloat16",
                                        kv_cache_tokens=300 * (context + 96), max_model_len=context + 64,
                                        max_batch_seqs=512, **extra))
        width = rt.limits.hidden_states_width
        for batch in batches:
            prefill, decode = b.make_steps(batch, context, 3, 5, width, shape["vocab_size"], seed=batch)
            b.run_prefill(rt, prefill)
            inputs, columns = b.to_inputs(decode), b.to_batch_input(decode)
            arms = {"step_per_sequence": lambda: rt.proposer.step_per_sequence(inputs),
                    "step": lambda: rt.proposer.step(inputs),
                    "step_batch": lambda: rt.proposer.step_batch(columns)}
            got = {name: [] for name in arms}
            for _ in range(ROUNDS):
                for name, step in arms.items():
                    got[name].append(median_ms(step))
            drafts = [o.drafts for o in rt.proposer.step_per_sequence(inputs)]
            assert drafts == [o.drafts for o in rt.proposer.step(inputs)]
            assert drafts == [o.drafts for o in rt.proposer.step_batch(columns).to_outputs()]
            result["rows"].append({"batch": batch, **got})
            print(f"{preset} batch {batch}: "
                  + ", ".join(f"{name} {' '.join(f'{x:.2f}' for x in v)} ms" for name, v in got.items()), flush=True)
            for s in decode:
                rt.proposer.table.release("bench", s.sequence_id)
    pathlib.Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
