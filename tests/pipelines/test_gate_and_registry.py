"""The PR gate and the registry: publish, promote, rollback, races, tampering."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.gate import MARKER, gate
from pipelines.registry import Registry
from schemas import RegistryError
from tests.conftest import Workspace, built_as, gpt2_spec

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))
ONNX = "serving/triton/tiny-gpt2/1/model.onnx"


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(str(tmp_path / "registry"))


def bundle(ws: Workspace) -> Path:
    return ws.out("tiny-gpt2", "bundle")


def verdicts(result) -> dict[str, str]:
    return {row.check: row.verdict for row in result.rows}


def test_gate_passes_a_built_release_with_no_production_yet(built_gpt2, registry) -> None:
    result = gate(built_gpt2.root, [built_gpt2.spec(gpt2_spec())], registry)
    assert result.ok
    assert verdicts(result)["evaluate"] == "PASS"
    assert verdicts(result)["perplexity vs production"] == "n/a"
    assert "## Shipyard release gate: PASS" in result.markdown()


def test_gate_fails_on_a_missing_or_failed_stage(ws: Workspace, registry) -> None:
    ws.run("pin", gpt2_spec(pins={"packages": {"torch": "==1.0"}}))
    result = gate(ws.root, [ws.spec(gpt2_spec())], registry)
    assert not result.ok
    rows = verdicts(result)
    assert rows["pin"] == "FAIL" and rows["export"] == "FAIL"
    detail = next(r.detail for r in result.rows if r.check == "export")
    assert detail == "no report: run `dvc repro export@tiny-gpt2`"
    assert "❌ FAIL" in result.markdown()


def test_gate_treats_a_skipped_stage_as_a_failure(built_gpt2, registry, tmp_path) -> None:
    (tmp_path / "copy").mkdir()
    ws = Workspace(tmp_path / "copy")
    shutil.copytree(built_gpt2.root / "build", ws.root / "build")
    report = ws.out("tiny-gpt2", "parity") / "report.json"
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "status": "skipped", "reasons": ["no GPU"]}))
    result = gate(ws.root, [ws.spec(gpt2_spec())], registry)
    assert verdicts(result)["parity"] == "FAIL" and not result.ok


def test_publish_is_immutable_per_version(built_gpt2, registry, tmp_path) -> None:
    first = registry.publish(bundle(built_gpt2), "tiny-gpt2", "0.1.0")
    assert registry.publish(bundle(built_gpt2), "tiny-gpt2", "0.1.0").already
    other = tmp_path / "other"
    shutil.copytree(bundle(built_gpt2), other)
    card = other / "MODEL_CARD.md"
    card.chmod(0o644)
    card.write_text(card.read_text() + "edited\n")
    with pytest.raises(RegistryError, match="does not match its manifest"):
        registry.publish(other, "tiny-gpt2", "0.1.0")
    manifest = json.loads(
        Path(registry.path("releases", "tiny-gpt2", "0.1.0", "manifest.json")).read_text()
    )
    assert first.record.digest == manifest["subject"][0]["digest"]["sha256"]


def test_regression_vs_production_turns_the_gate_red(built_gpt2, registry) -> None:
    registry.publish(bundle(built_gpt2), "tiny-gpt2", "0.1.0")
    registry.promote("tiny-gpt2", "0.1.0", "production", "baseline")
    spec = gpt2_spec(version="0.2.0")
    spec["quantization"]["method"] = "int4-weight-only"  # coarser: perplexity gets worse
    spec["evaluation"]["thresholds"] = [
        {
            "metric": "perplexity",
            "min_relative_change": 0.0,
            "greater_is_better": False,
            "baseline": "production",
        }
    ]
    try:
        for stage in ("quantize", "evaluate"):
            assert built_gpt2.run(stage, spec).status.value == "passed"
        result = gate(built_gpt2.root, [built_gpt2.spec(spec)], registry)
    finally:  # leave the shared workspace as the other tests expect it
        for stage in ("quantize", "evaluate"):
            built_gpt2.run(stage, gpt2_spec())
    row = next(r for r in result.rows if r.check.startswith("perplexity vs production"))
    assert row.verdict == "FAIL" and not result.ok
    assert "vs production" in row.detail and "needs <=" in row.detail


def test_promote_refuses_a_tampered_published_bundle_naming_the_file(built_gpt2, registry) -> None:
    registry.publish(bundle(built_gpt2), "tiny-gpt2", "0.1.0")
    weights = Path(registry.path("releases", "tiny-gpt2", "0.1.0", *ONNX.split("/")))
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RegistryError) as info:
        registry.promote("tiny-gpt2", "0.1.0", "production", "should fail")
    assert f"{ONNX}: changed (sha256 differs from the manifest)" in str(info.value)
    assert registry.channel("tiny-gpt2", "production") is None and registry.history() == []


def test_rollback_twice_walks_back_through_the_history(built_gpt2, registry) -> None:
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        copy = built_as(bundle(built_gpt2), Path(registry.url).parent / f"v{version}", version)
        registry.publish(copy, "tiny-gpt2", version)
        registry.promote("tiny-gpt2", version, "production", f"ship {version}")
    assert registry.rollback("tiny-gpt2", "production", "bad").to == "tiny-gpt2@1.1.0"
    assert registry.rollback("tiny-gpt2", "production", "worse").to == "tiny-gpt2@1.0.0"
    with pytest.raises(RegistryError, match="no earlier version to roll back to"):
        registry.rollback("tiny-gpt2", "production", "nothing left")
    actions = [(e.seq, e.action, e.from_, e.to) for e in registry.history()]
    assert actions[-2:] == [
        (4, "rollback", "tiny-gpt2@1.2.0", "tiny-gpt2@1.1.0"),
        (5, "rollback", "tiny-gpt2@1.1.0", "tiny-gpt2@1.0.0"),
    ]
    assert registry.channel("tiny-gpt2", "production").version == "1.0.0"


def test_two_racing_promotions_are_both_recorded_in_order(built_gpt2, registry) -> None:
    for version in ("2.0.0", "2.1.0"):
        copy = built_as(bundle(built_gpt2), Path(registry.url).parent / f"v{version}", version)
        registry.publish(copy, "tiny-gpt2", version)
    env = {**os.environ, "SHIPYARD_REGISTRY": registry.url, "SHIPYARD_ROOT": str(built_gpt2.root)}
    procs = [
        subprocess.Popen(
            [SHIPYARD, "promote", f"tiny-gpt2@{v}", "--to", "production", "--reason", f"race {v}"],
            env=env,
            cwd=built_gpt2.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for v in ("2.0.0", "2.1.0")
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    history = registry.history()
    assert [e.seq for e in history] == [1, 2]
    assert {e.to for e in history} == {"tiny-gpt2@2.0.0", "tiny-gpt2@2.1.0"}
    assert history[1].from_ == history[0].to  # the second saw the first: serialized
    assert registry.channel("tiny-gpt2", "production").version == history[1].to[-5:]


def test_cli_pr_flow_gate_publish_promote_status(built_gpt2, tmp_path) -> None:
    env = {
        **os.environ,
        "SHIPYARD_REGISTRY": str(tmp_path / "reg"),
        "SHIPYARD_ROOT": str(built_gpt2.root),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SHIPYARD, *args],
            env=env,
            cwd=built_gpt2.root,
            text=True,
            capture_output=True,
            timeout=120,
        )

    done = run("gate", "tiny-gpt2", "--report", str(tmp_path / "gate.md"))
    assert done.returncode == 0, done.stdout + done.stderr
    marker, head = (tmp_path / "gate.md").read_text().splitlines()[:2]
    assert marker == MARKER  # what the PR comment script finds its own comment by
    assert head.startswith("## Shipyard release gate: PASS")
    assert run("publish", "tiny-gpt2").returncode == 0
    assert run("promote", "tiny-gpt2@0.1.0", "--to", "staging").returncode == 0
    assert "tiny-gpt2        staging    0.1.0" in run("status").stdout
    assert "promote  staging" in run("history").stdout
    done = run("rollback", "staging")
    assert done.returncode == 5 and "no earlier version" in done.stderr
    done = run("gate", "no-such-release")
    assert done.returncode == 2 and "no release named 'no-such-release'" in done.stderr
