#!/usr/bin/env bash
# The CUDA path in one command (under 8 minutes on one GPU): every test marked gpu, then the
# figures of a 4 GiB CUDA state next to the hardware's own measured in the same run (pinned
# cudaMemcpy D2H and H2D): the stall of a blocking and a non-blocking save (and what the
# latter takes from training steps it overlaps), the load back to the GPU, each reload
# compared bit for bit. Without a CUDA device it says so in one line and exits 0.
#
# Python: $PYTHON, else .venv/bin/python, else python3 (a GPU machine's own CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    echo "gpu-check: no CUDA device visible to $PY: skipped the CUDA tests and the GPU figures"
    exit 0
fi
"$PY" -c "import ckptcache" >/dev/null 2>&1 || "$PY" -m pip install -q --no-deps -e . || exit 1
export PYTHONUNBUFFERED=1
status=0
echo "== CUDA tests"
timeout 240 "$PY" -m pytest -p no:cacheprovider -m gpu -q -ra tests || status=$?
echo "== CUDA figures (4 GiB, 2,072-tensor mix and 32 large tensors)"
timeout 220 "$PY" benchmarks/gpu/bench.py --sizes 4GiB --repeats 1 || status=$?
exit "$status"
