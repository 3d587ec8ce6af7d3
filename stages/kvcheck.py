"""kvcheck: cached decoding equals a full recompute, in PyTorch, in the exported graph and
in the shipped (quantized) graph.

The reference is a full pass (no cache, the whole sequence at once) at each compared
length, each candidate fed only the pasts it produced itself (stages/onnx/kvcache.py):
PyTorch's full pass for PyTorch's own cached decode and for ONNX Runtime's over the export;
the shipped graph's own full pass for its cached decode, since quantization moves its numbers
away from PyTorch's on purpose. The quantize stage's dynamic INT8 takes one activation scale
per token (stages/quant/pertoken.py); its products are checked on the activation before its
rounding (`pertoken.unrounded`: a chunk's and a full pass's float rounding can put one
activation across a rounding step, the quantizer's per-token error, not the cache's). A
graph with onnxruntime's per-call scales (`DynamicQuantizeLinear`, which couples positions)
runs with each scale pinned to a constant (stages/quant/pinned.py). Either is held to the
same float tolerance. A left-padded row of
a batch must equal the same row alone. A release without a KV cache is skipped (optional).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import ReleaseSpec
from schemas.artifacts import QuantInfo
from schemas.details import KvcheckDetails, KvComparison, KvPlan, ShippedKv
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult, in_child, map_big_blocks
from stages.onnx import fused
from stages.onnx import kvcache as kv
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.quant import pertoken
from stages.quant import pinned as pq

if TYPE_CHECKING:
    from schemas.spec.parity import ParityConfig, Tolerance

NAME = "kvcheck"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export", "parity"),
        reads=(QuantInfo,),
        upstream=("export/model.onnx", "quantize/model.onnx"),
        reads_model=True,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    if not TASKS[release.task].kv_cache:
        return StageResult.skipped(f"task {release.task} has no KV cache", optional=True)
    plan = kv.make_plan(release.export.dims, release.parity.kv)
    with tempfile.TemporaryDirectory(prefix="shipyard-kvcheck-") as tmp:
        # PyTorch in a child: the full-pass references on disk, its own cached decode judged
        # there; then ONNX Runtime here, judged against the same references
        lay, torch_rows = in_child(_pytorch, ctx, release, plan, Path(tmp))
        # ONNX Runtime's sessions without an arena, and glibc handing big blocks back:
        # what one pass left in the process stayed under the next (3.77x the checkpoint on a
        # 30-layer model, 2.50x now, the same in child processes, 8-10 s slower: pages
        # mapped afresh for each pass's tensors)
        map_big_blocks()
        onnx_rows = _onnx(ctx, release, plan, lay, Path(tmp))
        shipped_rows, shipped = _shipped(ctx, release, plan, lay, Path(tmp))
    failures = kv.reasons("PyTorch", torch_rows) + kv.reasons("ONNX Runtime", onnx_rows)
    failures += kv.reasons(f"shipped graph ({shipped})", shipped_rows)
    rows = torch_rows + onnx_rows + shipped_rows
    # a present accepted as quantization rounding is judged by its share, not this error
    worst = max((r.error for r in rows if r.rounding is None), default=0.0)
    metrics = {"worst_normalized_error": worst, "comparisons": float(len(rows))}
    details = KvcheckDetails(
        plan=KvPlan(
            prompt=plan.prompt,
            steps=plan.steps,
            past_lengths=list(plan.pasts),
            prefill_chunk=plan.chunk,
            padded=None if plan.padded is None else list(plan.padded),
            full_pass_lengths=plan.lengths(),
        ),
        pytorch=torch_rows,
        onnx=onnx_rows,
        shipped=ShippedKv(graph=shipped, rows=shipped_rows),
    ).dump()
    if failures:
        # the token sequences every comparison decoded: evidence, kept in failed/kvcheck/
        tokens = _tokens(release, kv.vocab_of(lay), plan)
        np.savez(ctx.work / "failed_inputs.npz", input_ids=tokens)
        return StageResult.failed(
            "cached decoding differs from a full recompute",
            failures,
            details=details,
            metrics=metrics,
        )
    padded = (
        "; padded rows not checked (parity.kv.padded off, or export.dims.batch has no 2)"
        if plan.padded is None
        else ", a padded row equal to itself alone"
    )
    return StageResult.passed(
        f"cached decode = full recompute in PyTorch, the export and the shipped graph "
        f"({shipped}): {plan.steps} steps, pasts {list(plan.pasts)}{padded} "
        f"(worst normalized error {worst:.3g} <= 1)",
        details=details,
        metrics=metrics,
    )


def _tokens(release: ReleaseSpec, vocab: int, plan: kv.Plan) -> np.ndarray:
    need = max([*plan.lengths(), *(n for _, n in plan.padded_lengths()), 1])
    return kv.sequences(vocab, need, release.parity.kv.seed)


def _file(into: Path, kind: str, row: int, n: int, who: str = "pytorch") -> Path:
    return into / f"{who}-{kind}-{row}-{n}.npz"


def _pytorch(
    ctx: StageContext, release: ReleaseSpec, plan: kv.Plan, into: Path
) -> tuple[sh.Layout, list[KvComparison]]:
    """Full passes saved under `into`; PyTorch's cached decode judged against them."""
    net, lay = m.load_with_layout(ctx.root, release)
    torch_run = m.named_run(m.adapter(release.task, net, lay), lay)

    tokens = _tokens(release, kv.vocab_of(lay), plan)
    with m.weights_paged(net):
        for kind, row, n, ref in kv.references(torch_run, lay, tokens, plan):
            np.savez(_file(into, kind, row, n), **ref)  # type: ignore[arg-type]
        rows = kv.check(torch_run, lay, tokens, plan, _loader(into), *_tol(release))
    return lay, rows


def _onnx(
    ctx: StageContext, release: ReleaseSpec, plan: kv.Plan, lay: sh.Layout, into: Path
) -> list[KvComparison]:
    onnx_run = _session(ctx.upstream("export") / "model.onnx")
    tokens = _tokens(release, kv.vocab_of(lay), plan)
    return kv.check(onnx_run, lay, tokens, plan, _loader(into), *_tol(release))


def _shipped(
    ctx: StageContext, release: ReleaseSpec, plan: kv.Plan, lay: sh.Layout, into: Path
) -> tuple[list[KvComparison], str]:
    """The shipped graph's cached decode against its own full passes, its dynamic scales
    pinned to ranges that cover every pass of the check (gathered by a first run)."""
    if ctx.read(QuantInfo).method == "none":
        return [], "the export itself: quantization.method none"
    path, tokens = ctx.upstream("quantize") / "model.onnx", _tokens(release, kv.vocab_of(lay), plan)
    pq.refuse_unpinnable(path)
    right = fused.padding_side(path) == "right"  # a fused graph: its padded row pads after
    exposed: list[tuple[str, str, str]] = []
    ranges = pq.Ranges()
    collect = pq.collector(
        _session(path, lambda g: exposed.extend(pq.expose_scales(g))), exposed, ranges
    )
    if exposed:
        kv.exercise(collect, lay, tokens, plan, right)
    # the exposing session goes before the pinned one opens: each holds the weights and an
    # arena grown by every pass (two together were 4.5x the checkpoint on a 30-layer model)
    del collect
    unrounded: list[int] = []

    def view(g: Any) -> None:  # per-call scales pinned; per-token ones checked unrounded
        pq.pin(g, ranges)
        unrounded.append(pertoken.unrounded(g))

    run = _session(path, view)
    for kind, row, n, ref in kv.references(run, lay, tokens, plan):
        np.savez(_file(into, kind, row, n, "shipped"), **ref)  # type: ignore[arg-type]
    # judged with the FP32 (PyTorch) full passes at hand: a present off by quantization
    # rounding only is told from a cache bug (kv.judge)
    refs, fp32 = _loader(into, "shipped"), _loader(into)
    # a present off by rounding only is excused where scales are pinned: their rounding is
    # still there; checked before rounding, nothing is (a 0.1 % off past must fail)
    rows = kv.check(
        run, lay, tokens, plan, refs, *_tol(release), fp32=fp32 if exposed else None, right=right
    )
    rounded = [r.rounding for r in rows if r.rounding is not None]
    note = (
        f"; {len(rounded)} present(s) off by quantization rounding only, at most "
        f"{max(rounded):.3g} of its own error"
        if rounded
        else ""
    )
    how = (
        f"{len(exposed)} dynamic quantization scale(s) pinned"
        if exposed
        else f"activation scales per token: {unrounded[0]} product(s) checked before rounding"
    )
    if right:
        how += "; its padded row right-padded (a fused graph)"
    return rows, how + note


def _session(path: Path, edit: Any = None) -> kv.Run:
    """A Run over every output of the graph at `path` (edited by `edit` when given)."""
    import onnxruntime as ort

    from stages.onnx import stream

    options = ort.SessionOptions()
    options.log_severity_level = 3  # a view leaves initializers unused: onnxruntime warns
    # no arena, no memory patterns: the check runs a few dozen shapes (prefills of
    # hundreds of tokens between one-token decodes), and the arena kept every shape's
    # blocks; on a 30-layer model a second 1024-token prefill of the unrounded view took
    # it from 1.71 to 2.49 GB (1.52 GB without either)
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    with stream.external_view(path, edit) as view:
        session = ort.InferenceSession(str(view), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, feeds), strict=True))

    return run


def _loader(into: Path, who: str = "pytorch") -> Any:
    def load(kind: str, row: int, n: int) -> dict[str, np.ndarray]:
        with np.load(_file(into, kind, row, n, who)) as data:
            return {k: data[k] for k in data.files}

    return load


def _tol(release: ReleaseSpec) -> tuple[Tolerance, ParityConfig]:
    return release.parity.kv.tolerance, release.parity
