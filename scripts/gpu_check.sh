#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and TensorRT: build the tiny example's engine, then run the
# engine parity and CUDA-graph checks, printing one summary line per check. Under 5 minutes.
#   bash scripts/gpu_check.sh            (needs `pip install tensorrt cuda-python` in .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PATH="$PWD/.venv/bin:$PATH"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | sed 's/^/gpu: /'
"$PY" -c 'import tensorrt, cuda.bindings; print("tensorrt:", tensorrt.__version__)'
timeout 280 dvc repro engine@tiny-gpt2 >/tmp/gpu_check.log 2>&1 || true
"$PY" - <<'PYEOF'
import json, sys
r = json.load(open("build/tiny-gpt2/engine/report.json"))
d = r["details"]
print(f"engine build: {r['status']}: {r['summary']}")
for row in d.get("parity", []):
    print(f"engine parity: {'PASS' if row['ok'] else 'FAIL'}: {row['why']}")
for row in d.get("cuda_graphs", []):
    print(f"cuda graphs: {'PASS' if row['ok'] else 'FAIL'}: {row['why']}")
for reason in r["reasons"]:
    print(f"reason: {reason}")
sys.exit(0 if r["status"] == "passed" else 1)
PYEOF
