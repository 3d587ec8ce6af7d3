"""The KV path, proven (issue 24): cached decoding against a full recompute in PyTorch and in
ONNX Runtime, a left-padded row against itself alone, position ids from the mask, pasts the
model produces, multi-output modules compared output by output, a KV cache sized or refused.

The cache-bug models (tests/fixtures/kvbugs.py) compute correctly without a past and wrongly
with one: every stage that compares the graph with the model passes them, kvcheck stops
each, naming the probe and the position."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas import SpecError, StageError
from schemas.details import KvcheckDetails, KvComparison, ParityDetails
from tests.conftest import Workspace, gpt2_spec, model_info
from tests.fixtures import architectures as matrix
from tests.fixtures import kvbugs

KVBUGS = Path(kvbugs.__file__)
OTHER_STAGES = ("pin", "export", "evalcheck", "parity", "quantize", "evaluate", "plan", "serve")


def bug_ws(root: Path) -> Workspace:
    ws = Workspace(root)
    shutil.copy(KVBUGS, root / "kvbugs.py")
    return ws


@pytest.fixture(scope="module")
def bugs(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return bug_ws(tmp_path_factory.mktemp("kvbugs"))


def bug_spec(bug: str, **kv: Any) -> dict[str, Any]:
    spec = kvbugs.spec(f"kv-{bug}", bug, gpt2_spec())
    if kv:
        spec["parity"] = {**spec["parity"], "kv": kv}
    return spec


# ----------------------------------------------------------------------- cache-bug models
@pytest.mark.parametrize(
    ("bug", "probe"),
    [
        ("restart", "cached decode at step 0 (past 3): logits at position 3"),
        ("drop", "cached decode at step 0 (past 3): logits at position 3"),
        ("mask", "cached decode at padded row 1 (3 pads) step 1 (past 3): logits at position 3"),
        ("clip", "cached decode at past 37: logits at position 37"),
    ],
)
def test_each_cache_bug_passes_every_other_stage_and_kvcheck_stops_it(
    bugs: Workspace, bug: str, probe: str
) -> None:
    spec = bug_spec(bug)
    for stage in OTHER_STAGES:
        report = bugs.run(stage, spec)
        assert report.status.value == "passed", (bug, stage, report.reasons)
    report = bugs.run("kvcheck", spec)
    assert report.status.value == "failed"
    assert report.stage == "kvcheck"
    torch_reason, onnx_reason, shipped_reason, kept_reason = report.reasons
    assert "kept in build/" in kept_reason  # the token sequences every comparison decoded
    kept = bugs.root / "build" / spec["name"] / "failed" / "kvcheck"
    with np.load(kept / "failed_inputs.npz") as f:
        assert f["input_ids"].ndim == 2 and f["input_ids"].size > 0
    assert torch_reason.startswith(f"PyTorch: {probe} differs from a full recompute")
    assert onnx_reason.startswith(f"ONNX Runtime: {probe} differs from a full recompute")
    # the shipped INT8 graph carries the model's bug too, judged against its own full pass
    # (its activations are quantized per token: checked before their rounding)
    label = re.match(
        r"shipped graph \(activation scales per token: (\d+) product\(s\) checked before "
        r"rounding\): ",
        shipped_reason,
    )
    assert label and int(label[1]) > 0, shipped_reason
    assert shipped_reason[label.end() :].startswith(f"{probe} differs from a full recompute")
    assert report.metrics["worst_normalized_error"] > 1


def test_the_same_decoder_without_a_bug_passes_with_the_same_probes(bugs: Workspace) -> None:
    spec = bug_spec("none")
    for stage in ("pin", "export", "quantize"):
        assert bugs.run(stage, spec).status.value == "passed"
    report = bugs.run("kvcheck", spec)
    assert report.status.value == "passed", report.reasons
    details = KvcheckDetails.model_validate(report.details)
    assert details.plan.past_lengths == [13, 25, 37, 48]  # odd ones spread out, max included
    assert details.plan.padded == [6, 3, 4]  # rows of 6 and 3 tokens, 4 steps
    probes = {r.probe for r in details.onnx}
    assert {"step 0", "step 3", "past 48", "padded row 1 (3 pads) step 4"} <= probes
    assert report.metrics["worst_normalized_error"] < 0.1


def test_a_clipped_past_passes_at_its_window_and_fails_one_token_past_it(
    bugs: Workspace,
) -> None:
    for stage in ("pin", "export", "quantize"):
        bugs.run(stage, bug_spec("clip"))
    at = bugs.run("kvcheck", bug_spec("clip", steps=0, padded=False, past_lengths=[32]))
    assert at.status.value == "passed", at.reasons
    past = bugs.run("kvcheck", bug_spec("clip", steps=0, padded=False, past_lengths=[33]))
    assert past.status.value == "failed"
    assert "cached decode at past 33: logits at position 33" in past.reasons[0]


def test_a_dropped_token_is_found_in_the_presents_at_its_position() -> None:
    """The presents are compared too: a cache that loses a position names it."""
    from schemas.spec.parity import Tolerance
    from stages.onnx import kvcache as kv

    want = np.zeros((1, 2, 9, 4), np.float32)
    got = want.copy()
    got[0, 1, 6, 2] = 1.0
    assert kv.first_position(want, got, Tolerance()) == 6
    assert kv.first_position(want, want.copy(), Tolerance()) == -1


# --------------------------------------------------------------------------- tiny-gpt2
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("gpt2-kv"))
    for stage in ("pin", "export", "quantize"):
        assert ws.run(stage, gpt2_spec()).status.value == "passed"
    return ws


def test_tiny_gpt2_exports_position_ids_and_passes_kvcheck(gpt2: Workspace) -> None:
    import json

    info = json.loads((gpt2.out("tiny-gpt2", "export") / "model_info.json").read_text())
    names = [t["name"] for t in info["inputs"]]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    report = gpt2.run("kvcheck", gpt2_spec())
    assert report.status.value == "passed", report.reasons
    plan = KvcheckDetails.model_validate(report.details).plan
    assert plan.past_lengths[-1] == 24  # past_sequence.max


def test_a_left_padded_tiny_gpt2_batch_matches_each_row_alone_in_onnx_runtime(
    gpt2: Workspace,
) -> None:
    """Rows of 6 and 3 tokens (the second left-padded by 3), prefilled and then decoded
    three steps, through ONNX Runtime with the mask's zeros and positions from the mask."""
    import onnxruntime as ort

    from stages.onnx import kvcache as kv
    from stages.onnx import model as m
    from stages.onnx import shapes as sh

    info_path = gpt2.out("tiny-gpt2", "export") / "model_info.json"
    from schemas.artifacts import ModelInfo

    lay = m.layout_from_info(ModelInfo.model_validate_json(info_path.read_text()))
    session = ort.InferenceSession(str(gpt2.out("tiny-gpt2", "export") / "model.onnx"))
    names = [t.name for t in lay.outputs]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, feeds), strict=True))

    rows = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13], [21, 22, 23, 24, 25, 26, 0, 0, 0]])
    ids = np.array([[5, 6, 7, 8, 9, 10], [0, 0, 0, 21, 22, 23]])
    mask = np.array([[1] * 6, [0, 0, 0, 1, 1, 1]])
    assert sh.positions_from_mask(mask, 6).tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2]]
    out = run(kv.feeds(lay, ids, mask, None))
    lengths = [6, 3]
    for step in range(4):
        for row in (0, 1):
            alone = rows[row : row + 1, : lengths[row]]
            want = kv.full_pass(run, lay, alone)["logits"][0]
            assert np.abs(out["logits"][row, -1] - want).max() < 1e-4, (step, row)
        if step == 3:
            break
        nxt = np.array([[rows[0, lengths[0]]], [rows[1, lengths[1]]]])
        lengths = [n + 1 for n in lengths]
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        out = run(kv.feeds(lay, nxt, mask, kv.presents(lay, out)))


def test_a_full_pass_keeps_the_last_logits_and_not_every_positions() -> None:
    """The reference keeps [batch, vocab]: a view of the last position held the whole
    [batch, n, vocab] output alive under the next pass (0.2 GB at 1024 tokens of a 49k
    vocabulary; issue 40's kvcheck memory)."""
    from stages.onnx import kvcache as kv
    from stages.onnx import shapes as sh

    lay = sh.Layout(
        inputs=(sh.Tensor("input_ids", "int64", ("batch", "sequence"), high=50),),
        outputs=(sh.Tensor("logits", "float32", ("batch", "sequence", 50)),),
    )
    every = np.random.default_rng(0).normal(size=(1, 300, 50)).astype(np.float32)
    kept = kv.full_pass(lambda feeds: {"logits": every}, lay, np.ones((1, 300), np.int64))
    assert kept["logits"].shape == (1, 50) and kept["logits"].base is None
    assert np.array_equal(kept["logits"], every[:, -1])


def test_without_position_ids_a_padded_row_is_wrong_and_kvcheck_says_so(
    gpt2: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check bites: the same graph fed positions that ignore the padding (what an
    export without position_ids computes) fails the padded probe."""
    from stages.onnx import kvcache as kv
    from stages.onnx import shapes as sh

    def from_zero(mask: np.ndarray, width: int) -> np.ndarray:
        total = np.asarray(mask).shape[-1]
        return np.tile(np.arange(total - width, total), (len(mask), 1)).astype(np.int64)

    monkeypatch.setattr(sh, "positions_from_mask", from_zero)
    monkeypatch.setattr(kv.sh, "positions_from_mask", from_zero)
    report = gpt2.run("kvcheck", gpt2_spec())
    assert report.status.value == "failed"
    assert "padded row 1 (3 pads) step 0" in report.reasons[0]


def test_a_produced_past_is_the_models_own_cache_over_seeded_tokens(gpt2: Workspace) -> None:
    """Parity's pasts: prefilled through the cache in chunks, equal to one full pass's."""
    from schemas.loader import load_release
    from stages.onnx import kvcache as kv
    from stages.onnx import model as m
    from stages.onnx import shapes as sh

    release = load_release(gpt2.write(gpt2_spec()))
    net, lay = m.load_with_layout(gpt2.root, release)
    run = m.named_run(m.adapter("causal-lm", net, lay), lay)

    random = sh.make_inputs(lay, {"batch": 2, "sequence": 3, "past_sequence": 13}, seed=0)
    produced = kv.with_produced_past(run, lay, random, chunk=5, seed=0)
    assert produced["input_ids"] is random["input_ids"]
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 13))
    whole = run(kv.feeds(lay, tokens, np.ones((2, 13)), None))
    for name, value in kv.presents(lay, whole).items():
        assert value.shape == produced[name].shape
        assert np.abs(value - produced[name]).max() < 1e-5
        assert np.abs(random[name] - produced[name]).max() > 0.1  # the noise is gone


# ------------------------------------------------------------------ layerwise, rotary
def test_layerwise_compares_each_rotary_output_with_its_own_tensor(tmp_path: Path) -> None:
    """Llama's rotary embedding returns (cos, sin), both [batch, sequence, head_dim]: each is
    compared with the graph tensor it is, never cos with sin (max |cos - sin| is sqrt 2)."""
    ws = Workspace(tmp_path)
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "Llama")
    slug = matrix.slug_of(arch)
    matrix.build_model(arch, tmp_path / "models" / slug)
    spec = matrix.spec_for(arch, slug)
    spec["parity"]["layerwise"] = "always"
    for stage in ("pin", "export"):
        assert ws.run(stage, spec).status.value == "passed"
    layers = ParityDetails.model_validate(ws.run("parity", spec).details).layerwise
    assert layers is not None
    rotary = {r.module: r for r in layers.layers if "rotary_emb" in r.module}
    assert set(rotary) == {"model.rotary_emb[0]", "model.rotary_emb[1]"}
    assert rotary["model.rotary_emb[0]"].tensor != rotary["model.rotary_emb[1]"].tensor
    assert all(r.ok and r.max_abs < 1e-5 for r in rotary.values())
    assert layers.first_divergent is None


# ---------------------------------------------------------------- derived dims, the plan
def test_a_python_decoders_kv_cache_is_sized_from_its_declared_past(bugs: Workspace) -> None:
    import json

    spec = bug_spec("none")
    for stage in ("pin", "export", "quantize", "plan"):
        assert bugs.run(stage, spec).status.value == "passed"
    info = json.loads((bugs.out("kv-none", "export") / "model_info.json").read_text())
    arch = {k: info["arch"][k] for k in ("layers", "kv_heads", "head_dim", "vocab")}
    assert arch == {
        "layers": kvbugs.LAYERS,
        "kv_heads": kvbugs.KV_HEADS,
        "head_dim": kvbugs.HEAD_DIM,
        "vocab": kvbugs.VOCAB,
    }
    plan = json.loads((bugs.out("kv-none", "plan") / "plan.json").read_text())
    # the engine counts at most past_sequence.max + 2 tokens a sequence (of 64 + 48)
    assert plan["kv_bytes_per_sequence"] == 2 * 2 * 2 * 8 * (48 + 2) * 4


def test_the_plan_refuses_a_kv_cache_it_cannot_size() -> None:
    from schemas.spec.capacity import CapacityConfig
    from stages import plan

    dims = {"batch": {"max": 2}, "sequence": {"max": 8}, "past_sequence": {"max": 8}}
    arch = {"layers": 0, "heads": 0, "kv_heads": 0, "head_dim": 0, "hidden": 0, "vocab": 9}
    info = model_info(dims=dims, arch={**arch, "positions": 0, "labels": 2})
    with pytest.raises(StageError) as exc:
        plan.compute(CapacityConfig(device_memory="1GiB"), info, "causal-lm", 100)
    assert "cannot size the KV cache: the export records layers, kv_heads, head_dim = 0" in str(
        exc.value
    )
    assert "past_key_values.<i>.key/value" in str(exc.value)


def test_total_sequence_is_derived_in_shapes_and_refused_as_a_declared_dim(tmp_path: Path) -> None:
    import yaml

    from schemas.loader import load_release

    ws = bug_ws(tmp_path)
    spec = bug_spec("none")
    assert load_release(ws.write(spec)).export.inputs  # shapes name it, undeclared
    spec["export"]["dims"]["total_sequence"] = {"min": 1, "opt": 8, "max": 112}
    path = ws.write(spec)
    with pytest.raises(SpecError) as exc:
        load_release(path)
    assert str(exc.value).endswith(
        "kv-none.yaml:26: export.dims.total_sequence: is derived (past_sequence + sequence), "
        "never declared; remove it from export.dims and name it in shapes as it is"
    )
    assert yaml.safe_load(path.read_text())["name"] == "kv-none"


def test_kv_past_lengths_outside_the_export_are_refused_at_validate(tmp_path: Path) -> None:
    from schemas.loader import load_release

    ws = Workspace(tmp_path)
    at = gpt2_spec(parity={"kv": {"past_lengths": [0, 24]}})
    assert load_release(ws.write(at)).parity.kv.past_lengths == [0, 24]
    over = gpt2_spec(parity={"kv": {"past_lengths": [25]}})
    with pytest.raises(SpecError) as exc:
        load_release(ws.write(over))
    assert "tiny-gpt2.yaml:34: parity.kv.past_lengths: [25] lie outside [0, 24]" in str(exc.value)


def test_an_embedding_release_skips_kvcheck_as_optional(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "DistilBERT")
    slug = matrix.slug_of(arch)
    matrix.build_model(arch, tmp_path / "models" / slug)
    report = ws.run("kvcheck", matrix.spec_for(arch, slug))
    assert report.status.value == "skipped"
    assert report.reasons == ["task text-embedding has no KV cache"]
    assert report.acceptable()


def test_a_kv_graph_must_take_one_token_on_an_empty_past(tmp_path: Path) -> None:
    """The runtime prefills with an empty past and decodes one token a step: an export
    that does not promise those sizes is refused at validate, naming the dim."""
    from schemas.loader import load_release

    ws = Workspace(tmp_path)
    for dim, value, found in (
        ("sequence", 2, "sequence.min 1 (is 2)"),
        ("past_sequence", 1, "past_sequence.min must be 0 (is 1)"),
    ):
        spec = gpt2_spec()
        spec["export"]["dims"][dim]["min"] = value
        with pytest.raises(SpecError) as exc:
            load_release(ws.write(spec))
        assert "a KV-cache graph is prefilled with an empty past" in str(exc.value)
        assert found in str(exc.value)


def test_run_stage_names_the_stage_the_step_and_the_position_and_exits_3(
    bugs: Workspace,
) -> None:
    """What `dvc repro` prints: the stage's command, `shipyard run-stage`, on a cache bug."""
    import os
    import subprocess
    import sys

    spec = bug_spec("restart")
    for stage in ("pin", "export", "quantize"):
        assert bugs.run(stage, spec).status.value == "passed"
    path = bugs.write(spec)
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("shipyard")),
            "run-stage",
            "kvcheck",
            "--release",
            str(path.relative_to(bugs.root)),
        ],
        cwd=bugs.root,
        env={**os.environ, "SHIPYARD_ROOT": str(bugs.root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if not line.startswith("    ")]
    assert any(
        line.startswith("FAIL kvcheck@kv-restart: cached decoding differs from a full recompute")
        for line in lines
    ), done.stdout
    assert any(
        "- ONNX Runtime: cached decode at step 0 (past 3): logits at position 3" in line
        for line in lines
    ), done.stdout


def test_without_a_padded_batch_the_report_says_padded_rows_were_not_checked(
    gpt2: Workspace,
) -> None:
    report = gpt2.run("kvcheck", gpt2_spec(parity={"kv": {"padded": False}}))
    assert report.status.value == "passed"
    assert "padded rows not checked" in report.summary
    onnx_rows = KvcheckDetails.model_validate(report.details).onnx
    assert onnx_rows and not any(r.probe.startswith("padded") for r in onnx_rows)


# ------------------------------------------------------------------ the shipped graph
def _layout(ws: Workspace) -> Any:
    from schemas.artifacts import ModelInfo
    from stages.onnx import shapes as sh

    info = ModelInfo.model_validate_json(
        (ws.out("tiny-gpt2", "export") / "model_info.json").read_text()
    )
    inputs = tuple(
        sh.Tensor(t.name, t.dtype, tuple(t.axes), t.low or 0, 1 if t.high is None else t.high)
        for t in info.inputs
    )
    return sh.Layout(inputs, tuple(sh.Tensor(t.name, t.dtype, tuple(t.axes)) for t in info.outputs))


def _session(path: Path, edit: Any = None) -> Any:
    import onnxruntime as ort

    from stages.onnx import stream

    with stream.external_view(path, edit) as view:
        session = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds), strict=True))


def _self_check(run: Any, lay: Any, release: Any) -> list[KvComparison]:
    from stages.onnx import kvcache as kv

    plan = kv.make_plan(release.export.dims, release.parity.kv)
    tokens = kv.sequences(kv.vocab_of(lay), 64, release.parity.kv.seed)
    refs = {(k, r, n): ref for k, r, n, ref in kv.references(run, lay, tokens, plan)}
    return kv.check(
        run,
        lay,
        tokens,
        plan,
        lambda k, r, n: refs[(k, r, n)],
        release.parity.kv.tolerance,
        release.parity,
    )


def test_the_shipped_int8_graph_is_checked_before_its_per_token_rounding(
    gpt2: Workspace,
) -> None:
    """Issue 41: the quantize stage's dynamic INT8 takes a scale per token (nothing to pin);
    a prefill chunk's and a full pass's float rounding can still put an activation on the
    other side of a rounding step, so the check runs each quantized product on the
    activation before its rounding (the same integer weights): that view's cached decode
    equals its own full recompute within the float tolerance."""
    import onnx

    from schemas.loader import load_release
    from stages.quant import pertoken

    release = load_release(gpt2.write(gpt2_spec()))
    lay, path = _layout(gpt2), gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    ops = {n.op_type for n in onnx.load(path, load_external_data=False).graph.node}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops
    changed: list[int] = []
    rows = _self_check(
        _session(path, lambda g: changed.append(pertoken.unrounded(g))), lay, release
    )
    assert changed == [9]  # every quantized product of tiny-gpt2's two layers and its head
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok][:3]


@pytest.mark.parametrize("method", ["int4-weight-only", "int8-weight-only"])
def test_a_weight_only_graph_is_checked_on_its_float_path(tmp_path: Path, method: str) -> None:
    """A weight-only graph on onnxruntime's int8 kernels (MatMulNBits accuracy_level 4)
    rounds each row's activations inside the kernel, where a chunk's and a full pass's
    float rounding can land on either side of a step: kvcheck runs each MatMulNBits on its
    float path (the same integer weights, the activation unrounded), and the stage passes."""
    import onnx

    from stages.quant import pertoken

    ws = Workspace(tmp_path)
    spec = gpt2_spec()
    spec["quantization"] |= {"method": method, "budget": {"top1_agreement_min": 0.5}}
    spec["evaluation"]["thresholds"] = []  # the cache is the point here, not the accuracy
    for stage in ("pin", "export", "quantize"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    path = ws.out("tiny-gpt2", "quantize") / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and pertoken.unrounded(model) == len(nbits)
    after = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert [{a.name: a.i for a in n.attribute}["accuracy_level"] for n in nbits] == [4] * len(nbits)
    assert [{a.name: a.i for a in n.attribute}["accuracy_level"] for n in after] == [0] * len(nbits)
    report = ws.run("kvcheck", spec)
    assert report.status.value == "passed", report.reasons
    assert f"{len(nbits)} product(s) checked before rounding" in report.summary


def test_dynamic_int8_decodes_apart_through_its_cache_until_its_scales_are_pinned(
    gpt2: Workspace, tmp_path: Path
) -> None:
    """Why a graph with onnxruntime's per-call scales is checked pinned: a correct
    INT8-dynamic graph judged against its own full pass fails (a per-call scale couples
    positions); pinned, it is exact. And pinning to one pass's own ranges reproduces that
    pass bit for bit (the range each scale covered is recovered right)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from schemas.loader import load_release
    from stages.onnx import kvcache as kv
    from stages.quant import pinned as pq

    release = load_release(gpt2.write(gpt2_spec()))
    lay, path = _layout(gpt2), tmp_path / "per_call.onnx"
    quantize_dynamic(
        gpt2.out("tiny-gpt2", "export") / "model.onnx",
        path,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        weight_type=QuantType.QInt8,
    )
    raw = _self_check(_session(path), lay, release)
    assert not all(r.ok for r in raw)  # the noise the pinning removes

    exposed: list[tuple[str, str, str]] = []
    raw_all = _session(path, lambda g: exposed.extend(pq.expose_scales(g)))
    ranges = pq.Ranges()
    feeds = kv.feeds(lay, kv.sequences(kv.vocab_of(lay), 12, 3)[:1], np.ones((1, 12)), None)
    want = pq.collector(raw_all, exposed, ranges)(feeds)
    assert len(exposed) >= 4  # one per quantized activation (q, k and v share one)
    got = _session(path, lambda g: pq.pin(g, ranges))(feeds)
    for name in (t.name for t in lay.outputs):
        assert np.array_equal(want[name], got[name]), name

    ranges = pq.Ranges()
    kv.exercise(
        pq.collector(raw_all, exposed, ranges),
        lay,
        kv.sequences(kv.vocab_of(lay), 64, release.parity.kv.seed),
        kv.make_plan(release.export.dims, release.parity.kv),
    )
    pinned = _self_check(_session(path, lambda g: pq.pin(g, ranges)), lay, release)
    assert all(r.ok for r in pinned), kv.reasons("pinned", pinned)


def test_a_quantized_graph_whose_cache_path_is_off_is_stopped_on_the_shipped_graph(
    gpt2: Workspace,
) -> None:
    """A quantizer that leaves one layer's past values 0.1 % off (everything else intact):
    PyTorch and the export pass, kvcheck stops the shipped graph at its first cached steps."""
    import onnx
    from onnx import TensorProto, helper

    shipped = gpt2.out("tiny-gpt2", "quantize") / "model.onnx"
    kept = shipped.read_bytes()
    graph = onnx.load(shipped)
    past = "past_key_values.0.value"
    for node in graph.graph.node:
        node.input[:] = [f"{past}/off" if x == past else x for x in node.input]
    off = helper.make_tensor("off", TensorProto.FLOAT, [], [1.001])
    graph.graph.node.insert(0, helper.make_node("Mul", [past, "off"], [f"{past}/off"]))
    graph.graph.initializer.append(off)
    try:
        shipped.unlink()  # quantize's output may be a hard link: never write through it
        onnx.save(graph, shipped)
        report = gpt2.run("kvcheck", gpt2_spec())
    finally:
        shipped.unlink()
        shipped.write_bytes(kept)
    assert report.status.value == "failed"
    reason, kept = report.reasons  # PyTorch and the export are right
    assert "kept in build/tiny-gpt2/failed/kvcheck/" in kept
    # caught at the first cached steps (at step 0 the perturbed past moves the logits by
    # less than the tolerance; from step 1 it does not)
    assert re.match(
        r"shipped graph \(activation scales per token: 9 product\(s\) checked before "
        r"rounding\): cached decode at step [01] \(past [34]\): logits at position [34] "
        r"differs from a full recompute",
        reason,
    ), reason
    assert gpt2.run("kvcheck", gpt2_spec()).status.value == "passed"


def test_a_release_shipping_the_export_checks_it_once(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    spec = gpt2_spec()
    spec["quantization"] = {"method": "none"}
    for stage in ("pin", "export", "quantize"):
        assert ws.run(stage, spec).status.value == "passed"
    report = ws.run("kvcheck", spec)
    assert report.status.value == "passed", report.reasons
    assert "the shipped graph (the export itself: quantization.method none)" in report.summary
    assert KvcheckDetails.model_validate(report.details).shipped.rows == []


def test_a_fused_dynamic_kernel_cannot_be_pinned_and_is_refused_naming_the_node(
    tmp_path: Path,
) -> None:
    import onnx
    from onnx import TensorProto, helper

    from stages.quant import pinned as pq

    node = helper.make_node(
        "DynamicQuantizeMatMul",
        ["x", "w", "s", "z"],
        ["y"],
        name="mlp/fused",
        domain="com.microsoft",
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    with pytest.raises(StageError) as exc:
        pq.refuse_unpinnable(path)
    assert "node 'mlp/fused' (DynamicQuantizeMatMul, 1 such)" in exc.value.message
    assert "quantize_dynamic" in exc.value.hint


# ------------------------------------------------- quantization rounding in the presents
def _rounding_case(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """An FP32 full pass, and a quantized graph's full pass: FP32 plus INT8-sized noise
    (about 1 % of the values' rms) on a [1, 2, 40, 8] key."""
    rng = np.random.default_rng(seed)
    fp32 = {
        "logits": rng.standard_normal((1, 50)).astype(np.float32),
        "present.0.key": rng.standard_normal((1, 2, 40, 8)).astype(np.float32),
    }
    quant = {
        k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in fp32.items()
    }
    return fp32, quant


def _judged(got_key: np.ndarray, quant: dict[str, np.ndarray], fp32: Any) -> KvComparison:
    from schemas.spec.parity import ParityConfig
    from stages.onnx import kvcache as kv

    probe = kv.Probe(
        "step 0", 39, 39, {"logits": quant["logits"][:, None], "present.0.key": got_key}
    )
    rows = kv.judge(probe, quant, ParityConfig().tolerance, ParityConfig(), fp32)
    return next(r for r in rows if r.output == "present.0.key")


def test_a_rounding_flip_in_a_quantized_present_is_told_from_a_cache_bug() -> None:
    """One quantizer step flipped at one position, mixed thinly into the later positions
    (what float-level differences do to an INT8 graph's cache path): out of the FP32
    tolerance, accepted as rounding with its share. The same key 2 % off everywhere (a
    cache bug far smaller than a stale position), or one position replaced: refused."""
    from stages.onnx import kvcache as kv

    fp32, quant = _rounding_case()
    key = quant["present.0.key"]
    flipped = key.copy()
    flipped[0, 1, 20, :] += 0.004  # one step of a quantizer, one position
    flipped[0, :, 21:, :] += 2e-4 * np.sign(flipped[0, :, 21:, :])
    strict = _judged(flipped, quant, None)
    assert not strict.ok and strict.position == 20
    row = _judged(flipped, quant, fp32)
    assert row.ok and row.rounding is not None and 0 < row.rounding <= kv.ROUNDING_SHARE, row
    assert row.position == 20  # still named where it first moved

    for bad in (key * 1.02, np.concatenate([key[:, :, :39], key[:, :, :1]], axis=2)):
        refused = _judged(bad.astype(np.float32), quant, fp32)
        assert not refused.ok and refused.rounding is None, refused
    # where quantizing changed nothing, nothing is excused
    same = {k: v.copy() for k, v in quant.items()}
    assert not _judged(flipped, quant, same).ok


def test_the_logits_of_a_quantized_graph_are_never_excused() -> None:
    from schemas.spec.parity import ParityConfig
    from stages.onnx import kvcache as kv

    fp32, quant = _rounding_case(1)
    logits = quant["logits"] + 0.004
    probe = kv.Probe(
        "step 0", 39, 39, {"logits": logits[:, None], "present.0.key": quant["present.0.key"]}
    )
    rows = kv.judge(probe, quant, ParityConfig().tolerance, ParityConfig(), fp32)
    first = next(r for r in rows if r.output == "logits")
    assert not first.ok and "rounding" not in first.dump()
