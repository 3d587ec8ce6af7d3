"""The bundle's layout table (stages/bundling/layout.py): every shipped file has one source
and one place, the relative paths between entries land where they point, and the shipped
runtime package imports and runs from a bundle's copy with nothing of the build."""

from __future__ import annotations

import posixpath
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages.bundling import layout
from tests.conftest import REPO


@pytest.mark.parametrize("generating", [False, True])
def test_every_shipped_file_has_a_source_and_a_place_of_its_own(generating: bool) -> None:
    files = layout.shipped("r", generating)
    paths = [f.path for f in files]
    assert len(paths) == len(set(paths)), "two sources ship to one path"
    for f in files:
        assert f.file.is_file(), f.source
        assert not f.path.startswith(("/", "..")) and "{" not in f.path
    assert paths.count(layout.LAUNCHER) == 1
    runtime = [f for f in files if f.source.startswith("shipyard_runtime/")]
    entries = 2 if generating else 1
    # each entry: every core module, plus its own adapter; the front door once
    assert len(runtime) == entries * (len(layout.core_modules()) + 1) + 1
    sources = {f.source for f in runtime}
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "shipyard_runtime").rglob("*.py")}
    if generating:
        assert sources == on_disk, "a runtime module ships nowhere (or one that is gone)"


def test_relative_paths_between_entries_land_on_their_target() -> None:
    pairs = [
        (layout.GENERATE_VERSION, layout.ORT_SESSION),
        (layout.GENERATE_VERSION, layout.TEXT_DIR),
        (layout.MLSERVER_ENTRY, layout.ORT_SESSION),
        (layout.MLSERVER_ENTRY, layout.TEXT_DIR),
        (layout.MLSERVER_ENTRY, layout.MODEL_FILE),
    ]
    for start, target in pairs:
        for release in ("r", "a-b.c"):
            rel = layout.relative(start, target, release)
            landed = posixpath.normpath(posixpath.join(layout.at(start, release), rel))
            assert landed == layout.at(target, release), (start, target, rel)
            assert not landed.startswith("..")


def test_the_shipped_runtime_runs_from_a_bundle_copy_with_nothing_of_the_build(
    tmp_path: Path,
) -> None:
    """Both entries' copies import from the bundle folder (not the repository), reach the
    engine, and load no module of schemas, stages or pipelines."""
    for f in layout.shipped("r", generating=True):
        if not f.rendered:
            (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.file, tmp_path / f.path)
    entries = {
        "mlserver": tmp_path / layout.at(layout.MLSERVER_ENTRY, "r"),
        "triton": tmp_path / layout.at(layout.GENERATE_VERSION, "r"),
    }
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import shipyard_runtime, shipyard_runtime.settings, shipyard_runtime.metrics\n"
        "from shipyard_runtime.generation.core import Engine\n"
        "assert shipyard_runtime.__file__.startswith(sys.argv[1]), shipyard_runtime.__file__\n"
        "build = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('schemas', 'stages', 'pipelines'))\n"
        "assert not build, build\n"
        "print('ok')\n"
    )
    for name, folder in entries.items():
        done = subprocess.run(
            [sys.executable, "-c", code, str(folder)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", (name, done.stderr)
    assert (entries["triton"] / "model.py").read_bytes() == (
        REPO / "shipyard_runtime" / "triton.py"
    ).read_bytes()
    assert not (entries["triton"] / "shipyard_runtime" / "mlserver.py").exists()


def test_the_triton_entry_serves_its_own_copy_when_another_is_earlier_on_the_path(
    tmp_path: Path,
) -> None:
    """Triton's python-backend stub appends the version folder to sys.path, behind its site
    folders: an installed Shipyard there would have served instead of the bundle's copy.
    model.py moves its folder first, and initialize() refuses a foreign copy."""
    for f in layout.shipped("r", generating=True):
        if not f.rendered:
            (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.file, tmp_path / f.path)
    version = tmp_path / layout.at(layout.GENERATE_VERSION, "r")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "triton_python_backend_utils.py").write_text(
        "class TritonModelException(Exception):\n    pass\n"
    )
    code = (
        "import importlib.util, sys\n"
        "repo, stub, version = sys.argv[1:4]\n"
        "sys.path[:0] = [repo, stub]  # another shipyard_runtime first, as a site folder\n"
        "sys.path.append(version)  # what Triton's stub does\n"
        "spec = importlib.util.spec_from_file_location('model', version + '/model.py')\n"
        "model = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(model)\n"
        "import shipyard_runtime\n"
        "print(shipyard_runtime.__file__)\n"
        "print(model.foreign_runtime(__import__('pathlib').Path(version)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(stub), str(version)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    origin, problem = done.stdout.strip().splitlines()
    assert origin.startswith(str(version)), origin
    assert problem == "None"
