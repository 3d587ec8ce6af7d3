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


def evict(root: Path, stage: str, release: str) -> None:
    """An untrusted stage output goes, so `dvc repro` runs the stage: its files, the cache
    objects dvc.lock names for them, and every run-cache entry that would restore them."""
    outs = next((o for s, r, o in _locked(root) if (s, r) == (stage, release)), [])
    _evict(root, stage, release, outs)


def _evict(root: Path, stage: str, release: str, outs: list[str]) -> None:
    """The stage's outputs, the cache objects dvc.lock names for them, and the run-cache
    entries that name them (so DVC cannot restore them again) go."""
    import shutil

    import yaml

    entry = _lock(root).get(f"{stage}@{release}", {})
    gone = set()
    for out in entry.get("outs", []):
        md5 = str(out.get("md5", ""))
        if len(md5) > 2:
            (root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]).unlink(missing_ok=True)
            gone.add(md5)
    runs = root / ".dvc" / "cache" / "runs"
    for path in sorted(runs.rglob("*")) if runs.is_dir() else []:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(data, dict):  # not a run-cache entry DVC wrote: not ours to judge
            continue
        listed = data.get("outs")
        named = (
            {str(o.get("md5")) for o in listed if isinstance(o, dict)}
            if isinstance(listed, list)
            else set()
        )
        if named & gone:
            path.unlink()
    for rel in outs:
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)


def push(root: Path) -> str:
    url = configure(root)
    done = _dvc(root, "push", "--run-cache", "--remote", REMOTE)
    extra = _push_uncached(root, url)
    return f"pushed to {url}: {done.stdout.strip().splitlines()[-1] if done.stdout else ''}" + (
        f"; {extra} uncached output(s) for the run-cache" if extra else ""
    )


def _push_uncached(root: Path, url: str) -> int:
    """The objects of the run-cache entries' uncached outputs (each stage's metrics file):
    DVC keeps them in the local cache when it saves a run, but `dvc push --run-cache` sends
    only the entries and what dvc.lock tracks, so a clone whose dvc.lock predates the build
    could restore no stage from the run-cache (each needs all its outputs' objects) and
    rebuilt them all. Sent in DVC's own remote layout (files/md5/<2>/<rest>)."""
    import fsspec
    import yaml

    cache = root / ".dvc" / "cache"
    wanted: set[str] = set()
    for entry in (cache / "runs").rglob("*") if (cache / "runs").is_dir() else []:
        try:
            data = yaml.safe_load(entry.read_text(encoding="utf-8")) if entry.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        for out in (data or {}).get("outs", []) if isinstance(data, dict) else []:
            md5 = str(out.get("md5", "")) if isinstance(out, dict) else ""
            if len(md5) == 32 and (cache / "files" / "md5" / md5[:2] / md5[2:]).is_file():
                wanted.add(md5)
    options = {}
    endpoint = os.environ.get("SHIPYARD_DVC_ENDPOINT")
    if url.startswith("s3://") and endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    fs, base = fsspec.core.url_to_fs(url, **options)
    sent = 0
    for md5 in sorted(wanted):
        target = f"{base.rstrip('/')}/files/md5/{md5[:2]}/{md5[2:]}"
        if fs.exists(target):
            continue
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(cache / "files" / "md5" / md5[:2] / md5[2:]), target)
        sent += 1
    return sent
