"""SHA-256 of big files: large blocks, threads across files and 1 GiB shards.

hashlib releases the GIL while it hashes a large buffer, so threads use every core.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 16 << 20
SHARD = 1 << 30


def shard_ranges(size: int, shard: int = SHARD) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering a file; an empty file is one empty shard."""
    return [(s, min(s + shard, size)) for s in range(0, size, shard)] or [(0, 0)]


def hash_range(path: Path, start: int = 0, end: int | None = None) -> str:
    """sha256 hex digest of bytes [start, end) of a file (the whole file by default)."""
    end = path.stat().st_size if end is None else end
    digest = hashlib.sha256()
    buf = bytearray(min(BLOCK, max(end - start, 1)))
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        fh.seek(start)
        left = end - start
        while left > 0:
            n = fh.readinto(view[: min(len(buf), left)])
            if not n:
                raise OSError(f"{path}: file shrank while hashing")
            digest.update(view[:n])
            left -= n
    return digest.hexdigest()


def hash_shards(
    files: dict[str, Path],
    shard: int = SHARD,
    workers: int | None = None,
    advance: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """OMS shard resources: `name:start:end` -> sha256, hashed in parallel, biggest first."""
    jobs = [
        (name, path, s, e)
        for name, path in files.items()
        for s, e in shard_ranges(path.stat().st_size, shard)
    ]
    jobs.sort(key=lambda j: j[2] - j[3])

    def one(job: tuple[str, Path, int, int]) -> tuple[str, str]:
        name, path, s, e = job
        digest = hash_range(path, s, e)
        if advance:
            advance(e - s)
        return f"{name}:{s}:{e}", digest

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return dict(sorted(pool.map(one, jobs)))


def hash_files(files: dict[str, Path], workers: int | None = None) -> dict[str, str]:
    """Whole-file sha256 per name (comparable with `sha256sum`), parallel across files."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        digests = pool.map(hash_range, files.values())
        return dict(sorted(zip(files, digests, strict=True)))
