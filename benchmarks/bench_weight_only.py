"""A decode step of the shipped graph against weight-only variants of the same export
(issue 41: weight bytes per token at one stream).

For a built causal-lm release (default gpt2-small from `make release`; or `--root DIR` for a
workspace `bench_memory.py --synthetic llama-30 --keep DIR` left), builds the export's
weight-only variants with MatMulNBits (block 32, symmetric) on onnxruntime's int8 path
(`compute: int8`, accuracy_level 4) and its float path (`compute: float`), and times one
decode step (one token a row on a past of PAST tokens) of FP32, the shipped graph and each
variant at 1 and 16 rows: interleaved rounds, every graph once a round, the median and the
ratio to the shipped graph. Also prints each variant's size and whether a row's logits are
the same to the bit alone and in the 16-row batch.

Usage: python benchmarks/bench_weight_only.py [RELEASE] [--root DIR] [--rounds N]
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PAST = 128


def variants(export: Path, folder: Path) -> dict[str, Path]:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    out = {}
    for bits in (4, 8):
        for compute, level in (("int8", 4), ("float", 0)):
            path = folder / f"int{bits}-weight-only-{compute}.onnx"
            q = MatMulNBitsQuantizer(
                onnx.load(str(export)), bits=bits, block_size=32, accuracy_level=level
            )
            q.process()
            q.model.save_model_to_file(str(path), use_external_data_format=True)
            out[path.stem] = path
    return out


def decode_feeds(session: Any, rows: int) -> dict[str, np.ndarray]:
    inputs = session.get_inputs()
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(5, 500, (rows, 1)).astype(np.int64),
        "attention_mask": np.ones((rows, PAST + 1), np.int64),
    }
    if any(i.name == "position_ids" for i in inputs):
        feeds["position_ids"] = np.full((rows, 1), PAST, np.int64)
    for i in inputs:
        if i.name.startswith("past_key_values."):
            shape = (rows, int(i.shape[1]), PAST, int(i.shape[3]))
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32) * 0.5
    return feeds


def interleaved(
    sessions: dict[str, Any], feeds: dict[str, np.ndarray], rounds: int
) -> dict[str, float]:
    """Median ms of one run of each session on `feeds`: a warm-up each, then `rounds`
    rounds that run every session once, in turn (what the machine does meanwhile falls on
    all of them alike)."""
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(["logits"], feeds)
    for _ in range(rounds):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(["logits"], feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def arguments(args: list[str]) -> tuple[Path, str, int]:
    """`[RELEASE] [--root DIR] [--rounds N]`: the workspace, the release (default gpt2-small
    here, else the workspace's built one) and the rounds (default 9)."""
    root = Path(args[args.index("--root") + 1]) if "--root" in args else REPO
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 9
    values = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--root", "--rounds")}
    named = [a for a in args if not a.startswith("--") and a not in values]
    if named:
        return root, named[0], rounds
    if root == REPO:
        return root, "gpt2-small", rounds
    built = next(p.name for p in (root / "build").iterdir() if (p / "quantize").is_dir())
    return root, built, rounds


def main() -> None:
    import onnxruntime as ort

    root, release, rounds = arguments(sys.argv[1:])
    build = root / "build" / release
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "fp32": build / "export" / "model.onnx",
            "shipped": build / "quantize" / "model.onnx",
            **variants(build / "export" / "model.onnx", Path(tmp)),
        }
        sessions = {
            k: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
            for k, p in paths.items()
        }
        print(f"{release}: a decode step on a {PAST}-token past, {rounds} interleaved rounds")
        for name, path in paths.items():
            size = sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))
            print(f"  {name:28} {size / 1e6:7.1f} MB")
        for rows in (1, 16):
            medians = interleaved(sessions, decode_feeds(sessions["fp32"], rows), rounds)
            print(f"rows {rows}:")
            for name, med in medians.items():
                ratio = medians["shipped"] / med
                print(f"  {name:28} {med:7.1f} ms  {ratio:5.2f}x the shipped graph's speed")
        probe = decode_feeds(sessions["fp32"], 16)
        alone = {k: v[:1] for k, v in probe.items()}
        print("row 0 alone == row 0 of 16 (to the bit):")
        for name, s in sessions.items():
            a = s.run(["logits"], alone)[0]
            b = s.run(["logits"], probe)[0][:1]
            same = "yes" if np.array_equal(a, b) else f"no ({np.abs(a - b).max():.2e})"
            print(f"  {name:28} {same}")


if __name__ == "__main__":
    main()
