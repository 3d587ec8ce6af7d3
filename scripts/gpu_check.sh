#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the project with its [gpu] extra (TensorRT and
# cuda-bindings, pinned), build the tiny example's engine, and print the TensorRT, driver and
# GPU versions and one line per build, parity and CUDA-graph check (with its speed-up).
# Fails on any error: a crash is never reported as a stale earlier result.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
start=$SECONDS
test -x .venv/bin/python || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev,gpu]'
export PATH="$PWD/.venv/bin:$PATH"

# Old results never count: the engine's outputs and report go first.
rm -rf build/tiny-gpt2/engine build/tiny-gpt2/.engine.* /tmp/gpu_check.log

nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader \
  | sed 's/^/gpu: /'
python - <<'PYEOF'
import tensorrt
from cuda import bindings
print(f"tensorrt: {tensorrt.__version__}; cuda-bindings: {bindings.__version__}")
PYEOF
python -c 'from stages.engine import why_unavailable as w; m = w(); print("engine:", m or "TensorRT and a CUDA device found"); raise SystemExit(1 if m else 0)'

shipyard validate releases/tiny-gpt2.yaml
# The engine needs pin, export, quantize and plan first; all of it counts in the timing.
if ! dvc repro engine@tiny-gpt2 >/tmp/gpu_check.log 2>&1; then
  tail -n 60 /tmp/gpu_check.log
  echo "FAIL: dvc repro engine@tiny-gpt2 exited non-zero (log above, full log /tmp/gpu_check.log)"
  exit 1
fi
python - <<'PYEOF'
import json, sys
r = json.load(open("build/tiny-gpt2/engine/report.json"))
d = r["details"]
print(f"engine build: {r['status']}: {r['summary']} ({d.get('build_seconds', '?')} s build)")
for row in d.get("parity", []):
    print(f"engine parity: {'PASS' if row['ok'] else 'FAIL'}: {row['why']}")
for row in d.get("cuda_graphs", []):
    print(f"cuda graphs: {'PASS' if row['ok'] else 'FAIL'}: {row['why']}")
for reason in r["reasons"]:
    print(f"reason: {reason}")
sys.exit(0 if r["status"] == "passed" else 1)
PYEOF
python -m pytest -q tests/stages/test_engine.py tests/stages/test_tensorrt_control.py
echo "gpu_check: done in $((SECONDS - start)) s"
