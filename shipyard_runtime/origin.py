"""Which copy of the runtime is running. A bundle ships its own `shipyard_runtime` in each
serving entry; a copy imported before it (another model's in the same server, an installed
Shipyard on the path) would serve the bundle with code that is not the signed one."""

from __future__ import annotations

import os
from pathlib import Path

# the folder this package was imported from (not its files' link targets)
PACKAGE_DIR = Path(__file__).absolute().parent


def foreign_runtime(folder: Path) -> str | None:
    """Why the running code is not the runtime the entry `folder` ships (None when it is,
    or when the folder ships none: a test's)."""
    shipped = folder / "shipyard_runtime"
    if shipped.is_dir() and not os.path.samefile(shipped, PACKAGE_DIR):
        return (
            f"the runtime in use is {PACKAGE_DIR}, not this bundle's {shipped}: another "
            "shipyard_runtime was imported first; serve one bundle per server, from an "
            "environment where no other copy is importable"
        )
    return None
