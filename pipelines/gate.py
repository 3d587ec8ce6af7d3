"""`shipyard gate`: every stage report of a release, plus the production comparison."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import RegistryError, ReleaseSpec, StageReport, StageStatus
from schemas.problems import first_problem
from stages import RELEASE_METRICS, load_stages
from stages._contract import report_dir
from stages.quant.thresholds import check, has_change

if TYPE_CHECKING:
    from pipelines.registry import Registry

MARKER = "<!-- shipyard-release-gate -->"  # how the PR comment script finds its own comment


@dataclass
class Row:
    release: str
    check: str
    verdict: str  # PASS, FAIL or n/a
    detail: str
    change: str = ""  # the stage's metrics against the base branch's (`--base`)


@dataclass
class GateResult:
    rows: list[Row] = field(default_factory=list)
    base: str | None = None  # the revision the metrics were compared with, if any
    base_note: str = ""  # why the comparison could not run, if it could not

    @property
    def ok(self) -> bool:
        return all(r.verdict != "FAIL" for r in self.rows)

    def markdown(self) -> str:
        head = f"{MARKER}\n## Shipyard release gate: {'PASS' if self.ok else 'FAIL'}\n\n"
        if self.base is not None:
            head += (
                f"Metrics against `{self.base}` (`dvc metrics diff`): a stage's row says what "
                "moved; `=` is no change.\n\n"
                if not self.base_note
                else f"Metrics against `{self.base}`: not compared ({self.base_note}).\n\n"
            )
        compared = self.base is not None and not self.base_note
        columns = ["release", "check", "verdict", *(["vs base"] if compared else []), "detail"]
        table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for r in self.rows:
            cells = [r.release, r.check, f"{_icon(r.verdict)} {r.verdict}"]
            cells += [r.change] if compared else []
            cells.append(r.detail)
            table.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        failed = sum(r.verdict == "FAIL" for r in self.rows)
        tail = f"\n\n{failed} check(s) failed." if failed else "\n\nEvery check passed."
        changed = sum(bool(r.change and r.change != "=") for r in self.rows)
        if compared:
            tail += f" {changed} stage(s) moved against `{self.base}`."
        return head + "\n".join(table) + tail + "\n"


def _icon(verdict: str) -> str:
    return {"PASS": "✅", "FAIL": "❌"}.get(verdict, "➖")


def gate(
    root: Path,
    releases: list[ReleaseSpec],
    registry: Registry | None,
    require_baseline: bool = False,
    base: str | None = None,
) -> GateResult:
    """Every release's rows: stage reports (missing, failed or skipped = FAIL), the bundle,
    SLOs and thresholds vs production; with `require_baseline`, a production comparison
    that cannot run (nothing in production, no registry) fails instead of reading n/a; with
    `base` (a git revision: the pull request's base branch), each stage row says how its
    metrics moved against that revision's (`dvc metrics diff`)."""
    result = GateResult(base=base)
    diff: dict[str, Any] = {}
    if base is not None:
        diff, result.base_note = metrics_diff(root, base)
    for spec in releases:
        stages, checks = _stage_rows(root, spec)
        if base is not None and not result.base_note:
            # the release's one metrics file, flattened by DVC: `quantize.size_ratio`
            moved = diff.get(f"build/{spec.name}/{RELEASE_METRICS}") or {}
            for row in stages:
                prefix = f"{row.check}."
                row.change = describe(
                    {k[len(prefix) :]: v for k, v in moved.items() if k.startswith(prefix)}
                )
        result.rows += stages
        result.rows += _bundle_rows(root, spec.name)
        result.rows += checks
        result.rows += _production_rows(root, spec, registry, require_baseline)
    # the report is posted on a pull request: the runner's paths are noise there, and say
    # more about the machine than a reader needs
    for row in result.rows:
        row.detail = _relative(row.detail, root)
    return result


def _relative(text: str, root: Path) -> str:
    """`text` with the repository root and the home folder taken out of every path."""
    import re

    for base, shown in ((root.resolve(), ""), (root, ""), (Path.home(), "~/")):
        text = text.replace(f"{base}/", shown)
        bare = re.escape(str(base)) + r"(?=[\s'\"`),;:]|$)"  # the folder itself, not a prefix
        text = re.sub(bare, shown.rstrip("/") or ".", text)
    return text


def _stage_rows(root: Path, spec: ReleaseSpec) -> tuple[list[Row], list[Row]]:
    """A row per stage report, and a row per check the reports judged beside their own
    verdicts (the load test's SLOs). The checks are shown, not trusted: they repeat a
    stage's own verdict, which its row gates (a failed load test writes only its report)."""
    release = spec.name
    rows, checks = [], []
    for stage in load_stages():
        path = report_dir(root / "build" / release, stage) / "report.json"
        if not path.is_file():
            rows.append(
                Row(release, stage, "FAIL", f"no report: run `dvc repro {stage}@{release}`")
            )
            continue
        report = _report(path, f"{stage}@{release}")
        if isinstance(report, str):
            rows.append(Row(release, stage, "FAIL", report))
            continue
        status, detail = report.status, report.summary
        if status is StageStatus.FAILED:
            detail = "; ".join(report.reasons) or detail
        elif status is StageStatus.SKIPPED and report.acceptable(required=_required(spec, stage)):
            rows.append(Row(release, stage, "n/a", f"skipped (optional): {report.summary}"))
            continue
        elif status is StageStatus.SKIPPED:  # skipped is never passed
            detail = f"skipped, but required: {'; '.join(report.reasons)}"
        rows.append(Row(release, stage, "PASS" if status is StageStatus.PASSED else "FAIL", detail))
        checks += [Row(release, c.name, "PASS" if c.ok else "FAIL", c.why) for c in report.checks]
    return rows, checks


def _report(path: Path, target: str) -> StageReport | str:
    """The stage report at `path`, or why it cannot be read (a FAIL row, not a traceback)."""
    try:
        return StageReport.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValidationError and UnicodeDecodeError are ValueErrors
        why = first_problem(exc)
        return f"{path} is not a stage report ({why}): rerun `dvc repro -f {target}`"


def _bundle_rows(root: Path, release: str) -> list[Row]:
    """The built bundle, verified, and the digest a signature and the registry will use."""
    from stages.bundling.oms import load_manifest, verify_bundle

    folder = root / "build" / release / "bundle"
    if not (folder / "manifest.json").is_file():
        return []  # the bundle stage row already fails
    problems = verify_bundle(folder)
    if problems:
        return [Row(release, "bundle verify", "FAIL", "; ".join(problems[:3]))]
    digest = load_manifest(folder / "manifest.json").digest
    detail = f"bundle digest (OMS root, manifest.json subject) {digest}"
    return [Row(release, "bundle verify", "PASS", detail)]


def _required(spec: ReleaseSpec, stage: str) -> bool:
    """Only the engine may skip, and only when the spec (as it is now) does not require it."""
    return spec.engine.required if stage == "engine" else True


def _production_rows(
    root: Path, spec: ReleaseSpec, registry: Registry | None, require_baseline: bool = False
) -> list[Row]:
    wanted = [t for t in spec.evaluation.thresholds if t.baseline == "production" and has_change(t)]
    if not wanted:
        return []
    current = registry.channel(spec.name, "production") if registry else None
    if registry is None or current is None:
        where = (
            f"registry {registry.url} has no {spec.name} in production"
            if registry is not None
            else "no registry is configured"
        )
        note = (
            f"NO BASELINE: {where}, so this comparison did not run (set SHIPYARD_REGISTRY to "
            "the team's registry; a first release has none)"
        )
        verdict = "FAIL" if require_baseline else "n/a"
        return [Row(spec.name, f"{t.metric} vs production", verdict, note) for t in wanted]
    # Only from a verified bundle: its digest matches its manifest and its publish record.
    try:
        baseline = registry.facts(current.release, current.version)
    except RegistryError as exc:
        why = f"production {current.version} does not verify: {' '.join(str(exc).split())}"
        return [Row(spec.name, f"{t.metric} vs production", "FAIL", why) for t in wanted]
    report = root / "build" / spec.name / "evaluate" / "report.json"
    if not report.is_file():
        return []  # the stage row already fails
    metrics = StageReport.model_validate_json(report.read_text()).metrics
    rows = []
    for t in wanted:
        base = baseline.evaluation.get(t.metric)
        label = f"{t.metric} vs production {current.version}"
        if base is None:
            rows.append(Row(spec.name, label, "FAIL", "production's manifest lacks this metric"))
            continue
        outcome = check(t, metrics, base, absolute=False)  # absolute bounds: evaluate stage
        rows.append(Row(spec.name, label, "PASS" if outcome.ok else "FAIL", outcome.message))
    return rows


def metrics_diff(root: Path, base: str) -> tuple[dict[str, Any], str]:
    """`dvc metrics diff BASE --json` in `root`: {file: {key: {old, new, diff}}} of what
    changed, and "" (or why it could not run: an unknown revision, no git history)."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "dvc", "metrics", "diff", base, "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        why = " ".join((done.stderr or done.stdout).split())[:300]
        return {}, f"`dvc metrics diff {base}` failed: {why or f'exit {done.returncode}'}"
    try:
        return dict(json.loads(done.stdout or "{}")), ""
    except ValueError:
        return {}, f"`dvc metrics diff {base}` wrote no JSON"


SHOWN = 4  # changed metrics a row lists before "and N more"


def describe(changes: dict[str, Any] | None) -> str:
    """A stage's changed metrics as `key old -> new (+diff)`; `=` when nothing moved."""
    if not changes:
        return "="
    parts = []
    for key, c in sorted(changes.items()):
        old, new = c.get("old"), c.get("new")
        if old is None:
            parts.append(f"{key} new: {_num(new)}")
        elif new is None:
            parts.append(f"{key} gone (was {_num(old)})")
        else:
            delta = c.get("diff")
            sign = f" ({'+' if isinstance(delta, int | float) and delta > 0 else ''}{_num(delta)})"
            parts.append(f"{key} {_num(old)} -> {_num(new)}{sign if delta is not None else ''}")
    more = len(parts) - SHOWN
    return "; ".join(parts[:SHOWN]) + (f"; and {more} more" if more > 0 else "")


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
