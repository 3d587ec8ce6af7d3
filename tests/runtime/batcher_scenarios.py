"""Batcher scenarios run in their own interpreter (see test_mlserver_requests.py); each
prints its observations as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shipyard_runtime.mlserver import Batcher  # noqa: E402


async def failed_merge() -> dict[str, Any]:
    batcher = Batcher(lambda key, feeds: feeds, 4, 0.05, max_queue=8, timeout=30)
    key = ("k",)  # a key that (wrongly) lets different widths meet in one batch
    start = time.monotonic()
    results = await asyncio.gather(
        batcher.submit(key, {"x": np.zeros((1, 2))}),
        batcher.submit(key, {"x": np.zeros((1, 3))}),
        return_exceptions=True,
    )
    return {
        "seconds": time.monotonic() - start,
        "errors": [type(r).__name__ for r in results],
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(globals()[sys.argv[1]]())))
