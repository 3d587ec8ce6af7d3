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
# onnxruntime and onnxruntime-gpu write the same package: keep the CUDA build alone
ORT_GPU=$(grep -o 'onnxruntime-gpu==[0-9.]*' pyproject.toml)
.venv/bin/python -m pip uninstall --quiet -y onnxruntime onnxruntime-gpu
.venv/bin/python -m pip install --quiet --no-deps "$ORT_GPU"
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

# `shipyard serve --device cuda` (issue 43): the runtime's session on the CUDA provider
# gives the CPU provider's logits, then the bundle serves a completion on it.
python - <<'PYEOF'
import os, numpy as np
from pathlib import Path
from shipyard_runtime import session as s
model = Path("build/tiny-gpt2/export/model.onnx")
outs = {}
for device in ("cpu", "cuda"):
    os.environ[s.DEVICE_ENV] = device
    sess = s.session_from(model, {})
    feeds = {}
    for i in sess.get_inputs():
        shape = [1 if not isinstance(d, int) else d for d in i.shape]
        if i.name.startswith("past"):
            shape[2] = 0
        if i.name == "input_ids":
            feeds[i.name] = np.array([[1, 2, 3]], dtype=np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, 3), dtype=np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(3, dtype=np.int64)[None]
        else:
            feeds[i.name] = np.zeros(shape, dtype=np.float32)
    outs[device] = sess.run(["logits"], feeds)[0]
    print(f"session {device}: providers {sess.get_providers()}")
diff = float(np.abs(outs["cpu"] - outs["cuda"]).max())
print(f"cuda vs cpu logits: max |diff| {diff:.3g}")
raise SystemExit(0 if diff < 1e-3 else 1)
PYEOF
if ! dvc repro bundle@tiny-gpt2 >/tmp/gpu_check_bundle.log 2>&1; then
  tail -n 40 /tmp/gpu_check_bundle.log
  echo "FAIL: dvc repro bundle@tiny-gpt2"
  exit 1
fi
SHIPYARD_SERVE_DIR=/tmp/gpu_check_served shipyard serve tiny-gpt2 --device cuda --no-auth \
  --http-port 18080 --grpc-port 18081 --metrics-port 18082 >/tmp/gpu_check_serve.log 2>&1 &
serve_pid=$!
for _ in $(seq 120); do
  curl -sf localhost:18080/v2/health/ready >/dev/null && break
  sleep 1
done
answer=$(curl -s localhost:18080/v1/completions -H 'content-type: application/json' \
  -d '{"model": "tiny-gpt2", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}')
kill "$serve_pid"; wait "$serve_pid" || true
echo "serve --device cuda: $answer"
echo "$answer" | grep -Eq '"completion_tokens": ?4' || { tail -n 40 /tmp/gpu_check_serve.log; exit 1; }
echo "gpu_check: done in $((SECONDS - start)) s"
