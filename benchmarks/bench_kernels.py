"""The cost model's constants (stages/quant/speed.py KERNELS, NODE_NS), measured here.

One MatMul X[rows, K] @ W[K, N] per graph, FP32 and each quantized kernel the recipe search
builds (dynamic INT8 per-channel: MatMulInteger; MatMulNBits at 8 and 4 bits, block 32, with
int8 compute (accuracy_level 4, `nbits8`/`nbits4`) and float compute (`...-float`)),
timed interleaved (one thread, 7 rounds, the median), at 1 and 16 rows, for matrices from
64x64 to 2048x2048. Prints each kernel's microseconds, its ratio to FP32, and the slope in
ns per weight parameter between the 0.6M- and 4.2M-parameter matrices (what KERNELS holds).
Usage: python benchmarks/bench_kernels.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.quant import speed as sp  # noqa: E402

SHAPES = [(64, 64), (256, 256), (768, 768), (768, 3072), (2048, 2048)]
KERNELS = ("float", "int8", "nbits8", "nbits4", "nbits8-float", "nbits4-float")


def build(folder: Path, k: int, n: int) -> dict[str, Path]:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", n])],
        [numpy_helper.from_array(w, "W")],
    )
    paths = {kind: folder / f"{kind}.onnx" for kind in KERNELS}
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), paths["float"])
    quantize_dynamic(paths["float"], paths["int8"], per_channel=True, weight_type=QuantType.QInt8)
    for bits in (8, 4):
        for suffix, level in (("", 4), ("-float", 0)):
            q = MatMulNBitsQuantizer(
                onnx.load(paths["float"]),
                block_size=32,
                is_symmetric=True,
                bits=bits,
                accuracy_level=level,
            )
            q.process()
            onnx.save(q.model.model, paths[f"nbits{bits}{suffix}"])
    return paths


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def timed(s: ort.InferenceSession, x: np.ndarray, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        s.run(None, {"X": x})
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    logging.disable(logging.WARNING)
    us: dict[tuple[int, int, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in SHAPES:
            paths = build(Path(tmp), k, n)
            sessions = {kind: session(p) for kind, p in paths.items()}
            for rows in (1, 16):
                x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
                reps = max(20, 2000 * 64 * 64 // (k * n))
                runs: dict[str, list[float]] = {kind: [] for kind in KERNELS}
                for kind in KERNELS:
                    timed(sessions[kind], x, 5)
                for _ in range(7):
                    for kind in KERNELS:
                        runs[kind].append(timed(sessions[kind], x, reps))
                med = {kind: float(np.median(v)) for kind, v in runs.items()}
                us[(k * n, rows, k)] = med
                print(
                    f"{k:>5}x{n:<5} rows {rows:>2}: "
                    + "  ".join(f"{kind} {med[kind]:8.1f} us" for kind in KERNELS)
                    + "  | FP32 / kernel: "
                    + "  ".join(f"{kind} {med['float'] / med[kind]:.2f}x" for kind in KERNELS[1:]),
                    flush=True,
                )
    print(f"\nslope, ns per weight parameter (KERNELS[{sp.isa()!r}] holds 1 row, 16 rows):")
    small, big = 768 * 768, 2048 * 2048
    for kind in KERNELS:
        slopes = []
        for rows in (1, 16):
            a = us[(small, rows, 768)][kind]
            b = us[(big, rows, 2048)][kind]
            slopes.append((b - a) * 1000 / (big - small))
        held = sp.KERNELS[sp.isa()][kind]
        print(f"  {kind:12} measured {slopes[0]:.3f}, {slopes[1]:.3f}   held {held[0]}, {held[1]}")


if __name__ == "__main__":
    main()
