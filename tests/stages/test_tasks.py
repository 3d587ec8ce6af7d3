"""Tasks beyond causal-lm (issue 13): the task registry, encoders through quantization,
label tasks served with their labels, and a quantization that gains nothing refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from schemas.quantsearch import PerNodeDetails
from schemas.tasks import TASKS, Task
from tests.conftest import REPO, Workspace
from tests.fixtures import architectures as matrix


def encoder(name: str, task: str) -> matrix.Arch:
    return next(a for a in matrix.ARCHITECTURES if a.name == name and a.task == task)


def prepare(ws: Workspace, arch: matrix.Arch, **quantization: Any) -> dict[str, Any]:
    slug = matrix.slug_of(arch)
    if not (ws.root / "models" / slug).is_dir():
        matrix.build_model(arch, ws.root / "models" / slug)
    spec = matrix.spec_for(arch, slug)
    spec["quantization"].update(quantization)
    if "budget" in quantization:  # a budget of its own: the example's reference checks go
        spec["evaluation"]["thresholds"] = []  # (one accuracy contract: evaluate applies it)
    return spec


# ------------------------------------------------------------------------------- registry
def test_the_registry_names_exactly_the_tasks_the_spec_accepts() -> None:
    from typing import get_args

    assert set(get_args(Task)) == set(TASKS)
    for task in TASKS.values():
        assert task.metrics and task.default_budget
        assert task.kv_cache == ("past_sequence" in task.dims)


def test_no_stage_branches_on_a_task_name() -> None:
    """Task behaviour lives in schemas/tasks.py; a stage comparing task names would let
    the registry and the code drift apart."""
    offenders = []
    for path in sorted((REPO / "stages").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "task ==" in line or "task !=" in line or "task in (" in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


# --------------------------------------------------------------------------- encoders PTQ
@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("encoders"))
    for name in ("BERT", "RoBERTa", "DistilBERT"):
        arch = encoder(name, "text-embedding")
        spec = prepare(ws, arch)
        for stage in ("pin", "export"):
            assert ws.run(stage, spec).status.value == "passed"
    return ws


@pytest.mark.parametrize("name", ["BERT", "RoBERTa", "DistilBERT"])
@pytest.mark.parametrize(
    "method,extra,op",
    [
        ("int8-dynamic", {}, "MatMulInteger"),
        ("int8-dynamic", {"per_channel": True}, "MatMulInteger"),
        ("int8-static", {}, "QuantizeLinear"),
        ("int4-weight-only", {"block_size": 32}, "MatMulNBits"),
    ],
)
def test_every_method_quantizes_every_encoder_family(
    encoders: Workspace, name: str, method: str, extra: dict[str, Any], op: str
) -> None:
    import onnx

    arch = encoder(name, "text-embedding")
    spec = prepare(encoders, arch, method=method, **extra)
    report = encoders.run("quantize", spec)
    assert report.status.value == "passed", report.reasons
    model = encoders.out(matrix.slug_of(arch), "quantize") / "model.onnx"
    assert op in {n.op_type for n in onnx.load(model).graph.node}
    budget = PerNodeDetails.model_validate(report.details).budget
    given = budget.model_dump(exclude_none=True)
    assert given == TASKS["text-embedding"].default_budget  # the spec gave none


def test_bert_pre_processing_falls_back_and_the_report_says_so(
    encoders: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORT's symbolic shape inference fails on BERT graphs; the stage retries without it.
    The failed pass writes sym_shape_infer_temp.onnx and its data into the working
    directory: none of that may land where `dvc repro` runs (the user's repository)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    spec = prepare(encoders, encoder("BERT", "text-embedding"), method="int8-dynamic")
    report = encoders.run("quantize", spec)
    assert list(cwd.iterdir()) == []
    assert report.status.value == "passed"
    preprocess = PerNodeDetails.model_validate(report.details).preprocess
    assert preprocess.startswith("symbolic shape inference failed (")
    assert "skip_symbolic_shape" in preprocess
    assert report.summary.endswith("(pre-processed without symbolic shape inference)")
    roberta = prepare(encoders, encoder("RoBERTa", "text-embedding"), method="int8-dynamic")
    other = encoders.run("quantize", roberta)  # its graph infers symbolically
    preprocess = PerNodeDetails.model_validate(other.details).preprocess
    assert preprocess == "quant_pre_process with symbolic shape inference"


def test_bert_takes_token_type_ids_and_distilbert_does_not(encoders: Workspace) -> None:
    def inputs(name: str) -> list[str]:
        slug = matrix.slug_of(encoder(name, "text-embedding"))
        info = json.loads((encoders.out(slug, "export") / "model_info.json").read_text())
        return [t["name"] for t in info["inputs"]]

    assert inputs("BERT") == ["input_ids", "attention_mask", "token_type_ids"]
    assert inputs("DistilBERT") == ["input_ids", "attention_mask"]


# ------------------------------------------------------------------- gains nothing: refused
def test_a_quantization_keeping_every_node_in_float_fails_with_remedies(
    encoders: Workspace,
) -> None:
    arch = encoder("DistilBERT", "text-embedding")
    # only all-float (200 dB) meets this budget; the cap allows keeping every node
    spec = prepare(
        encoders, arch, method="int8-dynamic", budget={"snr_db_min": 150.0}, max_float_nodes=99
    )
    report = encoders.run("quantize", spec)
    assert report.status.value == "failed"
    assert "kept all" in report.reasons[0] and "FP32 in all but name" in report.reasons[0]
    assert "per_channel" in report.reasons[0] and "int8-static" in report.reasons[0]
    out = encoders.out(matrix.slug_of(arch), "quantize")
    assert not (out / "model.onnx").exists()  # nothing that looks shipped stays


def test_the_size_ratio_limit_holds_at_its_boundary(encoders: Workspace) -> None:
    arch = encoder("DistilBERT", "text-embedding")
    passed = encoders.run("quantize", prepare(encoders, arch, method="int8-dynamic"))
    ratio = passed.metrics["size_ratio"]
    assert ratio < 0.9
    at = encoders.run(
        "quantize", prepare(encoders, arch, method="int8-dynamic", max_size_ratio=ratio)
    )
    assert at.status.value == "passed"
    below = ratio * (1 - 1e-9)
    over = encoders.run(
        "quantize", prepare(encoders, arch, method="int8-dynamic", max_size_ratio=below)
    )
    assert over.status.value == "failed"
    assert f"{ratio:.2f}x the FP32 file, above quantization.max_size_ratio" in over.reasons[0]


# --------------------------------------------------------------------------- label tasks
def test_label_scores_name_the_top_class_with_its_probability() -> None:
    """Through the shipped runtime module (imported in a child: mlserver's protobufs must
    not meet tritonclient's in the test process)."""
    code = (
        "import numpy as np, json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from shipyard_runtime.mlserver import label_scores\n"
        "out = label_scores(np.array([[[0.0, 2.0, 0.0], [5.0, 0.0, 0.0]]]), ['O', 'B', 'I'])\n"
        "print(json.dumps({'label': out['label'].tolist(), 'score': out['score'].tolist()}))\n"
        "try:\n    label_scores(np.zeros((1, 3)), ['a', 'b'])\nexcept RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    got = json.loads(first)
    assert got["label"] == [["B", "O"]]
    p1 = np.exp(2) / (np.exp(2) + 2)
    p2 = np.exp(5) / (np.exp(5) + 2)
    assert np.allclose(got["score"], [[p1, p2]], atol=1e-6)
    assert second == "2 labels for 3 scores"


def test_a_classifier_is_served_with_its_labels_over_http(tmp_path: Path) -> None:
    import aiohttp

    from stages.loadtesting import loadgen as lg
    from stages.loadtesting.server import LocalServer, assemble

    (tmp_path / "repo").mkdir()
    ws = Workspace(tmp_path / "repo")
    arch = encoder("RoBERTa", "sequence-classification")
    spec = prepare(ws, arch)
    slug = matrix.slug_of(arch)
    for stage in ("pin", "export", "quantize", "plan", "serve"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    info = json.loads((ws.out(slug, "export") / "model_info.json").read_text())
    assert info["labels"] == ["negative", "positive"]
    settings = yaml.safe_load(
        (ws.out(slug, "serve") / "serving" / "mlserver" / slug / "model-settings.json").read_text()
    )
    assert settings["parameters"]["extra"]["labels"] == ["negative", "positive"]
    tree = tmp_path / "tree"
    assemble(tree, sorted(ws.out(slug, "quantize").glob("model.onnx*")), ws.out(slug, "serve"))
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }

    async def infer() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            url = f"{srv.url}/v2/models/{slug}/infer"
            body = lg.v2_body(feeds, {})
            async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                assert r.status == 200, await r.text()
                return {o["name"]: o for o in (await r.json())["outputs"]}

    async def metadata() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{srv.url}/v2/models/{slug}") as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    with LocalServer(tree, slug, tmp_path / "log", 60) as srv:
        outputs = asyncio.run(infer())
        meta = asyncio.run(metadata())
    assert set(outputs) == {"logits", "label", "score"}
    # the metadata a V2 client reads is the signature it just used
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]} == {
        "input_ids": ("INT64", [-1, -1]),
        "attention_mask": ("INT64", [-1, -1]),
        "token_type_ids": ("INT64", [-1, -1]),
    }
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        ("logits", "FP32", [-1, 2]),
        ("label", "BYTES", [-1, 1]),
        ("score", "FP32", [-1]),
    ]
    bounds = {t["name"]: t.get("parameters") for t in meta["inputs"]}
    assert bounds["input_ids"] == {"low": 0, "high": matrix.VOCAB}
    logits = np.array(outputs["logits"]["data"], dtype=np.float64).reshape(2, 2)
    want = ["negative", "positive"]
    assert outputs["label"]["data"] == [want[i] for i in logits.argmax(1)]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert np.allclose(outputs["score"]["data"], probs.max(1), atol=1e-5)


def test_every_bounded_input_of_a_bert_is_refused_past_its_range_with_400(
    encoders: Workspace, tmp_path: Path
) -> None:
    """A BERT's token_type_ids index a table of type_vocab_size (2) rows: model_info
    records [low, high) for every integer input, and the server answers a value just past
    it with 400 naming the input, where ONNX Runtime would fail with a 500 (issue 28)."""
    import aiohttp

    from stages.loadtesting import loadgen as lg
    from stages.loadtesting.server import LocalServer

    tree, slug = served_bert(encoders, tmp_path / "tree")
    info = json.loads((encoders.out(slug, "export") / "model_info.json").read_text())
    bounds = {t["name"]: (t["low"], t["high"]) for t in info["inputs"]}
    assert bounds == {
        "input_ids": (0, matrix.VOCAB),
        "attention_mask": (0, 2),
        "token_type_ids": (0, 2),
    }
    ids = np.array([[5, 6, 7, 8]], dtype=np.int64)

    def feeds(**change: int) -> dict[str, np.ndarray]:
        out = {
            "input_ids": ids.copy(),
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
        }
        for name, value in change.items():
            out[name][0, -1] = value
        return out

    async def infer(body: dict[str, np.ndarray]) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            url = f"{srv.url}/v2/models/{slug}/infer"
            data = lg.v2_body(body, {})
            async with s.post(url, data=data, headers={"content-type": "application/json"}) as r:
                return r.status, await r.text()

    at_limit = [
        {"token_type_ids": 1},
        {"input_ids": matrix.VOCAB - 1},
        {"input_ids": 0},
        {"attention_mask": 0},
    ]
    past = [
        ({"token_type_ids": 2}, "input 'token_type_ids': values must lie in [0, 2); found 2"),
        ({"token_type_ids": -1}, "input 'token_type_ids': values must lie in [0, 2); found -1"),
        ({"input_ids": matrix.VOCAB}, f"values must lie in [0, {matrix.VOCAB}); found 512"),
        ({"attention_mask": 2}, "input 'attention_mask': values must lie in [0, 2); found 2"),
    ]
    with LocalServer(tree, slug, tmp_path / "log", 60) as srv:
        for change in at_limit:
            status, text = asyncio.run(infer(feeds(**change)))
            assert status == 200, (change, text)
        for change, reason in past:
            status, text = asyncio.run(infer(feeds(**change)))
            assert status == 400 and reason in text, (change, status, text)


def served_bert(ws: Workspace, tree: Path) -> tuple[Path, str]:
    """A BERT text-embedding release quantized, planned and served into `tree`."""
    from stages.loadtesting.server import assemble

    arch = encoder("BERT", "text-embedding")
    spec, slug = prepare(ws, arch), matrix.slug_of(arch)
    for stage in ("quantize", "plan", "serve"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    assemble(tree, sorted(ws.out(slug, "quantize").glob("model.onnx*")), ws.out(slug, "serve"))
    return tree, slug


@pytest.mark.parametrize("binary", [True, False])
def test_an_embedding_bundle_answers_only_the_outputs_asked_for_to_tritonclient(
    encoders: Workspace, tmp_path: Path, binary: bool
) -> None:
    """Open Inference Protocol V2 `outputs`: a client asking for the sentence embedding gets
    it alone (token_embeddings is most of an embedding response), as JSON or as binary
    tensors (tritonclient's default), over HTTP and gRPC, with the same numbers (issue 28)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from stages.loadtesting.server import LocalServer

    tree, slug = served_bert(encoders, tmp_path / "tree")
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 0]], dtype=np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": (ids > 0).astype(np.int64),
        "token_type_ids": np.zeros_like(ids),
    }

    def inputs(module: Any) -> list[Any]:
        made = []
        for name, value in feeds.items():
            tensor = module.InferInput(name, list(value.shape), "INT64")
            kw = {"binary_data": binary} if module is httpclient else {}
            tensor.set_data_from_numpy(value, **kw)
            made.append(tensor)
        return made

    with LocalServer(tree, slug, tmp_path / "log", 60) as srv:
        http = httpclient.InferenceServerClient(srv.url.removeprefix("http://"))
        every = http.infer(slug, inputs(httpclient), headers={})  # no outputs: all, binary
        want = [httpclient.InferRequestedOutput("sentence_embedding", binary_data=binary)]
        one = http.infer(slug, inputs(httpclient), outputs=want, headers={})
        grpc = grpcclient.InferenceServerClient(srv.grpc).infer(
            slug,
            inputs(grpcclient),
            outputs=[grpcclient.InferRequestedOutput("sentence_embedding")],
        )
    assert {o["name"] for o in one.get_response()["outputs"]} == {"sentence_embedding"}
    assert one.as_numpy("token_embeddings") is None
    assert {o.name for o in grpc.get_response().outputs} == {"sentence_embedding"}
    sentence = one.as_numpy("sentence_embedding")
    assert sentence.dtype == np.float32 and sentence.ndim == 2 and sentence.shape[0] == 2
    assert every.as_numpy("token_embeddings").shape == (2, 4, sentence.shape[1])
    assert np.array_equal(every.as_numpy("sentence_embedding"), sentence)
    assert np.array_equal(grpc.as_numpy("sentence_embedding"), sentence)
