"""What row-independent serving costs (issue 41), side by side in one run.

On one FP32 KV-cache export (any `model.onnx` with past inputs; default: the gpt2-small
example's, `make release` first), four graphs are built here:
- `fp32`: the export with onnxruntime's Softmax and one-row MatMul (padding moves bits);
- `fp32-invariant`: the same, attention rewritten by stages/onnx/invariant.py;
- `int8-per-call`: onnxruntime's dynamic INT8 (per-channel weights, one activation scale
  per call: rows coupled), on the plain export;
- `int8-per-token`: the same with per-token scales (stages/quant/pertoken.py) on the
  rewritten export: what the quantize stage ships now.
Each is timed on decode steps at batch 1 and 16 (a past of --past tokens, rows left-padded
to different lengths as the engine pads them) and on one prefill of --prefill tokens, in
interleaved rounds (every graph once per round, order rotated), medians and the ratio of
each to its baseline printed with the spread of the per-round ratios.

    python benchmarks/bench_row_invariance.py [--model PATH] [--rounds 15] [--past 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(model: Path, into: Path) -> dict[str, Path]:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from stages.onnx import invariant
    from stages.quant import pertoken

    plain = onnx.load(str(model))
    if invariant.rewrite(plain) == 0:  # an export made before the rewrite: itself
        raise SystemExit(f"{model}: no softmax to rewrite (opset < 15, or already rewritten)")
    fp32 = into / "fp32.onnx"
    onnx.save(onnx.load(str(model)), fp32, save_as_external_data=True, location="fp32.data")
    onnx.save(plain, into / "inv.onnx", save_as_external_data=True, location="inv.data")
    out = {"fp32": fp32, "fp32-invariant": into / "inv.onnx"}
    for name, src in (("int8-per-call", fp32), ("int8-per-token", into / "inv.onnx")):
        path = into / f"{name}.onnx"
        quantize_dynamic(
            src,
            path,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            weight_type=QuantType.QInt8,
            use_external_data_format=True,
        )
        if name == "int8-per-token":
            q = onnx.load(str(path), load_external_data=False)
            pertoken.rewrite(q)
            onnx.save(q, str(path))
        out[name] = path
    return out


def feeds_for(session: Any, rows: int, past: int, new: int) -> dict[str, np.ndarray]:
    """A step of `new` tokens for `rows` rows on a left-padded past of up to `past`."""
    from shipyard_runtime.generation.kv import positions_from_mask

    rng = np.random.default_rng(rows * 1000 + new)
    inputs = {i.name: i for i in session.get_inputs()}
    total = past + new
    mask = np.ones((rows, total), np.int64)
    for r in range(rows):  # rows of different lengths, as a served batch pads them
        mask[r, : int(rng.integers(0, max(1, past // 2)))] = 0
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(1, 500, (rows, new)).astype(np.int64),
        "attention_mask": mask,
    }
    if "position_ids" in inputs:
        feeds["position_ids"] = positions_from_mask(mask, new)
    for name, inp in inputs.items():
        if name.startswith("past_key_values."):
            heads, dim = int(inp.shape[1]), int(inp.shape[3])
            feeds[name] = rng.normal(0, 1, (rows, heads, past, dim)).astype(np.float32)
    return feeds


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=REPO / "build/gpt2-small/export/model.onnx")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rows-") as tmp:
        graphs = build(args.model, Path(tmp))
        options = ort.SessionOptions()
        sessions = {
            k: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
            for k, p in graphs.items()
        }
        passes = {
            "decode, batch 1": (1, args.past, 1),
            "decode, batch 16": (16, args.past, 1),
            f"prefill {args.prefill}": (1, 0, args.prefill),
        }
        print(f"model {args.model}, {args.rounds} interleaved rounds\n")
        for label, shape in passes.items():
            feeds = {k: feeds_for(s, *shape) for k, s in sessions.items()}
            times: dict[str, list[float]] = {k: [] for k in sessions}
            names = list(sessions)
            for k in names:  # warm-up
                sessions[k].run(None, feeds[k])
            for r in range(args.rounds):
                for k in names[r % len(names) :] + names[: r % len(names)]:
                    t = time.perf_counter()
                    sessions[k].run(None, feeds[k])
                    times[k].append(time.perf_counter() - t)
            print(label)
            for k, base in (
                ("fp32", "fp32"),
                ("fp32-invariant", "fp32"),
                ("int8-per-call", "fp32"),
                ("int8-per-token", "int8-per-call"),
            ):
                ratios = sorted(a / b for a, b in zip(times[k], times[base], strict=True))
                lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
                print(
                    f"  {k:15} {statistics.median(times[k]) * 1e3:8.2f} ms"
                    f"   x{statistics.median(ratios):.3f} of {base} (80 % of rounds "
                    f"{lo:.3f}-{hi:.3f})"
                )
            print()


if __name__ == "__main__":
    main()
