"""Promote's re-verification throughput vs `openssl dgst -sha256`, side by side.

A bundle with one big weights file (2 shards at 1 GiB, so both cores hash) and its OMS
manifest is published into a local registry; then `Registry.promote` (lock, strict
verify of every file against the manifest, digest vs the publish record, the pointer and
the history entry) is timed against `openssl dgst -sha256` over the same bytes.

Usage: python benchmarks/bench_promote_verify.py [SIZE_GB]   (default 2; page-cached)
Goal (issue 10): >= 1.7x openssl's single-core throughput, as manifest hashing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_hashing import ROUNDS, best  # noqa: E402

from pipelines.registry import Registry  # noqa: E402
from schemas.manifest import FACTS_FILE  # noqa: E402
from stages.bundling.hashing import hash_shards  # noqa: E402
from stages.bundling.oms import build_manifest, write_manifest  # noqa: E402


def make_bundle(folder: Path, size: int) -> Path:
    block = os.urandom(64 << 20)
    weights = folder / "serving" / "triton" / "bench" / "1" / "model.onnx"
    weights.parent.mkdir(parents=True)
    with weights.open("wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)
    stages = {"pin": {"status": "passed", "summary": "bench"}}
    (folder / FACTS_FILE).write_text(json.dumps({"release": "bench", "stages": stages}))
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    write_manifest(folder / "manifest.json", build_manifest("bench@1.0.0", hash_shards(files)))
    return weights


def main() -> None:
    size = int(float(sys.argv[1] if len(sys.argv) > 1 else 2) * (1 << 30))
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        bundle = Path(tmp) / "bundle"
        weights = make_bundle(bundle, size)
        registry = Registry(str(Path(tmp) / "registry"))
        registry.publish(bundle, "bench", "1.0.0")
        published = Path(registry.path("releases", "bench", "1.0.0")) / weights.relative_to(bundle)
        gb = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) / 1e9
        openssl = ["openssl", "dgst", "-sha256", str(published)]
        subprocess.run(openssl, check=True, capture_output=True)  # warm the page cache
        t_openssl = best(lambda: subprocess.run(openssl, check=True, capture_output=True))
        t_promote = best(lambda: registry.promote("bench", "1.0.0", "production", "bench"))
    print(f"bundle: {gb:.2f} GB, page-cached; {os.cpu_count()} cores; best of {ROUNDS}")
    print(f"openssl dgst -sha256       : {gb / t_openssl:6.2f} GB/s")
    print(f"shipyard promote (verify)  : {gb / t_promote:6.2f} GB/s")
    print(f"ratio promote/openssl      : {t_openssl / t_promote:6.2f}x  (goal >= 1.7x)")


if __name__ == "__main__":
    main()
