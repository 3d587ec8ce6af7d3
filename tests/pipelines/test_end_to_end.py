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

from schemas import StageReport
from schemas.loadresults import LoadTestResults
from schemas.quantsearch import PerNodeDetails
from stages import load_stages
from stages.engine import why_unavailable
from tests.conftest import REPO

pytestmark = pytest.mark.slow
VENV = Path(sys.executable).parent.parent
STAGES = list(load_stages())  # the order itself is pinned in tests/stages/test_contract.py


def sh(
    cmd: list[str], cwd: Path, extra: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}", "SHIPYARD_ROOT": ""}
    env["SHIPYARD_STAGE_CHILD"] = "1"  # as a user's build runs: PyTorch in a child
    env.pop("SHIPYARD_ROOT")
    env.update(extra or {})
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w-]+)@", output)


# the release's DVC plots: each committed data file (its id in the stage's `plots:`)
PLOT_IDS = [
    "build/tiny-gpt2/plots/loadtest/latency_throughput.json",
    "build/tiny-gpt2/plots/loadtest/streaming.json",
    "build/tiny-gpt2/plots/quantize/layer_snr.json",
]


def copy_worktree(root: Path) -> Path:
    """The committed tree plus uncommitted work, without build outputs, copied to root."""
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
    return root


def commit_all(root: Path) -> Path:
    """root as a new git repository with everything in it committed."""
    sh(["git", "init", "-q"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], root)
    return root


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git clone of the committed tree plus uncommitted work, without build outputs."""
    return commit_all(copy_worktree(tmp_path_factory.mktemp("clone") / "repo"))


def test_make_release_builds_a_verified_bundle(clone: Path, tmp_path: Path) -> None:
    from tests.keys import keypair

    stamp = VENV / ".installed"
    # The 124M example release is built by `make release` and the benchmark, not in CI.
    args = ["RELEASE_TARGETS=bundle@tiny-gpt2", "CHECKPOINTS="]
    key, pub = keypair(tmp_path, "builder")
    done = sh(
        ["make", "release", f"VENV={VENV}", "-o", str(stamp), *args],
        clone,
        {"SHIPYARD_BUILDER_KEY": str(key)},
    )
    assert ran(done.stdout) == STAGES
    verdicts = re.findall(r"^(PASS|FAIL|SKIP) (\w+)@tiny-gpt2", done.stdout, re.M)
    # The engine stage skips (optional) where no GPU and TensorRT are, and runs where they are.
    engine = "SKIP" if why_unavailable() else "PASS"
    assert verdicts == [(engine if s == "engine" else "PASS", s) for s in ran(done.stdout)]
    assert "every file matches manifest.json" in done.stdout
    # the bundle carries who built each stage, and every shipped file is attested
    bundle = "build/tiny-gpt2/bundle"
    checked = sh(
        ["shipyard", "verify", bundle, "--provenance", "--trusted-builder", str(pub)], clone
    )
    # every stage, the bundle's own file list with them (attestations/bundle.json)
    assert checked.stdout.count(": built by ") == len(STAGES)
    assert "every shipped file attested" in checked.stdout
    sh(["shipyard", "provenance", "tiny-gpt2", "--trusted-builder", str(pub)], clone)


def test_second_repro_does_nothing(clone: Path) -> None:
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    assert ran(done.stdout) == []
    assert "Data and pipelines are up to date." in done.stdout


def test_dvc_plots_render_the_load_test_curves_and_the_per_layer_errors(clone: Path) -> None:
    shown = json.loads(sh(["dvc", "plots", "show", "--json", *PLOT_IDS], clone).stdout)
    assert not shown.get("errors"), shown["errors"]
    build = clone / "build" / "tiny-gpt2"
    measured = (build / "loadtest" / "loadtest.json").read_text()
    ramp = LoadTestResults.model_validate_json(measured).ramp.points
    quantized = StageReport.model_validate_json((build / "quantize" / "report.json").read_text())
    layers = PerNodeDetails.model_validate(quantized.details).layerwise or []
    ramp_id, stream_id, snr_id = PLOT_IDS
    want = {
        ramp_id: ("throughput_rps", "p95_latency_ms", len(ramp)),
        stream_id: ("concurrency", "p95_ttft_ms", None),
        snr_id: ("layer", "snr_db", len(layers)),
    }
    for plot_id, (x, y, rows) in want.items():
        content = shown["data"][plot_id][0]["content"]
        values = content["data"]["values"]
        assert values and all(v[x] is not None and v[y] is not None for v in values)
        assert rows is None or len(values) == rows
    # the rendered HTML (what a reviewer opens) holds every declared plot of the release,
    # and with the template `make release` configures it loads nothing from a CDN
    modules = REPO / ".tools" / "node_modules"
    if not (modules / "vega-embed").is_dir():
        pytest.fail("the Vega packages are not installed: `make test` installs them (npm)")
    sh([sys.executable, str(REPO / "scripts" / "plots_template.py"), str(modules),
        ".dvc/plots/offline.html"], clone)  # fmt: skip
    sh(["dvc", "config", "--local", "plots.html_template", "plots/offline.html"], clone)
    sh(["dvc", "plots", "show", "-o", "plots-html", *PLOT_IDS], clone)
    html = (clone / "plots-html" / "index.html").read_text()
    assert all(f"tiny-gpt2: {t}" in html for t in ("Latency vs", "Streaming", "Quantization"))
    assert "cdn.jsdelivr" not in html and "<script src=" not in html and "vegaEmbed" in html
    shutil.rmtree(clone / "plots-html")


def test_shipyard_build_runs_releases_in_parallel_and_records_both(clone: Path) -> None:
    """Two new releases built by two concurrent `dvc repro`s: both complete, dvc.lock holds
    both (a lost update would make the next repro rerun one), and the bundles verify."""
    import yaml

    source = yaml.safe_load((clone / "releases" / "tiny-gpt2.yaml").read_text())
    made = []
    for name in ("tiny-a", "tiny-b"):
        spec = {**source, "name": name}
        spec["engine"] = {**spec["engine"], "timing_cache": f"build/timing-caches/{name}.cache"}
        lt = spec["loadtest"]  # the load test is what takes time; keep it short here
        spec["loadtest"] = {  # no SLOs: two builds share 2 cores, this is not a capacity test
            "grid": lt["grid"],
            "ramp": {**lt["ramp"], "max_concurrency": 2, "max_windows": 3},
            "soak": {**lt["soak"], "seconds": 1},
        }
        path = clone / "releases" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        made.append(path)
    sh(["shipyard", "compile"], clone)
    try:
        done = sh(["shipyard", "build", "tiny-a", "tiny-b", "-j", "2", "--memory", "64GiB"], clone)
        starts = [line for line in done.stdout.splitlines() if line.startswith("started ")]
        assert len(starts) == 2
        # both started before either finished: they ran side by side
        first_done = min(done.stdout.index("tiny-a: ok"), done.stdout.index("tiny-b: ok"))
        assert done.stdout.index(starts[1]) < first_done
        for name in ("tiny-a", "tiny-b"):
            assert f"{name}: ok, {len(STAGES)} stage(s) ran" in done.stdout
            sh(["shipyard", "verify", f"build/{name}/bundle"], clone)
        again = sh(["dvc", "repro", "bundle@tiny-a", "bundle@tiny-b"], clone)
        assert ran(again.stdout) == []
        # the memory limit orders the work: a budget below two releases runs them one by one
        one = sh(["shipyard", "build", "tiny-a", "tiny-b", "-j", "2", "--memory", "1MiB"], clone)
        lines = [ln for ln in one.stdout.splitlines() if ln.startswith(("started", "tiny-"))]
        assert [ln.split()[0] for ln in lines] == ["started", "tiny-a:", "started", "tiny-b:"]
    finally:
        for path in made:
            path.unlink()
        sh(["shipyard", "compile"], clone)


def test_editing_parity_reruns_only_parity_and_what_depends_on_it(clone: Path) -> None:
    spec = clone / "releases" / "tiny-gpt2.yaml"
    spec.write_text(spec.read_text().replace("  statistic: max", "  statistic: mean"))
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], clone)
    # kvcheck judges with parity.statistic; engine reads parity.tolerance as its default
    assert ran(done.stdout) == ["parity", "kvcheck", "engine", "manifest", "bundle"]
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
    # same ONNX bytes: nothing after it reruns but the bundle, which ships export's new
    # attestation (it names the new code)
    assert ran(done.stdout) == ["export", "bundle"]


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
    # DVC's plots of a commit this clone never built (nor pulled): their data is in git
    diff = json.loads(
        sh(["dvc", "plots", "diff", "HEAD", "--json", "--targets", *PLOT_IDS], b).stdout
    )
    assert not diff.get("errors"), diff["errors"]
    for plot_id in PLOT_IDS:
        values = diff["data"][plot_id][0]["content"]["data"]["values"]
        # `plots diff HEAD` compares HEAD with the workspace; a clean clone's workspace holds
        # HEAD's committed data, so both revisions carry the same points
        by_rev: dict[str, list[dict[str, object]]] = {}
        for v in values:
            by_rev.setdefault(v.pop("rev"), []).append(v)
        assert set(by_rev) == {"HEAD", "workspace"}, (plot_id, values)
        assert by_rev["HEAD"] and by_rev["HEAD"] == by_rev["workspace"], (plot_id, by_rev)
    sh(["shipyard", "cache", "pull"], b, env_remote)
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], b)
    assert ran(done.stdout) == []  # everything restored, nothing recomputed
    sh(["shipyard", "verify", "build/tiny-gpt2/bundle"], b)
    spec = b / "releases" / "tiny-gpt2.yaml"
    text = spec.read_text()
    assert text.count("threshold: 0.97") == 1 and text.count("    samples: 64\n") == 1
    # a threshold alone: evaluate reruns, writes the same verdicts, and nothing follows it
    # but the bundle (evaluate's attestation names the new spec)
    spec.write_text(text.replace("threshold: 0.97", "threshold: 0.96"))
    assert ran(sh(["dvc", "repro", "bundle@tiny-gpt2"], b).stdout) == ["evaluate", "bundle"]
    # and DVC's own views show the spec change (its params are the specs, on the code stage)
    params = json.loads(sh(["dvc", "params", "diff", "--json"], b).stdout)
    changed = params["releases/tiny-gpt2.yaml"]
    assert list(changed) and all(k.startswith("evaluation.thresholds") for k in changed), changed
    assert "0.96" in json.dumps(changed) and "0.97" in json.dumps(changed)
    # and `dvc exp show`: the workspace row carries the edited spec value, HEAD's the old
    rows = json.loads(sh(["dvc", "exp", "show", "--json"], b).stdout)
    seen = {
        row["rev"]: json.dumps(row["data"]["params"]["releases/tiny-gpt2.yaml"]["data"])
        for row in rows
        if row.get("data") and "releases/tiny-gpt2.yaml" in row["data"].get("params", {})
    }
    head = next(rev for rev in seen if rev != "workspace")
    assert '"threshold": 0.96' in seen["workspace"] and '"threshold": 0.97' in seen[head], seen
    # fewer evaluation samples change the metrics: evaluate and what follows it rerun
    spec.write_text(spec.read_text().replace("    samples: 64\n", "    samples: 48\n"))
    done = sh(["dvc", "repro", "bundle@tiny-gpt2"], b)
    assert ran(done.stdout) == ["evaluate", "manifest", "bundle"]
    # the metrics are committed: DVC compares them with the last commit
    diff = json.loads(sh(["dvc", "metrics", "diff", "HEAD", "--json"], b).stdout)
    changed = diff["build/tiny-gpt2/metrics.json"]
    assert changed["evaluate.perplexity"]["diff"] != 0
    # a clone whose dvc.lock predates the build: only the run-cache can serve it, and it
    # serves every stage (the metrics files' objects travel with it: `cache push`)
    c = tmp_path / "c"
    sh(["git", "clone", "-q", str(clone), str(c)], tmp_path)
    (c / "dvc.lock").unlink()
    (c / "build" / "tiny-gpt2" / "metrics.json").unlink()
    sh(["shipyard", "cache", "pull"], c, env_remote)
    done = sh(["dvc", "repro", "--pull", "bundle@tiny-gpt2"], c)
    assert ran(done.stdout) == [], done.stdout
    sh(["shipyard", "verify", "build/tiny-gpt2/bundle"], c)


def test_a_bad_spec_fails_the_build_and_deletes_no_releases_params(tmp_path: Path) -> None:
    """Issue 43: DVC removes a stage's outs before it runs, so one bad spec failed the
    `code` stage and left build/.params empty: every stage of every release then read as
    changed. The params folder persists: the failed run leaves each release's params as
    they were, and fixing the spec rewrites them the same."""
    root = commit_all(copy_worktree(tmp_path / "repo"))
    sh(["dvc", "repro", "-q", "code"], root)
    params = root / "build" / ".params"
    before = {p.relative_to(params): p.read_bytes() for p in params.rglob("*.json")}
    assert {p.parts[0] for p in before} == {"gpt2-small", "tiny-gpt2"}
    spec = root / "releases" / "tiny-gpt2.yaml"
    good = spec.read_text()
    spec.write_text(good.replace("task: causal-lm", "task: causal-lm\nno_such_field: 1", 1))
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"}
    env.pop("SHIPYARD_ROOT", None)
    failed = subprocess.run(
        ["dvc", "repro", "code"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert failed.returncode != 0 and "no_such_field" in failed.stdout + failed.stderr
    assert {p.relative_to(params): p.read_bytes() for p in params.rglob("*.json")} == before
    spec.write_text(good)
    sh(["dvc", "repro", "-q", "code"], root)
    assert {p.relative_to(params): p.read_bytes() for p in params.rglob("*.json")} == before
