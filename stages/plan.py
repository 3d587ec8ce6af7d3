"""plan: weights + KV cache + activations + overhead for the extreme case, vs the device.

The extreme case is the engine that will serve at its limits: a KV-cache model's engine with
its KV budget full (padded tokens across its rows, held as many times as that engine holds
it: three for the length of a step on the traced graph; on a fused graph, whose cache is
written in place, twice while its buffers are remade and one prompt's chunk beside them),
one prefill chunk and a decode step's activations for every row, and the weights as
shipped (the quantized file: INT8 parts count as INT8). The rows and the budget are sized
together (`_engine_rows`): the budget is what the device leaves, so the engine's rows are
not limited to the sequences that fit at the full context all at once. A one-pass model's
extreme is every row of the batch at its full sequence."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from schemas import ReleaseSpec, StageError
from schemas.artifacts import (
    KV_COPIES,
    KV_COPIES_IN_PLACE,
    Arch,
    CapacityPlan,
    DimSizes,
    MemoryParts,
    ModelInfo,
)
from schemas.spec.capacity import KV_BYTES
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult

if TYPE_CHECKING:
    from schemas.spec.capacity import CapacityConfig

NAME = "plan"
GIB = 1 << 30
ACT_BYTES = 4  # activations stay float32 under ORT's dynamic INT8 and weight-only INT4
# the rows the generation engine decodes together by default (vLLM's max_num_seqs), when its
# KV budget holds each of them ROW_TOKENS at once beside one sequence at the full context
ROWS = 16
ROW_TOKENS = 256


def activations(info: Shaped, task: str, context: int) -> tuple[int, int]:
    """Activation bytes at the extreme: (fixed, per sequence).

    A KV-cache task is served by the generation engine, which prefills at most one chunk
    of `sequence.max` tokens an iteration (across prompts) and decodes one token a row: one
    chunk's activations, plus each row's decode step. Per token: a few hidden-size buffers
    and the MLP's (8 x hidden), the logits over the vocabulary, and one layer's attention
    scores over the context. A one-pass task runs each row's whole sequence at once."""
    arch = info.arch
    per_token = (8 * arch.hidden + arch.vocab + arch.heads * context) * ACT_BYTES
    if TASKS[task].kv_cache:
        chunk = min(info.dims["sequence"].max, context) if "sequence" in info.dims else context
        return chunk * per_token, per_token
    # one pass over the whole sequence: hidden buffers and the logits (no attention scores
    # counted here, as before: encoders' sequences are short)
    return 0, context * (4 * arch.hidden + arch.vocab) * ACT_BYTES


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("task", "export", "capacity"),
        reads=(ModelInfo,),
        upstream=("quantize/model.onnx",),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    info, quantized = ctx.read(ModelInfo), ctx.upstream("quantize")
    weights = sum(f.stat().st_size for f in quantized.glob("model.onnx*"))
    fused = TASKS[release.task].kv_cache and in_place(quantized / "model.onnx")
    plan = compute(release.capacity, info, release.task, weights, in_place=fused)
    ctx.write(plan)
    need, usable, ex = plan.extreme.total, plan.usable_bytes, plan.extreme
    parts = ", ".join(
        f"{k} {v / GIB:.3g}"
        for k, v in (
            ("weights", ex.weights),
            ("kv_cache", ex.kv_cache),
            ("activations", ex.activations),
            ("overhead", ex.overhead),
        )
    )
    case = (
        f"batch {plan.batch} x {plan.context} tokens"
        if not plan.kv_budget_tokens
        else f"{plan.batch} engine row{'s' * (plan.batch != 1)}, a KV budget of "
        f"{plan.kv_budget_tokens} tokens ({plan.kv_budget_tokens / max(plan.cached_tokens, 1):.3g}"
        f" x the longest sequence, {plan.cached_tokens}, held {plan.kv_copies} times"
        + (" and a prompt beside it: the fused" if plan.kv_prefill_bytes else ": the traced")
        + " graph's engine)"
    )
    if need > usable:
        if not plan.max_batch_that_fits and ex.weights + ex.overhead < usable and ex.kv_cache:
            fix = (
                "even one sequence at the full context does not fit beside the weights: lower "
                "capacity.max_context, quantize further or use a bigger device"
            )
        elif plan.max_batch_that_fits:
            fix = f"lower capacity.max_batch to {plan.max_batch_that_fits}"
        else:
            fix = "the weights alone do not fit: quantize further or use a bigger device"
        raise StageError(
            NAME,
            f"the extreme case ({case}) needs {need / GIB:.3g} GiB ({parts} GiB) but "
            f"{release.capacity.headroom:g} x {plan.device_bytes / GIB:.3g} GiB "
            f"= {usable / GIB:.3g} GiB is usable",
            fix,
        )
    return StageResult.passed(
        f"{case} needs {need / GIB:.3g} of {usable / GIB:.3g} GiB usable ({parts} GiB); up to "
        f"{'rows' if plan.kv_budget_tokens else 'batch'} {plan.max_batch_that_fits} fit",
        details=plan.model_dump(),
        metrics={
            "extreme_bytes": need,
            "usable_bytes": usable,
            "max_batch_that_fits": plan.max_batch_that_fits,
        },
    )


class Shaped(Protocol):
    """What the plan reads of a model: its dims and architecture (a ModelInfo after export;
    `shipyard init` gives the same from the checkpoint's config, before any export)."""

    @property
    def dims(self) -> dict[str, DimSizes]: ...

    @property
    def arch(self) -> Arch: ...


def in_place(shipped: Path) -> bool:
    """Whether the engine serving `shipped` writes its cache in place (kv.Slots): a fused
    graph, marked right-padded (stages/onnx/fused.py); the traced graph's engine copies
    every step's presents back (kv.Batch)."""
    from stages.onnx.fused import padding_side

    return padding_side(shipped) == "right"


def compute(
    cap: CapacityConfig, info: Shaped, task: str, weights: int, *, in_place: bool = False
) -> CapacityPlan:
    """The memory plan; linear in batch, so the largest fitting batch is exact.

    `in_place`: the serving engine writes its cache in place (a fused graph): it holds its
    KV budget twice (KV_COPIES_IN_PLACE, while its buffers are remade) and one sequence at
    the full context beside it (a prompt's chunk: the past fed and the presents grown from
    it); else three times (KV_COPIES), which covers its prefills. Two budgets and a
    sequence never exceed three budgets (a budget holds a sequence at the full context), so
    a plan for the traced engine holds the fused one: `shipyard init` and `validate` plan
    that way, before quantize chose the graph (one sequence costs the same three times in
    both)."""
    dims, arch = info.dims, info.arch
    export_context = sum(dims[d].max for d in ("sequence", "past_sequence") if d in dims)
    context = cap.max_context or export_context
    batch = cap.max_batch or (dims["batch"].max if "batch" in dims else 1)
    if export_context and context > export_context:
        raise StageError(
            NAME,
            f"capacity.max_context {context} exceeds what the export "
            f"accepts ({export_context} tokens)",
            "lower capacity.max_context",
        )
    unsized = [k for k in ("layers", "kv_heads", "head_dim") if not getattr(arch, k)]
    if TASKS[task].kv_cache and unsized:
        raise StageError(
            NAME,
            f"cannot size the KV cache: the export records {', '.join(unsized)} = 0 (neither "
            "the model's config nor its past_key_values inputs give them)",
            "declare each past_key_values.<i>.key/value input of export.inputs with fixed "
            "sizes, [batch, <kv_heads>, past_sequence, <head_dim>], or use a Hugging Face folder",
        )
    kv = TASKS[task].kv_cache
    per_token = (
        2 * arch.layers * arch.kv_heads * arch.head_dim * KV_BYTES[cap.kv_dtype] if kv else 0
    )
    # the engine counts a sequence's prompt + max_tokens against its KV budget, and refuses
    # one whose last step would read a past beyond past_sequence.max: at most that + 2
    cached = (
        min(context, dims["past_sequence"].max + 2) if kv and "past_sequence" in dims else context
    )
    kv_per_seq = per_token * cached
    copies = KV_COPIES_IN_PLACE if in_place else KV_COPIES
    prefill = kv_per_seq if in_place and kv else 0
    fixed_act, act_per_seq = activations(info, task, context)
    usable = int(cap.device_memory * cap.headroom)
    fixed = weights + int(cap.runtime_overhead) + fixed_act + prefill
    if kv and per_token:
        # a graph without a batch axis runs one row
        asked = cap.max_batch or (None if "batch" in dims else 1)
        room, per_kv = usable - fixed, copies * per_token
        batch, fits, tokens = _engine_rows(asked, room, act_per_seq, per_kv, cached)
        fits = fits if "batch" in dims else min(fits, 1)
        kv_bytes = copies * per_token * tokens + prefill
    else:
        batch = cap.max_batch or (dims["batch"].max if "batch" in dims else 1)
        # every row at the full context, held `copies` times
        per_seq = copies * kv_per_seq + act_per_seq
        # with nothing that grows with the batch (a generic model), any batch fits or none
        whole = batch if fixed <= usable else 0
        fits = max(0, (usable - fixed) // per_seq) if per_seq else whole
        tokens = batch * cached if kv else 0
        kv_bytes = copies * kv_per_seq * batch + prefill
    parts = {
        "weights": weights,
        "kv_cache": kv_bytes,
        "activations": fixed_act + act_per_seq * batch,
        "overhead": int(cap.runtime_overhead),
    }
    return CapacityPlan(
        batch=batch,
        context=context,
        device_bytes=int(cap.device_memory),
        usable_bytes=usable,
        extreme=MemoryParts(**parts, total=sum(parts.values())),
        kv_bytes_per_sequence=kv_per_seq,
        kv_bytes_per_token=per_token,
        cached_tokens=cached if kv else 0,
        max_batch_that_fits=int(fits),
        kv_budget_tokens=tokens,
        activation_bytes_per_sequence=act_per_seq,
        kv_dtype=cap.kv_dtype,
        kv_copies=copies,
        kv_prefill_bytes=prefill,
    )


def _engine_rows(
    asked: int | None, room: int, per_row: int, per_token: int, cached: int
) -> tuple[int, int, int]:
    """The generation engine's rows, the most that fit, and its KV budget in tokens.

    The engine holds its cache within a budget of padded tokens (rows x the longest
    sequence), not one full-context cache per row: a request is admitted only when the
    padded cache with it stays within the budget. So the rows it decodes together are sized
    from that budget, as vLLM's max_num_seqs is from its KV blocks: `room` (the device
    after weights, overhead and the prefill chunk) pays each row's decode activations, and
    the rest is the budget (`per_token`: one token's cache, held as many times as the engine
    holds it). Rows fit while the budget still holds one sequence at the full context
    (`cached` tokens) and ROW_TOKENS for each row at once. The default is ROWS of them at
    most; the budget is what is left, but never more than every row at the full context.
    When the asked rows do not fit, the budget returned is what they need (the plan then
    fails with the numbers)."""
    least = min(cached, ROW_TOKENS)
    per_row = max(1, per_row)
    fits = max(
        0, min((room - per_token * cached) // per_row, room // (per_row + per_token * least))
    )
    rows = asked or max(1, min(ROWS, fits))
    left = max(0, (room - rows * per_row) // per_token)
    need = max(cached, rows * least)
    tokens = min(left, rows * cached) if left >= need else need
    return rows, int(fits), int(tokens)
