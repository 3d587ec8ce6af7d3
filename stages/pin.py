"""pin: record and check the code commit, Python and package versions, checkpoint digests."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import GitState, Provenance, VersionLock
from schemas.details import PinDetails
from stages._contract import StageContext, StageIO, StageResult
from stages.bundling.hashing import hash_files
from stages.onnx.model import model_paths

if TYPE_CHECKING:
    from schemas.spec.model import HfModel, PythonModel

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
VCS_DIRS = frozenset({".git", ".hg", ".dvc"})


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("pins", "model"),
        reads_model=True,
        code=("pyproject.toml",),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    pins = release.pins
    packages = {name: _version(name) for name in sorted({*RECORDED, *pins.packages})}
    files, checkpoints = _hash_model(ctx, release.model)
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
    lock = VersionLock(python=python, packages=packages, checkpoints=checkpoints, files=files)
    ctx.write(lock)
    ctx.write(Provenance(git=GitState(**git)))
    details = PinDetails(**dict(lock), git=GitState(**git)).dump()
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


def _hash_model(
    ctx: StageContext, model: HfModel | PythonModel
) -> tuple[dict[str, str], dict[str, str]]:
    """sha256 of every file under the model's paths, by repo-relative name: the stages that
    load the model depend on lock.json, not on the folders, so nothing in them may be left
    out (tokenizer, generation config, custom code). And of the checkpoint among them, named
    as pins.checkpoints names them: the weights, the config and a sharded checkpoint's index
    (which shard holds which tensor: they decide what the weights mean)."""
    names: dict[str, Path] = {}
    checkpoint: dict[str, str] = {}
    for rel in dict.fromkeys(model_paths(model)):
        base = ctx.path(rel)
        if not base.exists():
            raise StageError(
                NAME,
                f"model checkpoint {rel} does not exist",
                "fix model.path / model.weights, or regenerate the checkpoint",
            )
        prefix = Path(rel).as_posix()
        found = [base] if base.is_file() else sorted(p for p in base.rglob("*") if _kept(p, base))
        for f in found:
            name = prefix if base.is_file() else f"{prefix}/{f.relative_to(base).as_posix()}"
            names[name] = f
            if f.suffix in WEIGHT_SUFFIXES or f.name == "config.json" or _is_index(f):
                checkpoint[f.relative_to(base).as_posix() if base.is_dir() else f.name] = name
    if not any(Path(n).suffix in WEIGHT_SUFFIXES for n in checkpoint) and model.kind == "hf":
        raise StageError(
            NAME,
            f"model.path {model.path}: no weight file found",
            "save the checkpoint as *.safetensors",
        )
    files = hash_files(names)
    return files, {key: files[name] for key, name in sorted(checkpoint.items())}


def _kept(path: Path, base: Path) -> bool:
    """A file of the model, not of a version control's store inside its folder (a cloned
    model repository's .git holds every LFS object again; DVC skips these too)."""
    return path.is_file() and not VCS_DIRS & set(path.relative_to(base).parts[:-1])


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
