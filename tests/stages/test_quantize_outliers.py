"""PTQ on models that behave like real ones: planted activation outliers (Llama-style
massive down_proj inputs, per-channel attention outliers) in a briefly trained Llama.

Per-tensor dynamic INT8 must fail there and `auto` must ship a recipe that handles the
outliers (SmoothQuant) within the task's default budget; SmoothQuant must compute the same
function in float, fold its factors where it can, and even out the channels it smooths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipelines.init import build_spec
from schemas.artifacts import QuantInfo
from schemas.quantsearch import PerNodeDetails, RecipeSearchDetails
from schemas.tasks import TASKS
from stages.quant import accuracy as acc
from stages.quant.methods import _gemm_as_matmul
from stages.quant.search import session_for
from stages.quant.smooth import smooth
from tests.conftest import Workspace
from tests.fixtures import outliers

DOCS = "data/calibration/docstrings.jsonl"
NAME = "llama-outliers"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Workspace, dict]:
    """A trained Llama with planted outliers, `init`'s spec for it (smaller dims), exported."""
    ws = Workspace(tmp_path_factory.mktemp("outliers"))
    lines = (ws.root / DOCS).read_text().splitlines()
    (ws.root / "data" / "cal.jsonl").write_text("\n".join(lines[:240]) + "\n")
    texts = [json.loads(line)["text"] for line in lines[240:]]  # trained on other texts
    folder = ws.root / "models" / NAME
    outliers.build_llama_with_outliers(folder, texts, steps=200)
    spec = build_spec(ws.root, folder, NAME, "data/cal.jsonl")
    spec["export"]["dims"] = {
        "batch": {"min": 1, "opt": 1, "max": 4},
        "past_sequence": {"min": 0, "opt": 16, "max": 64},
        "sequence": {"min": 1, "opt": 16, "max": 64},
    }
    spec["quantization"]["calibration"].update(samples=48, holdout=32)
    for stage in ("pin", "export"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    return ws, spec


def test_the_planted_outliers_are_there_and_change_nothing_in_float(tmp_path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**outliers.LLAMA)).eval()
    ids = torch.randint(0, outliers.VOCAB, (2, 24))
    before = model(ids).logits
    seen: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.down_proj.register_forward_hook(
            lambda _m, inp, _o, i=i: seen.__setitem__(f"down{i}", inp[0].abs())
        )
    model(ids)
    plain = min(float(a.max() / a.median()) for a in seen.values())
    outliers.plant_mlp_outliers(model, channels=2, low=100.0, high=400.0, seed=1)
    outliers.plant_attention_outliers(model, channels=2, low=10.0, high=40.0, seed=2)
    after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    planted = min(float(a.max() / a.median()) for a in seen.values())
    assert planted > 20 * plain  # every layer's down_proj input now has massive channels
    torch.set_grad_enabled(True)


def test_smoothquant_keeps_the_function_folds_where_it_can_and_evens_the_channels(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    ws, _ = llama
    src = ws.out(NAME, "export") / "model.onnx"
    ids = np.array([[5, 17, 42, 99, 3, 250, 7, 8, 300, 11]], dtype=np.int64)
    fp32 = session_for(src)
    feeds = _feeds(fp32, ids)
    report = smooth(src, tmp_path / "s.onnx", [feeds], 0.5, "s.data")
    got = session_for(tmp_path / "s.onnx").run(None, feeds)
    ref = fp32.run(None, feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-3, atol=1e-4)
    # per layer: q/k/v and gate/up share RMSNorm outputs (folded into its weight), down_proj's
    # input is SwiGLU's product (folded into up_proj), o_proj's input is a reshape (a Mul)
    layers = outliers.LLAMA["num_hidden_layers"]
    assert report.tensors == 4 * layers + 1  # + lm_head after the final norm
    assert report.folded == 3 * layers + 1 and report.inserted == layers
    assert report.max_ratio_before > 500
    assert report.max_ratio_after < report.max_ratio_before / 10


def test_smoothquant_on_gpt2_keeps_the_function_where_it_cannot_fold(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    src = _gemm_as_matmul(export, tmp_path / "m.onnx")  # as the quantizer hands it over
    fp32 = session_for(export)
    feeds = _feeds(fp32, np.arange(3, 40, dtype=np.int64)[None, :])
    report = smooth(src, tmp_path / "s.onnx", [feeds], 0.8, "s.data")
    # GPT-2's Conv1D reads a Reshape of each LayerNorm: nothing to fold, a Mul per input
    assert report.tensors == 4 * 2 and report.inserted == 4 * 2 and report.folded == 0
    got = session_for(tmp_path / "s.onnx").run(None, feeds)
    np.testing.assert_allclose(got[0], fp32.run(None, feeds)[0], rtol=1e-3, atol=1e-4)
    # the smoothed weights were spilled one at a time beside the source, then moved into
    # the graph's own data file: the spill is gone
    assert not list(tmp_path.glob(".*smoothed-weights"))


def test_a_smoothing_that_fails_midway_leaves_neither_its_spill_nor_a_graph(
    built_gpt2: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.quant import smooth as smoothing

    export = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    src = _gemm_as_matmul(export, tmp_path / "m.onnx")
    feeds = _feeds(session_for(export), np.arange(3, 40, dtype=np.int64)[None, :])
    spilled = smoothing._spilled
    calls = iter(range(100))

    def second_fails(*args: Any) -> Any:
        if next(calls) == 1:
            raise OSError("disk full")
        return spilled(*args)

    monkeypatch.setattr(smoothing, "_spilled", second_fails)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OSError, match="disk full"):
        smooth(src, tmp_path / "s.onnx", [feeds], 0.8, "s.data")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_per_tensor_int8_fails_and_auto_ships_smoothquant_within_the_default_budget(
    llama: tuple[Workspace, dict],
) -> None:
    ws, spec = llama
    # init writes the task's default budget out (the accuracy contract, explained)
    assert spec["quantization"]["method"] == "auto"
    assert spec["quantization"]["budget"] == TASKS["causal-lm"].default_budget
    # per-tensor INT8 of every MatMul (4 layers: a few float nodes could patch them all)
    plain = {**spec["quantization"], "method": "int8-dynamic", "max_float_nodes": 0}
    plain.pop("recipes", None)
    report = ws.run("quantize", {**spec, "quantization": plain})
    assert report.status.value == "failed"
    assert "greedy_agreement" in report.reasons[0] and "perplexity_increase" in report.reasons[0]
    selection = PerNodeDetails.model_validate(report.details).selection
    assert selection[0].perplexity_increase > 0.2  # outliers crush it
    # auto, with min_speedup 0: a 1.6M-parameter model is too small to time INT8 against
    # FP32 reliably (the slow end-to-end test keeps the default on a bigger model)
    order = ["int8-dynamic-per-channel", "int8-dynamic", "int8-static", "int8-dynamic-smoothquant"]
    auto = {**spec["quantization"], "min_speedup": 0, "recipes": order}
    report = ws.run("quantize", {**spec, "quantization": auto})
    assert report.status.value == "passed", report.reasons
    details = RecipeSearchDetails.model_validate(report.details)
    assert details.chosen == "int8-dynamic-smoothquant"
    rows = {r.recipe: r for r in details.recipes}
    assert rows["int8-dynamic-per-channel"].chosen is False
    assert "perplexity_increase" in rows["int8-dynamic-per-channel"].why
    # per-tensor is per-channel on a coarser grid: per-channel missed the accuracy, so
    # per-tensor is not built; a recipe that misses is timed only if the search falls back
    # on it, and here the smoothquant recipe ships: only it is timed
    assert rows["int8-dynamic"].why.startswith("not tried: int8-dynamic-per-channel missed")
    assert rows["int8-dynamic"].speedup is None and rows["int8-dynamic"].speedups == {}
    # static QDQ has per-channel's weight scales and calibrated activation steps no finer
    # than a dynamic scale's: not built either
    assert rows["int8-static"].why.startswith("not tried: int8-dynamic-per-channel missed")
    assert rows["int8-static"].calibration == {}
    assert rows["int8-dynamic-per-channel"].speedup is None
    chosen = rows["int8-dynamic-smoothquant"]
    assert chosen.speedup is not None
    assert chosen.chosen and chosen.float_classes == []
    assert chosen.holdout["greedy_agreement"] >= 0.92  # the default 0.9 with its margin
    assert chosen.holdout["perplexity_increase"] <= 0.016
    assert chosen.size_ratio < 0.35
    model = ws.out(NAME, "quantize") / "model.onnx"
    import onnx

    ops = {n.op_type for n in onnx.load(str(model), load_external_data=False).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
    quant = QuantInfo.model_validate_json((ws.out(NAME, "quantize") / QuantInfo.FILE).read_text())
    assert (quant.method, quant.dtype, quant.float_nodes) == ("int8-dynamic", "int8", [])
    assert quant.recipes == [r.shipped() for r in details.recipes]
    assert [r.recipe for r in quant.recipes if r.chosen] == ["int8-dynamic-smoothquant"]


def test_greedy_agreement_is_one_for_the_same_model_and_falls_with_noise(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    ws, _ = llama
    src = ws.out(NAME, "export") / "model.onnx"
    fp32 = session_for(src)
    samples = [_feeds(fp32, np.array([[5, 17, 42, 99, 3 + i]], dtype=np.int64)) for i in range(4)]
    generated = acc.greedy_continuations(fp32, samples)
    assert all(f["input_ids"].shape[1] == 5 + acc.GREEDY_TOKENS for f, _ in generated)
    assert acc.greedy_agreement(fp32, generated) == 1.0
    report = smooth(src, tmp_path / "s.onnx", samples, 0.5, "s.data")  # exact in float
    assert (
        report.tensors and acc.greedy_agreement(session_for(tmp_path / "s.onnx"), generated) > 0.99
    )

    class Shuffled:  # a model that answers with another position's logits
        def get_inputs(self) -> list:
            return fp32.get_inputs()

        def get_outputs(self) -> list:
            return fp32.get_outputs()

        def run(self, names: list, feeds: dict) -> list:
            logits = fp32.run(names, feeds)[0]
            return [np.roll(logits, 1, axis=1)]

    assert acc.greedy_agreement(Shuffled(), generated) < 0.5


def test_batched_greedy_text_equals_one_prompt_at_a_time(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    """FP32's greedy text is generated for every prompt in one batch, shorter ones padded on
    the right: the text and its order must be what one prompt at a time gives, with prompts
    of several lengths mixed and longer samples cut to the prompt. A quantized model is
    scored one text at a time: its agreement must not depend on which texts share a batch."""
    ws, spec = llama
    src = ws.out(NAME, "export") / "model.onnx"
    fp32 = session_for(src)
    rng = np.random.default_rng(3)
    lengths = [40, 7, 40, 12, 7, 40, 33]  # 40 and 33 are cut to the 32-token prompt
    samples = [_feeds(fp32, rng.integers(3, 200, (1, n))) for n in lengths]
    together = acc.greedy_continuations(fp32, samples)
    alone = [acc.greedy_continuations(fp32, [s])[0] for s in samples]
    assert [p for _, p in together] == [min(n, acc.GREEDY_PROMPT_TOKENS) for n in lengths]
    for (a, pa), (b, pb) in zip(together, alone, strict=True):
        assert pa == pb and np.array_equal(a["input_ids"], b["input_ids"])
        assert a["input_ids"].shape == (1, pa + acc.GREEDY_TOKENS)
    assert len(acc.batches(fp32, [0] * len(lengths), 48)) == 1  # one run a token

    from schemas.loader import load_release
    from stages.quant.methods import Quantizer

    cfg = {**spec["quantization"], "method": "int8-dynamic"}
    cfg.pop("recipes", None)
    release = load_release(ws.write({**spec, "quantization": cfg}))
    q = Quantizer(src, release.quantization, samples[:1], tmp_path / "v")
    noisy = session_for(q.quantize())  # per-tensor INT8: not every token agrees
    one_by_one = [acc.greedy_agreement(noisy, [g]) for g in together]
    assert len(set(one_by_one)) > 1  # samples differ: a mean of equal values proves little
    assert acc.greedy_agreement(noisy, together) == pytest.approx(np.mean(one_by_one))

    class FixedBatch:  # a graph exported with batch 1: nothing is stacked
        def get_inputs(self) -> list:
            return [type("I", (), {"shape": [1, "sequence"]})()]

        def get_outputs(self) -> list:
            return fp32.get_outputs()

    assert acc.batches(FixedBatch(), [(7,)] * 5, 48) == [[0], [1], [2], [3], [4]]


def test_greedy_text_through_the_cache_is_pytorch_full_recompute_greedy(
    llama: tuple[Workspace, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FP32 reference text is generated through the graph's KV cache, prompts of mixed
    lengths left-padded in one batch. Judged by PyTorch's own greedy loop on the checkpoint
    (no cache, one prompt at a time, the whole sequence each step), and by the graph's full
    recompute path, which a graph without a cache takes."""
    import torch
    import transformers

    ws, _ = llama
    fp32 = session_for(ws.out(NAME, "export") / "model.onnx")
    rng = np.random.default_rng(7)
    lengths = [3, 32, 9, 40, 17]
    samples = [_feeds(fp32, rng.integers(3, 200, (1, n))) for n in lengths]
    assert acc.cacheable(fp32, samples[0])
    cached = acc.greedy_continuations(fp32, samples)
    model = transformers.AutoModelForCausalLM.from_pretrained(ws.root / "models" / NAME).eval()
    for (feeds, prompt), s in zip(cached, samples, strict=True):
        ids = torch.from_numpy(s["input_ids"][:, :prompt])
        with torch.no_grad():
            for _ in range(acc.GREEDY_TOKENS):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
        assert np.array_equal(feeds["input_ids"], ids.numpy())
    monkeypatch.setattr(acc, "cacheable", lambda *_: False)
    recomputed = acc.greedy_continuations(fp32, samples)
    for (a, pa), (b, pb) in zip(cached, recomputed, strict=True):
        assert pa == pb and np.array_equal(a["input_ids"], b["input_ids"])


def _feeds(session: object, ids: np.ndarray) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for i in session.get_inputs():  # type: ignore[attr-defined]
        if i.name == "input_ids":
            feeds[i.name] = ids
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones_like(ids)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(ids.shape[1], dtype=np.int64)[None, :]
        else:  # an empty KV cache: [batch, kv_heads, 0, head_dim]
            shape = [
                ids.shape[0] if d == "batch" else 0 if isinstance(d, str) else d for d in i.shape
            ]
            feeds[i.name] = np.zeros(shape, np.float32)
    return feeds


def test_one_pass_sensitivity_refines_only_the_worst_and_finds_the_same_culprits(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    """29 candidates, refine 8: one instrumented pass ranks them all by local SNR and only 8
    are quantized alone, yet the nodes a full per-node sweep ranks most damaging are there."""
    from schemas.loader import load_release
    from stages.quant.methods import Quantizer
    from stages.quant.search import Evaluator, sensitivity

    ws, spec = llama
    cfg = {**spec["quantization"], "method": "int8-dynamic"}
    cfg.pop("recipes", None)
    release = load_release(ws.write({**spec, "quantization": cfg}))
    export = ws.out(NAME, "export") / "model.onnx"
    samples = _samples(ws, release)
    quantizer = Quantizer(export, release.quantization, samples, tmp_path / "q")
    evaluate = Evaluator("causal-lm", export, samples[:4])
    ctx = _Ctx()
    full = sensitivity(ctx, quantizer, evaluate, refine=len(quantizer.candidates()))
    fast = sensitivity(ctx, quantizer, evaluate, refine=8)
    assert len(fast) == len(full) == 29
    assert [r.measured for r in fast] == ["alone"] * 8 + ["one pass"] * 21
    alone = {r.node for r in fast[:8]}
    # one pass approximates: the worst node is refined, and most of the worst four
    assert full[0].node in alone
    assert len({r.node for r in full[:4]} & alone) >= 3
    # the planted layers do the most damage: down_proj's massive inputs and up_proj's
    # outlier rows (which crush a per-tensor weight scale; one SNR over its output hid that)
    assert fast[0].module.endswith(("mlp.down_proj", "mlp.up_proj"))
    # a node ranked in one pass was never measured alone: no end-to-end metric, in the
    # report's JSON too (absent, not null)
    assert all(r.snr_db is None and r.local_snr_db is not None for r in fast[8:])
    assert all("snr_db" not in r.model_dump() for r in fast[8:])
    assert all(r.local_snr_db is None for r in full)  # every node measured alone


class _Ctx:
    def log(self, _msg: str) -> None:
        pass

    def progress(self, _label: str, _total: int):  # type: ignore[no-untyped-def]
        import contextlib

        return contextlib.nullcontext(lambda: None)


def _release(ws: Workspace, spec: dict, **quantization: Any):  # type: ignore[no-untyped-def]
    """The fixture's release with another quantization method (its calibration and budget)."""
    from schemas.loader import load_release

    keep = {k: v for k, v in spec["quantization"].items() if k in ("calibration", "budget")}
    return load_release(ws.write({**spec, "quantization": {**keep, **quantization}}))


def _samples(ws: Workspace, release) -> list[dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    from schemas.artifacts import ModelInfo
    from stages.onnx import model as m
    from stages.quant import calibration as calib

    info = ModelInfo.model_validate_json((ws.out(NAME, "export") / ModelInfo.FILE).read_text())
    loaded = calib.load(
        ws.root,
        release.quantization.calibration,
        release.task,
        m.layout_from_info(info),
        release.export.dims,
        info.arch.vocab,
    )
    return loaded.calibration[:16]


def test_a_recipe_onnxruntime_cannot_build_is_a_row_and_the_search_goes_on(
    llama: tuple[Workspace, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.quant import methods

    def broken(*_args: object) -> None:
        raise AssertionError("scale issue")  # what quantize_data raises on a NaN weight

    monkeypatch.setitem(methods._METHODS, "int4-weight-only", broken)
    ws, spec = llama
    q = {**spec["quantization"], "recipes": ["int4-weight-only", "int8-dynamic-smoothquant"]}
    report = ws.run("quantize", {**spec, "quantization": {**q, "min_speedup": 0}})
    assert report.status.value == "passed", report.reasons
    first, second = RecipeSearchDetails.model_validate(report.details).recipes
    assert first.why == (
        "could not be built: onnxruntime's int4-weight-only quantizer failed: "
        "AssertionError: scale issue"
    )
    assert (first.size_ratio, first.speedup, first.calibration) == (0.0, None, {})
    assert not first.chosen and second.chosen
    # an explicit method: the same failure is a clear stage failure, not a traceback
    plain = {k: v for k, v in spec["quantization"].items() if k != "recipes"}
    report = ws.run("quantize", {**spec, "quantization": {**plain, "method": "int4-weight-only"}})
    assert report.status.value == "failed"
    assert "int4-weight-only quantizer failed: AssertionError" in report.reasons[0]


def test_a_graph_smoothquant_cannot_rewrite_is_a_row_too(
    llama: tuple[Workspace, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.quant import smooth

    def broken(*_args: object) -> None:
        raise ValueError("unexpected producer")

    monkeypatch.setattr(smooth, "smooth", broken)
    ws, spec = llama
    q = {**spec["quantization"], "recipes": ["int8-dynamic-smoothquant"], "min_speedup": 0}
    report = ws.run("quantize", {**spec, "quantization": {**q, "fallback": "fail"}})
    assert report.status.value == "failed"  # the only recipe could not be built
    (row,) = RecipeSearchDetails.model_validate(report.details).recipes
    assert row.why == (
        "could not be built: SmoothQuant could not rewrite the graph: "
        "ValueError: unexpected producer"
    )
    assert "Traceback" not in " ".join(report.reasons)


def test_a_model_with_nan_outputs_is_refused_before_any_recipe(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    import shutil

    import onnx
    from onnx import numpy_helper

    from schemas import StageError
    from stages.quant.search import Evaluator

    ws, _ = llama
    export = ws.out(NAME, "export")
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    model = onnx.load(str(copy / "model.onnx"))
    norm = next(t for t in model.graph.initializer if t.name.endswith("model.norm.weight"))
    norm.CopyFrom(numpy_helper.from_array(np.full(norm.dims, np.nan, np.float32), norm.name))
    onnx.save(model, str(tmp_path / "nan.onnx"))
    fp32 = session_for(export / "model.onnx")
    sample = _feeds(fp32, np.array([[5, 17, 42]], dtype=np.int64))
    with pytest.raises(StageError, match="calibration sample 1 is not finite"):
        Evaluator("causal-lm", tmp_path / "nan.onnx", [sample])


def test_bert_outliers_are_planted_without_changing_the_function() -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=outliers.VOCAB,
        max_position_embeddings=128,
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, outliers.VOCAB, (2, 16))
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.encoder.layer):
        layer.attention.output.dense.register_forward_hook(
            lambda _m, inp, _o, i=i: seen.__setitem__(i, inp[0].detach().abs())
        )
    with torch.no_grad():
        before = model(ids).last_hidden_state
        plain = min(float(a.max() / a.median()) for a in seen.values())
        outliers.plant_bert_outliers(model, channels=2, low=10.0, high=40.0, seed=3)
        after = model(ids).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert min(float(a.max() / a.median()) for a in seen.values()) > 2 * plain


@pytest.mark.parametrize(
    "method, extra",
    [
        ("int8-dynamic", {"per_channel": False}),
        ("int8-dynamic", {"per_channel": True}),
        ("int4-weight-only", {}),
    ],
)
def test_spliced_variants_equal_onnxruntimes_whole_model_quantization(
    llama: tuple[Workspace, dict], tmp_path: Path, method: str, extra: dict
) -> None:
    """A variant built from per-node pieces computes exactly what onnxruntime's quantizer
    makes of the whole model (all nodes, and all but some), with one dynamic quantization
    per shared input (q/k/v and gate/up read the same tensor), and ships as one file."""
    import shutil

    import onnx

    from stages.onnx import invariant
    from stages.quant import methods
    from stages.quant.methods import Quantizer

    ws, spec = llama
    release = _release(ws, spec, method=method, **extra)
    export = ws.out(NAME, "export") / "model.onnx"
    quantizer = Quantizer(export, release.quantization, [], tmp_path / "q")
    some = quantizer.candidates()[1::3]
    feeds = _feeds(session_for(export), np.arange(3, 40, dtype=np.int64)[None, :])
    # a softmax's sum against ones is never a candidate: the whole-model run leaves it too
    graph = quantizer.skeleton().graph
    sums = [n.name for n in graph.node if n.name.endswith(invariant.SUMS)]
    assert sums and not set(sums) & set(quantizer.candidates())
    for exclude in ([], some):
        spliced = quantizer.quantize(exclude=exclude)
        whole = tmp_path / f"whole{len(exclude)}.onnx"
        methods._METHODS[method](quantizer, quantizer.model, whole, [*exclude, *sums], None, False)
        alone = tmp_path / "alone" / "model.onnx"  # no side file: nothing points elsewhere
        alone.parent.mkdir(exist_ok=True)
        shutil.copyfile(spliced, alone)
        got = session_for(alone).run(None, feeds)
        want = session_for(whole).run(None, feeds)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        ops = [[n.op_type for n in onnx.load(str(p)).graph.node] for p in (spliced, whole)]
        assert sorted(ops[0]) == sorted(ops[1])


def test_spliced_static_qdq_equals_quantize_static_and_keeps_float_nodes_float(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    """Static QDQ is calibrated on the skeleton and spliced from per-node pieces: the
    ranges are onnxruntime's own calibrator's (minmax), the variant computes exactly what
    quantize_static makes of the whole model (all nodes; all but every down_proj), and a
    node kept in float whose input a quantized node shares reads that input unquantized."""
    import onnx

    from stages.onnx import invariant
    from stages.quant import methods, static
    from stages.quant.methods import Quantizer

    ws, spec = llama
    release = _release(ws, spec, method="int8-static")
    export = ws.out(NAME, "export") / "model.onnx"
    samples = _samples(ws, release)[:6]
    ours = Quantizer(export, release.quantization, samples, tmp_path / "ours")
    theirs = Quantizer(export, release.quantization, samples, tmp_path / "theirs")
    feeds = _feeds(session_for(export), np.arange(3, 40, dtype=np.int64)[None, :])
    graph = ours.skeleton().graph
    down = [n.name for n in graph.node if "down_proj" in n.name]
    assert down and len(ours.candidates()) > 7 * len(down)  # Q K^T and attn V are in
    # a softmax's sum of exponentials is never a candidate (stages/onnx/invariant.py):
    # onnxruntime's whole-model run is told to leave it in float too
    sums = [n.name for n in graph.node if n.name.endswith(invariant.SUMS)]
    assert sums and not set(sums) & set(ours.candidates())
    for exclude in ([], down):
        spliced = ours.quantize(exclude=exclude)
        whole = tmp_path / f"whole{len(exclude)}.onnx"  # onnxruntime calibrates itself
        methods._METHODS["int8-static"](theirs, theirs.model, whole, [*exclude, *sums], None, False)
        got = session_for(spliced).run(["logits"], feeds)[0]
        want = session_for(whole).run(["logits"], feeds)[0]
        np.testing.assert_array_equal(got, want)
        ops = [[n.op_type for n in onnx.load(str(p)).graph.node] for p in (spliced, whole)]
        assert sorted(ops[0]) == sorted(ops[1])
    from onnxruntime.quantization.calibrate import load_tensors_data

    mine, ort = (load_tensors_data(q.folder / static.CACHE) for q in (ours, theirs))
    assert mine.calibration_method == ort.calibration_method
    # onnxruntime also calibrated the sums' tensors it was then told to leave in float
    extra = set(ort.keys()) - set(mine.keys())
    assert set(mine.keys()) <= set(ort.keys())
    assert extra and all(n.endswith(("/exp_blocks", invariant.SUMS)) for n in extra), extra
    for name in mine:
        assert mine[name].range_value == ort[name].range_value

    v = [n.name for n in graph.node if "v_proj" in n.name]
    variant = onnx.load(str(ours.quantize(exclude=v)), load_external_data=False).graph
    dq = {o for n in variant.node if n.op_type == "DequantizeLinear" for o in n.output}
    reads = {n.name: n.input[0] for n in variant.node if n.input}
    assert all(reads[n] not in dq for n in v)  # float: the RMSNorm output itself
    q_proj = [n.name for n in graph.node if "q_proj" in n.name]
    assert all(reads[n] in dq for n in q_proj)  # its neighbour reads the same tensor Q/DQ'd


def test_static_histogram_ranges_are_collected_one_window_at_a_time(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    """entropy and percentile ranges come from onnxruntime's HistogramCollector fed one
    calibration window at a time: every tensor minmax calibrates gets a finite range inside
    minmax's, and the variant runs."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    from stages.quant import static
    from stages.quant.methods import Quantizer

    ws, spec = llama
    caches = {}
    for how in ("minmax", "entropy", "percentile"):
        release = _release(ws, spec, method="int8-static", calibrate_method=how)
        export = ws.out(NAME, "export") / "model.onnx"
        quantizer = Quantizer(
            export, release.quantization, _samples(ws, release)[:4], tmp_path / how
        )
        path = quantizer.alone(quantizer.candidates()[0])
        session_for(path).run(None, _feeds(session_for(export), np.arange(3, 20)[None, :]))
        caches[how] = load_tensors_data(quantizer.folder / static.CACHE)
    for how in ("entropy", "percentile"):
        assert caches[how].keys() == caches["minmax"].keys()
        for name in caches[how]:
            lo, hi = (float(np.ravel(v)[0]) for v in caches[how][name].range_value)
            m = [float(np.ravel(v)[0]) for v in caches["minmax"][name].range_value]
            bound = max(abs(m[0]), abs(m[1]))
            assert np.isfinite([lo, hi]).all() and lo <= hi
            assert max(abs(lo), abs(hi)) <= bound * 1.01, (how, name, lo, hi, m)


def test_one_pass_sensitivity_ranks_static_qdq_nodes_that_multiply_two_activations(
    llama: tuple[Workspace, dict], tmp_path: Path
) -> None:
    """Static QDQ also quantizes attention's activation x activation MatMuls (no weight):
    the one-pass ranking measures them against the product of their two FP32-valued
    inputs (it raised KeyError on the missing weight, failing any static run with more
    candidates than it refines)."""
    from stages.quant.methods import Quantizer
    from stages.quant.search import local_snr

    ws, spec = llama
    release = _release(ws, spec, method="int8-static")
    export = ws.out(NAME, "export") / "model.onnx"
    samples = _samples(ws, release)[:4]
    quantizer = Quantizer(export, release.quantization, samples, tmp_path / "q")
    nodes = quantizer.candidates()
    weights = {t.name for t in quantizer.skeleton().graph.initializer}
    by_name = {n.name: n for n in quantizer.skeleton().graph.node}
    two = [n for n in nodes if by_name[n].input[1] not in weights]
    assert two, "the graph has activation x activation MatMuls to rank"
    local = local_snr(quantizer, quantizer.quantize(), nodes, samples[0])
    assert set(local) == set(nodes)
    assert all(np.isfinite(v) for v in local.values()), local
    # against the right reference a quantized Q K^T is close (a wrong operand reads ~0 dB);
    # the planted down_proj layers may be far worse, which is what the ranking is for
    low = {n: local[n] for n in two if local[n] < 15}
    assert not low, low


@pytest.mark.slow  # ~30 s: every layer class probed and kept in float in turn
def test_the_fallback_is_the_best_scoring_recipe_fast_enough_timed_only_when_needed(
    llama: tuple[Workspace, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No recipe meets an unreachable budget outright, so the search falls back on the
    best-scoring recipe that is fast enough. The recipes that missed are not timed as they
    are measured; the best-scoring one is timed when the search needs it, and when it is too
    slow (forced here: the first timing says 0.5x) the next best is rebuilt, timed, and the
    layer classes are kept in float on it. (The cost model is made to expect every recipe
    slow: one it expects fast is not timed before its classes are tried, next test.)"""
    from stages.quant import recipes

    ws, spec = llama
    timings: list[int] = []
    real = recipes.Search._speed
    monkeypatch.setattr(recipes.Search, "_predicted_fast", lambda self, path: False)

    def first_slow(self: recipes.Search, session: object, path: Path) -> tuple:
        timings.append(1)
        checks, speedup, slow = real(self, session, path)
        if len(timings) == 1:
            forced = {k: c.model_copy(update={"ratio": 0.5}) for k, c in checks.items()}
            return forced, 0.5, "speed 0.50x FP32 (forced), below 1"
        return checks, speedup, slow

    monkeypatch.setattr(recipes.Search, "_speed", first_slow)
    order = ["int8-dynamic-per-channel", "int8-dynamic-smoothquant"]
    auto = {
        **spec["quantization"],
        "recipes": order,
        "min_speedup": 0.9,
        "budget": {"greedy_agreement_min": 0.9999, "perplexity_increase_max": 1e-6},
        "max_size_ratio": 0.95,
        "fallback": "fail",
    }
    report = ws.run("quantize", {**spec, "quantization": auto})
    rows = RecipeSearchDetails.model_validate(report.details).recipes
    first = {r.recipe: r for r in rows[: len(order)]}
    scores = {k: r.calibration["snr_db"] for k, r in first.items()}
    ranked = sorted(order, key=lambda k: -scores[k])
    assert first[ranked[0]].speedup == 0.5 and "(forced)" in first[ranked[0]].why
    assert first[ranked[1]].speedup not in (None, 0.5)  # rebuilt and timed
    assert len(timings) == 2
    assert rows[len(order)].recipe == ranked[1] and rows[len(order)].float_classes
    assert report.status.value == "failed"  # the budget is out of reach


def _unreachable(spec: dict, order: list[str]) -> dict:
    return {
        **spec["quantization"],
        "recipes": order,
        "min_speedup": 0.9,
        "budget": {"greedy_agreement_min": 0.9999, "perplexity_increase_max": 1e-6},
        "max_size_ratio": 0.95,
        "fallback": "fail",
    }


@pytest.mark.slow  # ~30 s each
@pytest.mark.parametrize("shipped_too_slow", [False, True])
def test_a_fallback_the_cost_model_expects_fast_is_timed_only_if_what_it_ships_is_slow(
    llama: tuple[Workspace, dict], monkeypatch: pytest.MonkeyPatch, shipped_too_slow: bool
) -> None:
    """The best-scoring recipe, expected fast by the cost model, is not timed before its
    layer classes are tried (the variant that ships is timed anyway). When what its classes
    give is too slow (forced here), the fallback itself is timed, as it would have been
    first: too slow too (forced), so the next best is rebuilt and its classes tried."""
    from stages.quant import recipes

    ws, spec = llama
    timed: list[str] = []
    classes: list[str] = []
    real_speed, real_by_class = recipes.Search._speed, recipes.Search._by_class

    def speed(self: recipes.Search, session: object, path: Path) -> tuple:
        timed.append(path.parent.name)
        checks, speedup, slow = real_speed(self, session, path)
        if shipped_too_slow and len(timed) == 1:
            forced = {k: c.model_copy(update={"ratio": 0.5}) for k, c in checks.items()}
            return forced, 0.5, "speed 0.50x FP32 (forced), below 0.9"
        return checks, speedup, slow

    def by_class(self: recipes.Search, out: recipes.Outcome, recipe: str, q: object) -> object:
        classes.append(recipe)
        if shipped_too_slow and len(classes) == 1:
            out.broken = ["speed 0.50x FP32 (forced: its classes in float), below 0.9"]
            return out
        return real_by_class(self, out, recipe, q)

    monkeypatch.setattr(recipes.Search, "_predicted_fast", lambda self, path: True)
    monkeypatch.setattr(recipes.Search, "_speed", speed)
    monkeypatch.setattr(recipes.Search, "_by_class", by_class)
    order = ["int8-dynamic-per-channel", "int8-dynamic-smoothquant"]
    report = ws.run("quantize", {**spec, "quantization": _unreachable(spec, order)})
    rows = RecipeSearchDetails.model_validate(report.details).recipes
    first = {r.recipe: r for r in rows[: len(order)]}
    scores = {k: r.calibration["snr_db"] for k, r in first.items()}
    ranked = sorted(order, key=lambda k: -scores[k])
    assert report.status.value == "failed"  # the budget is out of reach
    if not shipped_too_slow:
        # never timed: its class variants all missed the budget (a variant is timed only
        # when it meets it), and the fallback was not timed before them
        assert timed == [] and classes == [ranked[0]]
        assert first[ranked[0]].speedup is None and first[ranked[1]].speedup is None
        assert rows[len(order)].recipe == ranked[0] and rows[len(order)].float_classes
    else:
        # the fallback timed once its classes were too slow (forced slow); the next best
        # (expected fast too) then has its classes tried, untimed itself
        assert classes == ranked and timed == [ranked[0]]
        assert first[ranked[0]].speedup == 0.5 and "(forced)" in first[ranked[0]].why
        assert first[ranked[1]].speedup is None
        assert rows[len(order)].recipe == ranked[1] and rows[len(order)].float_classes
