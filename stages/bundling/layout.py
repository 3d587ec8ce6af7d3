"""Where everything sits in a bundle: one table of what ships (source file -> bundle path)
and the relative paths between its entries, derived from it.

The serve stage renders and copies by `shipped()`, the bundle stage assembles the model
into `MODEL_DIR`, the configs point from one entry to another with `relative()`, the
compiler fingerprints the shipped sources (`shipped_sources()`, serve's `io().code`), and
the load test, `shipyard serve` and the cluster manifests start the launcher at `LAUNCHER`.
Nothing else spells a bundle path.

The shipped runtime is the repository's `shipyard_runtime` package: each serving entry
gets the package's core modules (every module but the three adapters) under
`shipyard_runtime/`, plus its own adapter: MLServer's `mlserver.py` inside the package
(`implementation: shipyard_runtime.mlserver.ShipyardOnnxRuntime`), Triton's python model
as the version folder's `model.py` (where Triton looks for it); the front door ships alone
as the launcher, beside the MLServer settings.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

import shipyard_runtime

# --- bundle paths ({release}: the release's name) -----------------------------------------
SERVING_YAML = "serving.yaml"  # the generic server config
ORT_SESSION = "ort_session.json"  # the ONNX Runtime session options every entry reads
# The single copy of the ONNX model: Triton's version folder (Triton needs it there);
# serving.yaml, MLServer and the generate entry point at the same file.
TRITON = "serving/triton"  # Triton's model repository
TRITON_ENTRY = f"{TRITON}/{{release}}"
MODEL_DIR = f"{TRITON_ENTRY}/1"
MODEL_FILE = f"{MODEL_DIR}/model.onnx"
GENERATE_ENTRY = f"{TRITON}/{{release}}-generate"  # Triton's python backend (generation)
GENERATE_VERSION = f"{GENERATE_ENTRY}/1"
TRT_ENTRY = f"{TRITON}/{{release}}-trt"  # the TensorRT plan's entry (engine stage)
MLSERVER = "serving/mlserver"  # MLServer's settings.json, the launcher and its limits
MLSERVER_ENTRY = f"{MLSERVER}/{{release}}"  # model-settings.json and the runtime package
LAUNCHER = f"{MLSERVER}/shipyard_serve.py"  # the front door: how a bundle is started
LAUNCHER_LIMITS = f"{MLSERVER}/shipyard_server.json"  # the limits the launcher enforces
TEXT_DIR = "serving/text"  # the tokenizer files the runtime reads text with

# --- the shipped runtime --------------------------------------------------------------------
PACKAGE = shipyard_runtime.__name__
PACKAGE_ROOT = Path(shipyard_runtime.__file__).parent
CODE_ROOT = PACKAGE_ROOT.parent  # where `source` paths start (the repository, or site-packages)
MLSERVER_ADAPTER = "mlserver.py"
TRITON_ADAPTER = "triton.py"
FRONT_DOOR = "front_door.py"
MLSERVER_IMPLEMENTATION = f"{PACKAGE}.mlserver.ShipyardOnnxRuntime"
ADAPTERS = (MLSERVER_ADAPTER, TRITON_ADAPTER, FRONT_DOOR)

# --- rendered configs: bundle path -> template (stages/templates/) ----------------------------
TEMPLATES = "stages/templates"
RENDERED = {
    SERVING_YAML: "serving.yaml.j2",
    ORT_SESSION: "ort_session.json.j2",
    f"{TRITON_ENTRY}/config.pbtxt": "triton_config.pbtxt.j2",
    f"{MLSERVER}/settings.json": "mlserver_settings.json.j2",
    f"{MLSERVER_ENTRY}/model-settings.json": "model-settings.json.j2",
}
RENDERED_GENERATING = {f"{GENERATE_ENTRY}/config.pbtxt": "triton_generate_config.pbtxt.j2"}


@dataclass(frozen=True)
class Shipped:
    """One file the serve stage puts in a bundle: `source` (repository-relative) rendered
    (a template, with the serve stage's values) or copied to `path` (bundle-relative)."""

    source: str
    path: str
    rendered: bool

    @property
    def file(self) -> Path:
        return CODE_ROOT / self.source


def at(path: str, release: str) -> str:
    """A bundle path of the table with the release's name filled in."""
    return path.format(release=release)


def relative(start: str, target: str, release: str) -> str:
    """`target` as seen from the folder `start` (both bundle paths of the table): what one
    entry's config writes to point at another."""
    return posixpath.relpath(at(target, release), at(start, release))


def core_modules() -> list[str]:
    """The runtime package's modules every serving entry ships (package-relative, sorted):
    everything but the adapters, which go where their server looks for them."""
    found = (p.relative_to(PACKAGE_ROOT).as_posix() for p in PACKAGE_ROOT.rglob("*.py"))
    return sorted(m for m in found if m not in ADAPTERS)


def templates(release: str, generating: bool) -> dict[str, str]:
    """Bundle path -> template (a file name under stages/templates/) of every rendered config."""
    table = RENDERED | (RENDERED_GENERATING if generating else {})
    return {at(path, release): template for path, template in table.items()}


def shipped(release: str, generating: bool) -> list[Shipped]:
    """Every file the serve stage writes into a bundle, in a fixed order (the table)."""
    files = [
        Shipped(f"{TEMPLATES}/{t}", p, True) for p, t in templates(release, generating).items()
    ]
    files.append(Shipped(f"{PACKAGE}/{FRONT_DOOR}", LAUNCHER, False))
    entries = [(MLSERVER_ENTRY, MLSERVER_ADAPTER, f"{PACKAGE}/{MLSERVER_ADAPTER}")]
    if generating:
        entries.append((GENERATE_VERSION, TRITON_ADAPTER, "model.py"))
    for folder, adapter, adapter_path in entries:
        base = at(folder, release)
        for module in core_modules():
            files.append(Shipped(f"{PACKAGE}/{module}", f"{base}/{PACKAGE}/{module}", False))
        files.append(Shipped(f"{PACKAGE}/{adapter}", f"{base}/{adapter_path}", False))
    return files


def shipped_sources() -> list[str]:
    """Every repository file some bundle ships (a generating one ships them all): what the
    serve stage's output depends on besides its spec, fingerprinted byte for byte."""
    return sorted({f.source for f in shipped("release", generating=True)})
