from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from schemas.artifacts import LoadTestSummary
from stages.bundling.hashing import hash_range, hash_shards, shard_ranges
from stages.bundling.layout import core_modules
from stages.bundling.oms import load_manifest, verify_bundle
from stages.engine import why_unavailable
from stages.manifest import CHECKED
from tests.conftest import Workspace, gpt2_spec, writable_copy

RUNTIME_CORE = core_modules()


@pytest.fixture
def bundle(built_gpt2: Workspace, tmp_path: Path) -> Path:
    """A private copy of the built bundle that a test may tamper with."""
    return writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "bundle")


def test_shards_cover_the_file_and_match_hashlib(tmp_path: Path) -> None:
    data = bytes(range(256)) * 41  # 10,496 bytes: 3 shards of 4 KiB
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert shard_ranges(len(data), 4096) == [(0, 4096), (4096, 8192), (8192, 10496)]
    digests = hash_shards({"blob": path}, shard=4096, workers=2)
    assert digests["blob:4096:8192"] == hashlib.sha256(data[4096:8192]).hexdigest()
    assert hash_range(path) == hashlib.sha256(data).hexdigest()
    assert shard_ranges(0) == [(0, 0)]


def test_manifest_lists_weights_and_reports_in_oms_layout(built_gpt2: Workspace) -> None:
    manifest = load_manifest(built_gpt2.out("tiny-gpt2", "bundle") / "manifest.json")
    raw = json.loads((built_gpt2.out("tiny-gpt2", "bundle") / "manifest.json").read_text())
    assert raw["_type"] == "https://in-toto.io/Statement/v1"
    assert raw["predicateType"] == "https://model_signing/signature/v1.0"
    assert set(manifest.files()) == {
        "shipyard.json",
        # the file list its builder signed (unsigned here: no SHIPYARD_BUILDER_KEY)
        "attestations/bundle.json",
        "model/model_info.json",
        # the checkpoint's config and tokenizer: a client needs nothing else
        "model/files/config.json",
        "model/files/generation_config.json",
        "model/files/tokenizer.json",
        "reports/pin.json",
        "reports/export.json",
        "reports/evalcheck.json",
        "reports/parity.json",
        "reports/kvcheck.json",
        "reports/quantize.json",
        "reports/evaluate.json",
        "reports/plan.json",
        "reports/serve.json",
        "reports/engine.json",
        "engine/profiles.json",
        "reports/loadtest.json",
        "reports/loadtest/loadtest.json",
        "reports/loadtest/latency_throughput.png",
        "reports/loadtest/latency_throughput.svg",
        "reports/loadtest/ttft_itl.png",
        "reports/loadtest/ttft_itl.svg",
        # the curves' data, as `dvc plots` reads them
        "reports/loadtest/plots/latency_throughput.json",
        "reports/loadtest/plots/streaming.json",
        "model/quant_info.json",
        "serving.yaml",
        "ort_session.json",
        # the launcher (token, body cap, timeouts) and the limits it enforces
        "serving/mlserver/shipyard_serve.py",
        "serving/mlserver/shipyard_server.json",
        # alert rules from the load test's baseline, their promtool tests, a dashboard
        "monitoring/alerts.yml",
        "monitoring/alerts_test.yml",
        "monitoring/dashboard.json",
        "serving/triton/tiny-gpt2/config.pbtxt",
        "serving/triton/tiny-gpt2/1/model.onnx",
        "serving/mlserver/settings.json",
        "serving/mlserver/tiny-gpt2/model-settings.json",
        # the runtime package: its core modules and the MLServer adapter
        "serving/mlserver/tiny-gpt2/shipyard_runtime/mlserver.py",
        *(f"serving/mlserver/tiny-gpt2/shipyard_runtime/{m}" for m in RUNTIME_CORE),
        # the Triton entry that generates: the same engine, the model read from tiny-gpt2/1/
        "serving/triton/tiny-gpt2-generate/config.pbtxt",
        "serving/triton/tiny-gpt2-generate/1/model.py",
        *(f"serving/triton/tiny-gpt2-generate/1/shipyard_runtime/{m}" for m in RUNTIME_CORE),
        "serving/text/tokenizer.json",  # tiny-gpt2 ships no tokenizer_config.json
        "MODEL_CARD.md",
        # cluster manifests (KServe and plain Kubernetes) and the runtime image they name
        "deploy/kserve/servingruntime.yaml",
        "deploy/kserve/inferenceservice.yaml",
        "deploy/kubernetes/deployment.yaml",
        "deploy/kubernetes/service.yaml",
        "deploy/kubernetes/hpa.yaml",
        "deploy/Dockerfile",
    }
    onnx = "serving/triton/tiny-gpt2/1/model.onnx"  # stored once: Triton's folder
    onnx_bytes = (built_gpt2.out("tiny-gpt2", "bundle") / onnx).read_bytes()
    [shard] = manifest.files()[onnx]
    assert shard.digest == hashlib.sha256(onnx_bytes).hexdigest()
    assert shard.algorithm == "sha256-sharded-1073741824"
    facts = json.loads((built_gpt2.out("tiny-gpt2", "bundle") / "shipyard.json").read_text())
    assert facts["pins"]["packages"]["torch"].startswith("2.13.0")
    assert set(facts["stages"]) == set(CHECKED)  # every stage before the manifest
    assert facts["engine"]["status"] == ("skipped" if why_unavailable() else "passed")
    assert [p["name"] for p in facts["engine"]["profiles"]] == ["default"]
    assert facts["loadtest"]["target"] == "local MLServer"
    assert facts["evaluation"]["greedy_exact_match"] == 1.0
    assert facts["quantization"] == {
        "method": "int8-dynamic",
        "dtype": "int8",
        "float_nodes": [],
        # the accuracy contract (an explicit method holds the bounds themselves: no margin)
        "budget": {"perplexity_increase_max": 0.01, "top1_agreement_min": 0.98},
        "margin": 0.0,
    }
    assert len(facts["calibration"]["sha256"]) == 64
    # the typed view of the same file (schemas/facts.py), every part the artifact it came from
    from schemas.facts import BundleFacts
    from stages.bundling.oms import read_facts

    typed = read_facts(built_gpt2.out("tiny-gpt2", "bundle"), BundleFacts)
    assert typed.serving.max_batch_size == facts["serving"]["max_batch_size"]
    assert typed.quantization.float_nodes == [] and typed.stages["parity"].status == "passed"


def test_the_facts_are_typed_and_a_stray_key_is_refused() -> None:
    """BundleFacts forbids what it does not type (the manifest validates what it writes);
    FactsHead, what any version's bundle promises, keeps keys a later version adds."""
    from pydantic import ValidationError

    from schemas.facts import BundleFacts, FactsHead

    head = FactsHead.model_validate(
        {"release": "r", "version": "1.0.0", "stages": {"pin": {"status": "passed"}}, "new": 1}
    )
    assert head.stages["pin"].status == "passed" and head.evaluation == {}
    for broken in ({"release": "r"}, {"release": "r", "version": 1}, {"version": "1"}):
        with pytest.raises(ValidationError):
            FactsHead.model_validate(broken)
    with pytest.raises(ValidationError, match="task"):
        BundleFacts.model_validate({"release": "r", "version": "1.0.0"})


def test_verify_accepts_an_intact_bundle(bundle: Path) -> None:
    assert verify_bundle(bundle) == []


def test_verify_names_a_tampered_weight_file(bundle: Path) -> None:
    path = bundle / "serving/triton/tiny-gpt2/1/model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert verify_bundle(bundle) == [
        "serving/triton/tiny-gpt2/1/model.onnx: changed (sha256 differs from the manifest)"
    ]


def test_verify_names_added_and_missing_files(bundle: Path) -> None:
    (bundle / "reports" / "parity.json").unlink()
    (bundle / "backdoor.py").write_text("print('hi')")
    assert verify_bundle(bundle) == [
        "backdoor.py: added (not in the manifest)",
        "reports/parity.json: missing (listed in the manifest)",
    ]


def test_verify_notices_an_edited_manifest(bundle: Path) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    data["predicate"]["resources"] = data["predicate"]["resources"][1:]
    path.write_text(json.dumps(data))
    problems = verify_bundle(bundle)
    assert problems == ["manifest.json: subject digest does not match its resources (edited?)"]


def test_serving_config_is_rendered_from_spec_and_export(built_gpt2: Workspace) -> None:
    serving = yaml.safe_load((built_gpt2.out("tiny-gpt2", "bundle") / "serving.yaml").read_text())
    assert serving == {
        "model_path": "serving/triton/tiny-gpt2/1/model.onnx",
        "dtype": "int8",
        "port": 8000,
        # the engine's rows, sized by the plan from its KV budget (the export probes 3)
        "max_batch_size": 16,
        "max_queue_depth": 64,
        "max_context_length": 88,
        # 2 (k, v) x 2 layers x 4 heads x 16 head_dim x 16 rows x 4 bytes (fp32 KV) x the 26
        # tokens a sequence may hold (past_sequence.max + 2 of the 88-token context)
        "kv_cache_budget": 2 * 2 * 4 * 16 * 16 * 26 * 4,
        "request_timeout_seconds": 30.0,
        "streaming": True,
        "ort_session_config": "ort_session.json",
    }
    card = (built_gpt2.out("tiny-gpt2", "bundle") / "MODEL_CARD.md").read_text()
    assert "| parity | passed |" in card and "Apache-2.0" in card
    # the accuracy contract: each bound with what evaluate measured on the evaluation set
    facts = json.loads((built_gpt2.out("tiny-gpt2", "bundle") / "shipyard.json").read_text())
    measured = facts["evaluation"]
    assert "## Accuracy contract" in card and "with 0 % of each bound's" in card
    top1, ppl = measured["top1_agreement"], measured["perplexity_increase"]
    assert f"| top1\\_agreement | >= 0.98 | {top1:.4g} |" in card, card
    assert f"| perplexity\\_increase | <= 0.01 | {ppl:.4g} |" in card


def test_the_engine_serves_more_rows_than_the_export_probes_its_raw_entry_does_not(
    built_gpt2: Workspace,
) -> None:
    """A generation release may serve more rows than its export's batch max (issue 41 item
    5: the plan sizes them from the KV budget); the raw graph's Triton entry stays within
    the export's batch. A one-pass model's batch is still capped at validate (tests/schemas
    /test_cross_section_boundaries.py)."""
    spec = gpt2_spec()
    spec["bundle"] = {"serving": {"max_batch_size": 64}}
    report = built_gpt2.run("serve", spec)
    assert report.status.value == "passed", report.reasons
    out = built_gpt2.out("tiny-gpt2", "serve")
    settings = json.loads(next(out.rglob("model-settings.json")).read_text())["parameters"]["extra"]
    assert settings["engine"]["max_rows"] == 64
    raw = next(p for p in out.rglob("config.pbtxt") if 'backend: "python"' not in p.read_text())
    assert "max_batch_size: 3" in raw.read_text()
    built_gpt2.run("serve", gpt2_spec())  # restore the shared workspace


def test_manifest_refuses_a_release_whose_checks_failed(ws: Workspace) -> None:
    spec = gpt2_spec()
    from stages import STAGES

    for stage in STAGES[: STAGES.index("manifest")]:  # every check passes, then parity fails
        ws.run(stage, spec)
    ws.run("parity", gpt2_spec(parity={"tolerance": {"atol": 0, "rtol": 0}, "outputs": {}}))
    report = ws.run("manifest", spec)
    assert report.status.value == "failed"
    assert "upstream stages did not pass (parity: failed)" in report.reasons[0]


@pytest.mark.parametrize("tamper", ["edit", "add"])
def test_bundle_refuses_an_upstream_file_the_manifest_does_not_seal(
    built_gpt2: Workspace, tmp_path: Path, tamper: str
) -> None:
    """bundle's DVC entry depends on the manifest, not on the ten folders it copies from
    (`sealed_by`): so a file in them that changed or appeared after the manifest was
    written must stop the bundle, never ship."""
    ws = Workspace.__new__(Workspace)
    ws.root = tmp_path / "root"
    writable_copy(built_gpt2.root, ws.root)
    serve = ws.out("tiny-gpt2", "serve")
    if tamper == "edit":
        target = serve / "serving.yaml"
        target.write_text(target.read_text() + "# edited after the manifest\n")
    else:
        (serve / "extra.txt").write_text("not in the manifest\n")
    report = ws.run("bundle", gpt2_spec())
    assert report.status.value == "failed"
    assert "does not verify" in report.reasons[0]
    named = "serving.yaml: changed" if tamper == "edit" else "extra.txt: added"
    assert named in report.reasons[0]
    # nothing that verifies is left where the bundle goes
    assert verify_bundle(ws.out("tiny-gpt2", "bundle")) != []


def test_the_built_bundles_alert_rules_pass_promtool_with_this_builds_baseline(
    built_gpt2: Workspace,
) -> None:
    """What a bundle ships in monitoring/ (not a hand-written baseline): promtool accepts
    the rules and their unit tests pass, and each latency threshold is this build's own
    load-test p95 times its stated margin."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus")
    folder = built_gpt2.out("tiny-gpt2", "bundle") / "monitoring"
    for args in (("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml")):
        done = subprocess.run(
            [promtool, *args], cwd=folder, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
    summary = built_gpt2.out("tiny-gpt2", "loadtest") / LoadTestSummary.FILE
    p95_ttft = LoadTestSummary.model_validate_json(summary.read_text()).summary.p95_ttft_ms
    assert p95_ttft is not None
    rules = {
        r["alert"]: r
        for r in yaml.safe_load((folder / "alerts.yml").read_text())["groups"][0]["rules"]
    }
    threshold = float(rules["ShipyardTTFTHigh"]["expr"].rsplit(">", 1)[1])
    assert threshold == pytest.approx(p95_ttft * 2 / 1000, rel=1e-3)  # the stated 2x margin


def test_the_model_card_tabulates_untimed_and_untried_recipes(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    """An auto search's table as the manifest hands it to the card (None fields dropped):
    a timed row, one that missed the budget and was never timed, and one not built (a
    finer recipe of its scheme missed). The card renders each: "not timed", and "-" for
    the size of a recipe never built (a crash here failed a release's bundle stage)."""
    from schemas.artifacts import QuantInfo, RecipeRow

    ws = Workspace.copy_of(built_gpt2, tmp_path / "repo")
    path = ws.out("tiny-gpt2", "quantize") / QuantInfo.FILE
    info = QuantInfo.model_validate_json(path.read_text())
    row = {"method": "int8-dynamic", "float_classes": [], "calibration": {}, "holdout": {}}
    recipes = [
        RecipeRow(
            recipe="int8-dynamic-per-channel",
            **{**row, "calibration": {"greedy_agreement": 0.5}},
            size_ratio=0.3,
            chosen=False,
            why="calibration (with margin): greedy_agreement 0.5 < 0.92",
        ),
        RecipeRow(
            recipe="int8-dynamic",
            **row,
            size_ratio=0.0,
            chosen=False,
            why="not tried: int8-dynamic-per-channel missed the accuracy budget",
        ),
        RecipeRow(
            recipe="int8-dynamic-smoothquant",
            **{**row, "holdout": {"greedy_agreement": 0.95}},
            size_ratio=0.31,
            speedup=1.4,
            chosen=True,
            why="meets the budget with its margin, fast and small enough",
        ),
    ]
    path.write_text(info.model_copy(update={"recipes": recipes}).model_dump_json())
    for stage in ("manifest", "bundle"):
        report = ws.run(stage, gpt2_spec())
        assert report.status.value == "passed", (stage, report.reasons)
    card = (ws.out("tiny-gpt2", "bundle") / "MODEL_CARD.md").read_text()
    table = card[card.index("## Quantization recipes tried") :].splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table if "int8" in line}
    assert rows["int8-dynamic-per-channel"][2:4] == ["0.30", "not timed"]
    assert rows["int8-dynamic"][2:4] == ["-", "not timed"]
    assert rows["int8-dynamic-smoothquant"][2:4] == ["0.31", "1.40"]
    assert rows["int8-dynamic-smoothquant"][5] == "yes"
