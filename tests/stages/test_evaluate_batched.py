"""evaluate's passes in right-padded batches, each session's group before the other's turn
(issue 40: evaluate <= 3 FP32 passes). What must not move: every metric, to the bit, and
which sample a failure names. What must refuse to batch: a graph whose padding reaches a
row's logits, and a shipped graph whose rows depend on each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from schemas.artifacts import ModelInfo
from stages import evaluate
from stages.onnx import kvcache as kv
from stages.onnx import model as m
from stages.quant import accuracy as acc
from stages.quant import calibration as calib
from tests.conftest import Workspace, gpt2_spec


def _logits(rng: np.random.Generator, n: int, vocab: int = 97) -> np.ndarray:
    ref = rng.normal(size=(1, n, vocab)).astype(np.float32)
    ref[..., 3] += 40  # an outlier logit, as a real model's favourite tokens
    return ref


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_the_metrics_are_the_same_bits_in_any_order(task: str) -> None:
    rng = np.random.default_rng(0)
    samples = []
    for n in (3, 70, 130, 1, 64, 65, 9):
        ref = _logits(rng, n)
        got = ref + rng.normal(scale=0.3, size=ref.shape).astype(np.float32)
        samples.append((ref, got, {"input_ids": rng.integers(0, 97, size=(1, n))}))
    in_order = acc.Agreement(task)
    for ref, got, feeds in samples:
        in_order.add(ref, got, feeds)
    shuffled = acc.Agreement(task)
    for i in rng.permutation(len(samples)):
        ref, got, feeds = samples[i]
        shuffled.add(ref, got, feeds, index=int(i))
    assert shuffled.result() == in_order.result()  # every float, to the bit
    assert shuffled.per_sample == in_order.per_sample  # a failure names the same samples
    with pytest.raises(ValueError, match="sample 2 was added twice"):
        shuffled.add(samples[2][0], samples[2][1], samples[2][2], index=2)
    # on two threads, each with its own room, in two batches: the same bits again
    threaded = acc.Agreement(task)
    order = [int(i) for i in rng.permutation(len(samples))]
    threaded.add_many((*samples[i], i) for i in order[:4])
    threaded.add_many((*samples[i], i) for i in order[4:])
    with pytest.raises(ValueError, match="sample 5 was added twice"):
        threaded.add_many([(*samples[5], 5)])
    assert threaded.result() == in_order.result()
    assert threaded.per_sample == in_order.per_sample


def _eval_samples(ws: Workspace) -> tuple[list[dict[str, np.ndarray]], Any]:
    release = ws.spec(gpt2_spec())
    out = ws.out("tiny-gpt2", "export")
    info = ModelInfo.model_validate_json((out / ModelInfo.FILE).read_text())
    lay = m.layout_from_info(info)
    data = release.evaluation.dataset
    rows = calib.read_rows(ws.root, data, lay, 128, info.arch.vocab, "evaluation.dataset")
    return [calib.to_feeds("causal-lm", lay, r) for r in rows[: data.samples]], lay


def _session(path: Path) -> Any:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("stage", ["export", "quantize"])
def test_a_right_padded_row_is_its_sample_alone_to_the_bit(
    built_gpt2: Workspace, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FP32 export and the shipped per-token INT8 graph, groups sorted by length and
    bounded by the logits they hold (a small bound here: several groups, much padding)."""
    samples, _ = _eval_samples(built_gpt2)
    session = _session(built_gpt2.out("tiny-gpt2", stage) / "model.onnx")
    vocab = session.get_outputs()[0].shape[-1]
    monkeypatch.setattr(acc, "LOGITS_BYTES", vocab * 4 * 40)
    groups, padded = acc.pass_groups(session, samples)
    assert padded and len(groups) > 2
    assert sorted(i for g in groups for i in g) == list(range(len(samples)))
    lengths = [samples[i]["input_ids"].shape[1] for g in groups for i in g]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1
    for group in groups:
        width = max(samples[i]["input_ids"].shape[1] for i in group)
        assert len(group) == 1 or len(group) * width * vocab * 4 <= acc.LOGITS_BYTES
        many = session.run(["logits"], acc.right_padded([samples[i] for i in group]))[0]
        for row, i in enumerate(group):
            n = samples[i]["input_ids"].shape[1]
            alone = session.run(["logits"], samples[i])[0]
            assert np.array_equal(many[row : row + 1, :n], alone), (group, i)
    assert acc.padding_is_inert(session, samples)
    unpadded, flag = acc.pass_groups(session, samples, pad=False)
    assert not flag and [i for g in unpadded for i in g] == list(range(len(samples)))


def test_evaluate_batched_gives_the_metrics_of_one_sample_a_run(
    built_gpt2: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    real = acc.pass_groups

    def one_a_run(session: Any, samples: Any, pad: bool = True) -> Any:
        groups, padded = real(session, samples, pad)
        calls.append(padded)
        return [[i] for i in range(len(samples))], False

    monkeypatch.setattr(acc, "pass_groups", one_a_run)
    monkeypatch.setattr(acc, "teacher_forced_together", acc.greedy_agreement)  # a text a run
    alone = built_gpt2.run("evaluate", _with_greedy(gpt2_spec()))
    monkeypatch.undo()
    again = built_gpt2.run("evaluate", _with_greedy(gpt2_spec()))
    assert calls == [True]  # the batched run's grouping was padded
    assert alone.status.value == again.status.value == "passed", (alone.reasons, again.reasons)
    assert again.metrics == alone.metrics  # every float, to the bit
    assert "greedy_agreement" in again.metrics


def _with_greedy(spec: dict[str, Any]) -> dict[str, Any]:
    budget = {**(spec["quantization"].get("budget") or {}), "greedy_agreement_min": 0.5}
    return {**spec, "quantization": {**spec["quantization"], "budget": budget}}


def test_teacher_forcing_in_batches_counts_as_one_text_a_run(built_gpt2: Workspace) -> None:
    samples, _ = _eval_samples(built_gpt2)
    fp32 = _session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    shipped = _session(built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx")
    generated = acc.greedy_continuations(fp32, samples)
    assert len({f["input_ids"].shape[1] for f, _ in generated}) > 1  # texts of several lengths
    assert acc.teacher_forced_together(shipped, generated) == acc.greedy_agreement(
        shipped, generated
    )
    # a shuffled text agrees less: the count reads each row's own tokens
    rng = np.random.default_rng(1)
    broken = [
        ({**f, "input_ids": rng.permutation(f["input_ids"][0])[None]}, p) for f, p in generated
    ]
    assert acc.teacher_forced_together(shipped, broken) < acc.teacher_forced_together(
        shipped, generated
    )


def _peeking_graph(path: Path, vocab: int = 11) -> Path:
    """A KV-cache-shaped graph that is not causal: each position's logits add the sum of
    every token's embedding in its row (later tokens included), so right padding moves
    them."""
    emb = helper.make_tensor(
        "emb", TensorProto.FLOAT, [vocab, vocab], np.eye(vocab, dtype=np.float32).ravel()
    )
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axis1"], ["total"], keepdims=1),
        helper.make_node("Add", ["e", "total"], ["logits"]),
        helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]),
        helper.make_node("Cast", ["attention_mask"], ["unused"], to=TensorProto.FLOAT),
    ]
    axis = helper.make_tensor("axis1", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        nodes,
        "peek",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "all"]),
            helper.make_tensor_value_info(
                "past_key_values.0.key", TensorProto.FLOAT, ["batch", 1, "past", 2]
            ),
        ],
        [
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["batch", "sequence", vocab]
            ),
            helper.make_tensor_value_info(
                "present.0.key", TensorProto.FLOAT, ["batch", 1, "past", 2]
            ),
            helper.make_tensor_value_info("unused", TensorProto.FLOAT, ["batch", "all"]),
        ],
        initializer=[emb, axis],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _peek_samples() -> list[dict[str, np.ndarray]]:
    """Samples of four lengths for the peeking graph: ids, a mask, its empty cache."""
    rng = np.random.default_rng(0)
    samples = []
    for n in (2, 6, 3, 9):
        ids = rng.integers(1, 11, size=(1, n))
        past = np.zeros((1, 1, 0, 2), np.float32)
        samples.append(
            {"input_ids": ids, "attention_mask": np.ones_like(ids), "past_key_values.0.key": past}
        )
    return samples


def test_a_graph_whose_padding_reaches_a_row_is_not_batched(tmp_path: Path) -> None:
    session = _session(_peeking_graph(tmp_path / "peek.onnx"))
    samples = _peek_samples()
    groups, padded = acc.pass_groups(session, samples)
    assert padded and len(groups) == 1  # shaped like a causal model's cache graph
    assert not acc.padding_is_inert(session, samples)


def test_a_graph_without_a_cache_runs_its_groups_in_the_datasets_order(tmp_path: Path) -> None:
    """An encoder's samples are never padded together here: consecutive groups, one sample
    a run, the outputs a group holds bounded."""
    path = _peeking_graph(tmp_path / "peek.onnx")
    model = onnx.load(str(path))
    del model.graph.input[2]
    del model.graph.output[1]
    del model.graph.node[3]
    onnx.save(model, str(tmp_path / "encoder.onnx"))
    session = _session(tmp_path / "encoder.onnx")
    samples = [{"input_ids": np.ones((1, n), np.int64)} for n in (5, 1, 7, 2, 2)]
    groups, padded = acc.pass_groups(session, samples)
    assert not padded and groups == [[0, 1, 2, 3, 4]]
    acc_bytes = acc.LOGITS_BYTES
    try:
        acc.LOGITS_BYTES = 11 * 4 * 8  # eight positions' logits a group
        assert acc.pass_groups(session, samples)[0] == [[0, 1], [2], [3, 4]]
        # samples without token ids (a generic graph's inputs): one a group, their size unknown
        generic = [{"x": np.ones((1, 4), np.float32)} for _ in range(3)]
        assert acc.pass_groups(session, generic) == ([[0], [1], [2]], False)
    finally:
        acc.LOGITS_BYTES = acc_bytes


def test_evaluate_keeps_a_shipped_graph_with_per_call_scales_one_sample_a_run(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    """compare() with a shipped graph whose rows move each other (per-call INT8 scales):
    the FP32 group runs padded, the shipped graph one sample a run, and the metrics are
    those of one sample a run for both."""
    from onnxruntime.quantization import quantize_dynamic

    samples, _ = _eval_samples(built_gpt2)
    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    per_call = tmp_path / "per_call.onnx"
    quantize_dynamic(export, per_call, op_types_to_quantize=["MatMul"])
    assert not evaluate.rows_independent(per_call)
    fp32, shipped = _session(export), _session(per_call)
    groups, padded = acc.pass_groups(fp32, samples)
    assert padded and any(len(g) > 1 for g in groups)
    batched = acc.Agreement("causal-lm")
    for group in groups:
        for ref, got, feeds, i in evaluate.compare(
            group, padded, samples, fp32, shipped, "logits", False
        ):
            batched.add(ref, got, feeds, i)
    alone = acc.Agreement("causal-lm")
    for feeds in samples:
        alone.add(fp32.run(["logits"], feeds)[0], shipped.run(["logits"], feeds)[0], feeds)
    assert batched.result() == alone.result()


@pytest.mark.parametrize("prefill_rows", [None, 1, 3])
def test_one_fp32_decode_gives_the_contracts_text_and_the_decode_metrics_reference(
    built_gpt2: Workspace, prefill_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reference_generations decodes the contract's prompts (32 tokens) and the decode
    metrics' (8 here) as one batch, the prefill in runs of a few rows: the same text as
    acc.greedy_continuations, and the same tokens as decoding the decode prompts alone."""
    from schemas.spec.evaluation import DecodeConfig

    samples, lay = _eval_samples(built_gpt2)
    fp32 = _session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    assert evaluate.rows_independent(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    names = [t.name for t in lay.outputs]
    run = lambda feeds: fp32.run(names, feeds)  # noqa: E731
    cfg = DecodeConfig(prompts=5, prompt_tokens=8, tokens=20)  # more tokens than the text's
    if prefill_rows is not None:  # the logits bound that sets the prefill's rows
        width, vocab = acc.GREEDY_PROMPT_TOKENS, fp32.get_outputs()[0].shape[-1]
        monkeypatch.setattr(acc, "LOGITS_BYTES", prefill_rows * width * vocab * 4)
    generated, wanted = evaluate.reference_generations(run, lay, samples, cfg, texts=True)
    expected = acc.greedy_continuations(fp32, samples)
    assert generated is not None and len(generated) == len(expected) == acc.GREEDY_PROMPTS
    for (have, at), (want, want_at) in zip(generated, expected, strict=True):
        assert at == want_at
        assert set(have) == set(want)
        assert all(np.array_equal(have[k], want[k]) for k in want)
    prompts = [s["input_ids"][0, :8] for s in samples[:5]]
    assert wanted == evaluate.greedy(run, lay, prompts, 20)
    assert {len(p) for p in prompts} == {8}
    # without the contract's text: the decode metrics' tokens alone, the same
    none, alone = evaluate.reference_generations(run, lay, samples, cfg, texts=False)
    assert none is None and alone == wanted


def test_fp32_text_is_each_prompts_own_whatever_the_batch(
    built_gpt2: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acc.greedy_continuations decodes every prompt in one batch (its prefill in runs of
    a few rows here): each text is the one its prompt makes alone."""
    samples, lay = _eval_samples(built_gpt2)
    fp32 = _session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    vocab = fp32.get_outputs()[0].shape[-1]
    monkeypatch.setattr(acc, "LOGITS_BYTES", 3 * acc.GREEDY_PROMPT_TOKENS * vocab * 4)
    together = acc.greedy_continuations(fp32, samples)
    names = [t.name for t in lay.outputs]
    run = lambda feeds: fp32.run(names, feeds)  # noqa: E731
    for (feeds, prompt), sample in zip(together, samples, strict=False):
        alone = evaluate.greedy(run, lay, [sample["input_ids"][0, :prompt]], acc.GREEDY_TOKENS)
        assert feeds["input_ids"][0, prompt:].tolist() == alone[0]


def test_quantizes_evaluator_counts_the_greedy_text_the_same_in_batches(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    from onnxruntime.quantization import quantize_dynamic

    from stages.quant import pertoken, search

    samples, _ = _eval_samples(built_gpt2)
    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    shipped = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    judge = search.Evaluator("causal-lm", export, samples[:16], greedy=True)
    assert pertoken.rows_independent(shipped)
    batched = judge(shipped)  # read from its file: rows independent, texts in batches
    assert batched == judge(shipped, together=False)
    assert 0 < batched["greedy_agreement"] <= 1
    per_call = tmp_path / "per_call.onnx"
    quantize_dynamic(export, per_call, op_types_to_quantize=["MatMul"])
    calls: list[Any] = []
    real = acc.teacher_forced_together
    try:
        acc.teacher_forced_together = lambda *a: calls.append(a) or real(*a)  # type: ignore[assignment]
        judge(per_call)  # rows move each other: one text a run
        judge(shipped)
    finally:
        acc.teacher_forced_together = real  # type: ignore[assignment]
    assert len(calls) == 1


def test_quantizes_evaluator_keeps_a_leaking_graphs_text_one_a_run(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    """quantize runs before kvcheck: a graph whose padding reaches a row (not causal) must
    not have its greedy text batched there either."""
    from stages.quant import search

    peek = _session(_peeking_graph(tmp_path / "peek.onnx"))
    samples = _peek_samples()
    assert not search.Evaluator("causal-lm", peek, samples, greedy=True)._inert
    gpt2, _ = _eval_samples(built_gpt2)
    fp32 = _session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    assert search.Evaluator("causal-lm", fp32, gpt2[:16], greedy=True)._inert


@pytest.mark.parametrize("padded", [True, False])
def test_the_prefill_kept_from_the_pass_decodes_the_same_text(
    built_gpt2: Workspace, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evaluate keeps FP32's cache of each prompt from its pass over the evaluation set
    (right-padded groups, or one sample a run) instead of prefilling the prompts again: the
    contract's text and the decode metrics' tokens are the ones the prefill run here gives,
    and each sample's logits are its own."""
    from schemas.spec.evaluation import DecodeConfig

    samples, lay = _eval_samples(built_gpt2)
    fp32 = evaluate.reference_session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    names = [t.name for t in lay.outputs]
    run = lambda feeds: fp32.run(names, feeds)  # noqa: E731
    # small groups: the prompts' samples spread over several runs and widths
    vocab = fp32.get_outputs()[0].shape[-1]
    monkeypatch.setattr(acc, "LOGITS_BYTES", 5 * 40 * vocab * 4)
    cfg = DecodeConfig(prompts=5, prompt_tokens=8, tokens=20)
    rows = evaluate.prompt_rows(samples, cfg, texts=True)
    assert len(rows) == acc.GREEDY_PROMPTS + 5 and {n for _, n in rows[-5:]} == {8}
    assert any(n < acc.GREEDY_PROMPT_TOKENS for _, n in rows[:16])  # a sample shorter than one
    prefixes = evaluate.Prefixes(lay, rows)
    groups, _ = acc.pass_groups(fp32, samples, pad=padded)
    assert len(groups) > 2 and (not padded or max(len(g) for g in groups) > 1)
    for group in groups:
        pairs = evaluate.compare(group, padded, samples, fp32, fp32, "logits", True, prefixes)
        for ref, _, feeds, i in pairs:
            assert i in group and feeds is samples[i]
            np.testing.assert_allclose(ref, fp32.run(["logits"], samples[i])[0], atol=1e-4)
    kept, kept_wanted = evaluate.reference_generations(run, lay, samples, cfg, True, prefixes)
    made, made_wanted = evaluate.reference_generations(run, lay, samples, cfg, True)
    assert kept is not None and made is not None and kept_wanted == made_wanted
    assert [(f["input_ids"].tolist(), n) for f, n in kept] == [
        (f["input_ids"].tolist(), n) for f, n in made
    ]
    assert all(set(f) == set(samples[0]) for f, _ in kept)


def test_a_prompt_whose_cache_was_not_kept_is_refused(built_gpt2: Workspace) -> None:
    """The prefill is refused, not decoded from zeros, when a prompt's sample ran without
    its cache kept; and a kept prefill is for left-padded rows only."""
    from schemas.spec.evaluation import DecodeConfig

    samples, lay = _eval_samples(built_gpt2)
    fp32 = evaluate.reference_session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    prefixes = evaluate.Prefixes(lay, evaluate.prompt_rows(samples, DecodeConfig(), False))
    evaluate.compare([0], False, samples, fp32, fp32, "logits", True, prefixes)  # one of them
    with pytest.raises(RuntimeError, match=r"samples \[1, 2"):
        prefixes.first()
    prefixes.keep(99, {})  # a sample that starts no prompt: nothing kept, nothing read
    with pytest.raises(ValueError, match="right-padded"):
        kv.greedy(lambda f: {}, {}, False, [np.array([1])], 1, right=True, first={"x": np.zeros(1)})


def forced_both_ways(
    fp32: Any, shipped: Any, samples: list[dict[str, np.ndarray]], lay: Any, padded: bool
) -> tuple[float, float, float]:
    """The contract's greedy agreement on FP32's own text, the shipped graph teacher-forced
    through the cache its pass kept (evaluate.forced_through_cache), and the same by full
    passes, one text a run (acc.teacher_forced); and FP32's through its own kept cache."""
    generated = acc.greedy_continuations(fp32, samples)
    rows = [(i, prompt) for i, (_, prompt) in enumerate(generated)]
    kept = {"fp32": evaluate.Prefixes(lay, rows), "shipped": evaluate.Prefixes(lay, rows)}
    groups, _ = acc.pass_groups(fp32, samples, pad=padded)
    for group in groups:
        evaluate.compare(
            group, padded, samples, fp32, shipped, "logits", True, kept["fp32"], kept["shipped"]
        )
    names = [t.name for t in lay.outputs]
    through = {
        key: evaluate.forced_through_cache(
            lambda feeds, s=session: s.run(names, feeds), lay, kept[key], generated
        )
        for key, session in (("fp32", fp32), ("shipped", shipped))
    }
    full = acc.teacher_forced(lambda feeds: shipped.run(["logits"], feeds)[0], generated)
    return through["shipped"], full, through["fp32"]


@pytest.mark.parametrize("padded", [True, False])
def test_teacher_forcing_through_the_kept_cache_picks_what_full_passes_pick(
    built_gpt2: Workspace, padded: bool, tmp_path: Path
) -> None:
    """evaluate teacher-forces a shipped graph whose rows are independent through the cache
    its pass kept (each text's FP32 tokens fed as one chunk after its prompt's cache): the
    same agreement as one full pass a text on the per-token INT8 graph, and FP32 picks its
    own text (a cache fed at the wrong positions would not)."""
    samples, lay = _eval_samples(built_gpt2)
    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    fp32 = _session(export)
    path = built_gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    assert evaluate.rows_independent(path)
    through, full, own = forced_both_ways(fp32, _session(path), samples, lay, padded)
    assert own == 1.0
    assert through == full
    # weights moved until the graph disagrees with FP32 at some tokens, its rows still
    # its own: the same picks through the cache as by full passes
    noisy = _perturbed(export, tmp_path / "noisy.onnx")
    through, full, _ = forced_both_ways(fp32, _session(noisy), samples, lay, padded)
    assert through == full
    assert 0.3 < full < 0.95, full


def _perturbed(path: Path, out: Path, scale: float = 1.5) -> Path:
    """The FP32 graph with every float matrix moved by seeded noise (scale x its spread)."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    rng = np.random.default_rng(0)
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype == np.float32 and value.ndim == 2 and value.size > 256:
            moved = value + rng.normal(scale=scale * value.std(), size=value.shape)
            init.CopyFrom(numpy_helper.from_array(moved.astype(np.float32), init.name))
    onnx.save(model, str(out))
    return out


def test_a_prompt_kept_at_another_length_is_refused(built_gpt2: Workspace) -> None:
    samples, lay = _eval_samples(built_gpt2)
    fp32 = _session(built_gpt2.out("tiny-gpt2", "export") / "model.onnx")
    generated = acc.greedy_continuations(fp32, samples)[:2]
    kept = evaluate.Prefixes(lay, [(0, generated[0][1] - 1), (1, generated[1][1])])
    evaluate.compare([0, 1], False, samples, fp32, fp32, "logits", True, None, kept)
    with pytest.raises(ValueError, match="sample 0"):
        evaluate.forced_through_cache(lambda f: fp32.run(None, f), lay, kept, generated)


def test_a_layout_whose_cache_axis_is_unnamed_decodes_with_its_own_prefill(
    built_gpt2: Workspace,
) -> None:
    """The kept prefill needs each present's sequence axis by name; a layout without it
    (not an export's) is not given one, and FP32 prefills its prompts itself."""
    from dataclasses import replace

    from stages.onnx import shapes as sh

    _, lay = _eval_samples(built_gpt2)
    assert evaluate.Prefixes.fits(lay)
    unnamed = [
        replace(t, axes=tuple("seq" if a == sh.TOTAL else a for a in t.axes))
        if t.name.startswith(kv.PRESENT)
        else t
        for t in lay.outputs
    ]
    assert not evaluate.Prefixes.fits(replace(lay, outputs=tuple(unnamed)))
    assert not evaluate.Prefixes.fits(replace(lay, outputs=lay.outputs[:1]))  # no cache
