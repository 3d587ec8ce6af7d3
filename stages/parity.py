"""parity: PyTorch vs ONNX Runtime at every spec shape; layer by layer to find divergence."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import ReleaseSpec
from schemas.details import Compared, ParityDetails, ShapeComparison
from stages._contract import StageContext, StageIO, StageResult, in_child
from stages.onnx import kvcache as kv
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.onnx.compare import compare, placed, tolerance
from stages.onnx.layerwise import layerwise

if TYPE_CHECKING:
    from schemas.spec.parity import ParityConfig

NAME = "parity"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export", "parity"),
        upstream=("export/model.onnx",),
        reads_model=True,
    )


MAX_KEPT = 4  # failing inputs kept as evidence


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    cfg = release.parity
    path = ctx.upstream("export") / "model.onnx"
    shapes = _shapes(release)
    with tempfile.TemporaryDirectory(prefix="shipyard-parity-") as tmp:
        # PyTorch first, in a child process, its outputs on disk; then ONNX Runtime here, in
        # a process that never imported torch: the two copies of the weights are never in
        # memory together, nor torch with ONNX Runtime (issue 14: peak memory)
        lay, shapes = in_child(_reference_outputs, ctx, release, shapes, Path(tmp))
        rows, failures = _compare_all(ctx, cfg, path, lay, shapes, Path(tmp))
        wanted = failures or cfg.layerwise == "always"
        # the layerwise view runs on the first failure's inputs, else on the first shape's
        feeds = (failures[0][1] if failures else _feeds(Path(tmp), 0)) if wanted else None
    if feeds is None:
        details = ParityDetails(comparisons=rows)  # no layerwise key: not run
    else:
        net, lay = m.load_with_layout(ctx.root, release)
        flat = m.adapter(release.task, net, lay)
        details = ParityDetails(comparisons=rows, layerwise=layerwise(flat, lay, path, feeds, cfg))
    worst = max(r.error for r in rows)
    metrics = {"worst_normalized_error": worst, "max_abs_diff": max(r.max_abs for r in rows)}
    if failures:
        # the inputs each failure was fed, as .npz beside the report (the runner keeps a
        # failed run's files in build/<release>/failed/parity/, outside DVC): a failure can
        # be replayed in ONNX Runtime and PyTorch without rerunning the stage
        for i, (_, failed_feeds) in enumerate(failures[:MAX_KEPT]):
            arrays: dict[str, Any] = dict(failed_feeds)
            np.savez(ctx.work / f"failed_inputs_{i}.npz", **arrays)
        return StageResult.failed(
            f"{len(failures)} output(s) out of tolerance",
            _reasons(failures, details),
            details=details.dump(),
            metrics=metrics,
        )
    return StageResult.passed(
        f"{len(rows)} comparisons at {len(shapes)} shapes within tolerance "
        f"({cfg.statistic} normalized error {worst:.3g} <= 1)",
        details=details.dump(),
        metrics=metrics,
    )


def _reference_outputs(
    ctx: StageContext, release: ReleaseSpec, shapes: list[tuple[str, dict[str, int]]], into: Path
) -> tuple[sh.Layout, list[tuple[str, dict[str, int]]]]:
    """PyTorch's outputs at every shape, saved as .npy under `into` with the inputs both
    sides are fed (run in a child), and the shapes run. A KV-cache graph is fed the past
    the model produces from seeded tokens, never random-normal tensors
    (stages/onnx/kvcache.py). The corners run at a batch whose activations fit the probe
    budget (`sh.within_budget`); shapes the spec names in parity.shapes run as named."""
    net, lay = m.load_with_layout(ctx.root, release)
    flat = m.adapter(release.task, net, lay)
    if not release.parity.shapes:
        config = m.model_config(release.model, ctx.root)
        shapes = _fitted(release, m.arch_of(config, lay), _bytes(net), lay, shapes)
    torch_run = m.named_run(flat, lay)
    chunk = release.export.dims["sequence"].max if "sequence" in release.export.dims else 1

    with (
        ctx.progress("running the PyTorch reference", len(shapes)) as advance,
        m.weights_paged(net),
    ):
        for i, (_, sizes) in enumerate(shapes):
            feeds = sh.make_inputs(lay, sizes, seed=release.parity.seed)
            feeds = kv.with_produced_past(torch_run, lay, feeds, chunk, release.parity.seed)
            np.savez(into / f"{i}-feeds.npz", **feeds)  # type: ignore[arg-type]
            for j, out in enumerate(m.torch_outputs(flat, lay, feeds)):
                np.save(into / f"{i}-{j}.npy", out)
            advance()
    return lay, shapes


def _fitted(
    release: ReleaseSpec,
    arch: dict[str, int],
    weight_bytes: int,
    lay: sh.Layout,
    shapes: list[tuple[str, dict[str, int]]],
) -> list[tuple[str, dict[str, int]]]:
    """Each corner with its batch lowered until one pass's activations fit the probe
    budget, its label saying so; a corner that becomes another is run once."""
    dims = release.export.dims
    budget = sh.probe_budget(weight_bytes)

    def cost(s: Mapping[str, int]) -> int:
        return sh.run_bytes(lay, s, arch["hidden"], arch["heads"])

    out: dict[str, tuple[str, dict[str, int]]] = {}
    for label, sizes in shapes:
        fitted = sh.within_budget(sizes, dims, cost, budget)
        if fitted != sizes:
            label = f"{label}, batch {fitted['batch']} (probe memory)"
        out.setdefault(str(fitted), (label, fitted))
    return list(out.values())


def _bytes(net: Any) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters())


def _compare_all(
    ctx: StageContext,
    cfg: ParityConfig,
    path: Path,
    lay: sh.Layout,
    shapes: list[tuple[str, dict[str, int]]],
    saved: Path,
) -> tuple[list[ShapeComparison], list[tuple[ShapeComparison, dict[str, np.ndarray]]]]:
    """ONNX Runtime at every shape against the saved reference (read memory-mapped). The
    session reads the weights from the file (`stream.external_view`), not from a parse."""
    import onnxruntime as ort

    from stages.onnx import stream

    with stream.external_view(path) as view:
        session = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
    rows: list[ShapeComparison] = []
    failures: list[tuple[ShapeComparison, dict[str, np.ndarray]]] = []
    with ctx.progress("comparing outputs", len(shapes)) as advance:
        for i, (label, sizes) in enumerate(shapes):
            feeds = _feeds(saved, i)
            got: list[Any] = session.run([t.name for t in lay.outputs], feeds)
            done: dict[int, ShapeComparison] = {}
            # smallest first, each freed once compared: the biggest (a causal LM's logits)
            # is compared with the others gone (rows stay in output order)
            for j in sorted(range(len(got)), key=lambda k: got[k].nbytes):
                ref = np.load(saved / f"{i}-{j}.npy", mmap_mode="r")
                t = lay.outputs[j]
                compared = compare(ref, got[j], tolerance(cfg, t.name), cfg)
                done[j] = placed(ShapeComparison, compared, shape=label, sizes=sizes, output=t.name)
                got[j] = None
                del ref  # unmaps the reference's pages
            for j in range(len(done)):
                rows.append(done[j])
                if not done[j].ok:
                    failures.append((done[j], feeds))
            advance()
    return rows, failures


def _feeds(saved: Path, i: int) -> dict[str, np.ndarray]:
    """The inputs the reference ran shape `i` with."""
    with np.load(saved / f"{i}-feeds.npz") as data:
        return {k: data[k] for k in data.files}


def _shapes(release: ReleaseSpec) -> list[tuple[str, dict[str, int]]]:
    dims = release.export.dims
    if release.parity.shapes:
        return [
            (f"shape[{i}]", {**sh.trace_sizes(dims), **s})
            for i, s in enumerate(release.parity.shapes)
        ]
    shapes = sh.corners(dims, odd_avoid={n: d.opt for n, d in dims.items()})
    return list({str(s): (k, s) for k, s in shapes.items()}.values())


def _reasons(failures: list[tuple[ShapeComparison, Any]], details: ParityDetails) -> list[str]:
    reasons = [f"{r.output} at {r.shape} {r.sizes}: {cfg_stat(r)}" for r, _ in failures]
    first = details.layerwise.first_divergent if details.layerwise else None
    if first:
        reasons.append(
            f"first diverging layer: {first.module} (ONNX tensor {first.tensor},"
            f" normalized error {first.error:.3g}, max |diff| {first.max_abs:.3g})"
        )
    else:
        reasons.append(
            "layer-by-layer comparison found no diverging module output; the "
            "difference enters outside module boundaries"
        )
    return reasons


def cfg_stat(row: Compared) -> str:
    return row.note or f"normalized error {row.error:.3g} > 1 (max |diff| {row.max_abs:.3g})"
