"""Block-level prefix caching (issue 41): time to first token with the cache on and off, on
the two workloads it exists for, side by side in one run.

- `system prompt`: one 96-token system prompt, then many different user turns (16-40
  tokens each), one request at a time;
- `multi-turn chat`: 6 conversations of 4 turns, each turn's prompt the whole conversation
  so far (previous prompt + 24 generated tokens + a new 12-24-token user turn).

Each request is run through the engine (`shipyard_runtime/generation`, its thread, the real
graph: any KV-cache `model.onnx`; default the gpt2-small example's export, `make release`
first) with `prefix_caching` on and with it off, alternating request by request, so both
see the same machine. Printed: TTFT median and p95 per setting, the ratio off/on with
the spread of the per-request ratios, and the tokens the cache served.

    python benchmarks/bench_prefix_cache.py [--model PATH] [--repeat 2]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shipyard_runtime.generation.core import Engine, EngineSettings, Graph  # noqa: E402
from shipyard_runtime.generation.params import parse  # noqa: E402


def ttft(engine: Engine, prompt: list[int], tokens: int = 24) -> tuple[float, list[int], int]:
    """Seconds to the first token, the tokens, and the prompt tokens served from cache."""
    events: queue.Queue[Any] = queue.Queue()
    start = time.perf_counter()
    engine.submit(prompt, parse({"max_tokens": tokens, "temperature": 0, "ignore_eos": True}),
                  events.put)  # fmt: skip
    first = events.get(timeout=300)
    took = time.perf_counter() - start
    out, last = [first.token], first
    while not (last.finish or last.error):
        last = events.get(timeout=300)
        out.append(last.token)
    return took, [t for t in out if t is not None], first.cached_tokens


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=REPO / "build/gpt2-small/export/model.onnx")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    graph = Graph(ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"]))
    vocab = graph.vocab or 50257
    base = {"max_rows": 4, "max_context": 1024, "chunk": 512, "max_past": 1000,
            "kv_budget_tokens": 8 * 1024}  # fmt: skip
    engines = {
        "on": Engine(graph, EngineSettings(**base, prefix_cache_tokens=4 * 1024)),
        "off": Engine(graph, EngineSettings(**base)),
    }
    rng = np.random.default_rng(0)
    try:
        ttft(engines["on"], [5, 6, 7])  # warm-up: sessions, arenas
        ttft(engines["off"], [5, 6, 7])
        results: dict[str, dict[str, list[float]]] = {}
        cached: dict[str, int] = {}
        for _ in range(args.repeat):
            # one system prompt, different user turns
            system = rng.integers(100, vocab, 96).tolist()
            for _ in range(16):
                prompt = system + rng.integers(100, vocab, int(rng.integers(16, 41))).tolist()
                for name in ("on", "off") if rng.random() < 0.5 else ("off", "on"):
                    took, _, hit = ttft(engines[name], prompt)
                    results.setdefault("system prompt", {}).setdefault(name, []).append(took)
                    if name == "on":
                        cached["system prompt"] = cached.get("system prompt", 0) + hit
            # conversations growing turn by turn
            for _ in range(6):
                history: dict[str, list[int]] = {"on": [], "off": []}
                turn = rng.integers(100, vocab, 40).tolist()
                for _ in range(4):
                    for name in ("on", "off"):
                        prompt = history[name] + turn
                        took, out, hit = ttft(engines[name], prompt)
                        results.setdefault("multi-turn chat", {}).setdefault(name, []).append(took)
                        if name == "on":
                            cached["multi-turn chat"] = cached.get("multi-turn chat", 0) + hit
                        history[name] = prompt + out
                    turn = rng.integers(100, vocab, int(rng.integers(12, 25))).tolist()
    finally:
        for engine in engines.values():
            engine.close()
    print(f"model {args.model}\n")
    for workload, by in results.items():
        on, off = by["on"], by["off"]
        ratios = sorted(b / a for a, b in zip(on, off, strict=True))
        lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        print(f"{workload}: {len(on)} requests, {cached.get(workload, 0)} prompt tokens from cache")
        for name, xs in (("cache on", on), ("cache off", off)):
            xs = sorted(xs)
            print(f"  {name:9}  TTFT median {statistics.median(xs) * 1e3:7.1f} ms, "
                  f"p95 {xs[int(0.95 * (len(xs) - 1))] * 1e3:7.1f} ms")  # fmt: skip
        print(
            f"  off / on  x{statistics.median(ratios):.2f} (80 % of requests {lo:.2f}-{hi:.2f})\n"
        )


if __name__ == "__main__":
    main()
