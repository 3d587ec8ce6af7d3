"""pin: record and check the code commit, Python and package versions, checkpoint digests."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import GitState, Provenance, VersionLock
from stages._runtime import StageContext, StageIO, StageResult
from stages.bundling.hashing import hash_files
from stages.onnx.model import model_paths

NAME = "pin"
RECORDED = (
    "torch",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "polygraphy",
    "transformers",
    "safetensors",
    "numpy",
    "dvc",
    "pydantic",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".data")


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("pins", "model"),
        reads_model=True,
        code=("pyproject.toml",),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    pins = release.pins
    packages = {name: _version(name) for name in sorted({*RECORDED, *pins.packages})}
    checkpoints = _checkpoint_digests(ctx, release.model)
    python = platform.python_version()
    problems = _check_packages(pins.packages, packages)
    if pins.python and not _satisfies(python, pins.python):
        problems.append(f"python: expected {pins.python}, found {python}")
    problems += _check_checkpoints(pins.checkpoints, checkpoints)
    git = _git_state(ctx.root)
    if pins.require_clean_git and git["dirty"]:
        problems.append(
            "git: pins.require_clean_git is set but the work tree has "
            "uncommitted changes; commit them first"
        )
    # lock.json is what later stages depend on: deterministic, no commit, no time.
    lock = VersionLock(python=python, packages=packages, checkpoints=checkpoints)
    ctx.write(lock)
    ctx.write(Provenance(git=GitState(**git)))
    details = {**lock.model_dump(), "git": git}
    if problems:
        return StageResult.failed(f"{len(problems)} pin(s) do not match", problems, details=details)
    summary = (
        f"{len(checkpoints)} checkpoint file(s) hashed, {len(pins.packages)} package "
        f"pin(s) hold, code at {git['commit'][:12]}{' (dirty)' if git['dirty'] else ''}"
    )
    return StageResult.passed(
        summary, details=details, metrics={"checkpoint_files": len(checkpoints)}
    )


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _satisfies(version: str, spec: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except InvalidSpecifier:
        raise StageError(
            NAME,
            f"pins: {spec!r} is not a PEP 440 specifier",
            "write e.g. '==2.13.0' or '>=1.20,<2'",
        ) from None


def _check_packages(wanted: dict[str, str], found: dict[str, str | None]) -> list[str]:
    problems = []
    for name, spec in sorted(wanted.items()):
        have = found[name]
        if have is None:
            problems.append(f"pins.packages.{name}: expected {spec}, found not installed")
        elif not _satisfies(have.split("+")[0], spec):
            problems.append(f"pins.packages.{name}: expected {spec}, found {have}")
    return problems


def _checkpoint_digests(ctx: StageContext, model: Any) -> dict[str, str]:
    paths: dict[str, Path] = {}
    for rel in dict.fromkeys(model_paths(model)):
        base = ctx.path(rel)
        if not base.exists():
            raise StageError(
                NAME,
                f"model checkpoint {rel} does not exist",
                "fix model.path / model.weights, or regenerate the checkpoint",
            )
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            # the config and a sharded checkpoint's index (which shard holds which tensor)
            # decide what the weights mean, so they are hashed with them
            if f.suffix in WEIGHT_SUFFIXES or f.name == "config.json" or _is_index(f):
                paths[f.relative_to(base).as_posix() if base.is_dir() else f.name] = f
    if not any(p.suffix in WEIGHT_SUFFIXES for p in paths.values()) and model.kind == "hf":
        raise StageError(
            NAME,
            f"model.path {model.path}: no weight file found",
            "save the checkpoint as *.safetensors",
        )
    return hash_files(paths)


def _is_index(f: Path) -> bool:
    return f.name.endswith(".safetensors.index.json")


def _check_checkpoints(wanted: dict[str, str], found: dict[str, str]) -> list[str]:
    if not wanted:
        return []
    problems = [
        f"pins.checkpoints.{rel}: expected {digest}, found {found.get(rel, 'no such file')}"
        for rel, digest in sorted(wanted.items())
        if found.get(rel) != digest
    ]
    unpinned = [rel for rel in found if rel not in wanted and Path(rel).suffix in WEIGHT_SUFFIXES]
    problems += [
        f"pins.checkpoints: weight file {rel} is not pinned; add its sha256 {found[rel]}"
        for rel in unpinned
    ]
    return problems


def _git_state(root: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    # dvc.lock and the metrics are rewritten by the very `dvc repro` that runs this stage:
    # not a code change.
    dirty = bool(
        git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!dvc.lock",
            ":!build/*/metrics",  # rewritten by the same `dvc repro`, like dvc.lock
        )
    )
    return {"commit": commit, "dirty": dirty}
