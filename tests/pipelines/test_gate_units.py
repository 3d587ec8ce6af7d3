"""The gate's rules at their boundaries, in-process on a synthetic build folder (issue 16:
the gate's end-to-end tests build tiny-gpt2, which mutation testing cannot afford per
mutant). The reports are real StageReport files where the stages write them, the bundle is
a real verifiable folder, production is a real registry with a published bundle; the CLI
is the real `shipyard gate` entry point and its exit code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipelines.cli import main
from pipelines.gate import MARKER, GateResult, Row, describe, gate
from pipelines.registry import Registry
from schemas import ReleaseSpec
from schemas.loader import load_release
from stages import load_stages
from stages._contract import report_dir
from tests.conftest import Workspace, gpt2_spec, remanifest
from tests.pipelines.test_registry_units import make_bundle

RELEASE = "tiny-gpt2"
STAGES = list(load_stages())


def report(ws: Workspace, stage: str, status: str = "passed", **extra: Any) -> None:
    folder = report_dir(ws.root / "build" / RELEASE, stage)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "stage": stage,
        "release": RELEASE,
        "status": status,
        "summary": f"{stage} summary",
        "reasons": extra.pop("reasons", []),
        "metrics": extra.pop("metrics", {}),
        "optional": extra.pop("optional", False),
        "checks": extra.pop("checks", []),
        "details": extra.pop("details", {}),
    }
    (folder / "report.json").write_text(json.dumps(data))


def all_passed(ws: Workspace) -> None:
    for stage in STAGES:
        report(ws, stage)


def spec(ws: Workspace, **overrides: Any) -> ReleaseSpec:
    """tiny-gpt2 without production thresholds (those have their own tests below)."""
    s = gpt2_spec(**overrides)
    s["evaluation"]["thresholds"] = []
    return ws.spec(s)


def verdicts(result: GateResult) -> dict[str, str]:
    return {r.check: r.verdict for r in result.rows}


def test_every_stage_passed_is_a_pass(ws: Workspace) -> None:
    all_passed(ws)
    result = gate(ws.root, [spec(ws)], None)
    assert verdicts(result) == dict.fromkeys(STAGES, "PASS")
    assert result.ok and [r.detail for r in result.rows][0] == f"{STAGES[0]} summary"
    assert result.markdown().startswith(f"{MARKER}\n## Shipyard release gate: PASS\n\n")
    assert result.markdown().endswith("\n\nEvery check passed.\n")


def test_a_missing_failed_or_skipped_stage_fails_naming_why(ws: Workspace) -> None:
    all_passed(ws)
    shutil.rmtree(report_dir(ws.root / "build" / RELEASE, "parity"))
    report(ws, "quantize", "failed", reasons=["snr 3 dB < 20", "size 1.0x"])
    report(ws, "evaluate", "failed")  # no reasons: the summary
    report(ws, "loadtest", "skipped", reasons=["no server"], optional=True)
    rows = {r.check: r for r in gate(ws.root, [spec(ws)], None).rows}
    assert (rows["parity"].verdict, rows["parity"].detail) == (
        "FAIL",
        f"no report: run `dvc repro parity@{RELEASE}`",
    )
    assert (rows["quantize"].verdict, rows["quantize"].detail) == (
        "FAIL",
        "snr 3 dB < 20; size 1.0x",
    )
    assert (rows["evaluate"].verdict, rows["evaluate"].detail) == ("FAIL", "evaluate summary")
    # only the engine may skip: an optional skip elsewhere is still a failure
    assert (rows["loadtest"].verdict, rows["loadtest"].detail) == (
        "FAIL",
        "skipped, but required: no server",
    )
    assert sum(r.verdict == "FAIL" for r in rows.values()) == 4


@pytest.mark.parametrize(
    ("optional", "required", "verdict"),
    [(True, False, "n/a"), (True, True, "FAIL"), (False, False, "FAIL")],
)
def test_the_engine_may_skip_only_where_optional_and_not_required(
    ws: Workspace, optional: bool, required: bool, verdict: str
) -> None:
    all_passed(ws)
    report(ws, "engine", "skipped", reasons=["no GPU"], optional=optional)
    result = gate(ws.root, [spec(ws, engine={"required": required})], None)
    engine = next(r for r in result.rows if r.check == "engine")
    assert engine.verdict == verdict and engine.release == RELEASE
    if verdict == "n/a":
        assert engine.detail == "skipped (optional): engine summary"
    else:
        assert engine.detail == "skipped, but required: no GPU"
    assert result.ok is (verdict == "n/a")


def test_the_built_bundle_is_verified_and_its_digest_shown(ws: Workspace) -> None:
    all_passed(ws)
    assert "bundle verify" not in verdicts(gate(ws.root, [spec(ws)], None))  # none built
    bundle = make_bundle(ws.root / "build" / RELEASE / "bundle")
    digest = json.loads((bundle / "manifest.json").read_text())["subject"][0]["digest"]["sha256"]
    row = next(r for r in gate(ws.root, [spec(ws)], None).rows if r.check == "bundle verify")
    assert (row.verdict, row.detail) == (
        "PASS",
        f"bundle digest (OMS root, manifest.json subject) {digest}",
    )
    for name in ("a", "b", "c", "d"):
        (bundle / f"{name}.py").write_text("x")
    result = gate(ws.root, [spec(ws)], None)
    row = next(r for r in result.rows if r.check == "bundle verify")
    assert row.verdict == "FAIL" and not result.ok and row.release == RELEASE
    assert row.detail == "; ".join(f"{n}.py: added (not in the manifest)" for n in "abc")


def test_each_judged_slo_is_a_row_with_its_verdict(ws: Workspace) -> None:
    all_passed(ws)
    slo = [
        {"name": "SLO p95_latency_ms", "ok": True, "why": "p95 80 ms <= 100"},
        {"name": "SLO min_throughput_rps", "ok": False, "why": "12 rps < 20"},
    ]
    report(ws, "loadtest", checks=slo)
    rows = {r.check: r for r in gate(ws.root, [spec(ws)], None).rows}
    assert (rows["SLO p95_latency_ms"].verdict, rows["SLO p95_latency_ms"].detail) == (
        "PASS",
        "p95 80 ms <= 100",
    )
    assert rows["SLO min_throughput_rps"].verdict == "FAIL"


# --------------------------------------------------------------------------- production
def production_spec(ws: Workspace, change: float, up: bool = False) -> ReleaseSpec:
    s = gpt2_spec(version="0.2.0")
    s["evaluation"]["thresholds"] = [
        {
            "metric": "perplexity",
            "min_relative_change": change,
            "greater_is_better": up,
            "baseline": "production",
        }
    ]
    return ws.spec(s)


def in_production(ws: Workspace, perplexity: float | None) -> Registry:
    registry = Registry(str(ws.root / "registry"))
    evaluation = {} if perplexity is None else {"perplexity": perplexity}
    bundle = make_bundle(
        ws.root / "prod-bundle", evaluation=evaluation, name=RELEASE, version="0.1.0"
    )
    registry.publish(bundle, RELEASE, "0.1.0")
    registry.promote(RELEASE, "0.1.0", "production", "first")
    return registry


def candidate(ws: Workspace, perplexity: float) -> None:
    all_passed(ws)
    report(ws, "evaluate", metrics={"perplexity": perplexity})


def production_row(result: GateResult) -> Row:
    (row,) = [r for r in result.rows if "vs production" in r.check]
    return row


@pytest.mark.parametrize(
    ("change", "value", "verdict"),
    [
        (0.0, 100.0, "PASS"),  # equal, no change demanded
        (0.0, 100.5, "FAIL"),  # worse (lower is better), no loss allowed
        (-0.01, 101.0, "PASS"),  # exactly the 1 % loss allowed
        (-0.01, 101.5, "FAIL"),  # past it
        (0.01, 99.0, "PASS"),  # exactly the 1 % gain demanded
        (0.01, 99.5, "FAIL"),  # short of it
    ],
)
def test_a_production_threshold_at_its_boundary(
    ws: Workspace, change: float, value: float, verdict: str
) -> None:
    registry = in_production(ws, 100.0)
    candidate(ws, value)
    row = production_row(gate(ws.root, [production_spec(ws, change)], registry))
    assert (row.check, row.verdict) == ("perplexity vs production 0.1.0", verdict), row.detail
    assert row.release == RELEASE and row.detail.startswith(f"perplexity {value:.4g} vs ")


def test_greater_is_better_flips_the_direction(ws: Workspace) -> None:
    registry = in_production(ws, 100.0)
    candidate(ws, 99.0)
    row = production_row(gate(ws.root, [production_spec(ws, -0.01, up=True)], registry))
    assert row.verdict == "PASS"
    candidate(ws, 98.5)
    row = production_row(gate(ws.root, [production_spec(ws, -0.01, up=True)], registry))
    assert row.verdict == "FAIL"


def test_without_production_the_comparison_is_a_loud_n_a_or_with_require_baseline_a_fail(
    ws: Workspace,
) -> None:
    candidate(ws, 100.0)
    for registry in (None, Registry(str(ws.root / "empty"))):
        row = production_row(gate(ws.root, [production_spec(ws, 0.0)], registry))
        assert (row.check, row.verdict) == ("perplexity vs production", "n/a")
        assert row.detail.startswith("NO BASELINE: ") and "did not run" in row.detail
        assert ("has no tiny-gpt2 in production" in row.detail) == (registry is not None)
        strict = production_row(gate(ws.root, [production_spec(ws, 0.0)], registry, True))
        assert strict.verdict == "FAIL" and strict.detail == row.detail
    # a threshold against the reference, or without a change, is not a production row
    s = gpt2_spec()
    s["evaluation"]["thresholds"] = [
        {"metric": "perplexity", "threshold": 1e9, "greater_is_better": False},
        {
            "metric": "perplexity",
            "min_relative_change": -0.01,  # the budget's own bound (one accuracy contract)
            "greater_is_better": False,
            "baseline": "reference",
        },
    ]
    registry = in_production(ws, 100.0)
    assert not [r for r in gate(ws.root, [ws.spec(s)], registry).rows if "production" in r.check]


def test_production_that_does_not_verify_or_lacks_the_metric_fails(ws: Workspace) -> None:
    registry = in_production(ws, None)
    candidate(ws, 100.0)
    row = production_row(gate(ws.root, [production_spec(ws, 0.0)], registry))
    assert (row.verdict, row.detail) == ("FAIL", "production's manifest lacks this metric")
    published = Path(registry.path("releases", RELEASE, "0.1.0", "model.onnx"))
    published.chmod(0o644)
    published.write_bytes(b"tampered")
    row = production_row(gate(ws.root, [production_spec(ws, 0.0)], registry))
    assert row.verdict == "FAIL" and row.release == RELEASE
    assert row.detail.startswith("production 0.1.0 does not verify: published tiny-gpt2@0.1.0 ")
    assert "model.onnx: changed" in row.detail and "\n" not in row.detail


def test_no_evaluate_report_means_no_production_row(ws: Workspace) -> None:
    registry = in_production(ws, 100.0)
    all_passed(ws)
    shutil.rmtree(report_dir(ws.root / "build" / RELEASE, "evaluate"))
    result = gate(ws.root, [production_spec(ws, 0.0)], registry)
    assert [r for r in result.rows if "production" in r.check] == []
    assert verdicts(result)["evaluate"] == "FAIL"


# --------------------------------------------------------------------------- the report
def test_the_markdown_counts_failures_and_escapes_table_pipes() -> None:
    result = GateResult(
        [
            Row("r", "a", "PASS", "fine"),
            Row("r", "b", "FAIL", "x | y"),
            Row("r", "c", "n/a", "skipped"),
            Row("r", "d", "FAIL", "z"),
        ]
    )
    assert not result.ok
    assert result.markdown() == (
        f"{MARKER}\n## Shipyard release gate: FAIL\n\n"
        "| release | check | verdict | detail |\n|---|---|---|---|\n"
        "| r | a | ✅ PASS | fine |\n| r | b | ❌ FAIL | x / y |\n"
        "| r | c | ➖ n/a | skipped |\n| r | d | ❌ FAIL | z |\n\n2 check(s) failed.\n"
    )
    assert GateResult([Row("r", "c", "n/a", "")]).ok


# --------------------------------------------------------------------------- the command
def test_the_gate_command_exits_4_on_one_failure_and_0_when_all_pass(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHIPYARD_ROOT", str(ws.root))
    ws.write(gpt2_spec())
    all_passed(ws)
    report(ws, "loadtest", "failed", reasons=["p95 over"])
    registry = ["--registry", str(ws.root / "registry")]
    assert main(["gate", RELEASE, *registry, "--report", str(ws.root / "gate.md")]) == 4
    out, err = capsys.readouterr()
    assert "gate passed" not in out
    assert "error: gate failed: 1 check(s) did not pass" in err
    assert "| loadtest | ❌ FAIL | p95 over |" in (ws.root / "gate.md").read_text()
    report(ws, "loadtest")
    assert main(["gate", RELEASE, *registry]) == 0
    assert capsys.readouterr().out.endswith("gate passed\n")
    # and the installed command says the same through its exit code
    report(ws, "parity", "failed", reasons=["max error 3.2"])
    done = subprocess.run(
        [str(Path(sys.executable).with_name("shipyard")), "gate", RELEASE, *registry],
        capture_output=True,
        text=True,
        cwd=ws.root,
        timeout=120,
    )
    assert done.returncode == 4 and "FAIL" in done.stdout and "max error 3.2" in done.stdout


def test_every_row_names_its_release_and_no_release_hides_another(ws: Workspace) -> None:
    all_passed(ws)
    make_bundle(ws.root / "build" / RELEASE / "bundle")
    report(ws, "loadtest", checks=[{"name": "SLO p95_latency_ms", "ok": True, "why": "ok"}])
    other = gpt2_spec(name="other-gpt2")
    other["evaluation"]["thresholds"] = []
    ws.write(other)
    result = gate(ws.root, [spec(ws), load_release(ws.root / "releases" / "other-gpt2.yaml")], None)
    ours = [r for r in result.rows if r.release == RELEASE]
    assert {r.check for r in ours} == {*STAGES, "bundle verify", "SLO p95_latency_ms"}
    theirs = [r for r in result.rows if r.release == "other-gpt2"]
    assert [r.check for r in theirs] == STAGES and {r.verdict for r in theirs} == {"FAIL"}
    assert len(result.rows) == len(ours) + len(theirs)


def test_an_optional_engine_skip_does_not_end_the_walk(ws: Workspace) -> None:
    all_passed(ws)
    report(ws, "engine", "skipped", optional=True)
    report(ws, "bundle", "failed", reasons=["late failure"])
    rows = gate(ws.root, [spec(ws)], None).rows
    assert [r.check for r in rows] == STAGES
    assert rows[-1].verdict == "FAIL" and rows[-1].detail == "late failure"


def test_a_required_skip_lists_every_reason_and_a_report_may_lack_details(
    ws: Workspace,
) -> None:
    all_passed(ws)
    report(ws, "engine", "skipped", reasons=["no GPU", "no TensorRT"])
    folder = report_dir(ws.root / "build" / RELEASE, "loadtest")
    data = json.loads((folder / "report.json").read_text())
    del data["details"]
    (folder / "report.json").write_text(json.dumps(data))
    rows = {r.check: r for r in gate(ws.root, [spec(ws, engine={"required": True})], None).rows}
    assert rows["engine"].detail == "skipped, but required: no GPU; no TensorRT"
    assert rows["loadtest"].verdict == "PASS"  # no SLO rows, no crash


def test_production_rows_judge_change_only_and_every_threshold(ws: Workspace) -> None:
    registry = in_production(ws, 100.0)
    candidate(ws, 100.0)
    s = gpt2_spec(version="0.2.0")
    s["evaluation"]["thresholds"] = [
        {"metric": "greedy_token_match", "min_relative_change": 0, "greater_is_better": True},
        # an absolute bound the candidate misses is the evaluate stage's verdict, not this row's
        {
            "metric": "perplexity",
            "threshold": 50.0,
            "min_relative_change": 0.0,
            "greater_is_better": False,
        },
    ]
    rows = [r for r in gate(ws.root, [ws.spec(s)], registry).rows if "production" in r.check]
    assert [(r.release, r.check, r.verdict) for r in rows] == [
        (RELEASE, "greedy_token_match vs production 0.1.0", "FAIL"),
        (RELEASE, "perplexity vs production 0.1.0", "PASS"),
    ]
    assert rows[0].detail == "production's manifest lacks this metric"


def test_production_facts_without_an_evaluation_section_lack_the_metric(ws: Workspace) -> None:
    registry = Registry(str(ws.root / "registry"))
    bundle = make_bundle(ws.root / "prod-bundle", name=RELEASE, version="0.1.0")
    facts = json.loads((bundle / "shipyard.json").read_text())
    del facts["evaluation"]
    (bundle / "shipyard.json").write_text(json.dumps(facts))
    remanifest(bundle, f"{RELEASE}@0.1.0")
    registry.publish(bundle, RELEASE, "0.1.0")
    registry.promote(RELEASE, "0.1.0", "production", "first")
    candidate(ws, 100.0)
    row = production_row(gate(ws.root, [production_spec(ws, 0.0)], registry))
    assert (row.verdict, row.detail) == ("FAIL", "production's manifest lacks this metric")


def test_the_report_posted_on_a_pull_request_names_no_runner_paths(ws: Workspace) -> None:
    all_passed(ws)
    where = ws.root / "build" / RELEASE / "export" / "model.onnx"
    home = Path.home() / ".cache" / "x"
    report(ws, "export", "failed", reasons=[f"{where}: bad graph; see {home}"])
    result = gate(ws.root, [spec(ws)], None)
    detail = next(r.detail for r in result.rows if r.check == "export")
    assert detail == f"build/{RELEASE}/export/model.onnx: bad graph; see ~/.cache/x"
    assert str(ws.root) not in result.markdown() and str(Path.home()) not in result.markdown()


@pytest.mark.parametrize("text", ["{not json", '{"stage": "parity"}', '{"status": 3}'])
def test_a_report_that_is_not_one_is_a_failed_row_naming_the_file(ws: Workspace, text: str) -> None:
    all_passed(ws)
    path = report_dir(ws.root / "build" / RELEASE, "parity") / "report.json"
    path.write_text(text)
    result = gate(ws.root, [spec(ws)], None)
    row = next(r for r in result.rows if r.check == "parity")
    assert row.verdict == "FAIL" and not result.ok
    assert "is not a stage report (" in row.detail
    assert row.detail.endswith(f"rerun `dvc repro -f parity@{RELEASE}`")
    assert "report.json" in row.detail


# ----------------------------------------------------------------- against the base branch
def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=root, check=True, capture_output=True,
    )  # fmt: skip


def test_each_stage_row_says_how_its_metrics_moved_against_the_base(ws: Workspace) -> None:
    """Issue 43 item 5: the PR comment was a 38-row all-PASS table with no deltas. With
    `--base`, `dvc metrics diff` against the base revision fills a `vs base` column."""
    all_passed(ws)
    metrics = ws.root / "build" / RELEASE / "metrics.json"
    values = {stage: {"passed": 1, "x": 1.0} for stage in STAGES}
    metrics.write_text(json.dumps(values))
    (ws.root / "dvc.yaml").write_text(f"metrics:\n- build/{RELEASE}/metrics.json\n")
    git(ws.root, "init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=ws.root, check=True)
    git(ws.root, "add", "-A")
    git(ws.root, "commit", "-qm", "base")
    values["quantize"] = {"passed": 1, "x": 1.25, "size": 0.5}
    values["evaluate"] = {"passed": 0, "x": 1.0}
    metrics.write_text(json.dumps(values))
    result = gate(ws.root, [spec(ws)], None, base="HEAD")
    change = {r.check: r.change for r in result.rows}
    assert change["quantize"] == "size new: 0.5; x 1 -> 1.25 (+0.25)"
    assert change["evaluate"] == "passed 1 -> 0 (-1)"
    assert {change[s] for s in STAGES if s not in ("quantize", "evaluate")} == {"="}
    text = result.markdown()
    assert "| release | check | verdict | vs base | detail |" in text
    assert "| tiny-gpt2 | quantize | ✅ PASS | size new: 0.5; x 1 -> 1.25 (+0.25) |" in text
    assert text.rstrip().endswith("2 stage(s) moved against `HEAD`.")
    # an unknown revision: said once, no column, the verdicts unchanged
    missing = gate(ws.root, [spec(ws)], None, base="no-such-branch")
    assert "no-such-branch" in missing.base_note and "unknown" in missing.base_note.lower()
    assert "vs base" not in missing.markdown() and "not compared" in missing.markdown()
    assert verdicts(missing) == verdicts(result)


def test_describe_lists_a_few_changes_then_counts_the_rest() -> None:
    assert describe(None) == describe({}) == "="
    many = {f"k{i}": {"old": i, "new": i + 1, "diff": 1} for i in range(6)}
    assert describe(many).endswith("; and 2 more")
    assert describe({"a": {"old": 2.0, "new": None}}) == "a gone (was 2)"
