"""Cluster manifests (issue 43 item 2): the objects a bundle ships under deploy/ hold to the
Kubernetes schemas (kubernetes-validate, strict: an unknown field is an error) and to the
KServe SDK's own models (each KServe object goes through the SDK and back unchanged: a field
the SDK does not know would be dropped), their numbers come from the plan and the load test,
and their probes, token and metrics agree with the server that runs inside them. Each
validator is shown to catch a planted mistake, so none of these checks can pass vacuously."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml

from schemas.artifacts import CapacityPlan, MemoryParts
from shipyard_runtime import front_door
from stages.bundling import cluster

K8S_VERSION = "1.33.0"
PLAN = CapacityPlan(
    batch=16,
    context=256,
    device_bytes=4 << 30,
    usable_bytes=3 << 30,
    kv_dtype="float32",
    kv_bytes_per_sequence=9_584_640,
    kv_bytes_per_token=73_728,
    cached_tokens=130,
    extreme=MemoryParts(
        weights=281_972_735,
        kv_cache=460_062_720,
        activations=34_256_448,
        overhead=268_435_456,
        total=1_044_727_359,
    ),
    max_batch_that_fits=105,
)
OPTS = cluster.defaults("gpt2-small", "0.1.0")


def rendered(peak: float | None = 979.2, rows: int = 16) -> dict[str, list[dict[str, Any]]]:
    files = cluster.files("gpt2-small", "0.1.0", PLAN, peak, rows, OPTS)
    return {
        name: [d for d in yaml.safe_load_all(text) if d]
        for name, text in files.items()
        if name.endswith(".yaml")
    }


def kserve_round_trip(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each document through the KServe SDK's model of its kind and back (in a child: the
    SDK is imported without its package's server half, which needs packages MLServer pins
    otherwise)."""
    script = r"""
import importlib.util, json, sys, types
spec = importlib.util.find_spec("kserve")
pkg = types.ModuleType("kserve")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["kserve"] = pkg
import kserve.models
import kubernetes.client.models as core
for name in dir(core):  # the SDK's models name Kubernetes' own (V1ObjectMeta, V1Container)
    if name.startswith("V") and not hasattr(kserve.models, name):
        setattr(kserve.models, name, getattr(core, name))
from kserve.api_client import ApiClient
client = ApiClient()
kinds = {"InferenceService": "V1beta1InferenceService", "ServingRuntime": "V1alpha1ServingRuntime"}
class Response:
    def __init__(self, doc):
        self.data = json.dumps(doc)
out = []
for doc in json.load(sys.stdin):
    model = client.deserialize(Response(doc), kinds[doc["kind"]])
    out.append(client.sanitize_for_serialization(model))
json.dump(out, sys.stdout)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return list(json.loads(done.stdout))


def test_the_kubernetes_objects_hold_to_the_kubernetes_schemas() -> None:
    docs = rendered()
    kinds = []
    for name in ("deployment", "service", "hpa"):
        for doc in docs[f"deploy/kubernetes/{name}.yaml"]:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            kinds.append(doc["kind"])
    assert kinds == ["Deployment", "Service", "HorizontalPodAutoscaler"]


@pytest.mark.parametrize(
    "plant",
    [
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinessProb={}),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
            containerPort="http"
        ),
        lambda d: d["spec"].pop("selector"),
    ],
    ids=["misspelt field", "wrong type", "required field missing"],
)
def test_the_kubernetes_check_catches_a_planted_mistake(plant: Any) -> None:
    [deployment] = rendered()["deploy/kubernetes/deployment.yaml"]
    plant(deployment)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_kserve_objects_are_what_the_kserve_sdk_reads() -> None:
    docs = rendered()
    ours = [
        *docs["deploy/kserve/servingruntime.yaml"],
        *docs["deploy/kserve/inferenceservice.yaml"],
    ]
    assert [d["kind"] for d in ours] == ["ServingRuntime", "InferenceService"]
    # nothing dropped, renamed or retyped (the SDK adds the container name KServe sets, "")
    assert [_unset_dropped(d) for d in kserve_round_trip(ours)] == ours


def _unset_dropped(value: Any) -> Any:
    """The SDK's output without the empty strings it fills required fields with."""
    if isinstance(value, dict):
        return {k: _unset_dropped(v) for k, v in value.items() if v != ""}
    if isinstance(value, list):
        return [_unset_dropped(v) for v in value]
    return value


def test_the_kserve_check_catches_a_misplaced_field() -> None:
    [isvc] = rendered()["deploy/kserve/inferenceservice.yaml"]
    isvc["spec"]["predictor"]["model"]["storageURI"] = isvc["spec"]["predictor"]["model"].pop(
        "storageUri"
    )
    isvc["spec"]["predictor"]["canaryPercent"] = 10
    back = kserve_round_trip([isvc])[0]
    assert "storageURI" not in back["spec"]["predictor"]["model"]
    assert "canaryPercent" not in back["spec"]["predictor"]
    assert back != isvc


def test_resources_come_from_the_plan_and_the_load_test() -> None:
    def memory(docs: dict[str, list[dict[str, Any]]]) -> tuple[str, str]:
        r = docs["deploy/kserve/inferenceservice.yaml"][0]["spec"]["predictor"]["model"]
        d = docs["deploy/kubernetes/deployment.yaml"][0]["spec"]["template"]["spec"]
        assert d["containers"][0]["resources"] == r["resources"]
        return r["resources"]["requests"]["memory"], r["resources"]["limits"]["memory"]

    # the plan's extreme (1,044,727,359 bytes = 997 MiB rounded up) above a small peak
    assert memory(rendered(peak=500.0)) == ("997Mi", f"{-(-1_044_727_359 * 3 // 2 // 2**20)}Mi")
    # a measured peak above the plan wins: 2,000 MB
    assert memory(rendered(peak=2000.0)) == ("1908Mi", "2862Mi")
    assert memory(rendered(peak=None))[0] == "997Mi"  # no load test: the plan alone


def test_the_autoscaler_reads_series_the_engine_exports() -> None:
    from prometheus_client import REGISTRY, generate_latest

    from shipyard_runtime.metrics import Metrics

    Metrics("cluster-manifest-test")  # the series a served engine registers
    exported = generate_latest(REGISTRY).decode()
    [hpa] = rendered(rows=16)["deploy/kubernetes/hpa.yaml"]
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == ["shipyard_requests_running", "shipyard_requests_waiting"]
    for name in names:
        assert f"# TYPE {name} gauge" in exported
    targets = [m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]]
    assert targets == ["12", "1"]  # 3/4 of 16 rows busy, or a request waiting, a pod
    [small] = rendered(rows=1)["deploy/kubernetes/hpa.yaml"]
    assert small["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "1"


def test_probes_token_and_command_agree_with_the_server_inside() -> None:
    docs = rendered()
    model = docs["deploy/kserve/inferenceservice.yaml"][0]["spec"]["predictor"]["model"]
    pod = docs["deploy/kubernetes/deployment.yaml"][0]["spec"]["template"]["spec"]
    runtime = docs["deploy/kserve/servingruntime.yaml"][0]["spec"]["containers"][0]
    for spec in (model, pod["containers"][0]):
        # the probes reach the two paths the front door leaves open without a token
        probed = {
            spec["readinessProbe"]["httpGet"]["path"],
            spec["livenessProbe"]["httpGet"]["path"],
        }
        assert probed == set(front_door.HEALTH)
        assert spec["readinessProbe"]["httpGet"]["port"] == cluster.HTTP
        # the token is a file from the Secret, never a value in the manifest
        [env] = spec["env"]
        assert env == {
            "name": front_door.TOKEN_FILE_ENV,
            "value": "/var/run/secrets/shipyard/token",
        }
        assert front_door.TOKEN_ENV not in {e["name"] for e in spec["env"]}
    for volumes in (docs["deploy/kserve/inferenceservice.yaml"][0]["spec"]["predictor"], pod):
        secret = next(v for v in volumes["volumes"] if v["name"] == "api-token")["secret"]
        assert secret == {"secretName": "gpt2-small-api-token", "defaultMode": 0o400}
    # both run the bundle's own launcher, bound for a pod, on the ports they declare
    for container in (runtime, pod["containers"][0]):
        assert container["command"] == ["python", "/mnt/models/serving/mlserver/shipyard_serve.py"]
        args = container["args"]
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[args.index("--http-port") + 1] == str(cluster.HTTP)
        assert "--no-auth" not in args and "--admin-api" not in args
    # the plain Deployment fetches the bundle the way KServe does, into the same folder
    [init] = pod["initContainers"]
    assert init["args"] == [OPTS.storage_uri, "/mnt/models"]


def test_the_dockerfile_pins_what_the_runtime_imports() -> None:
    from importlib.metadata import version

    text = cluster.files("gpt2-small", "0.1.0", PLAN, None, 4, OPTS)["deploy/Dockerfile"]
    for package in cluster.RUNTIME_PACKAGES:
        assert f"{package}=={version(package)}" in text
    assert "USER 1000" in text  # the manifests ask for runAsNonRoot
    assert f"docker build -t {OPTS.image} deploy/" in text  # the name the manifests use
    [runtime] = rendered()["deploy/kserve/servingruntime.yaml"]
    assert runtime["spec"]["containers"][0]["image"] == OPTS.image
