"""The load test's measurements against one server: grid, ramp, streaming, soak, and batching
on vs off at the knee."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from schemas.artifacts import ModelInfo
from schemas.tasks import TASKS
from stages._contract import StageContext
from stages.loadtesting import loadgen as lg
from stages.loadtesting.load_phases import grid, openai_mix, ramp, request, soak


def streams(task: str) -> bool:
    """Whether the load test measures streaming (TTFT/ITL): generating tasks only."""
    return TASKS[task].serving == "generate"


def measure_all(
    ctx: StageContext, release: Any, info: ModelInfo, model: str, tree: Path
) -> dict[str, Any]:
    """Everything measured against one server (plus one without batching)."""
    from stages.serving.server import LocalServer

    cfg = release.loadtest
    local = cfg.target is None
    log = ctx.work / "server.log"
    server: Any = LocalServer(tree, model, log, cfg.startup_seconds) if local else nullcontext()
    results: dict[str, Any] = {"target": "local MLServer" if local else cfg.target.url}
    with server as srv:
        url = srv.url if local else cfg.target.url
        base = f"{url}/v2/models/{model}"
        results["grid"] = grid(base, release, info)
        results["ramp"] = ramp(base, release, info, stream=False)
        knee = results["ramp"]["knee"]
        mix = None
        if streams(release.task):  # as users meet it: the OpenAI endpoint, streamed
            mix = openai_mix(url, model, release, info)
            results["streaming"] = ramp(base, release, info, stream=True, upto=knee, mix=mix)
            results["streaming"]["endpoint"] = "/v1/completions"
        results["soak"] = soak(base, release, info, srv if local else None, knee, mix)
        seen = srv.rss() if local else 0
        results["peak_rss_bytes"] = max(results["soak"].get("peak_rss_bytes", 0), seen)
    results["batching"] = batching(ctx, release, info, model, tree, knee, results["ramp"])
    return results


def batching(
    ctx: StageContext,
    release: Any,
    info: ModelInfo,
    model: str,
    tree: Path,
    knee: int,
    ramp_result: dict[str, Any],
) -> dict[str, Any]:
    """Throughput at the knee with the server's batching off, against the ramp's (on)."""
    from stages.serving.server import LocalServer

    cfg = release.loadtest
    if not cfg.batching_comparison:
        return {"skipped": "loadtest.batching_comparison is false"}
    if cfg.target is not None:
        return {"skipped": "external target: its batching cannot be switched from here"}
    settings = tree / "serving" / "mlserver" / model / "model-settings.json"
    extra = json.loads(settings.read_text())["parameters"]["extra"]
    if not (extra["batching"]["enabled"] or (extra.get("engine") or {}).get("max_rows", 1) > 1):
        return {"skipped": "the served config has dynamic batching off (bundle.serving)"}
    r = cfg.ramp
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
    on = ramp_result["knee_point"]
    return {
        "concurrency": knee,
        "on_rps": on["throughput_rps"],
        "off_rps": off["throughput_rps"],
        "ratio": on["throughput_rps"] / off["throughput_rps"] if off["throughput_rps"] else None,
        "off": off,
    }
