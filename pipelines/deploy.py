"""`shipyard deploy NAME@VERSION|NAME@CHANNEL --out DIR`: a published bundle's cluster
manifests (its `deploy/` folder, stages/bundling/cluster.py) for where it is published.

The bundle is checked out of the registry and verified as `shipyard serve` verifies it; its
manifests are read back into their typed models (a manifest that does not parse is refused,
never copied), and what a deployment decides is set on them: `storageUri` (the version's
folder in the registry, or under `--storage-uri BASE` where the cluster reaches the
registry another way, such as a PersistentVolumeClaim), the image, the namespace, the
replica range, and for a canary step `canaryTrafficPercent`. `promote --manifests` and
`rollback --manifests` write the same for the version the channel moved to.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import RegistryError, SpecError
from schemas.cluster import (
    ApiObject,
    Deployment,
    HorizontalPodAutoscaler,
    InferenceService,
    Service,
    ServingRuntime,
)
from stages.bundling.cluster import FOLDER

if TYPE_CHECKING:
    from pipelines.registry import CheckedOut, Registry

# bundle file -> the typed model each of its YAML documents must be
MANIFESTS: dict[str, type[ApiObject]] = {
    "kserve/servingruntime.yaml": ServingRuntime,
    "kserve/inferenceservice.yaml": InferenceService,
    "kubernetes/deployment.yaml": Deployment,
    "kubernetes/service.yaml": Service,
    "kubernetes/hpa.yaml": HorizontalPodAutoscaler,
}
REMOTE = ("s3://", "gs://", "gcs://", "azureblob://", "https://", "hdfs://", "webhdfs://", "pvc://")


@dataclasses.dataclass(frozen=True)
class Choices:
    """What `deploy` sets; None keeps the bundle's own value."""

    storage_base: str | None = None
    image: str | None = None
    namespace: str | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    canary_percent: int | None = None


@dataclasses.dataclass(frozen=True)
class Deployed:
    """What `render` wrote: the verified version, the URI the cluster fetches it from, and
    the manifest files."""

    version: CheckedOut
    storage_uri: str
    files: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.version.label


def storage_uri(registry_url: str, base: str | None, name: str, version: str) -> str:
    """Where the cluster fetches name@version: `base` (or the registry's own URL, when a
    cluster can reach it) + the registry's layout."""
    root = base or registry_url
    if not root.startswith(REMOTE):
        raise SpecError(
            "--storage-uri",
            [
                f"the registry {registry_url} is a folder on this machine, which a cluster "
                "cannot fetch from: pass --storage-uri with the URI the cluster reaches it by "
                "(e.g. pvc://CLAIM for the folder on a PersistentVolumeClaim), or publish to "
                "an s3:// registry"
            ],
        )
    return f"{root.rstrip('/')}/releases/{name}/{version}"


def load(folder: Path) -> dict[str, list[ApiObject]]:
    """The bundle's manifests as typed objects, each file checked against its model."""
    import yaml
    from pydantic import ValidationError

    out: dict[str, list[ApiObject]] = {}
    for name, model in MANIFESTS.items():
        path = folder / FOLDER / name
        if not path.is_file():
            raise RegistryError(
                f"the bundle has no {FOLDER}{name}: it was built before bundles carried cluster "
                "manifests; rebuild and publish it as a new version"
            )
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
            out[name] = [model.model_validate(d) for d in docs]
        except (yaml.YAMLError, ValidationError) as exc:
            first = " ".join(str(exc).split())[:300]
            raise RegistryError(
                f"{FOLDER}{name} of the bundle is not a valid {model.__name__}: {first}"
            ) from None
    return out


def adjust(objects: dict[str, list[ApiObject]], uri: str, choices: Choices) -> None:
    """Set what the deployment decides on the bundle's objects, in place."""
    for docs in objects.values():
        for obj in docs:
            meta = getattr(obj, "metadata")  # noqa: B009 (every top-level kind has one)
            if choices.namespace is not None:
                meta.namespace = choices.namespace
            if isinstance(obj, InferenceService):
                predictor = obj.spec.predictor
                predictor.model.storage_uri = uri
                predictor.canary_traffic_percent = choices.canary_percent
                predictor.min_replicas = _pick(choices.min_replicas, predictor.min_replicas)
                predictor.max_replicas = _pick(choices.max_replicas, predictor.max_replicas)
            elif isinstance(obj, ServingRuntime) and choices.image:
                for c in obj.spec.containers:
                    c.image = choices.image
            elif isinstance(obj, Deployment):
                pod = obj.spec.template.spec
                for c in pod.init_containers or []:
                    if c.args:  # the storage initializer: [uri, destination]
                        c.args[0] = uri
                for c in pod.containers:
                    c.image = choices.image or c.image
                obj.spec.replicas = _pick(choices.min_replicas, obj.spec.replicas)
            elif isinstance(obj, HorizontalPodAutoscaler):
                spec = obj.spec
                spec.min_replicas = _pick(choices.min_replicas, spec.min_replicas)
                spec.max_replicas = _pick(choices.max_replicas, spec.max_replicas)
    _check_range(objects)


def _pick(chosen: int | None, kept: Any) -> Any:
    return kept if chosen is None else chosen


def _check_range(objects: dict[str, list[ApiObject]]) -> None:
    """Refuse a replica range upside down (one flag set against the bundle's other end)."""
    for docs in objects.values():
        for obj in docs:
            if isinstance(obj, InferenceService):
                low, high = obj.spec.predictor.min_replicas, obj.spec.predictor.max_replicas
            elif isinstance(obj, HorizontalPodAutoscaler):
                low, high = obj.spec.min_replicas, obj.spec.max_replicas
            else:
                continue
            if low is not None and high is not None and low > high:
                raise SpecError(
                    "--min-replicas",
                    [
                        f"min replicas {low} is above max replicas {high}: set --min-replicas "
                        "and --max-replicas so that min <= max"
                    ],
                )


def render(registry: Registry, target: str, out: Path, choices: Choices) -> Deployed:
    """Check out `target` (NAME@VERSION or NAME@CHANNEL), write its manifests under `out`
    (kserve/ and kubernetes/, replacing files of the same names); what was deployed."""
    from stages.bundling.cluster import documents

    if "@" not in target:
        raise SpecError(
            "", [f"{target!r}: write NAME@VERSION or NAME@CHANNEL, e.g. tiny-gpt2@production"]
        )
    name, ref = target.rsplit("@", 1)
    if choices.canary_percent is not None and not 0 <= choices.canary_percent <= 100:
        raise SpecError(
            "--canary", [f"--canary {choices.canary_percent}: a percent of traffic, 0 to 100"]
        )
    for flag, value in (
        ("--min-replicas", choices.min_replicas),
        ("--max-replicas", choices.max_replicas),
    ):
        if value is not None and value < 1:
            raise SpecError(flag, [f"{flag} {value}: at least 1"])
    with tempfile.TemporaryDirectory(prefix="shipyard-deploy-") as tmp:
        got = registry.checkout(name, ref, Path(tmp) / "bundle")
        objects = load(Path(tmp) / "bundle")
    uri = storage_uri(registry.url, choices.storage_base, name, got.version)
    adjust(objects, uri, choices)
    written = []
    for rel, docs in objects.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_name(f".{path.name}.tmp")
        tmp_path.write_text(documents(docs), encoding="utf-8")
        tmp_path.replace(path)  # a reader never sees half a manifest
        written.append(str(path))
    return Deployed(got, uri, tuple(written))
