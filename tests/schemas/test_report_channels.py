"""Issue 29: a stage report's `details` are for people (the report file, the PR comment,
`dvc repro`'s log); what code decides from travels in typed fields (`optional`, `checks`,
`metrics`, `status`) or typed artifacts. These tests hold that line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from schemas import StageReport

REPO = Path(__file__).resolve().parents[2]
# reads of a report's `details` that are allowed, and why
ALLOWED = {
    # the runner copies what the stage returned into the report it writes
    ("stages/__init__.py", "result.details"),
    # a report written before `optional` was typed carried it as details.optional
    ("schemas/report.py", "data.get('details')"),
}


def details_reads(root: Path) -> list[tuple[str, str, int]]:
    """Every `x.details` read, `x["details"]` and `x.get("details")` in the package code."""
    found = []
    for folder in ("stages", "pipelines", "schemas", "scripts", "shipyard_runtime"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                hit = (
                    (
                        isinstance(node, ast.Attribute)
                        and node.attr == "details"
                        and isinstance(node.ctx, ast.Load)
                    )
                    or (
                        isinstance(node, ast.Subscript)
                        and isinstance(node.slice, ast.Constant)
                        and node.slice.value == "details"
                    )
                    or (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "get"
                        and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value == "details"
                    )
                )
                if hit:
                    found.append((rel, ast.unparse(node), node.lineno))
    return found


def test_no_code_reads_a_reports_details() -> None:
    unexpected = [
        f"{f}:{line}: {code}" for f, code, line in details_reads(REPO) if (f, code) not in ALLOWED
    ]
    assert not unexpected, (
        "details are for people; carry what code decides from in a typed field of "
        "StageReport or an artifact (schemas/): " + "; ".join(unexpected)
    )


def test_the_scan_finds_each_way_of_reading_details(tmp_path: Path) -> None:
    """The scan is not blind: each shape of read it must catch, in a package folder."""
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "x.py").write_text(
        "import json\n"
        "a = report.details['slo']\n"
        "b = json.loads(t)['details']\n"
        "c = json.loads(t).get('details', {})\n"
        "d = {'details': 1}\n"  # writing a report is fine
    )
    codes = sorted(code for _, code, _ in details_reads(tmp_path))
    assert codes == sorted(
        [
            "report.details",
            "json.loads(t)['details']",
            "json.loads(t).get('details', {})",
        ]
    )


def base(**kw: object) -> dict:
    return {"stage": "engine", "release": "r", "status": "skipped", "summary": "s", **kw}


@pytest.mark.parametrize(
    ("report", "required", "acceptable"),
    [
        (base(optional=True), False, True),
        (base(optional=True), True, False),  # the spec requires it now
        (base(), False, False),  # a skip that was not optional
        (base(details={"optional": True}), False, True),  # written before the field
        (base(optional=False, details={"optional": True}), False, False),  # the field wins
        (base(details={"optional": "yes"}), False, False),  # only True counts
        (base(status="failed", optional=True), False, False),  # optional never hides a failure
    ],
)
def test_a_skip_is_acceptable_only_where_the_stage_was_optional(
    report: dict, required: bool, acceptable: bool
) -> None:
    assert StageReport.model_validate(report).acceptable(required=required) is acceptable


def test_a_check_is_typed() -> None:
    from pydantic import ValidationError

    ok = StageReport.model_validate(base(checks=[{"name": "SLO x", "ok": True, "why": "1 <= 2"}]))
    assert ok.checks[0].ok is True
    with pytest.raises(ValidationError):
        StageReport.model_validate(base(checks=[{"name": "SLO x", "ok": True}]))
    with pytest.raises(ValidationError):
        StageReport.model_validate(base(checks=[{"slo": "x", "ok": True, "why": ""}]))
