"""Service-level objectives of the load test, judged where the measurement was stable.

A point whose last three windows disagree (on a small shared machine, most points above
concurrency 1) still gives a verdict for an SLO when the merged value and each of those
windows fall on the same side of its limit: then the verdict does not depend on which window
one trusts. Only a limit that falls among them is inconclusive, and inconclusive never passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from schemas.loadresults import Measured, Point, SloVerdict
from stages.loadtesting.load_phases import judged_point

if TYPE_CHECKING:
    from schemas.spec.loadtest import LoadSlo

Side = Literal["max", "min"]
Windows = list[float | None]


def check_slo(slo: LoadSlo, results: Measured, device_memory: int) -> list[SloVerdict]:
    """One row per SLO the spec sets, judged at the knee, or at the highest stable point
    below it when the knee's windows did not agree; inconclusive is never a pass."""
    judged = judged_point(results.ramp.points, results.ramp.knee)
    stream = results.streaming.points if results.streaming else []
    steady_stream = [p for p in stream if p.stable and p.concurrency <= judged.concurrency]
    at = steady_stream[-1] if steady_stream else (stream[-1] if stream else None)
    peak = results.peak_rss_bytes
    j, s = judged.window_metrics, at.window_metrics if at else None
    checks: list[tuple[str, Point | None, float | None, Windows, Side]] = [
        ("p95_latency_ms", judged, judged.p95_latency_ms, j.p95_latency_ms, "max"),
        ("p95_ttft_ms", at, at.p95_ttft_ms if at else None, s.p95_ttft_ms if s else [], "max"),
        ("p95_itl_ms", at, at.p95_itl_ms if at else None, s.p95_itl_ms if s else [], "max"),
        ("min_throughput_rps", judged, judged.throughput_rps, j.throughput_rps, "min"),
        ("min_tokens_per_s", judged, judged.tokens_per_s, j.tokens_per_s, "min"),
        ("max_memory_fraction", None, peak / device_memory if peak else None, [], "max"),
    ]
    rows = []
    for name, point, value, windows, kind in checks:
        limit = getattr(slo, name)
        if limit is None:
            continue
        rows.append(_judge(name, limit, value, kind, point, windows))
    return rows


def _one_side(limit: float, value: float, kind: Side, windows: Windows) -> bool:
    """The merged value and every one of the point's last windows agree on the verdict."""
    known = [w for w in windows if w is not None]
    if not windows or len(known) < len(windows):
        return False
    verdicts = {(v <= limit) if kind == "max" else (v >= limit) for v in [value, *known]}
    return len(verdicts) == 1


def _judge(
    name: str,
    limit: float,
    value: float | None,
    kind: Side,
    point: Point | None,
    windows: Windows,
) -> SloVerdict:
    """`point` None: a value measured over the whole run (peak memory), not at a point;
    `windows`: the point's last three windows' values of what the SLO limits."""
    if value is None:
        return SloVerdict(slo=name, limit=limit, value=None, ok=False, why="not measured")
    unstable = point is not None and not point.stable
    if unstable and not _one_side(limit, value, kind, windows):
        why = (
            f"inconclusive: the last 3 windows disagree and {limit:g} lies among them;"
            " raise loadtest.ramp.window_seconds"
        )
        return SloVerdict(slo=name, limit=limit, value=value, ok=False, why=why)
    ok = value <= limit if kind == "max" else value >= limit
    sign = "<=" if kind == "max" else ">="
    where = f" at concurrency {point.concurrency}" if point is not None else ""
    why = f"{value:.4g} {sign} {limit:g}" if ok else f"{value:.4g} breaks {sign} {limit:g}"
    why += where
    if unstable:
        why += " (windows disagree, but every one of the last 3 is on this side of the limit)"
    return SloVerdict(slo=name, limit=limit, value=value, ok=ok, why=why)
