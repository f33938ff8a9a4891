#!/usr/bin/env bash
# One call on the lent GPU machine (after scripts/gpu_session.sh's setup lines): the batch-scale benchmark table of
# docs/performance.md. Results under $OUT.   scripts/gpu_bench.sh [BATCHES]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
batches=${1:-1,8,32,64,128,256}
for preset in llama3-8b llama3-8b-eagle3; do
  timeout 240 python3 -m drafter_client.benchmarks.bench_step --preset "$preset" --device cuda --batches "$batches" \
    --iters 20 --out "$OUT/bench_step_$preset.json" > "$OUT/bench_step_$preset.log" 2>&1
  echo "== $preset (rc $?)"; tail -12 "$OUT/bench_step_$preset.log"
done
timeout 120 python3 scripts/profile_step.py --preset llama3-8b --batches "$batches" > "$OUT/profile_step.log" 2>&1
echo "== profile_step (rc $?)"; grep "=== batch" "$OUT/profile_step.log"
