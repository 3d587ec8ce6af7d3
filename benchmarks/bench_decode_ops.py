"""Where a decode step's time goes, by operator, and what tracing grouped-query attention
without repeating the cache saves (issue 41: no per-step copy of the whole KV cache).

For a built causal-lm workspace (`bench_memory.py --synthetic llama-30 --keep DIR` leaves
one; or this repository after `make release`), the export is traced a second time with the
model's own eager attention (stages/onnx/grouped.py switched off: `repeat_kv` writes every
key/value head once per query head of its group, in every step) and, with `--quantize`,
the release's quantize stage runs on that export as written (its own search: a few minutes
on a 30-layer decoder). Then, for 1 and 16 rows on a PAST-token past:
- wall ms per decode step of each graph, interleaved rounds, median, and the ratio of the
  graph as built (grouped) to the same graph traced with the model's own attention;
- onnxruntime's profile of the step, kernel time per operator type (the top ones) and the
  copies' share (Concat, Expand, Tile, Pad, ConstantOfShape, Slice, Transpose).

Usage: python benchmarks/bench_decode_ops.py --root DIR [RELEASE] [--rounds N] [--quantize]
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_weight_only import PAST, arguments, decode_feeds, interleaved  # noqa: E402

COPIES = ("Concat", "Expand", "Tile", "Pad", "ConstantOfShape", "Slice", "Transpose")


def own_attention_build(root: Path, release: str, quantize: bool) -> Path:
    """A copy of the workspace's build whose export is traced with the model's own attention
    (and, with `quantize`, quantized by the release's quantize stage as written)."""
    from schemas.loader import load_release
    from stages import execute
    from stages.onnx import grouped

    copy = Path(tempfile.mkdtemp(prefix="own-attention-"))
    for part in ("releases", "models", "data"):
        shutil.copytree(root / part, copy / part, symlinks=True)
    (copy / "build" / release).mkdir(parents=True)
    shutil.copytree(root / "build" / release / "pin", copy / "build" / release / "pin")
    spec = copy / "releases" / f"{release}.yaml"
    stages = ["export", "quantize"] if quantize else ["export"]
    with (
        mock.patch.dict(os.environ, {"SHIPYARD_STAGE_CHILD": "0"}),
        mock.patch.object(grouped, "use", lambda net: False),
    ):
        for stage in stages:
            report = execute(stage, load_release(spec), spec, copy)
            if report.status.value != "passed":
                sys.exit(f"{stage} with the model's own attention: {report.reasons}")
    return copy / "build" / release


def profile(path: Path, feeds: dict[str, np.ndarray], runs: int = 8) -> dict[str, float]:
    """Kernel ms per run by operator type (onnxruntime's profiler)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"decode-ops-{os.getpid()}")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(2 + runs):
        session.run(["logits"], feeds)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    ran = sum(1 for e in events if e.get("name") == "model_run")
    by: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"].get("op_name", "?")] += e["dur"]
    return {op: us / ran / 1e3 for op, us in by.items()}


def main() -> None:
    import onnxruntime as ort

    args = sys.argv[1:]
    root, release, rounds = arguments(args)
    build = root / "build" / release
    quantize = "--quantize" in args
    own = own_attention_build(root, release, quantize)
    paths = {
        "fp32 (grouped)": build / "export" / "model.onnx",
        "fp32 (own attention)": own / "export" / "model.onnx",
    }
    if quantize:
        paths |= {
            "shipped (grouped)": build / "quantize" / "model.onnx",
            "shipped (own attention)": own / "quantize" / "model.onnx",
        }
    cpu = ["CPUExecutionProvider"]
    sessions = {k: ort.InferenceSession(str(p), providers=cpu) for k, p in paths.items()}
    print(f"{release}: a decode step on a {PAST}-token past, {rounds} interleaved rounds")
    for rows in (1, 16):
        feeds = decode_feeds(sessions["fp32 (grouped)"], rows)
        med = interleaved(sessions, feeds, rounds)
        print(f"rows {rows}:")
        for name in paths:
            pair = name.replace("grouped", "own attention")
            ratio = f"  {med[pair] / med[name]:5.2f}x the speed of {pair}" if pair != name else ""
            print(f"  {name:26} {med[name]:7.1f} ms{ratio}")
        for name, path in paths.items():
            ops = profile(path, feeds)
            total = sum(ops.values())
            copies = sum(v for k, v in ops.items() if k in COPIES)
            ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
            top = ", ".join(f"{k} {v:.1f}" for k, v in ranked)
            print(
                f"    {name:24} kernels {total:6.1f} ms, copies {copies:5.1f} ms "
                f"({copies / total:4.0%}); top: {top}"
            )
    shutil.rmtree(own.parent.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
