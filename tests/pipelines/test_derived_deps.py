"""Dependencies derived from the code: running a stage imports nothing of ours that its
DVC entry does not declare (the import closure the compiler computes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.closure import import_closure
from pipelines.compiler import compile_dvc
from stages import STAGES
from tests.conftest import REPO, Workspace, gpt2_spec

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))
ENTRY_POINT = {"pipelines/__init__.py", "pipelines/cli.py"}  # `shipyard run-stage` itself


def declared(stage: str) -> set[str]:
    import yaml

    deps = yaml.safe_load(compile_dvc(REPO))["stages"][stage]["do"]["deps"]
    return {d for d in deps if d.split("/")[0] in ("schemas", "stages", "pipelines")}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_run_imports_only_what_its_dvc_entry_declares(
    built_gpt2: Workspace, tmp_path: Path, stage: str
) -> None:
    record = tmp_path / "imports.txt"
    spec = built_gpt2.write(gpt2_spec())
    done = subprocess.run(
        [SHIPYARD, "run-stage", stage, "--release", str(spec)],
        cwd=built_gpt2.root,
        env={
            **os.environ,
            "SHIPYARD_ROOT": str(built_gpt2.root),
            "SHIPYARD_RECORD_IMPORTS": str(record),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = set(record.read_text().split())
    assert f"stages/{stage}.py" in loaded
    assert loaded - ENTRY_POINT - declared(stage) == set()


def test_the_closure_follows_lazy_imports_and_packages(tmp_path: Path) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "schemas").mkdir()
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "schemas" / "__init__.py").write_text("from schemas.errors import E\n")
    (tmp_path / "schemas" / "errors.py").write_text("E = 1\n")
    (tmp_path / "stages" / "_helper.py").write_text("import numpy\n")
    (tmp_path / "stages" / "a.py").write_text(
        "import json\nfrom schemas import E\n\ndef run():\n    from stages import _helper\n"
    )
    assert import_closure(tmp_path, "stages/a.py") == [
        "schemas/__init__.py",
        "schemas/errors.py",
        "stages/__init__.py",
        "stages/_helper.py",
        "stages/a.py",
    ]
