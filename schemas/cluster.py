"""Typed cluster manifests: the parts of the Kubernetes and KServe objects a bundle ships
(stages/bundling/cluster.py renders them; nothing is a text template).

Field names are Python's; `dump()` writes the API's camelCase with what is unset left out.
Every model refuses a field it does not know (`extra="forbid"`), and the tests hold the
rendered objects to the Kubernetes schemas (`kubernetes-validate`, strict) and round-trip
the KServe ones through the KServe SDK's own models, so a misspelt or misplaced field fails
a test here instead of `kubectl apply` on a cluster.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ApiObject(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    def dump(self) -> dict[str, Any]:
        """The object as the API spells it (camelCase), unset fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ObjectMeta(ApiObject):
    name: str
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class EnvVar(ApiObject):
    name: str
    value: str | None = None


class HTTPGetAction(ApiObject):
    path: str
    port: int | str


class Probe(ApiObject):
    http_get: HTTPGetAction
    initial_delay_seconds: int | None = None
    period_seconds: int | None = None
    timeout_seconds: int | None = None
    failure_threshold: int | None = None


class ResourceRequirements(ApiObject):
    requests: dict[str, str]
    limits: dict[str, str] | None = None


class ContainerPort(ApiObject):
    container_port: int
    name: str | None = None
    protocol: Literal["TCP"] = "TCP"


class VolumeMount(ApiObject):
    name: str
    mount_path: str
    read_only: bool | None = None


class SecurityContext(ApiObject):
    allow_privilege_escalation: bool = False
    run_as_non_root: bool | None = None


class Container(ApiObject):
    name: str
    image: str
    command: list[str] | None = None
    args: list[str] | None = None
    ports: list[ContainerPort] | None = None
    env: list[EnvVar] | None = None
    resources: ResourceRequirements | None = None
    readiness_probe: Probe | None = None
    liveness_probe: Probe | None = None
    volume_mounts: list[VolumeMount] | None = None
    security_context: SecurityContext | None = None


class SecretVolumeSource(ApiObject):
    secret_name: str
    default_mode: int | None = None


class EmptyDirVolumeSource(ApiObject):
    size_limit: str | None = None


class Volume(ApiObject):
    name: str
    secret: SecretVolumeSource | None = None
    empty_dir: EmptyDirVolumeSource | None = None


class PodSpec(ApiObject):
    containers: list[Container]
    init_containers: list[Container] | None = None
    volumes: list[Volume] | None = None
    automount_service_account_token: bool | None = None


class PodTemplateSpec(ApiObject):
    metadata: ObjectMeta | None = None
    spec: PodSpec


class LabelSelector(ApiObject):
    match_labels: dict[str, str]


class DeploymentSpec(ApiObject):
    replicas: int | None = None
    selector: LabelSelector
    template: PodTemplateSpec


class Deployment(ApiObject):
    api_version: Literal["apps/v1"] = "apps/v1"
    kind: Literal["Deployment"] = "Deployment"
    metadata: ObjectMeta
    spec: DeploymentSpec


class ServicePort(ApiObject):
    name: str
    port: int
    target_port: int | str
    protocol: Literal["TCP"] = "TCP"


class ServiceSpec(ApiObject):
    selector: dict[str, str]
    ports: list[ServicePort]
    type: Literal["ClusterIP"] = "ClusterIP"


class Service(ApiObject):
    api_version: Literal["v1"] = "v1"
    kind: Literal["Service"] = "Service"
    metadata: ObjectMeta
    spec: ServiceSpec


class CrossVersionObjectReference(ApiObject):
    api_version: str
    kind: str
    name: str


class MetricIdentifier(ApiObject):
    name: str


class MetricTarget(ApiObject):
    type: Literal["AverageValue"] = "AverageValue"
    average_value: str


class PodsMetricSource(ApiObject):
    metric: MetricIdentifier
    target: MetricTarget


class MetricSpec(ApiObject):
    type: Literal["Pods"] = "Pods"
    pods: PodsMetricSource


class HorizontalPodAutoscalerSpec(ApiObject):
    scale_target_ref: CrossVersionObjectReference
    min_replicas: int = Field(ge=1)
    max_replicas: int = Field(ge=1)
    metrics: list[MetricSpec]


class HorizontalPodAutoscaler(ApiObject):
    api_version: Literal["autoscaling/v2"] = "autoscaling/v2"
    kind: Literal["HorizontalPodAutoscaler"] = "HorizontalPodAutoscaler"
    metadata: ObjectMeta
    spec: HorizontalPodAutoscalerSpec


# --------------------------------------------------------------------------- KServe
class ModelFormat(ApiObject):
    name: str
    version: str | None = None


class SupportedModelFormat(ApiObject):
    name: str
    version: str | None = None
    auto_select: bool | None = None


class ServingRuntimeSpec(ApiObject):
    supported_model_formats: list[SupportedModelFormat]
    protocol_versions: list[Literal["v1", "v2", "grpc-v2"]]
    multi_model: bool = False
    containers: list[Container]


class ServingRuntime(ApiObject):
    api_version: Literal["serving.kserve.io/v1alpha1"] = "serving.kserve.io/v1alpha1"
    kind: Literal["ServingRuntime"] = "ServingRuntime"
    metadata: ObjectMeta
    spec: ServingRuntimeSpec


class ModelSpec(ApiObject):
    """The predictor's model: a container spec (KServe's ModelSpec embeds one) without
    name or image, which come from the runtime."""

    model_format: ModelFormat
    runtime: str
    storage_uri: str
    protocol_version: Literal["v1", "v2", "grpc-v2"] = "v2"
    env: list[EnvVar] | None = None
    resources: ResourceRequirements | None = None
    readiness_probe: Probe | None = None
    liveness_probe: Probe | None = None
    volume_mounts: list[VolumeMount] | None = None


class PredictorSpec(ApiObject):
    model: ModelSpec
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    canary_traffic_percent: int | None = Field(default=None, ge=0, le=100)
    volumes: list[Volume] | None = None
    automount_service_account_token: bool | None = None


class InferenceServiceSpec(ApiObject):
    predictor: PredictorSpec


class InferenceService(ApiObject):
    api_version: Literal["serving.kserve.io/v1beta1"] = "serving.kserve.io/v1beta1"
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: ObjectMeta
    spec: InferenceServiceSpec
