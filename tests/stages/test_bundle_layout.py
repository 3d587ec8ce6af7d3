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
        assert (REPO / f.source).read_bytes() == f.file.read_bytes(), f.source
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
