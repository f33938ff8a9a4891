#!/usr/bin/env bash
# One call on the lent GPU machine (carry .whl and ab.diff): a host-side change measured against its base on one machine.
#   git diff --no-renames BASE HEAD -- drafter_service kernels clients > ab.diff   (here, before the call; git-ignored:
#   carry [".whl", "ab.diff"])
#   scripts/gpu_ab.sh [tests] [ab PRESET ROUNDS BATCHES] [channel PRESET ROUNDS BATCHES] ...
# tests: pytest -m gpu. ab: profile_step --states-on-gpu --columns --phases --mixed-m on PRESET at BATCHES, ROUNDS
# times the tree as it is ("after") then with ab.diff reverted ("before", patch -R; put back after). channel: the same
# alternation with profile_channel --api batch,steps (a drafter subprocess, step channel). Results under $OUT (ab.log,
# channel.log); docs/performance.md, "The sequences' state as columns by table row", shows its use.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/kernels" /tmp/pkgs/drafter_kernels && ln -sfn "$PWD/clients" /tmp/pkgs/drafter_client
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:/tmp/pkgs PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt"; nproc >> "$OUT/device.txt"
while [ $# -gt 0 ]; do
  case $1 in
    tests) shift; start=$(date +%s)
      timeout "${GPU_TESTS_TIMEOUT_S:-260}" python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/ > "$OUT/pytest_gpu.log" 2>&1
      echo "gpu tests rc $? in $(( $(date +%s) - start )) s: $(grep -E 'passed|failed' "$OUT/pytest_gpu.log" | tail -1)";;
    ab) preset=$2; rounds=$3; batches=$4; shift 4
      for r in $(seq "$rounds"); do for arm in after before; do
        start=$(date +%s)
        [ $arm = before ] && patch -s -R -p1 < ab.diff
        timeout "${AB_TIMEOUT_S:-150}" python3 scripts/profile_step.py --preset "$preset" --batches "$batches" --states-on-gpu \
          --columns --phases --mixed-m 2>&1 | grep -E "^===|^---|Error|error" | sed "s/^/$preset $arm r$r: /" | tee -a "$OUT/ab.log"
        [ $arm = before ] && patch -s -p1 < ab.diff
        echo "$preset $arm r$r took $(( $(date +%s) - start )) s" | tee -a "$OUT/ab.log"
      done; done;;
    channel) preset=$2; rounds=$3; batches=$4; shift 4
      for r in $(seq "$rounds"); do for arm in after before; do
        start=$(date +%s)
        [ $arm = before ] && patch -s -R -p1 < ab.diff
        timeout "${AB_TIMEOUT_S:-240}" python3 scripts/profile_channel.py --preset "$preset" --batches "$batches" \
          --api batch,steps --device cuda 2>&1 | grep -E "^batch|Error|error" | sed "s/^/$preset $arm r$r: /" | tee -a "$OUT/channel.log"
        [ $arm = before ] && patch -s -p1 < ab.diff
        echo "$preset $arm r$r took $(( $(date +%s) - start )) s" | tee -a "$OUT/channel.log"
      done; done;;
    *) echo "unknown $1"; exit 2;;
  esac
done
