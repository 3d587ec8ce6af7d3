"""A shared DVC remote and run-cache, configured from the environment (DVC's own machinery).

`shipyard cache pull` before `dvc repro` restores every output some machine already built
for the same inputs (outputs and the run-cache), so a fresh clone recomputes nothing;
`shipyard cache push` after a build shares its outputs. The remote is DVC's:
- SHIPYARD_DVC_REMOTE: a folder or URL (`s3://bucket/path` through dvc-s3); default
  ~/.cache/shipyard/dvc-remote, shared by every clone on this machine;
- SHIPYARD_DVC_ENDPOINT: an S3-compatible endpoint (MinIO, moto's server in tests).
It is written to `.dvc/config.local` (never committed) as the default remote `shipyard`,
with DVC's `verify = true` (every pulled object is re-hashed, so one swapped under its old
name is refused); options a user set on it stay.

Whoever can write the remote chooses what is pulled. With SHIPYARD_TRUSTED_BUILDERS set,
`pull` keeps only outputs whose provenance (pipelines/provenance.py) a trusted builder
signed for the inputs this checkout has: any other is removed with its cached objects, so
`dvc repro` rebuilds it, and `pull` says which and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from schemas import ShipyardError

REMOTE = "shipyard"


def remote_url() -> str:
    configured = os.environ.get("SHIPYARD_DVC_REMOTE")
    return configured or str(Path.home() / ".cache" / "shipyard" / "dvc-remote")


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    dvc = Path(sys.executable).with_name("dvc")
    done = subprocess.run(
        [str(dvc if dvc.exists() else "dvc"), *args],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ShipyardError(
            f"`dvc {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()[-800:]}"
        )
    return done


def configure(root: Path) -> str:
    """Point the default remote at SHIPYARD_DVC_REMOTE (local config only)."""
    url = remote_url()
    if "://" not in url:
        Path(url).mkdir(parents=True, exist_ok=True)
    listed = _dvc(root, "remote", "list", "--local").stdout.split()
    if REMOTE in listed:  # `remote add --force` would wipe what the user set on it
        _dvc(root, "remote", "modify", "--local", REMOTE, "url", url)
        _dvc(root, "remote", "default", "--local", REMOTE)
    else:
        _dvc(root, "remote", "add", "--local", "--default", REMOTE, url)
    _dvc(root, "remote", "modify", "--local", REMOTE, "verify", "true")
    endpoint = os.environ.get("SHIPYARD_DVC_ENDPOINT")
    if endpoint:
        _dvc(root, "remote", "modify", "--local", REMOTE, "endpointurl", endpoint)
    return url


def pull(root: Path) -> str:
    """Outputs and run-cache entries for what dvc.lock records; missing ones are built."""
    url = configure(root)
    done = _dvc(root, "pull", "--run-cache", "--allow-missing", "--remote", REMOTE)
    lines = [f"pulled from {url}: {done.stdout.strip().splitlines()[-1] if done.stdout else ''}"]
    return "\n".join(lines + screen(root))


def screen(root: Path) -> list[str]:
    """Pulled outputs a trusted builder did not attest for these inputs are removed (with
    their cached objects, so DVC rebuilds rather than restores them); one line each."""
    from pipelines import provenance

    trusted = provenance.trusted_keys()
    if not trusted:
        return [
            f"{provenance.TRUST_ENV} is not set: pulled outputs are trusted as the remote "
            "gave them (set it to the builders' public keys to check their provenance)"
        ]
    lines = []
    for stage, release, outs in _locked(root):
        if not all((root / o).exists() for o in outs):
            continue
        paths = provenance.stage_paths(root, stage, release)
        if paths is None:  # dvc.lock names a stage dvc.yaml no longer has: DVC ignores it
            continue
        who, problems = provenance.check(root, paths, trusted)
        if problems:
            _evict(root, stage, release, outs)
            lines.append(f"rebuild {stage}@{release}: {problems[0]}")
        else:
            lines.append(f"trusted {stage}@{release}: built by {who[:16] if who else '?'}")
    return lines


def _lock(root: Path) -> dict[str, Any]:
    import yaml

    path = root / "dvc.lock"
    data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    return data.get("stages", {}) if isinstance(data, dict) else {}


def _locked(root: Path) -> list[tuple[str, str, list[str]]]:
    """(stage, release, cached outs) of each stage instance dvc.lock records."""
    found = []
    for name, entry in _lock(root).items():
        stage, _, release = name.partition("@")
        if release and isinstance(entry, dict):
            outs = [str(o["path"]) for o in entry.get("outs", []) if isinstance(o, dict)]
            found.append((stage, release, outs))
    return found


def _evict(root: Path, stage: str, release: str, outs: list[str]) -> None:
    """The stage's outputs and the cache objects dvc.lock names for them go."""
    import shutil

    entry = _lock(root).get(f"{stage}@{release}", {})
    for out in entry.get("outs", []):
        md5 = str(out.get("md5", ""))
        if len(md5) > 2:
            (root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]).unlink(missing_ok=True)
    for rel in outs:
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)


def push(root: Path) -> str:
    url = configure(root)
    done = _dvc(root, "push", "--run-cache", "--remote", REMOTE)
    return f"pushed to {url}: {done.stdout.strip().splitlines()[-1] if done.stdout else ''}"
