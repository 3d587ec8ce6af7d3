"""`shipyard deploy`, `promote --canary --manifests` and `rollback --manifests` (issue 43
item 2): a published bundle's own deploy/ manifests, written for where the registry is
(storageUri), checked against the Kubernetes schemas and the typed models after the
deployment's choices are set; a canary step and its rollback are moves in the registry's
history; a registry a cluster cannot reach, an upside-down replica range, a tampered bundle
and a bundle without manifests are refused with the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pipelines.registry import Registry
from tests.conftest import Workspace, bucket

SHIPYARD = str(Path(sys.executable).parent / "shipyard")


def shipyard(ws: Workspace, *args: str) -> tuple[int, str]:
    env = {**os.environ, "SHIPYARD_ROOT": str(ws.root)}
    done = subprocess.run(
        [SHIPYARD, *args], env=env, capture_output=True, text=True, timeout=300, cwd=ws.root
    )
    return done.returncode, done.stdout + done.stderr


def docs(folder: Path, rel: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((folder / rel).read_text()) if d]


@pytest.fixture(scope="module")
def version(built_gpt2: Workspace) -> str:
    facts = json.loads((built_gpt2.out("tiny-gpt2", "bundle") / "shipyard.json").read_text())
    return str(facts["version"])


def test_the_bundle_ships_manifests_and_deploy_writes_them_for_the_registry(
    built_gpt2: Workspace, version: str, tmp_path: Path
) -> None:
    bundle = built_gpt2.out("tiny-gpt2", "bundle")
    for rel in ("kserve/inferenceservice.yaml", "kubernetes/deployment.yaml", "Dockerfile"):
        assert (bundle / "deploy" / rel).is_file()
    registry = tmp_path / "registry"
    Registry(str(registry)).publish(bundle, "tiny-gpt2", version)
    out = tmp_path / "manifests"
    # a folder registry: a cluster cannot fetch from this machine's disk
    rc, text = shipyard(built_gpt2, "deploy", f"tiny-gpt2@{version}", "--out", str(out),
                        "--registry", str(registry))  # fmt: skip
    assert rc != 0 and "--storage-uri" in text and "Traceback" not in text
    assert not out.exists()
    rc, text = shipyard(
        built_gpt2, "deploy", f"tiny-gpt2@{version}", "--out", str(out), "--registry",
        str(registry), "--storage-uri", "pvc://models", "--image", "registry.example/rt:1",
        "--namespace", "ml", "--min-replicas", "2", "--max-replicas", "6",
    )  # fmt: skip
    assert rc == 0, text
    [isvc] = docs(out, "kserve/inferenceservice.yaml")
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["storageUri"] == f"pvc://models/releases/tiny-gpt2/{version}"
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (2, 6)
    assert "canaryTrafficPercent" not in predictor
    [runtime] = docs(out, "kserve/servingruntime.yaml")
    assert runtime["spec"]["containers"][0]["image"] == "registry.example/rt:1"
    [deployment] = docs(out, "kubernetes/deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["args"][0] == predictor["model"]["storageUri"]
    assert pod["containers"][0]["image"] == "registry.example/rt:1"
    assert deployment["spec"]["replicas"] == 2
    for rel in ("kubernetes/deployment.yaml", "kubernetes/service.yaml", "kubernetes/hpa.yaml"):
        for doc in docs(out, rel):
            assert doc["metadata"]["namespace"] == "ml"
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
    [hpa] = docs(out, "kubernetes/hpa.yaml")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    # the registry's copy was verified and is untouched; nothing of the bundle was written
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == [
        "deployment.yaml", "hpa.yaml", "inferenceservice.yaml", "service.yaml",
        "servingruntime.yaml",
    ]  # fmt: skip
    # upside down: refused, naming both flags
    rc, text = shipyard(
        built_gpt2, "deploy", f"tiny-gpt2@{version}", "--out", str(tmp_path / "x"),
        "--registry", str(registry), "--storage-uri", "pvc://m", "--min-replicas", "9",
    )  # fmt: skip
    assert rc != 0 and "--max-replicas" in text and "Traceback" not in text
    for bad in (["--canary", "-5"], ["--min-replicas", "0"], ["--canary", "x"]):
        rc, text = shipyard(built_gpt2, "deploy", f"tiny-gpt2@{version}", "--out",
                            str(tmp_path / "x"), "--registry", str(registry),
                            "--storage-uri", "pvc://m", *bad)  # fmt: skip
        assert rc != 0 and "Traceback" not in text, (bad, text)
    assert not (tmp_path / "x").exists()


def test_a_canary_step_and_its_rollback_are_recorded_and_rendered(
    built_gpt2: Workspace, version: str, tmp_path: Path, s3_server: str
) -> None:
    url = f"s3://deploy-{bucket()}/registry"
    bundle = built_gpt2.out("tiny-gpt2", "bundle")
    reg = Registry(url)
    reg.publish(bundle, "tiny-gpt2", version)
    # one version in steps: a canary of 10 %, then all of it
    out = tmp_path / "m"
    rc, text = shipyard(
        built_gpt2, "promote", f"tiny-gpt2@{version}", "--to", "production", "--canary",
        "10", "--manifests", str(out), "--registry", url,
    )  # fmt: skip
    assert rc == 0, text
    [isvc] = docs(out, "kserve/inferenceservice.yaml")
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 10
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == f"{url}/releases/tiny-gpt2/{version}"
    # the same step again is no move; a larger share of the same version is one
    rc, text = shipyard(built_gpt2, "promote", f"tiny-gpt2@{version}", "--to", "production",
                        "--canary", "10", "--registry", url)  # fmt: skip
    assert rc == 0 and "nothing moved" in text
    rc, text = shipyard(built_gpt2, "promote", f"tiny-gpt2@{version}", "--to", "production",
                        "--canary", "100", "--registry", url)  # fmt: skip
    assert rc == 0 and "canary 100" in text
    history = Registry(url).history()
    assert [e.canary_percent for e in history] == [10, 100]
    rc, text = shipyard(built_gpt2, "history", "--registry", url)
    assert "(canary 10 %)" in text and "(canary 100 %)" in text
    # a canary percent out of range is refused before anything moves
    rc, text = shipyard(built_gpt2, "promote", f"tiny-gpt2@{version}", "--to", "production",
                        "--canary", "101", "--registry", url)  # fmt: skip
    assert rc != 0 and "0 to 100" in text and len(Registry(url).history()) == 2
    # rollback: this channel's stack holds one version, so there is nothing to go back to
    rc, text = shipyard(built_gpt2, "rollback", "production", "--manifests", str(out),
                        "--registry", url)  # fmt: skip
    assert rc != 0 and "no earlier version" in text


def test_rollback_writes_the_previous_version_with_all_of_the_traffic(
    built_gpt2: Workspace, version: str, tmp_path: Path
) -> None:
    from tests.conftest import built_as

    url = str(tmp_path / "registry")
    reg = Registry(url)
    first = built_gpt2.out("tiny-gpt2", "bundle")
    reg.publish(first, "tiny-gpt2", version)
    reg.publish(built_as(first, tmp_path / "second", "9.9.9"), "tiny-gpt2", "9.9.9")
    reg.promote("tiny-gpt2", version, "production", "first")
    out = tmp_path / "m"
    rc, text = shipyard(built_gpt2, "promote", "tiny-gpt2@9.9.9", "--to", "production",
                        "--canary", "25", "--manifests", str(out), "--registry", url,
                        "--storage-uri", "pvc://reg")  # fmt: skip
    assert rc == 0, text
    [isvc] = docs(out, "kserve/inferenceservice.yaml")
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 25
    assert isvc["spec"]["predictor"]["model"]["storageUri"].endswith("/tiny-gpt2/9.9.9")
    rc, text = shipyard(built_gpt2, "rollback", "production", "--manifests", str(out),
                        "--registry", url, "--storage-uri", "pvc://reg")  # fmt: skip
    assert rc == 0, text
    [isvc] = docs(out, "kserve/inferenceservice.yaml")
    assert "canaryTrafficPercent" not in isvc["spec"]["predictor"]
    assert (
        isvc["spec"]["predictor"]["model"]["storageUri"]
        == f"pvc://reg/releases/tiny-gpt2/{version}"
    )
    actions = [(e.action, e.to, e.canary_percent) for e in Registry(url).history()]
    assert actions == [
        ("promote", f"tiny-gpt2@{version}", None),
        ("promote", "tiny-gpt2@9.9.9", 25),
        ("rollback", f"tiny-gpt2@{version}", None),
    ]


def test_a_bundle_without_manifests_or_with_a_broken_one_is_refused(
    built_gpt2: Workspace, version: str, tmp_path: Path
) -> None:
    from pipelines.deploy import load
    from schemas import RegistryError
    from tests.conftest import writable_copy

    bundle = writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "b")
    path = bundle / "deploy/kubernetes/hpa.yaml"
    text = path.read_text()
    path.write_text(text.replace("maxReplicas", "maxReplica"))
    with pytest.raises(RegistryError, match="not a valid HorizontalPodAutoscaler"):
        load(bundle)
    path.unlink()
    with pytest.raises(RegistryError, match="built before bundles carried cluster manifests"):
        load(bundle)
    # and a tampered published copy never reaches the renderer: the checkout verifies it
    registry = tmp_path / "registry"
    Registry(str(registry)).publish(built_gpt2.out("tiny-gpt2", "bundle"), "tiny-gpt2", version)
    shipped = registry / "releases" / "tiny-gpt2" / version / "deploy/kserve/inferenceservice.yaml"
    shipped.chmod(0o644)
    shipped.write_text(shipped.read_text().replace("api-token", "no-token"))
    rc, text = shipyard(built_gpt2, "deploy", f"tiny-gpt2@{version}", "--out",
                        str(tmp_path / "o"), "--registry", str(registry),
                        "--storage-uri", "pvc://m")  # fmt: skip
    assert rc != 0 and "Traceback" not in text
    assert not (tmp_path / "o").exists()
