"""The compiler's promises with the import closure stubbed (pipelines/closure.py, about ten
seconds a call here, has tests of its own): the committed dvc.yaml is what compile writes,
each stage's params file holds its code digests, shipped files and spec sections, and the
helpers that place models, data and plots in the foreach items and templates. Fast enough to
run per mutant (scripts/mutation.py); test_compiler.py runs the same promises on the real
closure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines import compiler
from schemas import SpecError
from stages._contract import COMMON_CODE, StageIO
from tests.conftest import REPO, Workspace, generic_spec, gpt2_spec

Calls = list[tuple[Path, list[str], tuple[str, ...]]]


@pytest.fixture
def closures(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """stage_closure stubbed: a stage's closure is the files it starts from; the calls are
    recorded."""
    calls: Calls = []

    def stage_closure(code: Path, files: list[str], params: tuple[str, ...]) -> list[str]:
        calls.append((code, list(files), tuple(params)))
        return sorted(files)

    monkeypatch.setattr(compiler, "stage_closure", stage_closure)
    return calls


def test_the_committed_dvc_yaml_is_what_compile_writes(closures: Calls, tmp_path: Path) -> None:
    """Everything in dvc.yaml but the closure's modules, which reach it only as the `code`
    stage's top-level folders: the same folders either way."""
    text = compiler.compile_dvc(REPO)
    assert text == (REPO / "dvc.yaml").read_text()
    assert text.startswith(compiler.HEADER + "stages:\n  code:\n")
    assert not compiler.is_stale(REPO)
    # written through a temporary file, then renamed
    shutil.copytree(REPO / "releases", tmp_path / "releases")
    assert compiler.is_stale(tmp_path)
    assert compiler.write(tmp_path) == tmp_path / "dvc.yaml"
    assert (tmp_path / "dvc.yaml").read_text() == compiler.compile_dvc(tmp_path)
    assert not compiler.is_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dvc.yaml", "releases"]
    (tmp_path / "dvc.yaml").write_text(text + "# edited\n")
    assert compiler.is_stale(tmp_path)


def test_each_stage_closure_starts_from_its_module_and_the_common_code(
    closures: Calls, tmp_path: Path
) -> None:
    releases, ios = compiler.stage_ios(REPO)
    modules = compiler.code_modules(REPO, ios)
    assert list(modules) == list(ios)
    for (code, files, params), (name, per) in zip(closures, ios.items(), strict=True):
        assert code == REPO
        assert files == [f"stages/{name}.py", *COMMON_CODE]
        assert params == next(iter(per.values())).params
        assert modules[name] == sorted(files)
    # a folder of specs only: the code beside the compiler
    assert compiler.code_root(tmp_path) == Path(compiler.__file__).resolve().parents[1]
    (tmp_path / "stages").mkdir()
    assert compiler.code_root(tmp_path) == Path(compiler.__file__).resolve().parents[1]
    (tmp_path / "stages" / "__init__.py").write_text("")
    assert compiler.code_root(tmp_path) == tmp_path


def test_the_code_stage_depends_on_the_folders_of_the_code_and_every_spec(
    closures: Calls, tmp_path: Path
) -> None:
    ws = Workspace(tmp_path)
    ws.write(generic_spec("b-small", "small"))
    ws.write(generic_spec("a-small", "small"))
    code = yaml.safe_load(compiler.compile_dvc(tmp_path))["stages"]["code"]
    assert code == {
        "cmd": "shipyard fingerprint",
        "deps": [
            "pipelines",
            "pyproject.toml",
            "schemas",
            "shipyard_runtime",
            "stages",
            "releases",
        ],
        "params": [{"releases/a-small.yaml": None}, {"releases/b-small.yaml": None}],
        "outs": [{"build/.params": {"persist": True}}],
    }


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch, closures: Calls) -> None:
    """The fingerprint of a module stubbed: its path, reversed (the specs' folder has no
    code: the modules are the compiler's own repository's)."""
    from pipelines import fingerprint

    def stage_fingerprint(code: Path, modules: list[str]) -> dict[str, str]:
        assert code == Path(compiler.__file__).resolve().parents[1]  # where the modules are
        return {m: m[::-1] for m in modules}

    monkeypatch.setattr(fingerprint, "stage_fingerprint", stage_fingerprint)


def test_the_params_files_hold_code_files_and_spec_sections(digests: None, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    spec = gpt2_spec()
    spec["bundle"].pop("ort_session", None)
    ws.write(spec)
    ws.write(generic_spec("small", "small"))
    written = compiler.write_fingerprints(tmp_path)
    folder = tmp_path / compiler.PARAMS_DIR
    _, ios = compiler.stage_ios(tmp_path)
    assert sorted(written) == sorted(
        folder / release / f"{stage}.json" for release in ("small", "tiny-gpt2") for stage in ios
    )
    serve = json.loads((folder / "tiny-gpt2" / "serve.json").read_text())
    modules = ["stages/serve.py", *COMMON_CODE]
    assert serve["code"] == {m: m[::-1] for m in modules}
    assert sorted(serve["files"]) == sorted(set(ios["serve"]["tiny-gpt2"].code))
    assert serve["spec"]["bundle.ort_session"] is None
    assert serve["spec"]["version"] == spec["version"] and serve["spec"]["task"] == "causal-lm"
    assert json.loads((folder / "small" / "serve.json").read_text())["spec"]["task"] == "generic"
    pin = json.loads((folder / "tiny-gpt2" / "pin.json").read_text())
    assert list(pin["files"]) == ["pyproject.toml"]
    assert "files" not in json.loads((folder / "tiny-gpt2" / "export.json").read_text())
    # unchanged content: not rewritten
    before = {p: p.stat().st_mtime_ns for p in written}
    compiler.write_fingerprints(tmp_path)
    assert {p: p.stat().st_mtime_ns for p in written} == before


def test_the_params_text_is_canonical_json() -> None:
    io = StageIO(params=("task", "bundle.serving.max_batch_size", "missing.deep", "version"))
    data = {"task": "generic", "bundle": {"serving": {"max_batch_size": 4}}, "version": 1.5}
    text = compiler.params_text(io, data, {"b.py": "2", "a.py": "1"})
    assert text == (
        "{\n"
        '  "code": {\n'
        '    "a.py": "1",\n'
        '    "b.py": "2"\n'
        "  },\n"
        '  "spec": {\n'
        '    "bundle.serving.max_batch_size": 4,\n'
        '    "missing.deep": null,\n'
        '    "task": "generic",\n'
        '    "version": 1.5\n'
        "  }\n"
        "}\n"
    )
    dated = compiler.params_text(
        StageIO(params=("when",)), {"when": Path("x")}, None, {"t.j2": "ab"}
    )
    assert json.loads(dated) == {"code": {}, "files": {"t.j2": "ab"}, "spec": {"when": "x"}}
    assert compiler._lookup({"a": {"b": 1}}, "a.b.c") is None
    assert compiler._lookup({"a": {"b": None}}, "a.b") is None
    assert compiler._lookup({"a": [1]}, "a") == [1]


def test_the_file_digests_are_the_bytes_of_each_file_and_a_missing_one_is_named(
    tmp_path: Path,
) -> None:
    import hashlib

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.j2").write_bytes(b"{# a #}\n")
    (tmp_path / "b.txt").write_bytes(b"b")
    found = compiler.file_digests(tmp_path, ("t/a.j2", "b.txt", "t/a.j2"))
    assert found == {
        "t/a.j2": hashlib.sha256(b"{# a #}\n").hexdigest(),
        "b.txt": hashlib.sha256(b"b").hexdigest(),
    }
    with pytest.raises(SpecError) as info:
        compiler.file_digests(tmp_path, ("z.j2", "b.txt", "c.j2"))
    assert info.value.problems == [
        f"{rel}: a stage's io().code names this file, but it does not exist; restore it or "
        "remove it from io().code"
        for rel in ("c.j2", "z.j2")
    ]
    assert info.value.path == "c.j2"


def test_model_slots_and_data_slots_fill_the_foreach_items(closures: Calls, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    shutil.copy(REPO / "releases" / "tiny-gpt2.yaml", tmp_path / "releases")
    spec = generic_spec("small", "small")
    ws.write(spec)
    stages = yaml.safe_load(compiler.compile_dvc(tmp_path))["stages"]
    # one slot: HF folders and the trap file hold code and weights in one path
    assert stages["pin"]["foreach"] == {
        "small": {"spec": "releases/small.yaml", "model": "traps.py"},
        "tiny-gpt2": {"spec": "releases/tiny-gpt2.yaml", "model": "models/tiny-gpt2"},
    }
    assert stages["pin"]["do"]["deps"][:2] == ["build/.params/${key}/pin.json", "${item.model}"]
    # the tokenizer inside tiny-gpt2's own model is pin's lock; small uses none: its graph
    assert stages["quantize"]["foreach"]["tiny-gpt2"]["tokenizer"] == (
        "build/tiny-gpt2/pin/lock.json"
    )
    assert stages["quantize"]["foreach"]["small"]["tokenizer"] == ("build/small/export/model.onnx")
    assert "${item.tokenizer}" in stages["quantize"]["do"]["deps"]
    assert stages["evaluate"]["foreach"]["small"]["dataset"] == "data/generic.npz"
    assert stages["export"]["foreach"]["small"] == {"spec": "releases/small.yaml"}
    spec["model"]["weights"] = "w.safetensors"
    ws.write(spec)
    stages = yaml.safe_load(compiler.compile_dvc(tmp_path))["stages"]
    assert stages["pin"]["foreach"]["small"]["model_weights"] == "w.safetensors"
    assert stages["pin"]["foreach"]["tiny-gpt2"]["model_weights"] == "models/tiny-gpt2"
    assert stages["pin"]["do"]["deps"][1:3] == ["${item.model}", "${item.model_weights}"]
    assert compiler._inside("models/a/b/c.json", ("x", "models/a"))
    assert not compiler._inside("models/a", ("models/a/b",))


def test_a_stage_whose_io_differs_between_releases_is_refused(
    closures: Calls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = Workspace(tmp_path)
    ws.write(generic_spec("a", "small"))
    ws.write(generic_spec("b", "small"))

    class Odd:
        NAME = "odd"

        @staticmethod
        def io(release: Any) -> StageIO:
            return StageIO(params=(release.name,))

    monkeypatch.setattr(compiler, "load_stages", lambda: {"odd": Odd})
    monkeypatch.setattr(compiler, "stage_io", lambda module, spec: module.io(spec))
    with pytest.raises(RuntimeError) as info:
        compiler.stage_ios(tmp_path)
    assert str(info.value) == "stage odd: io() differs between releases; foreach needs one template"
    empty = tmp_path / "empty"
    (empty / "releases").mkdir(parents=True)
    assert compiler.stage_ios(empty) == ([], {})


def test_every_bad_release_is_reported_by_its_path(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.write(generic_spec("b", "small", version=None))
    ws.write(generic_spec("a", "small", task="chat"))
    ws.write(generic_spec("c", "small"))
    (tmp_path / "releases" / "notes.txt").write_text("not a spec")
    with pytest.raises(SpecError) as info:
        compiler.discover(tmp_path)
    assert info.value.path == "releases/"
    assert [p.split(":")[0] for p in info.value.problems] == ["releases/a.yaml", "releases/b.yaml"]
    (tmp_path / "releases" / "a.yaml").unlink()
    (tmp_path / "releases" / "b.yaml").unlink()
    [(path, spec)] = compiler.discover(tmp_path)
    assert path == tmp_path / "releases" / "c.yaml" and spec.name == "c"
