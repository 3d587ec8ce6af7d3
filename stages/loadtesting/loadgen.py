"""Closed-loop load generation against an Open Inference Protocol (KServe V2) endpoint.

aiohttp on one event loop: the client must not be the bottleneck (see
benchmarks/bench_loadclient.py for the comparison with wrk). Every loop is bounded in both
count and time. Measurement follows perf_analyzer: windows of fixed length, and a point is
stable when the last three windows agree within a fraction on throughput and p95 latency;
otherwise it is inconclusive.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.loadresults import WINDOW_METRICS, Point, Window, WindowMetrics
from shipyard_runtime.dtypes import V2_OF_NUMPY

STABLE_WINDOWS = 3
DRAIN_SECONDS = 30.0


@dataclass
class Request:
    """One prepared request: the URL, its encoded body, and what one success yields."""

    url: str
    body: bytes
    stream: bool = False
    rows: int = 1  # sequences per request (its batch)
    tokens: int = 0  # output tokens per request (causal-lm)
    marker: bytes = b"data:"  # a streamed line that carries one token (OpenAI: b"data: {")


@dataclass
class Sample:
    end: float
    latency: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    ok: bool = True
    error: str = ""
    tokens: int = 0  # output tokens this request yielded (all rows)


class Mix:
    """The requests of a load, drawn by weight from a seeded sequence: every worker takes
    the next one, so a run's requests are the same whatever the timing."""

    def __init__(self, requests: list[Request], weights: list[float] | None = None) -> None:
        self.requests = requests
        p = np.array(weights or [1.0] * len(requests), dtype=np.float64)
        self.order = np.random.default_rng(0).choice(len(requests), size=4096, p=p / p.sum())
        self.next = 0

    def take(self) -> Request:
        req = self.requests[int(self.order[self.next % len(self.order)])]
        self.next += 1
        return req


def v2_body(inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None = None) -> bytes:
    """A V2 inference request body."""
    body: dict[str, Any] = {
        "inputs": [
            {
                "name": name,
                "shape": list(value.shape),
                "datatype": V2_OF_NUMPY[str(value.dtype)],
                "data": value.ravel().tolist(),
            }
            for name, value in inputs.items()
        ]
    }
    if parameters:
        body["parameters"] = parameters
    return json.dumps(body).encode()


HEADERS = {"content-type": "application/json"}
KEEPALIVE_S = 2.0  # below every served idle timeout (uvicorn: 5 s, Triton: longer)


def run(coro: Any) -> Any:
    """asyncio.run on uvloop (already a dependency of MLServer), the cheaper event loop."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def session_for(concurrency: int, timeout: float) -> Any:
    """A session that does no per-request work it need not: no cookies, no decompression,
    no default headers, one timeout object for every request.

    Idle pooled connections are dropped after KEEPALIVE_S, below the servers' own idle
    timeout (uvicorn's and so MLServer's: 5 s): with aiohttp's default of 15 s a phase that
    began after a pause reused connections the server had just closed, and requests
    failed with "Can not write request body" (seen once in a streaming phase on a busy
    machine), counted against the server."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=timeout),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    )


async def _one(session: Any, req: Request, timeout: float) -> Sample:
    import aiohttp

    start = time.perf_counter()
    marks: list[float] = []
    try:
        async with session.post(req.url, data=req.body, headers=HEADERS) as resp:
            if req.stream:
                async for line in resp.content:
                    if line.startswith(req.marker):
                        marks.append(time.perf_counter())
            else:
                await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
    except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
        end = time.perf_counter()
        return Sample(end, end - start, ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if req.stream and len(marks) != req.tokens:
        return Sample(end, end - start, ok=False, error=f"{len(marks)} of {req.tokens} tokens")
    ttft = marks[0] - start if marks else None
    yielded = len(marks) if req.stream else req.rows * req.tokens
    return Sample(end, end - start, ttft, list(np.diff(marks)) if marks else [], tokens=yielded)


def summarize(samples: list[Sample], seconds: float, req: Request) -> Window:
    """Throughput and latency percentiles (ms) of the successful samples; tokens/s counts
    what each request yielded (a mix has many lengths)."""
    good = [s for s in samples if s.ok]
    lat = np.array([s.latency for s in good]) * 1000
    rps = len(good) / seconds if seconds > 0 else 0.0
    out: dict[str, Any] = {
        "requests": len(good),
        "errors": len(samples) - len(good),
        "seconds": round(seconds, 3),
        "throughput_rps": rps,
        "rows_per_s": rps * req.rows,
        "tokens_per_s": sum(s.tokens for s in good) / seconds if seconds > 0 else 0.0,
    }
    for q in (50, 90, 95, 99):
        out[f"p{q}_latency_ms"] = float(np.percentile(lat, q)) if len(lat) else None
    ttft = [s.ttft * 1000 for s in good if s.ttft is not None]
    itl = [x * 1000 for s in good for x in s.itl]
    if ttft:
        out["p50_ttft_ms"], out["p95_ttft_ms"] = np.percentile(ttft, [50, 95]).tolist()
    if itl:
        out["p50_itl_ms"], out["p95_itl_ms"] = np.percentile(itl, [50, 95]).tolist()
    out["first_error"] = next((s.error for s in samples if not s.ok), "") or None
    return Window.model_validate(out)


def stable(windows: list[Window], within: float) -> bool:
    """The last three windows agree within `within` on throughput and p95 latency."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    for values in ([w.throughput_rps for w in last], [w.p95_latency_ms for w in last]):
        known = [v for v in values if v is not None]
        if len(known) < len(values) or min(known) <= 0:
            return False
        if (max(known) - min(known)) / float(np.mean(known)) > within:
            return False
    return True


async def measure(
    req: Request | Mix,
    concurrency: int,
    window: float,
    max_windows: int,
    within: float,
    timeout: float,
) -> Point:
    """Closed loop at `concurrency` until three windows agree or max_windows pass; with a
    Mix, each request is the mix's next."""
    mix = req if isinstance(req, Mix) else Mix([req])
    req = mix.requests[0]  # what summarize needs: rows per request
    samples: list[Sample] = []
    stop = asyncio.Event()
    async with session_for(concurrency, timeout) as session:

        async def worker() -> None:
            while not stop.is_set():
                samples.append(await _one(session, mix.take(), timeout))

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        windows: list[Window] = []
        bounds, begin = [0], time.perf_counter()
        for _ in range(max_windows):
            await asyncio.sleep(window)
            now = time.perf_counter()
            bounds.append(len(samples))
            windows.append(summarize(samples[bounds[-2] : bounds[-1]], now - begin, req))
            begin = now
            if stable(windows, within):
                break
        stop.set()
        await asyncio.wait(tasks, timeout=DRAIN_SECONDS)
        for t in tasks:
            t.cancel()
    last = windows[-STABLE_WINDOWS:]
    first = bounds[max(0, len(bounds) - 1 - STABLE_WINDOWS)]
    merged = summarize(samples[first : bounds[-1]], sum(w.seconds for w in last), req)
    return Point(
        **dict(merged),
        concurrency=concurrency,
        windows=len(windows),
        stable=stable(windows, within),
        window_throughput=[round(w.throughput_rps, 3) for w in windows],
        window_metrics=WindowMetrics.model_validate(
            {k: [getattr(w, k) for w in last] for k in WINDOW_METRICS}
        ),
    )


async def fixed_count(req: Request, count: int, timeout: float) -> Window:
    """`count` requests one after another (concurrency 1): the grid's latency per shape."""

    async with session_for(1, timeout) as session:
        await _one(session, req, timeout)  # warm the connection and the shape
        start = time.perf_counter()
        samples = [await _one(session, req, timeout) for _ in range(count)]
        return summarize(samples, time.perf_counter() - start, req)
