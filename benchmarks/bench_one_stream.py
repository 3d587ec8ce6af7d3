"""One stream against llama.cpp, interleaved by round (issue 41 item 4's one-stream goal).

Serves a build bench_peers left (`--keep DIR`: its shipped graph and serve output, and its
Q4_1 GGUF), and llama.cpp's server beside it, both up at once; then, `--rounds` times, the
bench_peers jobs at one stream through each in turn (the same client), printing output
tokens/s, inter-token latency p50 and TTFT p50 of each, and their ratio: a machine that
speeds up or slows down moves both sides of a round. Afterwards the engine's own step
profile at one row, in-process (Engine.step_profile: graph, inputs, output, the rest).

    python benchmarks/bench_one_stream.py DIR [--rounds 3] [--graph FOLDER]

`--graph FOLDER` serves the model.onnx* in FOLDER instead of the build's shipped graph (a
fused graph, stages/onnx/fused.py, built from the same checkpoint), with the same serve
settings.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_peers as bp  # noqa: E402
from bench_continuous_batching import drive  # noqa: E402
from bench_llamacpp_peer import LlamaServer, llama_token  # noqa: E402


def main() -> None:
    from stages.loadtesting.server import LocalServer, assemble

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a bench_peers --keep folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--graph", type=Path, help="serve this folder's model.onnx* instead")
    args = parser.parse_args()
    build = args.root / "build" / bp.NAME
    gguf = args.root / f"{bp.NAME}-q4_1.gguf"
    llama = REPO / ".peers" / "llama.cpp"
    if not gguf.is_file() or not (llama / "bin" / "llama-server").is_file():
        sys.exit(f"need {gguf} (bench_peers --keep) and llama.cpp (scripts/install_llama_cpp.sh)")
    work = bp.jobs(bp.SHAPE["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="bench-one-stream-") as tmp:
        tree = Path(tmp) / "tree"
        graph = args.graph or build / "quantize"
        assemble(tree, sorted(graph.glob("model.onnx*")), build / "serve")
        ours = LocalServer(tree, bp.NAME, Path(tmp) / "serve.log", 600)
        peer = LlamaServer(llama, gguf, 16, 2048, Path(tmp) / "llama.log")
        with ours as a, peer as b:
            asyncio.run(drive(a.url, work[:4], 1, bp.NAME))  # warm both
            asyncio.run(drive(b.url, work[:4], 1, bp.NAME, llama_token, None))
            for r in range(args.rounds):
                x = asyncio.run(drive(a.url, work, 1, bp.NAME))
                y = asyncio.run(drive(b.url, work, 1, bp.NAME, llama_token, None))
                print(
                    f"round {r + 1}: shipyard {x['tokens_per_s']:.1f} tok/s (ITL p50 "
                    f"{x['itl_p50_ms']:.1f} ms, TTFT p50 {x['ttft_p50_ms']:.0f} ms), llama.cpp "
                    f"{y['tokens_per_s']:.1f} tok/s (ITL p50 {y['itl_p50_ms']:.1f} ms, TTFT p50 "
                    f"{y['ttft_p50_ms']:.0f} ms): {x['tokens_per_s'] / y['tokens_per_s']:.2f}x",
                    flush=True,
                )
        shutil.rmtree(tree, ignore_errors=True)
    profile = bp.profile(args.root, work[:8], 1, args.graph)
    print("engine in-process, one row, ms a step: "
          + ", ".join(f"{k} {v:.2f}" for k, v in profile.items()))  # fmt: skip


if __name__ == "__main__":
    main()
