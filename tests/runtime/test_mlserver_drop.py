"""A non-streamed OpenAI request whose client goes away stops generating (issue 41: it
generated to the end, holding its rows): `unless_dropped` cancels the work once Starlette's
request reports the disconnect, and lets work that finishes first through untouched. (Not
through shipyard_runtime.mlserver: its protobufs and tritonclient's cannot share one process.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request

from shipyard_runtime.openai_api import unless_dropped


def _request(gone_after: float) -> Request:
    start = time.monotonic()

    async def receive() -> dict[str, Any]:
        if time.monotonic() - start >= gone_after:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # nothing more from a client that is still there
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_a_client_that_goes_away_cancels_the_generation() -> None:
    cancelled = asyncio.Event()

    async def generate() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def go() -> tuple[Any, float]:
        t = time.monotonic()
        result = await unless_dropped(_request(0.3).is_disconnected, generate())
        return result, time.monotonic() - t

    result, took = asyncio.run(go())
    assert result is None and took < 2.0
    assert cancelled.is_set()


def test_work_that_finishes_while_the_client_waits_is_returned() -> None:
    async def generate() -> str:
        await asyncio.sleep(0.4)
        return "tokens"

    assert asyncio.run(unless_dropped(_request(3600).is_disconnected, generate())) == "tokens"
