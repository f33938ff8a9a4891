#!/usr/bin/env bash
# Create .venv and install the drafter into it.   scripts/setup.sh [test|demo]
#
# torch is installed first, pinned to 2.13.0: on a CPU machine that has the local CPU wheel, pip takes that wheel
# (no CUDA download); on a GPU machine pip's default Linux wheel of that version is the CUDA build. To keep a
# torch you already have, run with DRAFTER_TORCH= (empty); to pick another, DRAFTER_TORCH="torch==X.Y.Z".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
torch_spec=${DRAFTER_TORCH-torch==2.13.0}
if [ -n "$torch_spec" ]; then
  echo "setup: installing $torch_spec" >&2
  .venv/bin/python -m pip install -q "$torch_spec"
fi
extras=""
case "${1:-}" in
  test) extras="[test]" ;;
  demo) extras="[demo]" ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [test|demo]" >&2; exit 2 ;;
esac
echo "setup: installing drafter-sidecar${extras}" >&2
.venv/bin/python -m pip install -q -e ".${extras}"
.venv/bin/python -c 'import torch; print(f"setup: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")' >&2
