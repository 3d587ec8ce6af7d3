"""The load test's phases: inputs, the batch x length grid, the concurrency ramp and its
knee, and the soak with its memory-growth fit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from schemas import Refused
from schemas.artifacts import ModelInfo
from schemas.loadresults import (
    GridPoint,
    Growth,
    PairedStep,
    Point,
    Ramp,
    Skipped,
    Soak,
    Window,
)
from schemas.spec.loadtest import GROWTH_MIN_STEADY_SECONDS
from schemas.tasks import TASKS
from stages.loadtesting import loadgen as lg
from stages.onnx import shapes as sh

if TYPE_CHECKING:
    from schemas import ReleaseSpec
    from stages.loadtesting.server import LocalServer

MB = 1 << 20
P = TypeVar("P", bound=Window)


def _inputs(info: ModelInfo, batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    """Real-looking inputs for the exported graph; for causal-lm only input_ids (the server
    builds the attention mask and the past itself)."""
    sizes = {"batch": batch, "sequence": length}
    vocab = info.arch.vocab
    causal = TASKS[info.task].serving == "generate"
    tensors = [
        sh.token_tensor(t.name, t.dtype, t.axes, vocab, (t.low, t.high))
        for t in info.inputs
        if not causal or t.name == "input_ids"
    ]
    shapes = {
        t.name: [a if isinstance(a, int) else sizes.get(a, info.dims[a].opt) for a in t.axes]
        for t in tensors
    }
    return sh.seeded_inputs(tensors, shapes, seed)


def request(
    base: str, info: ModelInfo, batch: int, length: int, tokens: int, stream: bool
) -> lg.Request:
    causal = TASKS[info.task].serving == "generate"
    # a fixed output length, as benchmark tools ask it (the model's EOS would cut it short)
    params = {"max_new_tokens": tokens, "ignore_eos": True} if causal else None
    return lg.Request(
        url=f"{base}/{'infer_stream' if stream else 'infer'}",
        body=lg.v2_body(_inputs(info, batch, length), params),
        stream=stream,
        rows=batch,
        tokens=tokens if causal else 0,
    )


def trimmed(values: list[int], limit: int) -> list[int]:
    """The spec's values, those beyond the export's range replaced by its max."""
    return sorted({min(v, limit) for v in values})


def grid(base: str, release: ReleaseSpec, info: ModelInfo) -> list[GridPoint]:
    """Latency per batch x input length at concurrency 1 (prefill only for causal-lm)."""
    g, dims = release.loadtest.grid, info.dims
    batches = trimmed(g.batch_sizes, dims["batch"].max if "batch" in dims else 1)
    has_seq = "sequence" in dims
    lengths = trimmed(g.input_lengths, dims["sequence"].max) if has_seq else [0]
    timeout = release.loadtest.request_timeout_seconds
    points = []
    for b in batches:
        for n in lengths:
            req = request(base, info, b, n, 1, stream=False)
            point = require_success(lg.run(lg.fixed_count(req, g.requests, timeout)), req)
            points.append(GridPoint(**dict(point), batch=b, input_length=n or None))
    return points


def openai_mix(url: str, model: str, release: ReleaseSpec, info: ModelInfo) -> lg.Mix:
    """Streamed /v1/completions requests as users' clients send them (token-id prompts, a
    fixed output length: ignore_eos, as vLLM's and genai-perf's benchmarks ask it), one per
    entry of loadtest.ramp.mix, drawn by weight."""
    import json

    r = release.loadtest.ramp
    shapes = [(m.input_length, m.output_tokens, m.weight) for m in r.mix or []] or [
        (r.input_length, r.output_tokens, 1.0)
    ]
    vocab = max(1, info.arch.vocab or 1)
    rng = np.random.default_rng(0)
    requests = []
    for length, tokens, _ in shapes:
        body = {
            "model": model,
            "prompt": rng.integers(0, vocab, length).tolist(),
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        requests.append(
            lg.Request(
                url=f"{url}/v1/completions",
                body=json.dumps(body).encode(),
                stream=True,
                tokens=tokens,
                marker=b"data: {",
            )
        )
    return lg.Mix(requests, [w for _, _, w in shapes])


def ramp(
    base: str,
    release: ReleaseSpec,
    info: ModelInfo,
    stream: bool,
    upto: int | None = None,
    mix: lg.Mix | None = None,
) -> Ramp:
    """Concurrency 1, 2, 4, ... until the knee (Model Analyzer's rule) or the SLO breaks;
    with `mix`, those requests instead of one V2 request."""
    r, slo = release.loadtest.ramp, release.loadtest.slo
    req: lg.Request | lg.Mix = mix or request(
        base, info, 1, r.input_length, r.output_tokens, stream
    )
    points: list[Point] = []
    knee, c, timeout = 1, 1, release.loadtest.request_timeout_seconds
    steps: dict[tuple[int, int], PairedStep] = {}

    def window(concurrency: int) -> float:
        """One window's throughput at `concurrency`, after a window that absorbs the start."""
        point = lg.run(lg.measure(req, concurrency, r.window_seconds, 2, r.stability, timeout))
        return float(point.window_throughput[-1])

    def confirm(a: int, b: int) -> PairedStep:
        if (a, b) not in steps:
            steps[a, b] = paired_step(window, a, b, r.knee_gain)
        return steps[a, b]

    while c <= min(r.max_concurrency, upto or r.max_concurrency):
        point = lg.run(lg.measure(req, c, r.window_seconds, r.max_windows, r.stability, timeout))
        points.append(
            require_success(point, req if isinstance(req, lg.Request) else req.requests[0])
        )
        knee, stop = find_knee(points, r.knee_gain, r.knee_patience, slo.p95_latency_ms, confirm)
        if stop:
            break
        c *= 2
    judged = None if stream else judged_point(points, knee).concurrency
    return Ramp(
        points=points,
        knee=knee,
        knee_point=_at(points, knee),
        judged_at=judged,
        paired=list(steps.values()),
    )


PAIRS = 3  # B windows of a paired step, each between two A windows


def paired_step(window: Callable[[int], float], a: int, b: int, gain: float) -> PairedStep:
    """Throughput at concurrency `b` against `a`, measured interleaved: A B A B A B A, each
    B window against the mean of the A windows on either side, so a machine that slows or
    speeds up during the step (another job starting) moves both sides alike (a linear drift
    cancels exactly). `b` gains when the median of the pairs' ratios clears 1 + gain."""
    seen = [window(a)]
    ratios = []
    for _ in range(PAIRS):
        got = window(b)
        seen.append(window(a))
        around = (seen[-2] + seen[-1]) / 2
        ratios.append(got / around if around > 0 else 0.0)
    middle = float(np.median(ratios))
    return PairedStep(
        base=a,
        step=b,
        ratios=[round(x, 4) for x in ratios],
        median=round(middle, 4),
        gains=middle >= 1 + gain,
    )


def judged_point(points: list[Point], knee: int) -> Point:
    """Where the SLOs are judged: the highest stable point at or below the knee, or the knee
    when none was stable."""
    steady = [p for p in points if p.stable and p.concurrency <= knee]
    return steady[-1] if steady else _at(points, knee)


def require_success(point: P, req: lg.Request) -> P:
    """A point where no request succeeded ends the load test with the first error."""
    if point.requests == 0:
        raise Refused(
            f"every request to {req.url} failed: {point.first_error or 'no response'}",
            "check loadtest.target (URL and model name) or the server log in the report",
        )
    return point


def find_knee(
    points: list[Point],
    gain: float,
    patience: int,
    slo_ms: float | None,
    confirm: Callable[[int, int], PairedStep] | None = None,
) -> tuple[int, bool]:
    """(knee concurrency, stop?) after the points so far. The knee is the last point that
    raised throughput by at least `gain` beyond the noise. A point whose slowest window
    clears the knee's fastest by the gain gains; one whose fastest window does not clear
    the knee's slowest by it is flat; between the two, the windows (measured one point after
    the other, while the machine's speed may change: three rebuilds read knees 16, 8, 16)
    cannot tell, and `confirm` decides: the two concurrencies measured interleaved
    (paired_step). Without `confirm` such a point is flat. Stop after `patience` points
    that did not gain, or at the first point (beyond the first) whose p95 latency breaks the
    SLO (marked so in `points`)."""
    flat, knee = 0, points[0].concurrency
    best_low = best_high = 0.0
    for i, p in enumerate(points):
        if slo_ms and i > 0 and (p.p95_latency_ms or 0) > slo_ms:
            points[i] = p.model_copy(update={"breaks_slo": True})
            return knee, True
        low, high = spread(p.window_metrics.throughput_rps, p.throughput_rps)
        if i == 0 or low >= best_high * (1 + gain):
            gains = True
        elif high < best_low * (1 + gain) or confirm is None:
            gains = False
        else:
            gains = confirm(knee, p.concurrency).gains
        if gains:
            best_low, best_high, flat, knee = low, high, 0, p.concurrency
        else:
            flat += 1
    return knee, flat >= patience


def spread(windows: list[float | None], merged: float | None) -> tuple[float, float]:
    """A point's value as the interval its windows span (the merged value where no window
    has one): what a rebuild of the same code may measure."""
    values = [v for v in windows if v is not None] or [merged or 0.0]
    return min(values), max(values)


def _at(points: list[Point], concurrency: int) -> Point:
    return next(p for p in points if p.concurrency == concurrency)


def soak(
    base: str,
    release: ReleaseSpec,
    info: ModelInfo,
    server: LocalServer | None,
    knee: int,
    mix: lg.Mix | None = None,
) -> Soak | Skipped:
    """Load at the knee for `soak.seconds` while sampling the server's RSS; with `mix` (a
    generating task), the streamed OpenAI requests the streaming ramp sends."""
    s, r = release.loadtest.soak, release.loadtest.ramp
    if server is None:
        return Skipped(skipped="external target: the server's memory is not observable from here")
    if s.seconds == 0:
        return Skipped(skipped="loadtest.soak.seconds is 0")
    req: lg.Request | lg.Mix = mix or request(
        base, info, 1, r.input_length, r.output_tokens, stream=False
    )
    concurrency = s.concurrency or knee
    samples: list[tuple[float, int]] = []

    async def go() -> Point:
        async def sample() -> None:
            start = time.monotonic()
            while True:
                samples.append((time.monotonic() - start, server.rss()))
                await asyncio.sleep(max(s.seconds / 40, 0.05))

        sampler = asyncio.create_task(sample())
        windows = max(3, round(s.seconds / r.window_seconds))
        point = await lg.measure(
            req,
            concurrency,
            s.seconds / windows,
            windows,
            1e-9,
            release.loadtest.request_timeout_seconds,
        )
        sampler.cancel()
        return point

    point = lg.run(go())
    return Soak(
        **dict(growth(samples, s.max_growth_mb_per_min)),
        seconds=s.seconds,
        preset=s.preset,
        endpoint="/v1/completions" if mix else "infer",
        load=point,
    )


def growth(samples: list[tuple[float, int]], limit_mb_per_min: float) -> Growth:
    """Least-squares RSS slope after the first third (warm-up), in MB per minute; judged
    against the limit only over a steady part of GROWTH_MIN_STEADY_SECONDS or more."""
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples], dtype=float)
    steady = t >= t[-1] / 3 if len(t) else t
    slope = float(np.polyfit(t[steady], rss[steady], 1)[0]) * 60 / MB if steady.sum() > 2 else 0.0
    span = float(t[steady][-1] - t[steady][0]) if steady.sum() else 0.0
    judged: bool | None = bool(slope <= limit_mb_per_min)
    note = None
    if span < GROWTH_MIN_STEADY_SECONDS:
        judged = None
        note = (
            f"not judged: the soak's steady part lasted {span:.1f} s, under "
            f"{GROWTH_MIN_STEADY_SECONDS:g} s (a slope over so few samples is allocator "
            f"noise); set loadtest.soak.seconds to {1.5 * GROWTH_MIN_STEADY_SECONDS + 5:g} or more"
        )
    return Growth(
        samples=len(samples),
        rss_start_mb=round(rss[0] / MB, 1) if len(rss) else None,
        rss_end_mb=round(rss[-1] / MB, 1) if len(rss) else None,
        peak_rss_bytes=int(rss.max()) if len(rss) else 0,
        growth_mb_per_min=round(slope, 2),
        growth_ok=judged,
        growth_limit_mb_per_min=limit_mb_per_min,
        growth_note=note,
    )
