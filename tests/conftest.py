"""Shared fixtures: a throwaway repo root with the tiny GPT-2 and trap models."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from schemas import ReleaseSpec, StageReport
from schemas.loader import load_release
from stages import execute, load_stages
from tests.s3_server import start_moto

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-gpt2"

# Stages run their PyTorch step in this process (after pickling it as for the child), not
# in a child that imports torch again per stage: tests/stages/test_child.py tests the child,
# and the end-to-end builds set it back to 1 (stages._contract.in_child).
os.environ.setdefault("SHIPYARD_STAGE_CHILD", "0")
TRAPS = Path(__file__).parent / "fixtures" / "traps.py"


# A load test of a few seconds: one grid point, concurrency 1-2, no soak, no comparison.
QUICK_LOADTEST: dict[str, Any] = {
    "grid": {"batch_sizes": [2], "input_lengths": [8], "requests": 2},
    "ramp": {
        "max_concurrency": 2,
        "window_seconds": 0.3,
        "max_windows": 3,
        "output_tokens": 4,
        "input_length": 8,
    },
    "soak": {"seconds": 0},
    "batching_comparison": False,
}


def model_info(**fields: Any) -> Any:
    """A ModelInfo artifact for unit tests: the given fields over a tiny GPT-2's."""
    from schemas.artifacts import ModelInfo

    dims = fields.pop("dims", {"batch": {"min": 1, "opt": 2, "max": 8}})
    for name, d in dims.items():  # tests give only the bounds they care about
        d.setdefault("min", 0 if name == "past_sequence" else 1)
        d.setdefault("opt", d["max"])
    base: dict[str, Any] = {
        "task": "causal-lm",
        "arch": {
            "layers": 2,
            "heads": 4,
            "kv_heads": 4,
            "head_dim": 16,
            "hidden": 64,
            "vocab": 512,
            "positions": 256,
            "labels": 2,
        },
        "parameters": 1,
        "weight_bytes": 4,
        "dtype": "float32",
        "exporter": "legacy",
        "opset": 18,
        "external_data": False,
        "dims": dims,
        "inputs": [],
        "outputs": [],
    }
    return ModelInfo.model_validate(base | fields)


def generic_spec(name: str, factory: str, **overrides: Any) -> dict[str, Any]:
    """A release spec for a trap model: x [batch, 4, 8] -> y [batch, ...]."""
    spec: dict[str, Any] = {
        "schema_version": 1,
        "name": name,
        "version": "0.0.1",
        "task": "generic",
        "model": {"kind": "python", "entrypoint": f"traps:{factory}", "source": "traps.py"},
        "pins": {},
        "export": {
            "dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
            "inputs": [{"name": "x", "shape": ["batch", 4, 8]}],
            "outputs": [{"name": "y", "shape": ["batch"]}],
        },
        "parity": {},
        "quantization": {"method": "none"},
        "evaluation": {"dataset": {"path": "data/generic.npz", "samples": 8}},
        "capacity": {"device_memory": "1GiB"},
        "bundle": {},
        "engine": {},
        "loadtest": QUICK_LOADTEST,
    }
    for key, value in overrides.items():
        spec[key] = value
    return spec


def gpt2_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((REPO / "releases" / "tiny-gpt2.yaml").read_text())
    spec["loadtest"] = QUICK_LOADTEST
    spec["engine"] = {}  # the example's profiles exceed these smaller test dims
    spec["export"]["dims"] = {
        "batch": {"min": 1, "opt": 2, "max": 3},
        "sequence": {"min": 1, "opt": 4, "max": 64},
        "past_sequence": {"min": 0, "opt": 4, "max": 24},
    }
    spec.update(overrides)
    return spec


class Workspace:
    """A repo root in tmp: releases/, the tiny model, the trap module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "releases").mkdir()
        shutil.copytree(TINY, root / "models" / "tiny-gpt2")
        shutil.copy(TRAPS, root / "traps.py")
        shutil.copytree(REPO / "data", root / "data")
        rng = np.random.default_rng(0)  # real inputs for the trap models: x [N, 4, 8]
        np.savez(root / "data" / "generic.npz", x=rng.standard_normal((48, 4, 8)).astype("f4"))

    @classmethod
    def copy_of(cls, other: Workspace, root: Path) -> Workspace:
        """Another workspace's whole tree (builds included) copied to `root`."""
        shutil.copytree(other.root, root, symlinks=True)
        ws = cls.__new__(cls)
        ws.root = root
        return ws

    def write(self, spec: dict[str, Any]) -> Path:
        path = self.root / "releases" / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    def spec(self, spec: dict[str, Any]) -> ReleaseSpec:
        return load_release(self.write(spec))

    def run(self, stage: str, spec: dict[str, Any]) -> StageReport:
        path = self.write(spec)
        return execute(stage, load_release(path), path, self.root)

    def run_all(self, spec: dict[str, Any], stages: list[str]) -> dict[str, StageReport]:
        return {s: self.run(s, spec) for s in stages}

    def out(self, release: str, stage: str) -> Path:
        return self.root / "build" / release / stage


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


@pytest.fixture(scope="session")
def _gpt2_built_once(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """tiny-gpt2 (small dims) run through every stage once per test run (no test touches
    it: each module gets its own copy, `built_gpt2`)."""
    ws = Workspace(tmp_path_factory.mktemp("gpt2-once"))
    for stage in load_stages():
        report = ws.run(stage, gpt2_spec())
        optional = stage == "engine" and report.status.value == "skipped"  # no GPU here
        assert report.status.value == "passed" or optional, (stage, report.reasons)
    return ws


@pytest.fixture(scope="module")
def built_gpt2(_gpt2_built_once: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """A copy of the once-built tiny-gpt2 workspace, private to a test module: its tests may
    rerun stages or write into it without reaching another module's."""
    return Workspace.copy_of(_gpt2_built_once, tmp_path_factory.mktemp("gpt2") / "repo")


Run = Callable[[str, dict[str, Any]], StageReport]


def writable_copy(source: Path, target: Path) -> Path:
    """A private copy of a (read-only) bundle that a test may tamper with."""
    shutil.copytree(source, target)
    for p in target.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return target


def built_as(source: Path, target: Path, version: str) -> Path:
    """The bundle a rebuild at another `version` makes, as far as the registry can tell:
    shipyard.json's version and the manifest's subject (the registry files a bundle only
    under the release@version it says it is); unsigned."""
    import json

    if target.exists():
        return target
    writable_copy(source, target)
    (target / "model.sig").unlink(missing_ok=True)
    facts = json.loads((target / "shipyard.json").read_text())
    facts["version"] = version
    (target / "shipyard.json").write_text(json.dumps(facts, indent=2) + "\n")
    remanifest(target, f"{facts['release']}@{version}")
    return target


def remanifest(bundle: Path, subject: str = "tiny-gpt2@0.1.0", shard: int = 0) -> None:
    """What an attacker with write access does after editing files: a manifest that is
    consistent with the edited folder (`shard`: the shard size, default the bundle's)."""
    from schemas.manifest import SHARD_SIZE
    from stages.bundling.hashing import hash_shards
    from stages.bundling.oms import build_manifest, write_manifest

    size = shard or SHARD_SIZE
    files = {
        p.relative_to(bundle).as_posix(): p
        for p in bundle.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", "model.sig")
    }
    manifest = build_manifest(subject, hash_shards(files, size), size)
    write_manifest(bundle / "manifest.json", manifest)


# A real S3 API on localhost (moto's server mode), for the registry and the DVC remote.


def _forget_s3_clients() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def bucket() -> str:
    """A bucket name no other test (or earlier run against a shared server) has used."""
    return f"t{uuid.uuid4().hex[:20]}"


def local_or_s3(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> str:
    """A registry URL for a test parametrized over ["local", "s3"]: a folder, or a fresh
    bucket on the module's moto server."""
    if request.param == "local":
        return str(tmp_path / "registry")
    request.getfixturevalue("s3_server")
    return f"s3://{prefix}-{bucket()}/registry"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """A moto S3 server for the module; SHIPYARD_S3_ENDPOINT names one already running
    (mutation testing starts one for all its mutants: a server per mutant run is slow)."""
    shared = os.environ.get("SHIPYARD_S3_ENDPOINT")
    proc, url = (None, shared) if shared else start_moto()
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    _forget_s3_clients()  # fsspec caches filesystems: one made for an earlier server is stale
    try:
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        _forget_s3_clients()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
