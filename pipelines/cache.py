"""A shared DVC remote and run-cache, configured from the environment (DVC's own machinery).

`shipyard cache pull` before `dvc repro` restores every output some machine already built
for the same inputs (outputs and the run-cache), so a fresh clone recomputes nothing;
`shipyard cache push` after a build shares its outputs. The remote is DVC's:
- SHIPYARD_DVC_REMOTE: a folder or URL (`s3://bucket/path` through dvc-s3); default
  ~/.cache/shipyard/dvc-remote, shared by every clone on this machine;
- SHIPYARD_DVC_ENDPOINT: an S3-compatible endpoint (MinIO, moto's server in tests).
It is written to `.dvc/config.local` (never committed) as the default remote `shipyard`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    _dvc(root, "remote", "add", "--local", "--force", "--default", REMOTE, url)
    endpoint = os.environ.get("SHIPYARD_DVC_ENDPOINT")
    if endpoint:
        _dvc(root, "remote", "modify", "--local", REMOTE, "endpointurl", endpoint)
    return url


def pull(root: Path) -> str:
    """Outputs and run-cache entries for what dvc.lock records; missing ones are built."""
    url = configure(root)
    done = _dvc(root, "pull", "--run-cache", "--allow-missing", "--remote", REMOTE)
    return f"pulled from {url}: {done.stdout.strip().splitlines()[-1] if done.stdout else ''}"


def push(root: Path) -> str:
    url = configure(root)
    done = _dvc(root, "push", "--run-cache", "--remote", REMOTE)
    return f"pushed to {url}: {done.stdout.strip().splitlines()[-1] if done.stdout else ''}"
