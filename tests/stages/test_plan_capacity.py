from __future__ import annotations

import json

import pytest

from schemas import StageError
from schemas.artifacts import CapacityPlan, MemoryParts, ModelInfo
from stages.serving.configs import serving_values
from tests.conftest import Workspace, gpt2_spec, model_info

MIB = 1 << 20


def test_plan_counts_weights_kv_cache_activations_and_overhead(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("plan", gpt2_spec())
    assert report.status.value == "passed", report.reasons
    plan = json.loads((built_gpt2.out("tiny-gpt2", "plan") / "plan.json").read_text())
    # 2 (k, v) x 2 layers x 4 kv heads x 16 head_dim x 4 bytes a token; a sequence holds at
    # most past_sequence.max + 2 = 26 of the 88-token context (what the engine counts)
    assert plan["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 4
    assert plan["cached_tokens"] == 26
    assert plan["kv_bytes_per_sequence"] == 2 * 2 * 4 * 16 * 4 * 26
    # the engine's rows are sized from the KV budget (16 at most), not the export's batch 3;
    # on a device this large the budget holds every row at its longest sequence
    assert plan["batch"] == 16 and plan["context"] == 88
    assert plan["kv_budget_tokens"] == 16 * 26
    extreme = plan["extreme"]
    # the budget's cache, three times for the length of a step (input, ORT's presents, copy)
    assert extreme["kv_cache"] == 3 * plan["kv_bytes_per_token"] * plan["kv_budget_tokens"]
    assert extreme["total"] == sum(v for k, v in extreme.items() if k != "total")
    weights = sum(
        f.stat().st_size for f in built_gpt2.out("tiny-gpt2", "quantize").glob("model.onnx*")
    )
    assert extreme["weights"] == weights  # the quantized model, not the FP32 checkpoint


def test_a_fused_graph_is_planned_for_the_engine_that_writes_its_cache_in_place(
    built_gpt2: Workspace,
) -> None:
    """Issue 40 item 2: the plan reads the shipped graph's mark. Marked right-padded (a
    fused graph, served with its cache in place), its budget is charged twice and one
    sequence beside it; the same graph unmarked, three times. On a device too small for
    every row three times, the in-place plan fits more rows, and the serving config takes
    its rows and budget."""
    import onnx

    from stages.onnx.fused import PADDING_KEY

    shipped = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    original = shipped.read_bytes()
    model = onnx.load(str(shipped), load_external_data=False)
    onnx.helper.set_model_props(model, {PADDING_KEY: "right"})
    roomy = json.loads((built_gpt2.out("tiny-gpt2", "plan") / "plan.json").read_text())
    # a device that leaves room for half of the 16 rows' longest sequences, three times
    ex = roomy["extreme"]
    half = 3 * roomy["kv_bytes_per_token"] * roomy["kv_budget_tokens"] // 2
    device = ex["weights"] + ex["overhead"] + ex["activations"] + half
    spec = gpt2_spec(capacity={"device_memory": device, "headroom": 1.0})
    try:
        traced = built_gpt2.run("plan", spec)
        three = json.loads((built_gpt2.out("tiny-gpt2", "plan") / "plan.json").read_text())
        onnx.save(model, str(shipped))
        fused = built_gpt2.run("plan", spec)
        two = CapacityPlan.model_validate_json(
            (built_gpt2.out("tiny-gpt2", "plan") / "plan.json").read_text()
        )
    finally:
        shipped.write_bytes(original)
        built_gpt2.run("plan", gpt2_spec())  # restore the shared workspace
    assert traced.status.value == fused.status.value == "passed", fused.reasons
    assert (three["kv_copies"], three["kv_prefill_bytes"]) == (3, 0)
    assert (two.kv_copies, two.kv_prefill_bytes) == (2, two.kv_bytes_per_sequence)
    token = two.kv_bytes_per_token
    assert two.extreme.kv_cache == 2 * token * two.kv_budget_tokens + two.kv_prefill_bytes
    # a device too small for 16 rows at their longest three times: in place, the same
    # device holds more of them
    assert three["batch"] < two.batch == two.max_batch_that_fits < 16
    assert two.kv_budget_tokens == two.batch * two.cached_tokens
    assert "held 2 times and a prompt beside it: the fused graph's engine" in fused.summary
    assert "held 3 times: the traced graph's engine" in traced.summary
    assert two.extreme.total <= two.usable_bytes
    info = ModelInfo.model_validate_json(
        (built_gpt2.out("tiny-gpt2", "export") / ModelInfo.FILE).read_text()
    )
    values = serving_values(release(), info, two, "int8")
    assert values.max_batch_size == two.batch
    assert values.kv_cache_budget == two.kv_budget_tokens * token


def test_the_serving_budget_is_what_the_device_leaves_the_engines_copies() -> None:
    """The serving config's KV budget check divides what the device leaves by the plan's
    copies, less the prompt an in-place engine holds beside them: on a device whose budget
    is less than every row at its longest (a 4000-token past), the plan's own budget is
    accepted and one token more refused, for either engine; in place, the budget is larger
    by what the third copy cost, less the prompt."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    info = model_info(
        dims={"batch": {"max": 2}, "sequence": {"max": 64}, "past_sequence": {"max": 4000}},
    )
    cap = CapacityConfig(device_memory="40MiB", runtime_overhead=0, headroom=1.0)
    traced = compute(cap, info, "causal-lm", 0)
    fused = compute(cap, info, "causal-lm", 0, in_place=True)
    token = fused.kv_bytes_per_token
    for plan, copies in ((traced, 3), (fused, 2)):
        assert plan.kv_copies == copies and plan.batch == 16
        assert plan.cached_tokens <= plan.kv_budget_tokens < 16 * plan.cached_tokens
        values = serving_values(release(), info, plan, "int8")
        assert values.kv_cache_budget == plan.kv_budget_tokens * token
        more = values.kv_cache_budget + token
        with pytest.raises(StageError, match=rf"exceeds the device memory .*\(held {copies}x\)"):
            serving_values(release(kv_cache_budget=more), info, plan, "int8")
    room = cap.device_memory - traced.extreme.activations  # no weights, no overhead
    assert traced.kv_budget_tokens == room // (3 * token)
    assert fused.kv_budget_tokens == (room - fused.kv_prefill_bytes) // (2 * token)
    assert fused.kv_prefill_bytes == fused.kv_bytes_per_sequence


def test_plan_that_does_not_fit_fails_with_the_numbers(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(capacity={"device_memory": "400MiB", "max_batch": 4000})
    report = built_gpt2.run("plan", spec)
    assert report.status.value == "failed"
    reason = report.reasons[0]
    assert reason.startswith("the extreme case (4000 engine rows, a KV budget of ")
    assert "0.85 x 0.391 GiB = 0.332 GiB is usable" in reason
    assert "Fix: lower capacity.max_batch to " in reason
    fits = int(reason.rsplit(" ", 1)[1])
    assert 0 < fits < 4000
    built_gpt2.run("plan", gpt2_spec())  # restore the shared workspace


def test_weights_alone_too_big_says_so(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(capacity={"device_memory": "200MiB"})
    report = built_gpt2.run("plan", spec)
    assert "the weights alone do not fit" in report.reasons[0]
    built_gpt2.run("plan", gpt2_spec())


INFO = model_info(
    dims={"batch": {"max": 8}, "sequence": {"max": 64}, "past_sequence": {"max": 64}},
)
PLAN = CapacityPlan(
    batch=8,
    context=128,
    device_bytes=2 * 10**9,
    usable_bytes=10**9,
    kv_dtype="float32",
    kv_bytes_per_sequence=1000,
    extreme=MemoryParts(weights=10**6, kv_cache=0, activations=0, overhead=10**6, total=2 * 10**6),
    max_batch_that_fits=5,
)


def release(**serving: object) -> object:
    from types import SimpleNamespace

    from schemas.release import ServingConfig

    return SimpleNamespace(
        name="r", task="causal-lm", bundle=SimpleNamespace(serving=ServingConfig(**serving))
    )


def test_serving_takes_its_batch_and_kv_budget_from_the_plan() -> None:
    values = serving_values(release(), INFO, PLAN, "int8")
    assert values.max_batch_size == 5  # what fits, below the export's 8
    assert values.kv_cache_budget == 5 * 1000


def test_the_engine_serves_the_rows_the_plan_sized_from_its_kv_budget() -> None:
    """Issue 41 item 5: a generation engine's rows come from the plan (16 here, beyond the
    export's probe batch 8), its KV budget is the plan's (not rows x the full context);
    more rows than fit, or a budget the device cannot hold three times beside them, are
    refused with the numbers; the raw graph's Triton entry stays within the export's 8."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute
    from stages.serving.configs import triton_values

    info = model_info(
        dims={"batch": {"max": 8}, "sequence": {"max": 64}, "past_sequence": {"max": 1000}},
    )
    plan = compute(CapacityConfig(device_memory="24MiB", runtime_overhead=0), info, "causal-lm", 0)
    assert plan.batch == 16 and plan.kv_budget_tokens < 16 * plan.cached_tokens
    values = serving_values(release(), info, plan, "int8")
    assert values.max_batch_size == 16
    assert values.kv_cache_budget == plan.kv_budget_tokens * plan.kv_bytes_per_token
    assert triton_values(info, values)["max_batch_size"] == 8
    # preferred sizes past the raw entry's batch are not rendered there (the engine's are)
    preferred = serving_values(release(preferred_batch_sizes=[2, 16]), info, plan, "int8")
    assert triton_values(info, preferred)["preferred_batch_sizes"] == [2]
    # fewer rows: still the plan's budget, at most every row at its longest sequence
    few = serving_values(release(max_batch_size=2), info, plan, "int8")
    assert few.kv_cache_budget == 2 * plan.cached_tokens * plan.kv_bytes_per_token
    with pytest.raises(StageError, match="max_batch_size = 1000 exceeds the largest batch"):
        serving_values(release(max_batch_size=1000), info, plan, "int8")
    # the plan's budget is all the device leaves: one token more is refused
    token = plan.kv_bytes_per_token
    assert serving_values(release(kv_cache_budget=values.kv_cache_budget), info, plan, "int8")
    with pytest.raises(StageError, match="kv_cache_budget = .* exceeds the device memory"):
        serving_values(release(kv_cache_budget=values.kv_cache_budget + token), info, plan, "int8")


def test_serving_batch_beyond_the_plan_is_refused() -> None:
    with pytest.raises(
        StageError,
        match="bundle.serving.max_batch_size = 6 exceeds the largest "
        "batch the capacity plan fits at 128 tokens = 5",
    ):
        serving_values(release(max_batch_size=6), INFO, PLAN, "int8")


def test_preferred_sizes_beyond_the_batch_the_plan_chose_are_refused_at_serve() -> None:
    """The spec allows preferred sizes up to the export's batch max (8 here); the plan
    serves 5, and the serve stage applies the spec's rule (batch_limits) to that."""
    assert serving_values(release(preferred_batch_sizes=[5]), INFO, PLAN, "int8")
    with pytest.raises(
        StageError, match="preferred_batch_sizes: 6 is beyond the served max_batch_size 5"
    ):
        serving_values(release(preferred_batch_sizes=[6]), INFO, PLAN, "int8")


def test_a_generic_model_whose_weights_exceed_the_device_fits_no_batch() -> None:
    """Nothing grows with the batch (no KV cache, no vocabulary): the plan must still say
    the weights do not fit, not 'lower max_batch to' the batch it already has."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    arch = {"layers": 0, "heads": 0, "kv_heads": 0, "head_dim": 0, "hidden": 0, "vocab": 0}
    info = model_info(task="generic", arch={**arch, "positions": 0, "labels": 2})
    cap = CapacityConfig(device_memory="1GiB", headroom=0.85)
    usable = int((1 << 30) * 0.85)
    overhead = int(cap.runtime_overhead)
    assert compute(cap, info, "generic", usable - overhead).max_batch_that_fits == 8  # at
    assert compute(cap, info, "generic", usable - overhead + 1).max_batch_that_fits == 0


def test_the_plan_is_exact_at_the_headroom_and_counts_the_kv_cache() -> None:
    """compute() at its boundaries, for 8 engine rows: a device of exactly need / headroom
    holds them (the KV budget holds every row at 66 tokens, the longest a sequence can be),
    a byte less does not; the largest batch that fits counts KV cache and activations per
    row (a plan that forgot the KV cache would fit more)."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    weights = 10 * MIB
    probe = compute(CapacityConfig(device_memory="64GiB", max_batch=8), INFO, "causal-lm", weights)
    need, per_seq = probe.extreme.total, probe.kv_bytes_per_sequence
    # k+v x layers x kv_heads x head_dim x f32 x (past_sequence.max + 2 of the 128 context)
    assert per_seq == 2 * 2 * 4 * 16 * 4 * 66
    assert probe.kv_budget_tokens == 8 * 66 and probe.extreme.kv_cache == 3 * 8 * per_seq
    at = compute(
        CapacityConfig(device_memory=2 * need, headroom=0.5, max_batch=8),
        INFO,
        "causal-lm",
        weights,
    )
    assert at.usable_bytes == need and at.extreme.total <= at.usable_bytes
    assert at.max_batch_that_fits == at.batch == 8
    short = compute(
        CapacityConfig(device_memory=2 * need - 2, headroom=0.5, max_batch=8),
        INFO,
        "causal-lm",
        weights,
    )
    assert short.extreme.total > short.usable_bytes
    assert short.max_batch_that_fits == 7
    assert short.extreme.kv_cache == 3 * 8 * per_seq  # what the 8 rows need, not what is left


def test_the_engine_rows_are_sized_from_the_kv_budget_not_the_export_batch() -> None:
    """Issue 41 item 5: the rows the engine decodes together come from what its KV budget
    holds (one sequence at the full context and 256 tokens a row), up to 16, whatever the
    export's probe batch; the budget is what the device leaves, never more than every row
    at its longest sequence; rows that do not fit are refused with the largest that does."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import KV_COPIES, compute

    big = compute(CapacityConfig(device_memory="64GiB"), INFO, "causal-lm", 0)
    assert (big.batch, big.kv_budget_tokens) == (16, 16 * 66)  # the export's batch is 8
    row = big.activation_bytes_per_sequence
    token = KV_COPIES * big.kv_bytes_per_token
    fixed = big.extreme.overhead + big.extreme.activations - 16 * row
    # a device whose budget holds 5 sequences at 66 tokens beside 16 rows' activations:
    # still 16 rows (each may hold 66 / 16 ... when the others are short: the scheduler
    # admits by the padded budget), a budget of 5 x 66 tokens
    cap = CapacityConfig(device_memory=fixed + 16 * row + 5 * 66 * token, headroom=1.0)
    five = compute(cap, INFO, "causal-lm", 0)
    assert five.batch == 5 and five.kv_budget_tokens == 5 * 66  # 256 a row: min(66, 256)
    assert five.extreme.total <= five.usable_bytes
    # a model whose sequences are long: rows need only 256 tokens each at once
    long_info = model_info(
        dims={"batch": {"max": 2}, "sequence": {"max": 64}, "past_sequence": {"max": 4000}},
    )
    base = compute(CapacityConfig(device_memory="64GiB"), long_info, "causal-lm", 0)
    row, token = base.activation_bytes_per_sequence, KV_COPIES * base.kv_bytes_per_token
    fixed = base.extreme.overhead + base.extreme.activations - base.batch * row
    cap = CapacityConfig(device_memory=fixed + 16 * row + 16 * 256 * token, headroom=1.0)
    plan = compute(cap, long_info, "causal-lm", 0)
    assert plan.cached_tokens == 4002 and plan.batch == 16  # not the export's 2
    assert plan.kv_budget_tokens == 16 * 256 and plan.extreme.total == plan.usable_bytes
    # 16 rows x 256 > 4002: the budget is one full sequence and a little more
    assert plan.kv_budget_tokens >= plan.cached_tokens
    less = CapacityConfig(device_memory=fixed + 16 * row + 16 * 256 * token - 1, headroom=1.0)
    assert compute(less, long_info, "causal-lm", 0).batch == 15
    asked = CapacityConfig(
        device_memory=fixed + 16 * row + 16 * 256 * token - 1, headroom=1.0, max_batch=16
    )
    refused = compute(asked, long_info, "causal-lm", 0)
    assert refused.extreme.total > refused.usable_bytes and refused.max_batch_that_fits == 15


def test_activations_follow_the_formula_and_a_task_without_cache_has_none() -> None:
    """The engine: one prefill chunk (sequence.max tokens) plus one decode token a row, each
    token (8 x hidden + vocab + heads x context) x 4 bytes; a one-pass task: each row's
    context x (4 x hidden + vocab) x 4; KV cache only for a task that has one; a model
    without a batch dim plans for batch 1."""
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    cap = CapacityConfig(device_memory="64GiB")
    lm = compute(cap, INFO, "causal-lm", 0)
    per_token = (8 * 64 + 512 + 4 * 128) * 4
    assert lm.extreme.activations == (64 + 16) * per_token  # 16 engine rows
    dims = {"batch": {"max": 4}, "sequence": {"max": 32}}
    enc = compute(cap, model_info(task="text-embedding", dims=dims), "text-embedding", 0)
    assert enc.kv_bytes_per_sequence == 0 and enc.extreme.kv_cache == 0
    assert enc.batch == 4 and enc.context == 32
    assert enc.extreme.activations == 4 * 32 * (4 * 64 + 512) * 4
    single = compute(cap, model_info(dims={"sequence": {"max": 16}}), "causal-lm", 0)
    # no batch axis: the engine runs one row, its budget one sequence
    assert single.batch == single.max_batch_that_fits == 1 and single.kv_budget_tokens == 16


def test_a_context_beyond_the_export_is_refused_with_the_fix() -> None:
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    ok = compute(CapacityConfig(device_memory="64GiB", max_context=128), INFO, "causal-lm", 0)
    assert ok.context == 128  # exactly the export's sequence + past
    with pytest.raises(StageError) as caught:
        compute(CapacityConfig(device_memory="64GiB", max_context=129), INFO, "causal-lm", 0)
    assert caught.value.stage == "plan"
    assert "capacity.max_context 129 exceeds what the export accepts (128 tokens)" in str(
        caught.value
    )
    assert caught.value.hint == "lower capacity.max_context"


def test_when_even_one_sequence_does_not_fit_the_largest_batch_is_zero() -> None:
    from schemas.spec.capacity import CapacityConfig
    from stages.plan import compute

    probe = compute(CapacityConfig(device_memory="64GiB"), INFO, "causal-lm", 0)
    per_token = (8 * 64 + 512 + 4 * 128) * 4
    fixed = probe.extreme.overhead + 64 * per_token  # the prefill chunk: whatever the batch
    per_seq = 3 * probe.kv_bytes_per_sequence + per_token
    cap = CapacityConfig(device_memory=fixed + per_seq - 1, headroom=1.0)
    assert compute(cap, INFO, "causal-lm", 0).max_batch_that_fits == 0
    cap = CapacityConfig(device_memory=fixed + per_seq, headroom=1.0)
    assert compute(cap, INFO, "causal-lm", 0).max_batch_that_fits == 1
