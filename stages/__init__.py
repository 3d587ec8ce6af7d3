"""The stages, in pipeline order, and the one function that runs a stage for a release."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from schemas import ReleaseSpec, StageError, StageReport, StageStatus
from stages._contract import (
    Plot,
    Stage,
    StageContext,
    StageIO,
    StageResult,
    check_stage,
    publish,
    report_dir,
    scoped,
    write_json,
)

# Explicit and ordered: the compiler walks this list; a test checks it matches the modules.
# Each stage is the module of the same name (stages/<name>.py); what the stages share lives
# in subsystem packages (onnx, quant, serving, tensorrt, bundling).
STAGES: tuple[str, ...] = (
    "pin",
    "export",
    "evalcheck",
    "parity",
    "quantize",
    "kvcheck",
    "evaluate",
    "plan",
    "engine",
    "serve",
    "loadtest",
    "manifest",
    "bundle",
)
# The release's one DVC metrics file (build/<release>/metrics.json, committed: `cache:
# false`), written by the last stage from every stage's report: {stage: {passed, ...}}.
# One file a release keeps `dvc exp show` and `dvc metrics diff` to a column group per
# release (thirteen files a release made 300+ columns); each stage's own numbers stay in its
# report. The other stages declare no metrics: their outputs are all cached, which DVC's
# run-cache needs (an uncached output must be a metric or a plot).
RELEASE_METRICS = "metrics.json"
METRICS_STAGE = STAGES[-1]


def load_stages() -> dict[str, ModuleType]:
    """Stage name -> module, in pipeline order."""
    modules = {name: importlib.import_module(f"stages.{name}") for name in STAGES}
    for name, module in modules.items():
        check_stage(name, module)
    return modules


def stage_io(module: ModuleType | Stage, release: ReleaseSpec) -> StageIO:
    io: StageIO = module.io(release)
    return io


# build/<release>/failed/<stage>/: what a failed run wrote, kept for the person reading its
# report; no stage depends on it and DVC does not track it.
FAILED_DIR = "failed"


def _sweep(build: Path, name: str) -> None:
    """Remove what killed runs of this stage left: `.<stage>.<pid>.tmp` (and its report
    folder's) whose process is gone. A live one is another run's, left alone."""
    if not build.is_dir():
        return
    for path in build.glob(f".{name}*.*.tmp"):
        stage, _, pid = path.name[1:].removesuffix(".tmp").rpartition(".")
        if stage not in (name, report_dir(build, name).name) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            continue


def execute(name: str, release: ReleaseSpec, spec_path: Path, root: Path) -> StageReport:
    """Run one stage: temp folder, the spec scoped to its params, report, atomic publish."""
    if name not in STAGES:
        raise StageError(name, "no such stage", f"choose one of: {', '.join(STAGES)}")
    # Only this stage's module: what a run imports is what its DVC deps declare.
    module = check_stage(name, importlib.import_module(f"stages.{name}"))
    build = root / "build" / release.name
    out = build / name
    work = build / f".{name}.{os.getpid()}.tmp"  # per run: two runs never share one
    _sweep(build, name)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    io = stage_io(module, release)
    ctx = StageContext(name, release.name, root, work, spec_path, io.reads)
    view = scoped(release, io.params)  # a ReleaseSpec: undeclared sections raise
    start = time.monotonic()
    try:
        result: StageResult = module.run(ctx, view)
    except StageError as exc:
        reason = exc.message + (f" Fix: {exc.hint}" if exc.hint else "")
        result = StageResult.failed(exc.message, [reason])
    except Exception as exc:
        # A crash is a failure too: what the run wrote before it is evidence, kept where a
        # failed verdict keeps it; the CLI turns the exception into its error.
        if _keep_evidence(work, build, name):
            exc.add_note(f"what the crashed run wrote is kept in {_kept_words(release, name)}")
        shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException:  # interrupted: nothing to explain, nothing kept
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(build / FAILED_DIR / name, ignore_errors=True)  # no stale evidence
    if result.status is StageStatus.FAILED:
        # Nothing a later run could mistake for a finished artifact: only the report stays
        # in the stage's folder. What the run wrote (a server log, the inputs that failed)
        # is evidence: it moves outside anything DVC tracks, beside the report it explains.
        if _keep_evidence(work, build, name):
            result.reasons.append(
                f"what the failed run wrote is kept in {_kept_words(release, name)}"
            )
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    seconds = round(time.monotonic() - start, 3)
    report = StageReport(
        stage=name,
        release=release.name,
        status=result.status,
        summary=result.summary,
        reasons=result.reasons,
        metrics=result.metrics,
        optional=result.optional,
        checks=result.checks,
        details=result.details,
    )
    reports = report_dir(build, name)
    if reports == out:
        write_json(work / "report.json", report.model_dump(mode="json"))
        publish(work, out)
    else:  # a shipped folder: outputs first, then the verdict beside them
        report_work = build / f".{reports.name}.{os.getpid()}.tmp"
        shutil.rmtree(report_work, ignore_errors=True)
        report_work.mkdir()
        write_json(report_work / "report.json", report.model_dump(mode="json"))
        publish(work, out)
        publish(report_work, reports)
    _commit_plots(build, name, out, io.plots)
    # The release's DVC metrics file (committed to git, recorded in dvc.lock), from the last
    # stage: results only, so a rebuild on unchanged inputs changes neither it nor dvc.lock.
    # Wall-clock time goes to timings/, which nothing declares or depends on.
    if name == METRICS_STAGE:
        write_json(build / RELEASE_METRICS, release_metrics(build, report))
    (build / "timings").mkdir(exist_ok=True)
    write_json(build / "timings" / f"{name}.json", {"seconds": seconds})
    return report


def release_metrics(build: Path, last: StageReport) -> dict[str, dict[str, Any]]:
    """{stage: its verdict and metrics} for every stage with a report (each an upstream of
    the last stage; `last` is the last stage's own), written with sorted keys like every
    JSON file of a build. A skip is its own value (`skipped: 1`), never `passed: 0` (which
    reads as a failure)."""
    out: dict[str, dict[str, Any]] = {}
    for stage in STAGES:
        if stage == last.stage:
            report = last
        else:
            path = report_dir(build, stage) / "report.json"
            if not path.is_file():
                continue
            report = StageReport.model_validate_json(path.read_text(encoding="utf-8"))
        verdict = (
            {"skipped": 1}
            if report.status is StageStatus.SKIPPED
            else {"passed": int(report.status is StageStatus.PASSED)}
        )
        out[stage] = {**verdict, **report.metrics}
    return out


def _keep_evidence(work: Path, build: Path, name: str) -> bool:
    """Move a failed run's files to build/<release>/failed/<stage>/ (replacing older
    evidence); False when the run wrote nothing."""
    kept = build / FAILED_DIR / name
    shutil.rmtree(kept, ignore_errors=True)
    if not work.is_dir() or not any(work.iterdir()):
        return False
    kept.parent.mkdir(parents=True, exist_ok=True)
    work.rename(kept)
    return True


def _kept_words(release: ReleaseSpec, name: str) -> str:
    return f"build/{release.name}/{FAILED_DIR}/{name}/ (not a DVC output; replaced by the next run)"


def _commit_plots(build: Path, stage: str, out: Path, plots: Iterable[Plot]) -> None:
    """Each plot's data file, copied where git keeps it (Plot.committed); a plot this run
    did not write (a failed run) leaves no stale copy behind."""
    for plot in plots:
        target = build / plot.committed(stage)
        source = out / plot.file
        if not source.is_file():
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp)
        tmp.replace(target)


def repo_root() -> Path:
    """The repo root: SHIPYARD_ROOT, else the nearest folder above cwd holding releases/."""
    env = os.environ.get("SHIPYARD_ROOT")
    if env:
        return Path(env).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "releases").is_dir():
            return folder
    return here
