"""Speed verdicts that noise cannot flip: interleaved, repeated timing with a confidence
interval, and a deterministic cost model where the interval is not decisive.

On these shared 2-core machines one timing of the same recipe read anywhere from 0.02x to
3.82x FP32 across runs, and DVC caches whichever verdict came out. So a recipe is never
accepted or refused on one timing:

1. FP32 and the variant are timed in alternation, PAIRS rounds (the order swapped every
   round, so a drift within a round favours neither), after a warm-up of each. Each round
   gives one ratio FP32 time / variant time; the verdict reads their median and a
   distribution-free 95 % interval of that median (binomial order statistics: no
   assumption about how a busy machine's delays are distributed).
   The rounds stop early at 6, 9 or 12 (LOOKS) when every ratio so far is beyond the bar
   by BAND on one side: a variant 7x slower needs no 15 rounds to say so. They stop at
   any round once the interval of all PAIRS rounds can no longer clear the bar on either
   side (`futile`): the cost model decides then whatever the rounds left would read, so
   the verdict is the one all the rounds would give, sooner (a busy machine's wide
   spread gets there in a few rounds instead of timing 15 for nothing).
2. Timing decides only when the whole interval clears the bar by BAND (above
   bar x (1 + BAND): fast; below bar x (1 - BAND): slow). A quiet machine gives tight
   intervals; a busy one wide ones, which then decide nothing.
3. Otherwise the cost model decides: per node, a fixed dispatch cost, plus for every node
   that reads a weight, the weight's parameters times the kernel's cost per parameter at
   the timed rows (decode steps are bound by the weight bytes they move, and each kernel
   moves and unpacks them at its own rate on this CPU's instruction set). It reads only
   the two graphs and the CPU's flags: the same files give the same prediction on a quiet
   or a busy machine. Its constants are measured by benchmarks/bench_kernels.py.

The report says which decided, with the interval and the prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from stages.quant.pertoken import on_int8_path

PAIRS = 15  # rounds of (FP32, variant): the median's 95 % interval is ranks 4..12
BAND = 0.1  # an interval must clear the bar by 10 % to decide
CONFIDENCE = 0.95

# ns per weight parameter at 1 and at 16 rows, and a fixed cost per node (ns), measured by
# benchmarks/bench_kernels.py (onnxruntime 1.32, one thread, median of 7 interleaved runs;
# slopes between 0.6M- and 4.2M-parameter matrices). `vnni`: a CPU with AVX512-VNNI or
# AVX-VNNI, where onnxruntime's integer GEMM runs its dot-product instructions; without
# them MatMulInteger falls back to AVX2 widening multiplies, which benchmarks elsewhere put
# near the FP32 kernel (an assumption, not measured here: these machines all have VNNI).
KERNELS: dict[str, dict[str, tuple[float, float]]] = {
    "vnni": {
        "float": (0.155, 0.25),
        "int8": (0.045, 0.055),  # MatMulInteger / QLinearMatMul (dynamic or static INT8)
        # MatMulNBits on the int8 path (accuracy_level 4; 2026-12-05, this CPU: the same as
        # MatMulInteger at 1 row, 0.58x (8-bit) and 0.66x (4-bit) of FP32's time at 16),
        # written against the float and int8 figures above by those ratios
        "nbits8": (0.045, 0.14),
        "nbits4": (0.045, 0.16),
        "nbits8-float": (2.0, 3.7),  # the float path: no fast 8-bit kernel
        "nbits4-float": (0.08, 0.43),
    },
    "avx2": {
        "float": (0.155, 0.25),
        "int8": (0.14, 0.22),
        "nbits8": (0.14, 0.3),  # assumed: the int8 path's AVX2 figures, not measured here
        "nbits4": (0.14, 0.3),
        "nbits8-float": (2.0, 3.7),
        "nbits4-float": (0.08, 0.43),
    },
}
NODE_NS = 700.0  # dispatch of one node (the 4-5 node INT8 pattern costs ~1.5 us over 1)
PASS_THROUGH = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze"}


def isa() -> str:
    """Which kernel table applies to this CPU: `vnni` or `avx2` (from /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "avx2"
    return "vnni" if ("avx512_vnni" in flags or "avx_vnni" in flags) else "avx2"


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics k and n-k+1 (1-based)
    with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2; the whole range when n is too
    small for any such k."""
    xs, n = sorted(values), len(values)
    k = _rank(n, confidence)
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


@dataclass(frozen=True)
class Timing:
    """Paired timing of one pass: the median ratio and its interval, FP32's median seconds."""

    ratio: float
    low: float
    high: float
    fp32_s: float
    rounds: int = PAIRS


def paired(
    fp32: Callable[[], Any],
    variant: Callable[[], Any],
    pairs: int = PAIRS,
    bar: float | None = None,
    band: float = BAND,
) -> Timing:
    """Time the two passes in alternation, `pairs` rounds (order swapped every round) after
    a warm-up of each; the ratio of each round, FP32 time / variant time. With a `bar`, the
    rounds stop early at a look (LOOKS) where every ratio so far is beyond it by `band` on
    one side (`settled`)."""

    def one(run: Callable[[], Any]) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    one(fp32), one(variant)
    ratios, base = [], []
    for i in range(pairs):
        if i % 2:
            got, ref = one(variant), one(fp32)
        else:
            ref, got = one(fp32), one(variant)
        ratios.append(ref / max(got, 1e-12))
        base.append(ref)
        if bar is not None and len(ratios) in LOOKS and settled(ratios, bar, band):
            break
        if bar is not None and futile(ratios, bar, band, pairs):
            break
    low, high = median_interval(ratios)
    return Timing(float(np.median(ratios)), low, high, float(np.median(base)), len(ratios))


# Rounds after which the timing may stop early. All n ratios on one side of the true median
# has probability 2 x 0.5^n: 3.1 % at 6, 0.4 % at 9, 0.05 % at 12, 3.6 % over the three
# looks, and a stop needs every ratio beyond the bar by the band besides. On a 30-layer
# decoder an 8-bit weight-only variant 7x slower than FP32 took 60 s of a 223 s quantize
# for 15 rounds of two passes; 6 rounds give the same verdict.
LOOKS = (6, 9, 12)


def settled(ratios: list[float], bar: float, band: float = BAND) -> bool:
    """Every ratio so far clears `bar` by `band`, all above or all below (a bar of 0 or
    less: any speed is enough)."""
    return bar <= 0 or min(ratios) >= bar * (1 + band) or max(ratios) <= bar * (1 - band)


def futile(ratios: list[float], bar: float, band: float = BAND, pairs: int = PAIRS) -> bool:
    """Whether the interval of `pairs` rounds can no longer clear `bar` by `band`, whatever
    the rounds left read: it is the order statistics k and pairs - k + 1 (median_interval),
    so k ratios already below bar x (1 + band) keep its low end below it (not fast), and k
    already above bar x (1 - band) keep its high end above that (not slow). The interval
    of the rounds so far is wider still (its k is no larger), so `decide` on them leaves
    the verdict to the cost model, as it would after every round."""
    if bar <= 0:
        return False
    k = _rank(pairs)
    if k == 0:
        return False
    below = sum(r < bar * (1 + band) for r in ratios)
    above = sum(r > bar * (1 - band) for r in ratios)
    return below >= k and above >= k


def _rank(n: int, confidence: float = CONFIDENCE) -> int:
    """The k of median_interval for n values (0: the whole range)."""
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n:
        below += math.comb(n, k) / 2**n  # P(B <= k)
        if below > tail:
            break
        k += 1
    return k


@dataclass(frozen=True)
class Verdict:
    """Whether a recipe is fast enough, and what decided it."""

    speedup: float  # the decisive figure: the timed median, or the prediction
    fast: bool
    decided_by: Literal["timing", "cost model"]
    interval: tuple[float, float]
    predicted: float


def decide(timing: Timing, predicted: float, bar: float, band: float = BAND) -> Verdict:
    """Timing decides when its interval clears `bar` by `band`; the cost model otherwise.
    A bar of 0 accepts any speed (timing still reported)."""
    interval = (round(timing.low, 3), round(timing.high, 3))
    if bar <= 0:
        return Verdict(round(timing.ratio, 3), True, "timing", interval, round(predicted, 3))
    if timing.low >= bar * (1 + band) or timing.high <= bar * (1 - band):
        fast = timing.low >= bar * (1 + band)
        return Verdict(round(timing.ratio, 3), fast, "timing", interval, round(predicted, 3))
    return Verdict(
        round(predicted, 3), predicted >= bar, "cost model", interval, round(predicted, 3)
    )


def _producers(graph: Any) -> dict[str, Any]:
    return {out: node for node in graph.node for out in node.output}


def _weight(graph: Any, name: str, producers: dict[str, Any], sizes: dict[str, int]) -> int:
    """Parameters of the initializer behind `name` (through layout-only ops and a
    DequantizeLinear); 0 when it is an activation."""
    for _ in range(8):
        if name in sizes:
            return sizes[name]
        node = producers.get(name)
        if node is None or not (node.op_type in PASS_THROUGH or node.op_type == "DequantizeLinear"):
            return 0
        name = node.input[0]
    return 0


def _kernel(node: Any) -> str:
    if node.op_type in {"MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul"}:
        return "int8"
    if node.op_type == "MatMulNBits":
        bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
        kind = "nbits8" if bits == 8 else "nbits4"
        return kind if on_int8_path(node) else f"{kind}-float"
    return "float"


def graph_cost(path: Path, rows: int, table: str | None = None) -> float:
    """Predicted ns of one pass at `rows` rows (a decode step of `rows` sequences, or a
    forward pass over `rows` tokens): NODE_NS per node plus each weight's parameters times
    its kernel's cost per parameter (linear in rows between the 1- and 16-row figures)."""
    from stages.onnx import stream

    # the structure only: the bytes of inline weights are skipped, not parsed (a 0.5 GB
    # variant loaded whole for its node list took quantize to 4x the model on llama-30)
    graph, kernels = stream.skeleton(path).graph, KERNELS[table or isa()]
    sizes = {t.name: int(np.prod(t.dims)) if t.dims else 1 for t in graph.initializer}
    producers = _producers(graph)
    cost = NODE_NS * len(graph.node)
    for node in graph.node:
        params = 0
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            params = attrs.get("K", 0) * attrs.get("N", 0)
        elif node.op_type in {"MatMul", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul"}:
            params = max((_weight(graph, i, producers, sizes) for i in node.input[:2]), default=0)
        elif node.op_type == "QLinearMatMul":
            params = _weight(graph, node.input[3], producers, sizes)
        if params:
            one, sixteen = kernels[_kernel(node)]
            per = one + (sixteen - one) * (max(rows, 1) - 1) / 15
            cost += per * params
    return cost


def predicted_speedup(fp32: Path, variant: Path, rows: int, table: str | None = None) -> float:
    """FP32's predicted cost / the variant's at `rows` rows."""
    return graph_cost(fp32, rows, table) / graph_cost(variant, rows, table)
