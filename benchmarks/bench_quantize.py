"""INT8 vs FP32 for the ~124M example release (gpt2-small), measured side by side.

Compares, in one run and on the same inputs:
  fp32      the exported model (build/gpt2-small/export)
  fp32-pre  the same after onnxruntime's quant_pre_process (optimized, still FP32)
  plain     ORT dynamic INT8 of every MatMul/Gemm after quant_pre_process (the usual recipe)
  shipyard  the quantize stage's model (build/gpt2-small/quantize: sensitivity-checked,
            mixed precision where the budget needed it)
and prints size ratios, prefill latency ratios at batch 1 and 8 (seq 128, empty cache), and
accuracy vs FP32 on the release's held-out calibration samples.
Usage: dvc repro quantize@gpt2-small && python benchmarks/bench_quantize.py
Goal (issue 3): shipyard latency <= 0.65x FP32 with the accuracy budget held.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schemas.loader import load_release  # noqa: E402
from stages.onnx import model as m  # noqa: E402
from stages.quant import accuracy as acc  # noqa: E402
from stages.quant import calibration as calib  # noqa: E402

RELEASE, ROUNDS, SEQ = "gpt2-small", 10, 128


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def prefill(lay: m.Layout, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (batch, SEQ)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for t in lay.inputs[2:]:
        feeds[t.name] = np.zeros((batch, t.axes[1], 0, t.axes[3]), np.float32)
    return feeds


def latencies(sessions: dict[str, ort.InferenceSession], feeds: dict) -> dict[str, float]:
    """Median seconds per run; models alternate within each round so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(["logits"], feeds)  # warm-up
    for _ in range(ROUNDS):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(["logits"], feeds)
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def plain_int8(fp32: Path, folder: Path) -> tuple[Path, Path]:
    """(FP32 after quant_pre_process, dynamic INT8 of it): the usual recipe, and its own
    FP32 baseline, so pre-processing alone cannot pass for a quantization gain."""
    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre, out = folder / "pre.onnx", folder / "int8.onnx"
    quant_pre_process(fp32, pre)
    quantize_dynamic(pre, out, op_types_to_quantize=["MatMul", "Gemm"])
    return pre, out


def main() -> None:
    spec = load_release(REPO / "releases" / f"{RELEASE}.yaml")
    build = REPO / "build" / RELEASE
    fp32, ours = build / "export" / "model.onnx", build / "quantize" / "model.onnx"
    if not ours.is_file():
        sys.exit(f"{ours} is missing: run `dvc repro quantize@{RELEASE}` first")
    info = __import__("json").loads((build / "export" / "model_info.json").read_text())
    lay = m.layout_from_info(info)
    with tempfile.TemporaryDirectory() as tmp:
        pre, plain = plain_int8(fp32, Path(tmp))
        models = {"fp32": fp32, "fp32-pre": pre, "plain": plain, "shipyard": ours}
        sizes = {
            k: sum(f.stat().st_size for f in p.parent.glob(p.name + "*")) for k, p in models.items()
        }
        sessions = {k: session(p) for k, p in models.items()}
        lat = {b: latencies(sessions, prefill(lay, b)) for b in (1, 8)}
        samples = calib.load(
            REPO,
            spec.quantization.calibration,
            spec.task,
            lay,
            spec.export.dims,
            info["arch"]["vocab"],
        ).holdout
        ref = acc.outputs(sessions["fp32"], samples)
        quality = {
            k: acc.agreement(spec.task, ref, acc.outputs(sessions[k], samples), samples)
            for k in ("fp32-pre", "plain", "shipyard")
        }
    print(
        f"{RELEASE}: {info['parameters']:,} parameters; ORT {ort.__version__}, CPU, "
        f"median of {ROUNDS}; accuracy on {len(samples)} held-out samples"
    )
    print(
        f"{'':10}{'MB':>8}{'size':>7}{'b1 ms':>9}{'b1 x':>7}{'b8 ms':>9}{'b8 x':>7}"
        f"{'top1':>8}{'cosine':>8}{'ppl +%':>8}"
    )
    for k in models:
        q = quality.get(k)
        acc_cols = (
            (
                f"{q['top1_agreement']:8.4f}{q['logit_cosine']:8.4f}"
                f"{100 * q['perplexity_increase']:8.3f}"
            )
            if q
            else f"{'(ref)':>8}"
        )
        print(
            f"{k:10}{sizes[k] / 1e6:8.1f}{sizes[k] / sizes['fp32']:7.2f}"
            f"{1e3 * lat[1][k]:9.1f}{lat[1][k] / lat[1]['fp32']:7.2f}"
            f"{1e3 * lat[8][k]:9.1f}{lat[8][k] / lat[8]['fp32']:7.2f}{acc_cols}"
        )
    budget = spec.quantization.budget
    broken = acc.violations(budget, quality["shipyard"])
    print(
        f"budget {budget.model_dump(exclude_none=True)}: "
        f"{'held' if not broken else 'BROKEN: ' + '; '.join(broken)}; goal latency <= 0.65x"
    )


if __name__ == "__main__":
    main()
