"""plan: weights + KV cache + activations + overhead for the extreme case, vs the device.

The extreme case is the engine that will serve at its limits: every row of the served
batch at the full context, its cache held three times for the length of a step, one prefill
chunk and one decode step of activations, and the weights as shipped (the quantized file:
INT8 parts count as INT8)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from schemas import ReleaseSpec, StageError
from schemas.artifacts import Arch, CapacityPlan, DimSizes, MemoryParts, ModelInfo
from schemas.spec.capacity import KV_BYTES
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult

if TYPE_CHECKING:
    from schemas.spec.capacity import CapacityConfig

NAME = "plan"
GIB = 1 << 30
ACT_BYTES = 4  # activations stay float32 under ORT's dynamic INT8 and weight-only INT4
# the cache fed to a decode step, the presents ONNX Runtime builds from it (in its arena),
# and their copy into the arrays the engine keeps: three copies for the length of a step
# (measured: tests/stages/test_plan_models_the_engine.py, 3.04 copies at batch 8 x 898)
KV_COPIES = 3


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
    plan = compute(release.capacity, info, release.task, weights)
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
    if need > usable:
        fix = (
            f"lower capacity.max_batch to {plan.max_batch_that_fits}"
            if plan.max_batch_that_fits
            else "the weights alone do not fit: quantize further or use a bigger device"
        )
        raise StageError(
            NAME,
            f"the extreme case (batch {plan.batch} x {plan.context} "
            f"tokens) needs {need / GIB:.3g} GiB ({parts} GiB) but "
            f"{release.capacity.headroom:g} x {plan.device_bytes / GIB:.3g} GiB "
            f"= {usable / GIB:.3g} GiB is usable",
            fix,
        )
    return StageResult.passed(
        f"batch {plan.batch} x {plan.context} tokens needs {need / GIB:.3g} of "
        f"{usable / GIB:.3g} GiB usable ({parts} GiB); up to batch "
        f"{plan.max_batch_that_fits} fits",
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


def compute(cap: CapacityConfig, info: Shaped, task: str, weights: int) -> CapacityPlan:
    """The memory plan; linear in batch, so the largest fitting batch is exact."""
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
    fixed_act, act_per_seq = activations(info, task, context)
    usable = int(cap.device_memory * cap.headroom)
    fixed = weights + int(cap.runtime_overhead) + fixed_act
    # the engine's cache at the extreme: every row at the full context (the KV budget it
    # enforces), held KV_COPIES times for the length of a step
    per_seq = KV_COPIES * kv_per_seq + act_per_seq
    # with nothing that grows with the batch (a generic model), any batch fits or none does
    whole = batch if fixed <= usable else 0
    fits = max(0, (usable - fixed) // per_seq) if per_seq else whole
    parts = {
        "weights": weights,
        "kv_cache": KV_COPIES * kv_per_seq * batch,
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
        kv_dtype=cap.kv_dtype,
    )
