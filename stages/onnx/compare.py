"""The one comparator: PyTorch vs ONNX Runtime (parity), TensorRT vs ONNX Runtime (engine
parity) and CUDA-graph replay vs plain execution all judge outputs here.

Per element, the normalized error is |a-b| / (atol + rtol*|ref|); a tensor passes when the
spec's statistic of it (max = numpy.allclose, mean, or a quantile) is <= 1. A NaN or inf
where the reference has a number, a shape mismatch and a missing output all fail.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import numpy as np


def tolerance(cfg: Any, output: str) -> Any:
    """The per-output tolerance whose key (name or glob) matches, else the default."""
    return next(
        (tol for pattern, tol in cfg.outputs.items() if fnmatch.fnmatchcase(output, pattern)),
        cfg.tolerance,
    )


CHUNK = 1 << 20  # elements per step: ~40 MB of float64 temporaries, whatever the tensor


def compare(ref: np.ndarray, out: np.ndarray, tol: Any, cfg: Any) -> dict[str, Any]:
    """Normalized error |a-b| / (atol + rtol*|ref|), reduced by the spec's statistic.

    Computed in float64 a chunk at a time, so a big output (a 7B model's logits) costs a few
    chunks of temporaries, not five float64 copies of itself (issue 14: peak memory). Only a
    quantile statistic keeps every normalized error (one float64 array) to rank them. A
    reference memory-mapped read-only (parity's saved PyTorch outputs) leaves the resident
    set a chunk at a time as it is read."""
    done_with = _pager(ref)
    ref, out = np.asarray(ref), np.asarray(out)
    if ref.shape != out.shape:
        return {
            "ok": False,
            "error": math.inf,
            "max_abs": math.inf,
            "note": f"shape {list(out.shape)} != reference {list(ref.shape)}",
        }
    if ref.size == 0:
        return {"ok": True, "error": 0.0, "max_abs": 0.0}
    flat_ref, flat_out = ref.ravel(), out.ravel()
    stat = cfg.statistic
    kept = np.empty(ref.size) if stat == "quantile" else None
    top, total, max_abs, finite = 0.0, 0.0, 0.0, True
    for start in range(0, ref.size, CHUNK):
        r = flat_ref[start : start + CHUNK]
        diff = np.abs(np.subtract(r, flat_out[start : start + CHUNK], dtype=np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):  # zero tolerance: exact or inf
            # |ref| in its own dtype, as the whole-array formula always had it
            norm = np.where(diff == 0, 0.0, diff / (tol.atol + tol.rtol * np.abs(r)))
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
    return {"ok": error <= 1.0, "error": error, "max_abs": max_abs if finite else math.inf}


def _pager(ref: Any) -> Any:
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


def compare_outputs(
    want: dict[str, Any], have: dict[str, Any], cfg: Any, default: Any = None
) -> list[dict[str, Any]]:
    """One row per reference output, in its order; `default` replaces cfg.tolerance for
    outputs no per-output key matches (e.g. engine.parity)."""
    rows = []
    for name, ref in want.items():
        if name not in have:
            rows.append(
                {
                    "output": name,
                    "ok": False,
                    "error": float("inf"),
                    "max_abs": float("inf"),
                    "note": "missing from the outputs",
                }
            )
            continue
        tol = tolerance(cfg, name)
        if default is not None and tol is cfg.tolerance:
            tol = default
        rows.append({"output": name, **compare(np.asarray(ref), np.asarray(have[name]), tol, cfg)})
    return rows
