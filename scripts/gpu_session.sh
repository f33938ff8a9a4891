#!/usr/bin/env bash
# One call on the lent GPU machine: carry .whl (pytest-asyncio, grpcio-health-checking/-reflection 1.84 wheels).
#   scripts/gpu_session.sh tests|gpu-tests|bench|predraft|predraft-mechanics|predraft-sweep|host-profile|measure|columns|columns-bench|table|bulk-grpc|all
# results under $OUT (or ./gpu_out). followup = host-profile + predraft-mechanics (one 10-minute call, 7 files).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
# the package is used from the tree: map the import names the installed distribution would provide
mkdir -p /tmp/pkgs && ln -sfn "$PWD/kernels" /tmp/pkgs/drafter_kernels && ln -sfn "$PWD/clients" /tmp/pkgs/drafter_client
export PYTHONPATH=$PYTHONPATH:/tmp/pkgs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton, grpc, google.protobuf as p; print('torch', torch.__version__, 'triton', triton.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)" | tee -a "$OUT/device.txt"
what=${1:-all}
if [ "$what" = followup ]; then bash "$0" host-profile; bash "$0" predraft-mechanics; exit 0; fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -ra -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest_all.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40
fi
if [ "$what" = gpu-tests ]; then  # only the tests marked gpu (the CUDA variants), within GPU_TESTS_TIMEOUT_S
  timeout "${GPU_TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/ 2>&1 \
    | tee "$OUT/pytest_gpu.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40
fi
if [ "$what" = predraft ] || [ "$what" = all ]; then  # pre-drafting end to end with the bundled pair (docs/predraft.md)
  timeout "${PREDRAFT_TIMEOUT_S:-280}" python3 -m drafter_client.benchmarks.predraft --device cuda \
    --budgets "${PREDRAFT_BUDGETS:-0,4,8,16,32}" --batches "${PREDRAFT_BATCHES:-1,4,16,64}" \
    --out "$OUT/predraft_cuda.json" 2>&1 | tee "$OUT/predraft.log" | grep -v "Loading weights" | tail -30
fi
if [ "$what" = predraft-mechanics ]; then  # the drafter's side at the 8B head shapes (in-process)
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${MECH_TIMEOUT_S:-200}" python3 -m drafter_client.benchmarks.predraft_mechanics --preset $preset \
      --device cuda --batches "${MECH_BATCHES:-1,16,64}" --out "$OUT/predraft_mechanics_$preset.json" 2>&1 \
      | tee "$OUT/predraft_mechanics_$preset.log" | tail -6
  done
fi
if [ "$what" = predraft-sweep ]; then  # the 8B heads' hit rate and wait per fan-out budget F (docs/predraft.md)
  for preset in llama3-8b llama3-8b-eagle3; do
    for f in ${SWEEP_BUDGETS:-4 16}; do
      timeout "${MECH_TIMEOUT_S:-100}" python3 -m drafter_client.benchmarks.predraft_mechanics --preset $preset \
        --device cuda --batches "${MECH_BATCHES:-1,64}" --budget $f --out "$OUT/predraft_sweep_${preset}_F$f.json" 2>&1 \
        | grep -E "off|passes \(" | sed "s/^/$preset F=$f /" | tee -a "$OUT/predraft_sweep.log"
    done
  done
fi
if [ "$what" = host-profile ]; then  # where the host time of a large batch goes (docs/performance.md)
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${PROFILE_TIMEOUT_S:-100}" python3 scripts/profile_step.py --preset $preset --batches "${PROFILE_BATCHES:-128,256}" \
      --host-profile > "$OUT/host_profile_$preset.log" 2>&1
    echo "== $preset (rc $?)"; grep "=== batch" "$OUT/host_profile_$preset.log"
    timeout "${PHASES_TIMEOUT_S:-100}" python3 scripts/host_phases.py --preset $preset --device cuda --batches 1,128,256 \
      --out "/tmp/host_phases_$preset.json" 2>&1 | grep batch | tee -a "$OUT/host_profile_$preset.log"
  done
fi
if [ "$what" = measure ]; then  # #13 after a host-side change: staging threads, in-process vs kernel time, every path
  timeout 60 python3 benchmarks/bench_staging.py --device cuda --out "$OUT/staging.json" 2>&1 | tee "$OUT/bench_step.log" | tail -5
  for preset in llama3-8b llama3-8b-eagle3; do
    for states in "" --states-on-gpu; do  # the states staged from the host (as a sidecar gets them), then on the GPU
      timeout "${PROFILE_TIMEOUT_S:-80}" python3 scripts/profile_step.py --preset $preset --batches "${PROFILE_BATCHES:-1,64,128,256}" \
        $states 2>&1 | grep "=== batch" | sed "s/^/$preset /" | tee -a "$OUT/profile_step.log"
      timeout "${PHASES_TIMEOUT_S:-60}" python3 scripts/host_phases.py --preset $preset --device cuda --batches 1,128,256 \
        $states --out "/tmp/host_phases_$preset.json" 2>&1 | grep batch | sed "s/^/$preset $states /" | tee -a "$OUT/profile_step.log"
    done
  done
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${BENCH_TIMEOUT_S:-200}" python3 -m drafter_client.benchmarks.bench_step --preset $preset --device cuda \
      --batches "${BENCH_BATCHES:-1,8,32,64,128,256}" --prefill-tokens 0 --iters 20 \
      --out "$OUT/bench_step_$preset.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/bench_step.log" | tail -14
  done
fi
if [ "$what" = columns ]; then  # #13: the step from columns (Proposer.step_batch) against the per-sequence step
  timeout "${GPU_TESTS_TIMEOUT_S:-240}" python3 -m pytest -q -ra -p no:cacheprovider tests/test_step_batch.py \
    tests/test_cuda_fast_path.py tests/test_host_staging.py tests/test_batch_api.py tests/test_drafts_match_naive.py 2>&1 \
    | tee "$OUT/pytest_columns.log" | grep -E "passed|failed|FAILED|ERROR" | tail -20
  for preset in llama3-8b llama3-8b-eagle3; do
    for cols in "" --columns; do
      timeout "${PROFILE_TIMEOUT_S:-80}" python3 scripts/profile_step.py --preset $preset --states-on-gpu \
        --batches "${PROFILE_BATCHES:-1,64,128,256}" $cols 2>&1 | grep "=== batch" | sed "s/^/$preset /" \
        | tee -a "$OUT/profile_step_columns.log"
    done
  done
fi
if [ "$what" = columns-bench ]; then  # bench_step with the in-process step as columns, both heads
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${BENCH_TIMEOUT_S:-280}" python3 -m drafter_client.benchmarks.bench_step --preset $preset --device cuda \
      --batches "${BENCH_BATCHES:-1,32,128,256}" --prefill-tokens 0 --iters 20 \
      --out "$OUT/bench_step_$preset.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/bench_step.log" | tail -8
  done
fi
if [ "$what" = table ]; then  # #13's table at batch 1-256, both heads, in one 10-minute call (at most 6 files under $OUT):
  # the step's wall / GPU kernel time and host phases (profile_step), then the in-process step, its floor and the
  # alternating rounds through the drafter (bench_step --rounds-only; its JSON is written after each batch size, so a
  # run cut by its timeout keeps what it measured)
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${PROFILE_TIMEOUT_S:-80}" python3 scripts/profile_step.py --preset $preset \
      --batches "${TABLE_BATCHES:-1,8,32,64,128,256}" --states-on-gpu --columns --mixed-m --phases \
      > "$OUT/profile_step_$preset.log" 2>&1; grep -E "^===" "$OUT/profile_step_$preset.log" | cut -c1-160
  done
  for preset in llama3-8b llama3-8b-eagle3; do
    timeout "${BENCH_TIMEOUT_S:-180}" python3 -m drafter_client.benchmarks.bench_step --preset $preset --device cuda \
      --batches "${TABLE_BATCHES:-1,8,32,64,128,256}" --prefill-tokens 0 --iters 20 --rounds 2 --rounds-only \
      --out "$OUT/bench_step_$preset.json" > "$OUT/bench_step_$preset.log" 2>&1
    grep -A8 "alternating rounds" "$OUT/bench_step_$preset.log" | cut -c1-160
  done
fi
if [ "$what" = bulk-grpc ]; then  # large steps over TCP: bare gRPC echo, one message, chunks (docs/performance.md)
  timeout "${BULK_TIMEOUT_S:-150}" python3 benchmarks/bench_bulk_grpc.py --out "$OUT" ${BULK_MIB:+--mib $BULK_MIB} \
    ${BULK_MODES:+--modes $BULK_MODES} 2>&1 | tee "$OUT/bulk_grpc.log" | tail -30
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m drafter_client.benchmarks.bench_step --preset llama3-8b --device cuda --batches 1,8,32,128 --graphs-ab \
    --out "$OUT/bench_step_llama3-8b.json" 2>&1 | tee "$OUT/bench_step.log" | tail -12
  # data plane: inline vs pinned host shared memory vs CUDA IPC (docs/shared_memory.md)
  python3 benchmarks/bench_data_plane.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench_data_plane.log" | tail -16
fi
