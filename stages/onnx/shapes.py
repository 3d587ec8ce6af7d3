"""Shapes and inputs, in one place: the named-dim vocabulary (`total_sequence`), the sizes
every stage probes at (trace, min/opt/max, an odd size), and the seeded inputs it feeds.

export probes its graph, parity compares it with PyTorch, the engine compares TensorRT
with ONNX Runtime and the load test sends requests: all with these, so a shape one stage
proves is the shape the next one means.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from schemas.spec.export import DERIVED_DIM

if TYPE_CHECKING:
    from schemas.artifacts import DimSizes
    from schemas.spec.export import DimRange

    # a dim's min/opt/max: the spec's range, the export's record of it, or a plain dict
    DimBounds = DimRange | DimSizes | dict[str, int]

TOTAL = DERIVED_DIM  # past_sequence + sequence; derived, never declared in the spec
BOUNDS = ("min", "opt", "max")


@dataclass(frozen=True)
class Tensor:
    """A graph input or output: named axes are dims of the spec, ints are fixed.
    Integer inputs are drawn from [low, high) (token ids: [0, vocab); masks: ones)."""

    name: str
    dtype: str
    axes: tuple[int | str, ...]
    low: float = 0
    high: float = 1


@dataclass(frozen=True)
class Layout:
    """Graph inputs and outputs in call order, with named axes."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: a for i, a in enumerate(t.axes) if isinstance(a, str)}
            for t in (*self.inputs, *self.outputs)
        }


def with_total(sizes: Mapping[str, int]) -> dict[str, int]:
    if "past_sequence" in sizes and "sequence" in sizes:
        return {**sizes, TOTAL: sizes["past_sequence"] + sizes["sequence"]}
    return dict(sizes)


def ranges_of(dims: Mapping[str, DimBounds]) -> dict[str, dict[str, int]]:
    """Named dim -> {min, opt, max}, from spec DimRanges or plain dicts."""
    return {n: d if isinstance(d, dict) else d.model_dump() for n, d in dims.items()}


def trace_sizes(dims: Mapping[str, DimBounds]) -> dict[str, int]:
    """Sizes to trace at: opt, but never 0 or 1 (exporters specialize those) when max allows."""
    out = {}
    for n, r in ranges_of(dims).items():
        out[n] = r["opt"] if r["opt"] >= 2 or r["max"] < 2 else min(r["max"], 2 + (n == "sequence"))
    return out


def odd_size(low: int, high: int, avoid: Collection[int] = ()) -> int:
    """An odd size strictly inside (low, high), unlike every size in `avoid` where possible,
    low in the range (the one nearest a sixteenth of the way up: a probe there costs a
    small fraction of one at the max, which is probed anyway; on a 30-layer decoder's
    1..1024 ranges, 63 and 65 ran in 0.4 s where 255 and 257 took 2.1 s); `high` when the
    range has none (a specialized 0/1/2 still gets probed at max)."""
    candidates = [v for v in range(low + 1, high) if v % 2 == 1 and v not in avoid]
    if not candidates:
        return high
    target = low + (high - low) / 16
    return min(candidates, key=lambda v: (abs(v - target), v))


def corners(
    dims: Mapping[str, DimBounds],
    which: Iterable[str] = BOUNDS,
    odd_avoid: Mapping[str, int] | None = None,
) -> dict[str, dict[str, int]]:
    """Named sizes at each corner in `which` (min, opt, max) and, when `odd_avoid` is given,
    at an odd size per dim unlike those sizes and unlike the other dims' odd sizes (two dims
    a graph confuses, past and sequence, then differ in the one corner where both are
    inside their ranges). Every dim moves together."""
    ranges = ranges_of(dims)
    out = {k: {n: r[k] for n, r in ranges.items()} for k in which}
    if odd_avoid is not None:
        odd: dict[str, int] = {}
        for n, r in ranges.items():
            trace = {odd_avoid[n]} if n in odd_avoid else set()
            odd[n] = odd_size(r["min"], r["max"], trace | set(odd.values()))
            if odd[n] == r["max"]:  # every odd size taken by another dim: an odd one still
                odd[n] = odd_size(r["min"], r["max"], trace)
        out["odd"] = odd
    return out


def axis_size(axis: str | int, sizes: Mapping[str, int]) -> int:
    """The size of one axis given named sizes; total_sequence is past + sequence (at least 1)."""
    if isinstance(axis, int):
        return axis
    if axis == TOTAL and axis not in sizes:
        return max(sizes["past_sequence"] + sizes["sequence"], 1)
    return int(sizes[axis])


def shape_of(t: Tensor, sizes: Mapping[str, int]) -> list[int]:
    return [axis_size(a, sizes) for a in t.axes]


def token_tensor(
    name: str,
    dtype: str,
    axes: Iterable[int | str],
    vocab: int,
    declared: tuple[float | None, float | None] = (None, None),
) -> Tensor:
    """A graph input as recorded in model_info.json, with the values a real request sends:
    masks are ones (a mask accepts 0 too, but a row of zeros attends to nothing); other
    integer inputs take the range model_info records (token ids below the vocabulary,
    segment ids below type_vocab_size, a declared export.inputs range), else ids below
    `vocab`."""
    if "mask" in name:
        return Tensor(name, dtype, tuple(axes), 1, 2)
    if declared[0] is not None and declared[1] is not None:
        return Tensor(name, dtype, tuple(axes), declared[0], declared[1])
    return Tensor(name, dtype, tuple(axes), 0, vocab)


def accepted_range(t: Tensor) -> tuple[float, float]:
    """The values a server accepts for an integer input, [low, high): a mask takes 0 and 1
    (drawn as ones), everything else the range it is drawn from."""
    return (0, 2) if "mask" in t.name else (t.low, t.high)


def seeded_inputs(
    tensors: Iterable[Tensor], shapes: Mapping[str, list[int]], seed: int
) -> dict[str, np.ndarray]:
    """Deterministic inputs: integers in [low, high), booleans, normal floats."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for t in tensors:
        shape = tuple(shapes[t.name])
        if t.dtype.startswith("int"):
            feeds[t.name] = rng.integers(int(t.low), int(t.high), size=shape).astype(t.dtype)
        elif t.dtype == "bool":
            feeds[t.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[t.name] = rng.standard_normal(shape).astype(t.dtype)
    if POSITIONS in feeds and "attention_mask" in feeds:  # what a runtime feeds: from the mask
        width = feeds[POSITIONS].shape[-1]
        feeds[POSITIONS] = positions_from_mask(feeds["attention_mask"], width)
    return feeds


POSITIONS = "position_ids"


def positions_from_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """Position ids of the last `width` tokens of a [batch, total] mask: each real token's
    index among the row's real tokens (a row left-padded by 3 starts at 0 after the pads),
    padding at 0 (masked out, but a valid index). The serving runtime derives them the same
    way, as transformers' generate does (cumsum of the mask - 1)."""
    mask = np.asarray(mask)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0) * (mask != 0)
    return cast(np.ndarray, positions[:, positions.shape[-1] - width :].astype(np.int64))


def make_inputs(lay: Layout, sizes: Mapping[str, int], seed: int) -> dict[str, np.ndarray]:
    """Deterministic inputs of the layout at the given named dim sizes."""
    full = with_total(sizes)
    return seeded_inputs(lay.inputs, {t.name: shape_of(t, full) for t in lay.inputs}, seed)


# What a probe (export's shapes, parity's default corners) may spend on one
# forward pass's activations: the checkpoint's own size, at least PROBE_FLOOR. With the
# weights loaded once, a stage stays near 3x the checkpoint (issue 40: export and parity ran
# the all-max corner at batch 8 x 1024 + 1024 on a 30-layer, 50k-vocabulary decoder and
# peaked at 8.6x and 9.3x of it, nearly all in logits and attention scores).
PROBE_FLOOR = 256 << 20
ACT_BYTES = 4


def run_bytes(lay: Layout, sizes: Mapping[str, int], hidden: int, heads: int) -> int:
    """One forward pass's activation memory at `sizes`, estimated: every output (logits,
    present KV) plus, per token, a few hidden-size buffers and the MLP's (8 x hidden) and one
    layer's attention scores over the context (the plan stage's model of a step)."""
    full = with_total(sizes)
    outputs = sum(
        int(np.prod(shape_of(t, full), dtype=np.int64)) * _itemsize(t.dtype) for t in lay.outputs
    )
    tokens = full.get("batch", 1) * full.get("sequence", 1)
    context = full.get(TOTAL, full.get("sequence", 1))
    return outputs + tokens * (8 * hidden + heads * context) * ACT_BYTES


def _itemsize(dtype: str) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # bfloat16 and other names numpy lacks: two bytes or four, say four
        return ACT_BYTES


def probe_budget(weight_bytes: int) -> int:
    return max(weight_bytes, PROBE_FLOOR)


def within_budget(
    sizes: Mapping[str, int],
    dims: Mapping[str, DimBounds],
    cost: Callable[[Mapping[str, int]], int],
    budget: int,
) -> dict[str, int]:
    """`sizes` with the batch lowered (never below its min) until `cost` fits `budget`.
    Only the batch moves: it is the one dim a graph never mixes with the others (each row
    is computed alike), and each probe runs batch.max on its own at the small trace sizes,
    so a lowered corner still proves every other dim at its extreme."""
    out = dict(sizes)
    if "batch" not in out or "batch" not in dims:
        return out
    low = max(ranges_of(dims)["batch"]["min"], 1)
    while out["batch"] > low and cost(out) > budget:
        out["batch"] -= 1
    return out
