from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

import stages
from schemas import ReleaseSpec, StageError
from schemas.spec.bundle import BundleConfig
from stages import STAGES, load_stages
from stages._contract import scoped
from tests.conftest import REPO, Workspace, gpt2_spec


def test_registry_lists_every_stage_module_once_in_pipeline_order() -> None:
    on_disk = {p.stem for p in (REPO / "stages").glob("*.py") if not p.stem.startswith("_")}
    assert set(stages.STAGES) == on_disk - {"__init__"}
    assert list(stages.load_stages()) == [
        "pin",
        "export",
        "evalcheck",
        "parity",
        "quantize",
        "kvcheck",  # after quantize: it checks the shipped graph too
        "evaluate",
        "plan",
        "engine",
        "serve",
        "loadtest",
        "manifest",
        "bundle",
    ]


def test_every_stage_declares_params_that_exist_in_the_spec(ws: Workspace) -> None:
    spec = ws.spec(gpt2_spec())
    for name, module in stages.load_stages().items():
        io = module.io(spec)
        for param in io.params:  # dotted params name sub-sections
            node = spec
            for part in param.split("."):
                assert hasattr(node, part), (name, param)
                node = getattr(node, part)
        assert all((REPO / c).exists() for c in io.code), name


def test_the_scoped_spec_is_a_release_spec_that_refuses_an_undeclared_section(
    ws: Workspace,
) -> None:
    spec = ws.spec(gpt2_spec())
    view = scoped(spec, ["export"])
    assert isinstance(view, ReleaseSpec)  # what run(ctx, release: ReleaseSpec) promises
    assert view.export == spec.export and view.export.opset == 18 and view.name == spec.name
    with pytest.raises(AttributeError, match="reads spec section 'parity' without declaring"):
        _ = view.parity
    assert not hasattr(view, "loadtest")  # getattr's default, hasattr: the same refusal
    for whole in ("model_dump", "model_dump_json", "model_copy"):  # no way around it
        with pytest.raises(AttributeError, match=f"reads spec 'release' whole \\({whole}\\)"):
            getattr(view, whole)()
    assert spec.parity is not None  # the spec itself is untouched
    assert type(scoped(spec, ["export"])) is type(view)  # one class per section set
    again = pickle.loads(pickle.dumps(view))  # as a stage's child process receives it
    assert type(again) is type(view) and again.export == spec.export
    with pytest.raises(AttributeError, match="reads spec section 'parity' without declaring"):
        _ = again.parity


def test_a_dotted_param_shows_only_that_sub_section(ws: Workspace) -> None:
    view = scoped(ws.spec(gpt2_spec()), ["bundle.serving", "task"])
    assert view.bundle.serving.port == 8000 and view.task == "causal-lm"
    assert isinstance(view.bundle, BundleConfig)
    with pytest.raises(AttributeError, match="reads spec section 'bundle.model_card' without"):
        _ = view.bundle.model_card
    with pytest.raises(AttributeError, match="reads spec 'bundle' whole"):
        view.bundle.model_dump()
    assert view.bundle.serving.model_dump()["port"] == 8000  # a declared section is whole


def test_every_stage_reads_only_what_it_declares_through_a_real_spec(ws: Workspace) -> None:
    """Each stage's io().params, scoped: every declared param resolves on the scoped spec,
    and one section it does not declare raises (the runner passes exactly this)."""
    spec = ws.spec(gpt2_spec())
    for name in STAGES:
        io = load_stages()[name].io(spec)
        view = scoped(spec, io.params)
        for param in io.params:
            node: object = view
            for part in param.split("."):
                node = getattr(node, part)
        undeclared = [
            s for s in ReleaseSpec.model_fields if s not in {p.split(".")[0] for p in io.params}
        ]
        undeclared = [s for s in undeclared if s not in ("name",)]
        if undeclared:
            with pytest.raises(AttributeError, match="without declaring"):
                getattr(view, undeclared[0])


def test_failed_stage_leaves_only_its_report(ws: Workspace) -> None:
    spec = gpt2_spec(pins={"packages": {"torch": "==1.0"}})
    report = ws.run("pin", spec)
    assert report.status.value == "failed"
    assert sorted(p.name for p in ws.out("tiny-gpt2", "pin").iterdir()) == ["report.json"]


def test_a_failed_stage_keeps_what_it_wrote_outside_dvc_and_a_pass_clears_it(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module("stages.pin")
    real = module.run

    def fails_after_a_log(ctx: Any, release: Any) -> Any:
        (ctx.work / "server.log").write_text("the reason is in here\n")
        (ctx.work / "inputs").mkdir()
        (ctx.work / "inputs" / "bad.npz").write_bytes(b"x")
        raise StageError("pin", "it broke", "read server.log")

    monkeypatch.setattr(module, "run", fails_after_a_log)
    report = ws.run("pin", gpt2_spec())
    kept = ws.root / "build" / "tiny-gpt2" / "failed" / "pin"
    assert report.status.value == "failed"
    assert "kept in build/tiny-gpt2/failed/pin/" in report.reasons[-1]
    assert (kept / "server.log").read_text() == "the reason is in here\n"
    assert (kept / "inputs" / "bad.npz").is_file()
    assert sorted(p.name for p in ws.out("tiny-gpt2", "pin").iterdir()) == ["report.json"]
    monkeypatch.setattr(module, "run", real)
    assert ws.run("pin", gpt2_spec()).status.value == "passed"
    assert not kept.exists()  # no stale evidence beside a passing report


def test_crashing_stage_leaves_previous_output_untouched(ws: Workspace, monkeypatch) -> None:
    assert ws.run("pin", gpt2_spec()).status.value == "passed"
    before = (ws.out("tiny-gpt2", "pin") / "lock.json").read_bytes()
    module = importlib.import_module("stages.pin")

    def crash(ctx, release):  # a bug (not a StageError) halfway through writing
        (ctx.work / "lock.json").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", crash)
    with pytest.raises(KeyboardInterrupt):
        ws.run("pin", gpt2_spec())
    assert (ws.out("tiny-gpt2", "pin") / "lock.json").read_bytes() == before
    assert not list((ws.root / "build" / "tiny-gpt2").glob(".pin.*.tmp"))
    assert not (ws.root / "build" / "tiny-gpt2" / "failed" / "pin").exists()  # interrupted


def test_a_crash_keeps_what_the_run_wrote_as_evidence_and_names_it(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ws.run("pin", gpt2_spec()).status.value == "passed"
    before = (ws.out("tiny-gpt2", "pin") / "lock.json").read_bytes()
    module = importlib.import_module("stages.pin")

    def crash(ctx: Any, release: Any) -> Any:  # a bug, not a StageError, after a log
        (ctx.work / "server.log").write_text("the trace is in here\n")
        raise RuntimeError("a bug")

    monkeypatch.setattr(module, "run", crash)
    with pytest.raises(RuntimeError, match="a bug") as exc:
        ws.run("pin", gpt2_spec())
    kept = ws.root / "build" / "tiny-gpt2" / "failed" / "pin"
    assert (kept / "server.log").read_text() == "the trace is in here\n"
    assert any("kept in build/tiny-gpt2/failed/pin/" in n for n in exc.value.__notes__)
    assert (ws.out("tiny-gpt2", "pin") / "lock.json").read_bytes() == before
    assert not list((ws.root / "build" / "tiny-gpt2").glob(".pin.*.tmp"))


def test_a_run_sweeps_what_killed_runs_of_its_stage_left_and_nothing_else(
    ws: Workspace,
) -> None:
    """Issue 42 item 12: `.<stage>.<pid>.tmp` folders of killed runs stayed forever. A run
    removes its stage's whose process is gone; a live process's (another run), another
    stage's and other files stay."""
    import subprocess
    import sys

    build = ws.root / "build" / "tiny-gpt2"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = {
            "killed": build / f".pin.{dead}.tmp",
            "live": build / f".pin.{alive.pid}.tmp",
            "other stage": build / f".export.{dead}.tmp",
            "a name pin prefixes": build / f".pin-report.{dead}.tmp",  # not pin's report
            "not a pid": build / ".pin.x.tmp",
        }
        for path in left.values():
            (path / "half").mkdir(parents=True)
        assert ws.run("pin", gpt2_spec()).status.value == "passed"
        assert not left["killed"].exists()
        kept = ("live", "other stage", "a name pin prefixes", "not a pid")
        assert all(left[k].exists() for k in kept), {k: left[k].exists() for k in kept}
    finally:
        alive.kill()
        alive.wait()


def test_unknown_stage_is_a_stage_error(ws: Workspace) -> None:
    with pytest.raises(StageError, match="no such stage"):
        ws.run("exprot", gpt2_spec())


def test_upstream_missing_names_the_command_to_run(ws: Workspace) -> None:
    report = ws.run("evalcheck", gpt2_spec())
    assert report.status.value == "failed"
    assert "dvc repro export@tiny-gpt2" in report.reasons[0]


def test_reports_do_not_change_when_a_stage_reruns_on_the_same_inputs(ws: Workspace) -> None:
    ws.run("pin", gpt2_spec())
    first = (ws.out("tiny-gpt2", "pin") / "report.json").read_bytes()
    ws.run("pin", gpt2_spec())
    assert (ws.out("tiny-gpt2", "pin") / "report.json").read_bytes() == first
    # only the last stage writes the release's metrics file; every stage its timing
    assert not (ws.root / "build/tiny-gpt2/metrics.json").exists()
    assert Path(ws.root / "build/tiny-gpt2/timings/pin.json").is_file()


def test_the_dvc_metrics_file_says_passed_failed_or_skipped_each_as_itself(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from schemas import StageReport, StageStatus
    from stages import METRICS_STAGE, STAGES, release_metrics

    build = ws.root / "build" / "tiny-gpt2"
    last = StageReport(
        stage=METRICS_STAGE, release="tiny-gpt2", status=StageStatus.PASSED, summary="s",
        metrics={"files": 3},
    )  # fmt: skip

    def pin() -> dict[str, object]:
        written = json.loads(json.dumps(release_metrics(build, last)))
        assert list(written) == ["pin", METRICS_STAGE]  # only stages with a report, in order
        assert list(STAGES).index("pin") < list(STAGES).index(METRICS_STAGE)
        assert written[METRICS_STAGE] == {"passed": 1, "files": 3}
        return dict(written["pin"])

    ws.run("pin", gpt2_spec())
    assert pin()["passed"] == 1
    ws.run("pin", gpt2_spec(pins={"packages": {"torch": "==1.0"}}))
    assert pin() == {"passed": 0}
    from stages._contract import StageResult

    module = importlib.import_module("stages.pin")
    monkeypatch.setattr(module, "run", lambda ctx, release: StageResult.skipped("not here"))
    ws.run("pin", gpt2_spec())
    skipped = pin()
    assert skipped == {"skipped": 1}, skipped


def test_two_runs_of_one_stage_at_once_do_not_share_a_temp_folder(ws: Workspace) -> None:
    import os
    import subprocess
    import sys

    spec = ws.write(gpt2_spec())
    shipyard = str(Path(sys.executable).with_name("shipyard"))
    env = {**os.environ, "SHIPYARD_ROOT": str(ws.root)}
    procs = [
        subprocess.Popen(
            [shipyard, "run-stage", "pin", "--release", str(spec)],
            cwd=ws.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert all(o[0].startswith("PASS pin@tiny-gpt2") for o in outputs)
    assert (ws.out("tiny-gpt2", "pin") / "lock.json").is_file()
    assert not list((ws.root / "build" / "tiny-gpt2").glob(".pin.*tmp"))


def test_a_stage_sealed_by_anything_but_one_of_its_upstreams_is_refused() -> None:
    """`sealed_by` drops the other upstream folders from DVC's deps: sealed by a stage it
    does not read, nothing would rerun it when they change."""
    from stages._contract import StageIO

    with pytest.raises(ValueError, match="sealed_by='manifest' must be one of upstream"):
        StageIO(params=(), upstream=("export", "serve"), sealed_by="manifest")
    with pytest.raises(ValueError, match="must be one of upstream"):
        StageIO(params=(), sealed_by="manifest")
    sealed = StageIO(params=(), upstream=("export", "manifest"), sealed_by="manifest")
    assert sealed.upstream_files() == ("manifest",)


def _module(name: str, **attrs: Any) -> Any:
    import types

    module = types.ModuleType(f"stages.{name}")
    module.__dict__.update(attrs)
    return module


@pytest.mark.parametrize(
    ("attrs", "says"),
    [
        ({"NAME": "pin", "io": lambda release: None}, "is not a stage: it has no run"),
        ({"io": lambda r: None, "run": lambda c, r: None}, "is not a stage: it has no NAME"),
        ({"NAME": "pin", "run": lambda c, r: None}, "is not a stage: it has no io"),
        (
            {"NAME": "export", "io": lambda r: None, "run": lambda c, r: None},
            "names itself 'export', not 'pin'",
        ),
        ({"NAME": "pin", "io": lambda r: None, "run": lambda r: None}, "run() takes 1 parameter"),
        ({"NAME": "pin", "io": lambda: None, "run": lambda c, r: None}, "io() takes 0 parameter"),
    ],
)
def test_the_runner_refuses_a_module_that_is_not_a_stage(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, attrs: dict[str, Any], says: str
) -> None:
    """The Stage protocol (stages/_contract.py) is checked before a stage runs, with what
    the module lacks named: a stage without `run` was an AttributeError mid-run."""
    import sys

    from schemas.loader import load_release
    from stages._contract import check_stage

    fake = _module("pin", **attrs)
    with pytest.raises(RuntimeError, match=re.escape(says)):
        check_stage("pin", fake)
    monkeypatch.setitem(sys.modules, "stages.pin", fake)
    path = ws.write(gpt2_spec())
    with pytest.raises(RuntimeError, match=re.escape(says)):
        stages.execute("pin", load_release(path), path, ws.root)
    assert not (ws.root / "build").exists()  # refused before anything was written
    with pytest.raises(RuntimeError):
        stages.load_stages()


def test_every_stage_module_is_a_stage() -> None:
    from stages._contract import Stage

    for name, module in stages.load_stages().items():
        assert isinstance(module, Stage), name


def test_shared_code_raises_without_knowing_its_stage() -> None:
    """Issue 29: subsystems hard-coded their one stage's name (or were handed it through
    every helper) to raise. They raise Refused; the runner reports it as the failure of the
    stage it ran."""
    import ast

    found = []
    for folder in ("onnx", "quant", "serving", "loadtesting", "tensorrt", "bundling", "rendering"):
        for path in sorted((REPO / "stages" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                named = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "StageError"
                param = isinstance(node, ast.arg) and node.arg == "stage"
                if named or param:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def test_a_refusal_is_the_running_stages_failure(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from schemas import Refused
    from schemas.loader import load_release

    def refuse(ctx: Any, release: Any) -> Any:
        raise Refused("the data is wrong", "fix the data")

    monkeypatch.setattr(importlib.import_module("stages.pin"), "run", refuse)
    path = ws.write(gpt2_spec())
    report = stages.execute("pin", load_release(path), path, ws.root)
    assert (report.stage, report.status.value) == ("pin", "failed")
    assert report.reasons == ["the data is wrong Fix: fix the data"]
