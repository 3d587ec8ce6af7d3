"""One decode step of KV-cache graphs, alone: where a step's time goes when the engine is not
in the way (issue 41: the one-stream goal against llama.cpp).

For each graph: its node count, the median of 15 unprofiled `session.run`s of one decode
step (`--rows` rows on a `--past`-token past, 2 threads, after 3 warm-up runs), and then,
under onnxruntime's profiler (which inflates small kernels), the kernel calls a step makes
and the op types that take the most time. `--fix batch,sequence` also times a copy of each
graph with those dims fixed to 1 (onnxruntime's make_dim_param_fixed), which lets
onnxruntime fold the shape arithmetic they feed.

    python benchmarks/bench_graph_step.py GRAPH.onnx [GRAPH.onnx ...] [--rows 1] [--past 128]
                                          [--fix batch,sequence]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def session(path: Path, profile: str | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def feeds(sess: Any, rows: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {
        i.name: rng.standard_normal((rows, i.shape[1], past, i.shape[3])).astype(np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values.")
    }
    out["input_ids"] = np.full((rows, 1), 100, np.int64)
    out["attention_mask"] = np.ones((rows, past + 1), np.int64)
    if any(i.name == "position_ids" for i in sess.get_inputs()):
        out["position_ids"] = np.full((rows, 1), past, np.int64)
    return out


def measure(path: Path, rows: int, past: int, work: Path) -> str:
    import onnx

    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    sess = session(path)
    feed = feeds(sess, rows, past)
    for _ in range(3):
        sess.run(None, feed)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    profiled = session(path, str(work / "profile"))
    for _ in range(10):
        profiled.run(None, feed)
    events = json.loads(Path(profiled.end_profiling()).read_text())
    by: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"]
            calls[e["args"]["op_name"]] += 1
    top = ", ".join(f"{op} {us / 1e4:.2f} ms ({calls[op] // 10})" for op, us in by.most_common(8))
    return (
        f"{path}: {nodes} nodes, {1000 * float(np.median(times)):.2f} ms a step "
        f"(median of 15); profiled: {sum(calls.values()) // 10} kernel calls a step; {top}"
    )


def fixed(path: Path, dims: list[str], out: Path) -> Path:
    import onnx
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_dim_param_fixed

    model = onnx.load(str(path))
    for dim in dims:
        make_dim_param_fixed(model.graph, dim, 1)
    fix_output_shapes(model)
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--fix", default="", help="dims fixed to 1 in a second copy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-graph-step-") as tmp:
        work = Path(tmp)
        for i, path in enumerate(args.graphs):
            print(measure(path, args.rows, args.past, work), flush=True)
            if args.fix:
                copy = fixed(path, args.fix.split(","), work / f"fixed{i}.onnx")
                print(f"  dims {args.fix} fixed to 1: " + measure(copy, args.rows, args.past, work))


if __name__ == "__main__":
    main()
