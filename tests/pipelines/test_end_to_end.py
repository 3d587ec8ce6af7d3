"""`make release` on a fresh copy of the repo, then what DVC reruns after an edit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages import load_stages
from stages.engine import why_unavailable
from tests.conftest import REPO

pytestmark = pytest.mark.slow
VENV = Path(sys.executable).parent.parent
STAGES = list(load_stages())  # the order itself is pinned in tests/stages/test_runtime.py


def sh(
    cmd: list[str], cwd: Path, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}", "SHIPYARD_ROOT": ""}
    env.pop("SHIPYARD_ROOT")
    env.update(extra or {})
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w-]+)@", output)


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git clone of the committed tree plus uncommitted work, without build outputs."""
    root = tmp_path_factory.mktemp("clone") / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    sh(["git", "init", "-q"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], root)
    return root


def test_make_release_builds_a_verified_bundle(clone: Path) -> None:
    stamp = VENV / ".installed"
    # The 124M example release is built by `make release` and the benchmark, not in CI.
    args = ["RELEASE_TARGETS=bundle@tiny-gpt2", "CHECKPOINTS="]
    done = sh(["make", "release", f"VENV={VENV}", "-o", str(stamp), *args], clone)
    assert ran(done.stdout) == STAGES
    verdicts = re.findall(r"^(PASS|FAIL|SKIP) (\w+)@tiny-gpt2", done.stdout, re.M)
    # The engine stage skips (optional) where no GPU and TensorRT are, and runs where they are.
    engine = "SKIP" if why_unavailable() else "PASS"
    assert verdicts == [(engine if s == "engine" else "PASS", s) for s in ran(done.stdout)]
    assert "every file matches manifest.json" in done.stdout


def test_second_repro_does_nothing(clone: Path) -> None:
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == []
    assert "Data and pipelines are up to date." in done.stdout


def test_editing_parity_reruns_only_parity_and_what_depends_on_it(clone: Path) -> None:
    spec = clone / "releases" / "tiny-gpt2.yaml"
    spec.write_text(spec.read_text().replace("  statistic: max", "  statistic: mean"))
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    # engine reads parity.tolerance as its default; its unchanged output stops the chain there
    assert ran(done.stdout) == ["parity", "engine", "manifest", "bundle"]
    sh(["shipyard", "verify", "build/tiny-gpt2/bundle"], clone)


def test_editing_a_comment_or_field_description_reruns_no_stage(clone: Path) -> None:
    code = clone / "stages" / "export.py"
    code.write_text(code.read_text() + "\n# a comment changes the file, not what it does\n")
    section = clone / "schemas" / "spec" / "export.py"
    text = section.read_text()
    assert 'description="ONNX opset' in text
    section.write_text(text.replace('description="ONNX opset', 'description="The ONNX opset'))
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == []  # only the `code` stage ran: the fingerprints are unchanged
    assert "Running stage 'code'" in done.stdout


def test_editing_export_code_reruns_export_but_not_its_dependants(clone: Path) -> None:
    code = clone / "stages" / "export.py"
    code.write_text(code.read_text() + "\n_UNUSED = 'code, not a comment: the tree changes'\n")
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == ["export"]  # same ONNX bytes: nothing after it reruns


def test_editing_the_model_card_text_reruns_only_the_bundle(clone: Path) -> None:
    spec = clone / "releases" / "tiny-gpt2.yaml"
    text = spec.read_text()
    assert "    description: Tiny 2-layer GPT-2" in text
    spec.write_text(
        text.replace("    description: Tiny 2-layer GPT-2", "    description: A tiny GPT-2")
    )
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == ["bundle"]  # engine and serve read only bundle.serving (etc.)
    template = clone / "stages" / "templates" / "MODEL_CARD.md.j2"
    template.write_text(template.read_text() + "\n")
    assert ran(sh(["dvc", "repro", "bundle@tiny-gpt2"], clone).stdout) == ["bundle"]


def test_editing_the_manifest_schema_reruns_manifest_and_bundle_only(clone: Path) -> None:
    code = clone / "schemas" / "manifest.py"
    code.write_text(code.read_text() + "\n_UNUSED = 'derived dependencies: only its importers'\n")
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == ["manifest", "bundle"]
    sh(["shipyard", "verify", "build/tiny-gpt2/bundle"], clone)


def test_editing_one_spec_section_module_reruns_only_the_stages_that_read_it(clone: Path) -> None:
    code = clone / "schemas" / "spec" / "capacity.py"
    code.write_text(code.read_text() + "\n_UNUSED = 'read by plan and loadtest only'\n")
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    # plan's output is unchanged, so serve and engine stop there; the load test measures
    # again (timings differ), so the manifest and the bundle follow it
    assert ran(done.stdout) == ["plan", "loadtest", "manifest", "bundle"]


def test_a_fresh_clone_with_the_shared_remote_recomputes_nothing(
    clone: Path, tmp_path: Path, s3_server: str
) -> None:
    """Clone A (built above) pushes outputs and run-cache to a real S3 API (moto's server);
    clone B of the same commit pulls and `dvc repro` runs no stage. Then a threshold edit in
    B reruns only what follows it."""
    import boto3

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="shipyard-cache")
    remote = "s3://shipyard-cache/dvc"
    env_remote = {"SHIPYARD_DVC_REMOTE": remote, "SHIPYARD_DVC_ENDPOINT": s3_server}
    sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)  # A is complete after the edits above
    sh(["git", "add", "-A"], clone)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "built"], clone)
    pushed = sh(["shipyard", "cache", "push"], clone, env_remote)
    assert f"pushed to {remote}" in pushed.stdout
    b = tmp_path / "b"
    sh(["git", "clone", "-q", str(clone), str(b)], tmp_path)
    assert not (b / "build" / "tiny-gpt2" / "bundle").exists()
    sh(["shipyard", "cache", "pull"], b, env_remote)
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], b)
    assert ran(done.stdout) == []  # everything restored, nothing recomputed
    sh(["shipyard", "verify", "build/tiny-gpt2/bundle"], b)
    spec = b / "releases" / "tiny-gpt2.yaml"
    text = spec.read_text()
    assert text.count("threshold: 0.97") == 1 and text.count("    samples: 64\n") == 1
    # a threshold alone: evaluate reruns, writes the same verdicts, and nothing follows it
    spec.write_text(text.replace("threshold: 0.97", "threshold: 0.96"))
    assert ran(sh(["dvc", "repro", "bundle@tiny-gpt2"], b).stdout) == ["evaluate"]
    # fewer evaluation samples change the metrics: evaluate and what follows it rerun
    spec.write_text(spec.read_text().replace("    samples: 64\n", "    samples: 48\n"))
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], b)
    assert ran(done.stdout) == ["evaluate", "manifest", "bundle"]
    # the metrics are committed: DVC compares them with the last commit
    diff = json.loads(sh(["dvc", "metrics", "diff", "HEAD", "--json"], b).stdout)
    changed = diff["build/tiny-gpt2/metrics/evaluate.json"]
    assert changed["perplexity"]["diff"] != 0
