"""The one comparator: PyTorch vs ONNX Runtime (parity), TensorRT vs ONNX Runtime (engine
parity) and CUDA-graph replay vs plain execution all judge outputs here.

Per element, the normalized error is |a-b| / (atol*s + rtol*|ref|); a tensor passes when the
spec's statistic of it (max, mean, or a quantile) is <= 1. s is 1, or under the tolerance's
scale `rms` the reference tensor's RMS where that is above 1: float32 rounding grows with the
magnitude of the values a result is computed from, so an element near zero in a tensor of
magnitude 100 carries the tensor's rounding, not its own (measured: a trained Llama's values,
RMS 9, differ from a float64 recompute by 6e-4 in PyTorch float32 itself, six times a fixed
atol of 1e-4). With s = 1 and the max statistic this is numpy.allclose. A NaN or inf where
the reference has a number, a shape mismatch and a missing output all fail.
"""

from __future__ import annotations

import fnmatch
import math
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from schemas.details import Compared

if TYPE_CHECKING:
    from collections.abc import Callable

    from schemas.spec.parity import ParityConfig, Tolerance


R = TypeVar("R", bound=Compared)


def placed(row: type[R], compared: Compared, **where: Any) -> R:
    """`compared` as a `row` (schemas/details.py: at a shape, a module, a decode probe),
    with what it was a comparison of (`where`, which may also override the verdict:
    kvcheck's rounding). What the comparator left unset (`note`, `atol_scale`) stays
    unset, so it stays out of the report as it always did."""
    return row(**{**compared.model_dump(exclude_unset=True), **where})


def tolerance(cfg: ParityConfig, output: str) -> Tolerance:
    """The per-output tolerance whose key (name or glob) matches, else the default."""
    return next(
        (tol for pattern, tol in cfg.outputs.items() if fnmatch.fnmatchcase(output, pattern)),
        cfg.tolerance,
    )


CHUNK = 1 << 20  # elements per step: ~40 MB of float64 temporaries, whatever the tensor


def atol_scale(
    ref: np.ndarray, tol: Tolerance, done_with: Callable[[int, int], None] | None = None
) -> float:
    """What atol is multiplied by: 1, or under scale `rms` max(1, RMS of the reference's
    finite elements), summed in float64 a chunk at a time (`done_with` pages a chunk out)."""
    if tol.scale == "none" or not tol.atol:
        return 1.0
    flat = np.asarray(ref).ravel()
    squares, count = 0.0, 0
    for start in range(0, flat.size, CHUNK):
        r = flat[start : start + CHUNK].astype(np.float64)
        r = r[np.isfinite(r)]
        squares += float(np.dot(r, r))
        count += r.size
        if done_with is not None:
            done_with(start, start + CHUNK)
    return max(1.0, math.sqrt(squares / count)) if count else 1.0


def normalized(diff: np.ndarray, ref: np.ndarray, tol: Tolerance, scale: float) -> np.ndarray:
    """|a-b| / (atol*scale + rtol*|ref|) per element; 0 where equal (a zero tolerance: an
    exact element 0, any other inf). |ref| in its own dtype, as the formula always had it."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(diff == 0, 0.0, diff / (tol.atol * scale + tol.rtol * np.abs(ref)))


def compare(ref: np.ndarray, out: np.ndarray, tol: Tolerance, cfg: ParityConfig) -> Compared:
    """Normalized error |a-b| / (atol*s + rtol*|ref|), reduced by the spec's statistic;
    `atol_scale` is set only where it is not 1, `note` only where nothing was compared.

    Computed in float64 a chunk at a time, so a big output (a 7B model's logits) costs a few
    chunks of temporaries, not five float64 copies of itself (issue 14: peak memory). Only a
    quantile statistic keeps every normalized error (one float64 array) to rank them. A
    reference memory-mapped read-only (parity's saved PyTorch outputs) leaves the resident
    set a chunk at a time as it is read."""
    done_with = _pager(ref)
    ref, out = np.asarray(ref), np.asarray(out)
    if ref.shape != out.shape:
        return Compared(
            ok=False,
            error=math.inf,
            max_abs=math.inf,
            note=f"shape {list(out.shape)} != reference {list(ref.shape)}",
        )
    if ref.size == 0:
        return Compared(ok=True, error=0.0, max_abs=0.0)
    scale = atol_scale(ref, tol, done_with)
    flat_ref, flat_out = ref.ravel(), out.ravel()
    stat = cfg.statistic
    kept = np.empty(ref.size) if stat == "quantile" else None
    top, total, max_abs, finite = 0.0, 0.0, 0.0, True
    for start in range(0, ref.size, CHUNK):
        r = flat_ref[start : start + CHUNK]
        diff = np.abs(np.subtract(r, flat_out[start : start + CHUNK], dtype=np.float64))
        norm = normalized(diff, r, tol, scale)
        finite = finite and bool(np.isfinite(diff).all())
        if finite:
            max_abs = max(max_abs, float(np.max(diff)))
        top = max(top, float(np.max(norm)))
        total += float(np.sum(norm))
        if kept is not None:
            kept[start : start + norm.size] = norm
        done_with(start, start + r.size)
    if stat == "max":
        error = top
    elif stat == "mean":
        error = total / ref.size
    else:
        assert kept is not None
        error = float(np.quantile(kept, cfg.quantile))
    # NaN or inf anywhere fails, whatever the statistic (a quantile would rank one inf
    # element out of sight). A NaN normalized error needs a NaN or inf difference, so the
    # difference being finite everywhere is the whole test.
    error = math.inf if not finite or not np.isfinite(error) else error
    result = Compared(ok=error <= 1.0, error=error, max_abs=max_abs if finite else math.inf)
    # atol_scale is set only where it is not 1 (unset, it stays out of the report)
    return result if scale == 1.0 else placed(Compared, result, atol_scale=scale)


def _pager(ref: np.ndarray) -> Callable[[int, int], None]:
    """For a C-contiguous read-only np.memmap: a function dropping the pages of elements
    [start, stop) from the resident set (they fault back from the file if read again);
    otherwise a no-op. A writable mapping is left alone: dropping could lose a write."""
    import mmap

    raw = getattr(ref, "_mmap", None)
    if raw is None or ref.flags.writeable or not ref.flags.c_contiguous:
        return lambda start, stop: None
    base = ref.ctypes.data - np.frombuffer(raw, dtype=np.uint8).ctypes.data  # offset in map
    page = mmap.PAGESIZE

    def drop(start: int, stop: int) -> None:
        first = (base + start * ref.itemsize) // page * page
        last = (base + stop * ref.itemsize) // page * page  # a page still partly ahead stays
        if last > first:
            raw.madvise(mmap.MADV_DONTNEED, first, last - first)

    return drop


class OutputCompared(Compared):
    """compare_outputs' row: one named output of a run against the reference's."""

    output: str


def compare_outputs(
    want: dict[str, Any], have: dict[str, Any], cfg: ParityConfig, default: Tolerance | None = None
) -> list[OutputCompared]:
    """One row per reference output, in its order; `default` replaces cfg.tolerance for
    outputs no per-output key matches (e.g. engine.parity)."""
    rows = []
    for name, ref in want.items():
        if name not in have:
            rows.append(
                OutputCompared(
                    output=name,
                    ok=False,
                    error=math.inf,
                    max_abs=math.inf,
                    note="missing from the outputs",
                )
            )
            continue
        tol = tolerance(cfg, name)
        if default is not None and tol is cfg.tolerance:
            tol = default
        compared = compare(np.asarray(ref), np.asarray(have[name]), tol, cfg)
        rows.append(placed(OutputCompared, compared, output=name))
    return rows
