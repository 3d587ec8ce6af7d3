"""kvcheck: cached decoding equals a full recompute, in PyTorch and in the exported graph.

The reference is PyTorch's full pass (no cache, the whole sequence at once) at each
compared length; the candidates are PyTorch's own cached decode and ONNX Runtime's over the
exported graph, each fed only the pasts it produced itself (stages/onnx/kvcache.py). A
left-padded row of a batch must equal the same row alone. A release without a KV cache is
skipped (optional): there is nothing cached to check.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from schemas import ReleaseSpec
from schemas.tasks import TASKS
from stages._runtime import StageContext, StageIO, StageResult, in_child
from stages.onnx import kvcache as kv
from stages.onnx import model as m
from stages.onnx import shapes as sh

NAME = "kvcheck"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export", "parity"),
        upstream=("export/model.onnx",),
        reads_model=True,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    if not TASKS[release.task].kv_cache:
        return StageResult.skipped(
            f"task {release.task} has no KV cache", details={"optional": True}
        )
    plan = kv.make_plan(release.export.dims, release.parity.kv)
    with tempfile.TemporaryDirectory(prefix="shipyard-kvcheck-") as tmp:
        # PyTorch in a child: the full-pass references on disk, its own cached decode judged
        # there; then ONNX Runtime here, judged against the same references
        lay, torch_rows = in_child(_pytorch, ctx, release, plan, Path(tmp))
        onnx_rows = _onnx(ctx, release, plan, lay, Path(tmp))
    failures = kv.reasons("PyTorch", torch_rows) + kv.reasons("ONNX Runtime", onnx_rows)
    rows = torch_rows + onnx_rows
    worst = max((r["error"] for r in rows), default=0.0)
    metrics = {"worst_normalized_error": worst, "comparisons": float(len(rows))}
    details: dict[str, Any] = {
        "plan": {
            "prompt": plan.prompt,
            "steps": plan.steps,
            "past_lengths": list(plan.pasts),
            "prefill_chunk": plan.chunk,
            "padded": plan.padded,
            "full_pass_lengths": plan.lengths(),
        },
        "pytorch": torch_rows,
        "onnx": onnx_rows,
    }
    if failures:
        return StageResult.failed(
            "cached decoding differs from a full recompute",
            failures,
            details=details,
            metrics=metrics,
        )
    padded = (
        "; padded rows not checked (parity.kv.padded off, or export.dims.batch has no 2)"
        if plan.padded is None
        else ", a left-padded row equal to itself alone"
    )
    return StageResult.passed(
        f"cached decode = full recompute in PyTorch and ONNX Runtime: {plan.steps} steps, "
        f"pasts {list(plan.pasts)}{padded} (worst normalized error {worst:.3g} <= 1)",
        details=details,
        metrics=metrics,
    )


def _tokens(release: Any, vocab: int, plan: kv.Plan) -> np.ndarray:
    need = max([*plan.lengths(), *(n for _, n in plan.padded_lengths()), 1])
    return kv.sequences(vocab, need, release.parity.kv.seed)


def _file(into: Path, kind: str, row: int, n: int) -> Path:
    return into / f"{kind}-{row}-{n}.npz"


def _pytorch(
    ctx: StageContext, release: Any, plan: kv.Plan, into: Path
) -> tuple[sh.Layout, list[dict[str, Any]]]:
    """Full passes saved under `into`; PyTorch's cached decode judged against them."""
    net, lay = m.load_with_layout(NAME, ctx.root, release)
    torch_run = m.named_run(m.adapter(release.task, net, lay), lay)

    tokens = _tokens(release, kv.vocab_of(lay), plan)
    with m.weights_paged(net):
        for kind, row, n, ref in kv.references(torch_run, lay, tokens, plan):
            np.savez(_file(into, kind, row, n), **ref)  # type: ignore[arg-type]
        rows = kv.check(torch_run, lay, tokens, plan, _loader(into), *_tol(release))
    return lay, rows


def _onnx(
    ctx: StageContext, release: Any, plan: kv.Plan, lay: sh.Layout, into: Path
) -> list[dict[str, Any]]:
    import onnxruntime as ort

    from stages.onnx import stream

    with stream.external_view(ctx.upstream("export") / "model.onnx") as view:
        session = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
    names = [t.name for t in lay.outputs]

    def onnx_run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, feeds), strict=True))

    tokens = _tokens(release, kv.vocab_of(lay), plan)
    return kv.check(onnx_run, lay, tokens, plan, _loader(into), *_tol(release))


def _loader(into: Path) -> Any:
    def load(kind: str, row: int, n: int) -> dict[str, np.ndarray]:
        with np.load(_file(into, kind, row, n)) as data:
            return {k: data[k] for k in data.files}

    return load


def _tol(release: Any) -> tuple[Any, Any]:
    return release.parity.kv.tolerance, release.parity
