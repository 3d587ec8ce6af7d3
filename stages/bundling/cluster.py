"""The cluster manifests a bundle ships (`deploy/`), rendered from the typed models of
schemas/cluster.py:

- `deploy/kserve/servingruntime.yaml` and `deploy/kserve/inferenceservice.yaml`: a KServe
  `InferenceService` on a `ServingRuntime` that starts the bundle's own MLServer front door
  (`serving/mlserver/shipyard_serve.py`: the token check, limits and V2/OpenAI routes
  `shipyard serve` has) from the bundle KServe's storage initializer downloads from
  `storageUri` into /mnt/models;
- `deploy/kubernetes/deployment.yaml`, `service.yaml`, `hpa.yaml`: the same server for a
  cluster without KServe (KServe's storage initializer as an init container fetches the
  bundle), scaled by a HorizontalPodAutoscaler on the engine's own gauges
  (`shipyard_requests_running` and `shipyard_requests_waiting`, per pod, through a
  custom-metrics adapter such as prometheus-adapter);
- `deploy/Dockerfile`: the runtime image both run (the runtime's dependencies at the
  versions this build used; the bundle itself is not in the image).

Resources come from the release's own numbers: memory requested is the larger of the plan's
extreme (weights, KV budget, activations, overhead) and the load test's measured peak, the
limit MEMORY_LIMIT x that; readiness and liveness probe the V2 health endpoints, which the
front door leaves open; the API token is a Secret mounted as a file (never an environment
variable, never in the bundle). `shipyard deploy` renders the same objects for a published
version with its registry URI and, for a canary, `canaryTrafficPercent`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version as installed

from schemas.artifacts import CapacityPlan
from schemas.cluster import (
    ApiObject,
    Container,
    ContainerPort,
    CrossVersionObjectReference,
    Deployment,
    DeploymentSpec,
    EmptyDirVolumeSource,
    EnvVar,
    HorizontalPodAutoscaler,
    HorizontalPodAutoscalerSpec,
    HTTPGetAction,
    InferenceService,
    InferenceServiceSpec,
    LabelSelector,
    MetricIdentifier,
    MetricSpec,
    MetricTarget,
    ModelFormat,
    ModelSpec,
    ObjectMeta,
    PodsMetricSource,
    PodSpec,
    PodTemplateSpec,
    PredictorSpec,
    Probe,
    ResourceRequirements,
    SecretVolumeSource,
    SecurityContext,
    Service,
    ServicePort,
    ServiceSpec,
    ServingRuntime,
    ServingRuntimeSpec,
    SupportedModelFormat,
    Volume,
    VolumeMount,
)
from stages.bundling import layout

FOLDER = "deploy/"
HTTP, GRPC, METRICS = 8080, 8081, 8082  # KServe routes its predictor's traffic to 8080
MODELS = "/mnt/models"  # where KServe's storage initializer puts the bundle
SERVER = f"{MODELS}/{layout.LAUNCHER}"
TOKEN_DIR, TOKEN_KEY = "/var/run/secrets/shipyard", "token"
RUNTIME = "shipyard-mlserver"
FORMAT = "shipyard-bundle"
MEMORY_LIMIT = 1.5  # limit over request: the memory alert's margin (monitoring.MARGIN_MEMORY)
CPU = "2"  # the cores of the machines the load-test baseline (and the alerts) came from
RUNNING_SHARE = 0.75  # scale out when pods average this share of their engine rows busy
WAITING_PER_POD = "1"  # ... or more than one request waiting for admission a pod
INITIALIZER = "kserve/storage-initializer:v0.21.0"
# the runtime's third-party imports (the shipped modules import nothing of Shipyard)
RUNTIME_PACKAGES = (
    "mlserver",
    "onnxruntime",
    "numpy",
    "tokenizers",
    "jinja2",
    "uvloop",
    "protobuf",
)
DEFAULT_STORAGE = "pvc://shipyard-registry/releases/{name}/{version}"


@dataclass(frozen=True)
class Options:
    """What a deployment decides beyond the bundle (`shipyard deploy`'s flags)."""

    storage_uri: str
    image: str
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 4


def defaults(name: str, version: str) -> Options:
    """The bundle's own manifests: a folder registry on a PersistentVolumeClaim named
    `shipyard-registry` (`shipyard deploy` renders them for any registry)."""
    return Options(
        storage_uri=DEFAULT_STORAGE.format(name=name, version=version),
        image=f"shipyard-runtime:{installed('mlserver')}-ort{installed('onnxruntime')}",
    )


def memory_request(plan: CapacityPlan, peak_rss_mb: float | None) -> int:
    """Bytes: the plan's extreme or the load test's measured peak, whichever is larger."""
    measured = int((peak_rss_mb or 0) * 1e6)
    return max(plan.extreme.total, measured)


def _mi(nbytes: float) -> str:
    return f"{math.ceil(nbytes / 2**20)}Mi"


def _container(plan: CapacityPlan, peak: float | None) -> dict[str, object]:
    """The server container's settings, shared by KServe's model spec and the Deployment."""
    request = memory_request(plan, peak)
    return {
        "env": [EnvVar(name="SHIPYARD_API_TOKEN_FILE", value=f"{TOKEN_DIR}/{TOKEN_KEY}")],
        "resources": ResourceRequirements(
            requests={"cpu": CPU, "memory": _mi(request)},
            limits={"memory": _mi(request * MEMORY_LIMIT)},
        ),
        "readiness_probe": Probe(
            http_get=HTTPGetAction(path="/v2/health/ready", port=HTTP),
            initial_delay_seconds=5,
            period_seconds=5,
            failure_threshold=3,
        ),
        "liveness_probe": Probe(
            http_get=HTTPGetAction(path="/v2/health/live", port=HTTP),
            # a large model loads for a while: liveness waits longer than readiness
            initial_delay_seconds=30,
            period_seconds=10,
            failure_threshold=6,
        ),
        "volume_mounts": [VolumeMount(name="api-token", mount_path=TOKEN_DIR, read_only=True)],
    }


def _server_args() -> list[str]:
    return [
        "--host", "0.0.0.0",
        "--http-port", str(HTTP),
        "--grpc-port", str(GRPC),
        "--metrics-port", str(METRICS),
    ]  # fmt: skip


def _ports() -> list[ContainerPort]:
    return [
        ContainerPort(container_port=HTTP, name="http"),
        ContainerPort(container_port=GRPC, name="grpc"),
        ContainerPort(container_port=METRICS, name="metrics"),
    ]


def _token_volume(name: str) -> Volume:
    return Volume(
        name="api-token",
        secret=SecretVolumeSource(secret_name=token_secret(name), default_mode=0o400),
    )


def token_secret(name: str) -> str:
    """The Secret the operator creates (`kubectl create secret generic NAME
    --from-file=token=FILE`), mounted where SHIPYARD_API_TOKEN_FILE points."""
    return f"{name}-api-token"


def kserve(
    name: str, version: str, plan: CapacityPlan, peak: float | None, opts: Options
) -> tuple[ServingRuntime, InferenceService]:
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/version": version}
    runtime = ServingRuntime(
        metadata=ObjectMeta(name=RUNTIME, namespace=opts.namespace),
        spec=ServingRuntimeSpec(
            supported_model_formats=[
                SupportedModelFormat(name=FORMAT, version="1", auto_select=True)
            ],
            protocol_versions=["v2"],
            containers=[
                Container(
                    name="kserve-container",
                    image=opts.image,
                    command=["python", SERVER],
                    args=_server_args(),
                    ports=[ContainerPort(container_port=HTTP, name="http1")],
                    security_context=SecurityContext(run_as_non_root=True),
                )
            ],
        ),
    )
    service = InferenceService(
        metadata=ObjectMeta(name=name, namespace=opts.namespace, labels=labels),
        spec=InferenceServiceSpec(
            predictor=PredictorSpec(
                min_replicas=opts.min_replicas,
                max_replicas=opts.max_replicas,
                automount_service_account_token=False,
                volumes=[_token_volume(name)],
                model=ModelSpec(
                    model_format=ModelFormat(name=FORMAT, version="1"),
                    runtime=RUNTIME,
                    storage_uri=opts.storage_uri,
                    **_container(plan, peak),  # type: ignore[arg-type]
                ),
            )
        ),
    )
    return runtime, service


def kubernetes(
    name: str, version: str, plan: CapacityPlan, peak: float | None, rows: int, opts: Options
) -> tuple[Deployment, Service, HorizontalPodAutoscaler]:
    labels = {"app.kubernetes.io/name": name}
    pod_labels = {**labels, "app.kubernetes.io/version": version}
    models = VolumeMount(name="bundle", mount_path=MODELS)
    server = Container(
        name="server",
        image=opts.image,
        command=["python", SERVER],
        args=_server_args(),
        ports=_ports(),
        security_context=SecurityContext(run_as_non_root=True),
        **_container(plan, peak),  # type: ignore[arg-type]
    )
    server.volume_mounts = [
        *(server.volume_mounts or []),
        models.model_copy(update={"read_only": True}),
    ]
    fetch = Container(
        name="storage-initializer",
        image=INITIALIZER,
        args=[opts.storage_uri, MODELS],
        volume_mounts=[models],
        security_context=SecurityContext(),
    )
    deployment = Deployment(
        metadata=ObjectMeta(name=name, namespace=opts.namespace, labels=pod_labels),
        spec=DeploymentSpec(
            replicas=opts.min_replicas,
            selector=LabelSelector(match_labels=labels),
            template=PodTemplateSpec(
                metadata=ObjectMeta(
                    name=name,
                    labels=pod_labels,
                    annotations={
                        "prometheus.io/port": str(METRICS),
                        "prometheus.io/scrape": "true",
                    },
                ),
                spec=PodSpec(
                    init_containers=[fetch],
                    containers=[server],
                    automount_service_account_token=False,
                    volumes=[
                        _token_volume(name),
                        Volume(name="bundle", empty_dir=EmptyDirVolumeSource()),
                    ],
                ),
            ),
        ),
    )
    service = Service(
        metadata=ObjectMeta(name=name, namespace=opts.namespace, labels=labels),
        spec=ServiceSpec(
            selector=labels,
            ports=[
                ServicePort(name="http", port=HTTP, target_port="http"),
                ServicePort(name="grpc", port=GRPC, target_port="grpc"),
                ServicePort(name="metrics", port=METRICS, target_port="metrics"),
            ],
        ),
    )
    busy = max(1, math.floor(rows * RUNNING_SHARE))
    hpa = HorizontalPodAutoscaler(
        metadata=ObjectMeta(name=name, namespace=opts.namespace, labels=labels),
        spec=HorizontalPodAutoscalerSpec(
            scale_target_ref=CrossVersionObjectReference(
                api_version="apps/v1", kind="Deployment", name=name
            ),
            min_replicas=opts.min_replicas,
            max_replicas=opts.max_replicas,
            metrics=[
                MetricSpec(
                    pods=PodsMetricSource(
                        metric=MetricIdentifier(name="shipyard_requests_running"),
                        target=MetricTarget(average_value=str(busy)),
                    )
                ),
                MetricSpec(
                    pods=PodsMetricSource(
                        metric=MetricIdentifier(name="shipyard_requests_waiting"),
                        target=MetricTarget(average_value=WAITING_PER_POD),
                    )
                ),
            ],
        ),
    )
    return deployment, service, hpa


def dockerfile(image: str) -> str:
    """The runtime image: Python 3.11 and the runtime's dependencies as this build had them."""
    pins = " ".join(f"{p}=={installed(p)}" for p in RUNTIME_PACKAGES)
    return (
        "# The runtime image the manifests in deploy/ name; the bundle is not in it (KServe's\n"
        "# storage initializer fetches it into /mnt/models). Build it under the name they use:\n"
        f"#   docker build -t {image} deploy/\n"
        "# (or under your registry's name, then `shipyard deploy ... --image NAME`)\n"
        "FROM python:3.11-slim\n"
        f"RUN pip install --no-cache-dir {pins}\n"
        "RUN useradd --uid 1000 --create-home shipyard\n"
        "USER 1000\n"
        "ENV PYTHONDONTWRITEBYTECODE=1\n"
    )


def documents(objects: Sequence[ApiObject]) -> str:
    """YAML documents, one an object, in the API's spelling."""
    import yaml

    return "---\n".join(yaml.safe_dump(o.dump(), sort_keys=False, width=1000) for o in objects)


def files(
    name: str, version: str, plan: CapacityPlan, peak: float | None, rows: int, opts: Options
) -> dict[str, str]:
    """deploy/ path -> text."""
    runtime, isvc = kserve(name, version, plan, peak, opts)
    deployment, service, hpa = kubernetes(name, version, plan, peak, rows, opts)
    return {
        f"{FOLDER}kserve/servingruntime.yaml": documents([runtime]),
        f"{FOLDER}kserve/inferenceservice.yaml": documents([isvc]),
        f"{FOLDER}kubernetes/deployment.yaml": documents([deployment]),
        f"{FOLDER}kubernetes/service.yaml": documents([service]),
        f"{FOLDER}kubernetes/hpa.yaml": documents([hpa]),
        f"{FOLDER}Dockerfile": dockerfile(opts.image),
    }
