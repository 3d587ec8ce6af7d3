"""Service-level objectives of the load test, judged where the measurement was stable.

A point whose last three windows disagree (on a small shared machine, most points above
concurrency 1) still gives a verdict for an SLO when the merged value and each of those
windows fall on the same side of its limit: then the verdict does not depend on which window
one trusts. Only a limit that falls among them is inconclusive, and inconclusive never passes.
"""

from __future__ import annotations

from typing import Any


def check_slo(slo: Any, results: dict[str, Any], device_memory: int) -> list[dict[str, Any]]:
    """One row per SLO the spec sets, judged at the knee, or at the highest stable point
    below it when the knee's windows did not agree; inconclusive is never a pass."""
    points, knee = results["ramp"]["points"], results["ramp"]["knee"]
    steady = [p for p in points if p["stable"] and p["concurrency"] <= knee]
    judged = steady[-1] if steady else results["ramp"]["knee_point"]
    results["ramp"]["judged_at"] = judged["concurrency"]
    stream = results.get("streaming", {}).get("points", [])
    steady_stream = [p for p in stream if p["stable"] and p["concurrency"] <= judged["concurrency"]]
    at = steady_stream[-1] if steady_stream else (stream[-1] if stream else None)
    peak = results.get("peak_rss_bytes", 0)
    checks = [
        ("p95_latency_ms", judged, judged.get("p95_latency_ms"), "max"),
        ("p95_ttft_ms", at, (at or {}).get("p95_ttft_ms"), "max"),
        ("p95_itl_ms", at, (at or {}).get("p95_itl_ms"), "max"),
        ("min_throughput_rps", judged, judged.get("throughput_rps"), "min"),
        ("min_tokens_per_s", judged, judged.get("tokens_per_s"), "min"),
        ("max_memory_fraction", {"stable": True}, peak / device_memory if peak else None, "max"),
    ]
    rows = []
    for name, point, value, kind in checks:
        limit = getattr(slo, name)
        if limit is None:
            continue
        rows.append(_judge(name, limit, value, kind, point))
    return rows


_KEYS = {"min_throughput_rps": "throughput_rps", "min_tokens_per_s": "tokens_per_s"}


def _one_side(name: str, limit: float, value: float, kind: str, point: Any) -> bool:
    """The merged value and every one of the point's last windows agree on the verdict."""
    windows = point.get("window_metrics", {}).get(_KEYS.get(name, name))
    if not windows or any(w is None for w in windows):
        return False
    verdicts = {(v <= limit) if kind == "max" else (v >= limit) for v in [value, *windows]}
    return len(verdicts) == 1


def _judge(name: str, limit: float, value: float | None, kind: str, point: Any) -> dict[str, Any]:
    if value is None:
        return {"slo": name, "limit": limit, "value": None, "ok": False, "why": "not measured"}
    unstable = point is not None and not point.get("stable", False)
    if unstable and not _one_side(name, limit, value, kind, point):
        why = (
            f"inconclusive: the last 3 windows disagree and {limit:g} lies among them;"
            " raise loadtest.ramp.window_seconds"
        )
        return {"slo": name, "limit": limit, "value": value, "ok": False, "why": why}
    ok = value <= limit if kind == "max" else value >= limit
    sign = "<=" if kind == "max" else ">="
    where = f" at concurrency {point['concurrency']}" if "concurrency" in point else ""
    why = f"{value:.4g} {sign} {limit:g}" if ok else f"{value:.4g} breaks {sign} {limit:g}"
    why += where
    if unstable:
        why += " (windows disagree, but every one of the last 3 is on this side of the limit)"
    return {"slo": name, "limit": limit, "value": value, "ok": ok, "why": why}
