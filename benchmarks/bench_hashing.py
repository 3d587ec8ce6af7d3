"""Manifest hashing throughput vs `openssl dgst -sha256` on the same file, side by side.

Usage: python benchmarks/bench_hashing.py [SIZE_GB]   (default 2; the file is page-cached)
Goal (issue 2): >= 1.7x openssl's single-core throughput, using both cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.bundling.hashing import SHARD, hash_range, hash_shards  # noqa: E402

ROUNDS = 3


def make_file(path: Path, size: int) -> None:
    block = os.urandom(64 << 20)
    with path.open("wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)


def best(fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    size = int(float(sys.argv[1] if len(sys.argv) > 1 else 2) * (1 << 30))
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        path = Path(tmp) / "weights.bin"
        make_file(path, size)
        gb = path.stat().st_size / 1e9
        openssl = ["openssl", "dgst", "-sha256", str(path)]
        subprocess.run(openssl, check=True, capture_output=True)  # warm the page cache
        t_openssl = best(lambda: subprocess.run(openssl, check=True, capture_output=True))
        t_ours = best(lambda: hash_shards({"w": path}))
        t_single = best(lambda: hash_range(path))
    print(
        f"file: {gb:.2f} GB, page-cached; shard size {SHARD >> 20} MiB; "
        f"{os.cpu_count()} cores; best of {ROUNDS}"
    )
    print(f"openssl dgst -sha256      : {gb / t_openssl:6.2f} GB/s")
    print(f"shipyard, one thread      : {gb / t_single:6.2f} GB/s")
    print(f"shipyard manifest (shards): {gb / t_ours:6.2f} GB/s")
    print(f"ratio shipyard/openssl    : {t_openssl / t_ours:6.2f}x  (goal >= 1.7x)")


if __name__ == "__main__":
    main()
