"""The load test's measurements against one server: grid, ramp, streaming, soak, and batching
on vs off at the knee."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.artifacts import ModelInfo
from schemas.loadresults import Batching, Measured, Ramp, Skipped
from schemas.tasks import TASKS
from stages._contract import StageContext
from stages.bundling import layout
from stages.loadtesting import loadgen as lg
from stages.loadtesting.load_phases import grid, openai_mix, ramp, request, soak

if TYPE_CHECKING:
    from schemas import ReleaseSpec


def streams(task: str) -> bool:
    """Whether the load test measures streaming (TTFT/ITL): generating tasks only."""
    return TASKS[task].serving == "generate"


def measure_all(
    ctx: StageContext, release: ReleaseSpec, info: ModelInfo, model: str, tree: Path
) -> Measured:
    """Everything measured against one server (plus one without batching)."""
    from stages.loadtesting.server import LocalServer

    cfg = release.loadtest
    local = cfg.target is None
    log = ctx.work / "server.log"
    server: Any = LocalServer(tree, model, log, cfg.startup_seconds) if local else nullcontext()
    with server as srv:
        url = srv.url if cfg.target is None else cfg.target.url
        base = f"{url}/v2/models/{model}"
        points = grid(base, release, info)
        main = ramp(base, release, info, stream=False)
        mix, streaming = None, None
        if streams(release.task):  # as users meet it: the OpenAI endpoint, streamed
            mix = openai_mix(url, model, release, info)
            streaming = ramp(base, release, info, stream=True, upto=main.knee, mix=mix)
            streaming = streaming.model_copy(update={"endpoint": "/v1/completions"})
        soaked = soak(base, release, info, srv if local else None, main.knee, mix)
        seen = srv.rss() if local else 0
    soak_peak = soaked.peak_rss_bytes if not isinstance(soaked, Skipped) else 0
    return Measured(
        target="local MLServer" if cfg.target is None else cfg.target.url,
        grid=points,
        ramp=main,
        streaming=streaming,
        soak=soaked,
        peak_rss_bytes=max(soak_peak, seen),
        batching=batching(ctx, release, info, model, tree, main),
    )


def batching(
    ctx: StageContext,
    release: ReleaseSpec,
    info: ModelInfo,
    model: str,
    tree: Path,
    ramp_result: Ramp,
) -> Batching | Skipped:
    """Throughput at the knee with the server's batching off, against the ramp's (on)."""
    from stages.loadtesting.server import LocalServer

    cfg = release.loadtest
    if not cfg.batching_comparison:
        return Skipped(skipped="loadtest.batching_comparison is false")
    if cfg.target is not None:
        return Skipped(skipped="external target: its batching cannot be switched from here")
    settings = tree / layout.at(layout.MLSERVER_ENTRY, model) / "model-settings.json"
    from shipyard_runtime.settings import RuntimeSettings

    served = RuntimeSettings.model_validate(json.loads(settings.read_text())["parameters"]["extra"])
    if not (served.batching.enabled or (served.engine and served.engine.max_rows > 1)):
        return Skipped(skipped="the served config has dynamic batching off (bundle.serving)")
    r, knee = cfg.ramp, ramp_result.knee
    with LocalServer(
        tree, model, ctx.work / "server.log", cfg.startup_seconds, batching=False
    ) as srv:
        base = f"{srv.url}/v2/models/{model}"
        req = request(base, info, 1, r.input_length, r.output_tokens, stream=False)
        off = lg.run(
            lg.measure(
                req, knee, r.window_seconds, r.max_windows, r.stability, cfg.request_timeout_seconds
            )
        )
    on = ramp_result.knee_point
    return Batching(
        concurrency=knee,
        on_rps=on.throughput_rps,
        off_rps=off.throughput_rps,
        ratio=on.throughput_rps / off.throughput_rps if off.throughput_rps else None,
        off=off,
    )
