"""What the load test measured (`loadtest.json`) and the headline it reports, typed.

Written by `stages/loadtesting/` and read by the load test's verdict, its plots and its SLO
checks, the bundle's model card and `shipyard.json`: one model per shape, so that a field
read under a wrong name fails where it is read instead of reading None. Optional numbers
(TTFT and inter-token latency, the first error, a streaming ramp) are left out of the file
when they were not measured, as the untyped dicts did.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def _absent(value: Any) -> bool:
    return value is None


def _optional(description: str = "") -> Any:
    """A field that is left out of the JSON when it was not measured."""
    return Field(default=None, exclude_if=_absent, description=description)


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Window(_Row):
    """Throughput and latency percentiles (ms) of the successful requests in one span."""

    requests: int = Field(description="Requests that succeeded.")
    errors: int
    seconds: float
    throughput_rps: float
    rows_per_s: float = Field(description="Sequences per second (requests x their batch).")
    tokens_per_s: float = Field(description="Output tokens per second, as each one yielded.")
    p50_latency_ms: float | None
    p90_latency_ms: float | None
    p95_latency_ms: float | None
    p99_latency_ms: float | None
    p50_ttft_ms: float | None = _optional("Time to first token (streamed requests).")
    p95_ttft_ms: float | None = _optional()
    p50_itl_ms: float | None = _optional("Inter-token latency (streamed requests).")
    p95_itl_ms: float | None = _optional()
    first_error: str | None = _optional("The first failed request's error.")


class WindowMetrics(_Row):
    """What an SLO may be judged on, per window (the last three): an unstable point still
    gives a verdict when every window lands on one side of a limit."""

    throughput_rps: list[float | None]
    tokens_per_s: list[float | None]
    p95_latency_ms: list[float | None]
    p95_ttft_ms: list[float | None]
    p95_itl_ms: list[float | None]


# The window metrics' names, derived from the model (the load generator fills them).
WINDOW_METRICS: tuple[str, ...] = tuple(WindowMetrics.model_fields)


class Point(Window):
    """One closed-loop measurement at a concurrency: the last three windows merged."""

    concurrency: int
    windows: int = Field(description="Windows measured before the point was stable or ended.")
    stable: bool = Field(description="The last three windows agreed (perf_analyzer's rule).")
    window_throughput: list[float]
    window_metrics: WindowMetrics
    breaks_slo: bool | None = _optional("The ramp stopped here: p95 latency broke the SLO.")


class GridPoint(Window):
    """Latency of one batch x input length at concurrency 1."""

    batch: int
    input_length: int | None = Field(description="None: the graph has no sequence axis.")


class PairedStep(_Row):
    """A ramp step the windows could not judge, measured interleaved with the knee so far:
    A B A B A B A windows, each B against the mean of the A windows around it."""

    base: int = Field(description="The knee so far (A).")
    step: int = Field(description="The concurrency judged (B).")
    ratios: list[float] = Field(description="Each B window over the mean of its two A windows.")
    median: float
    gains: bool = Field(description="median >= 1 + loadtest.ramp.knee_gain")


class Ramp(_Row):
    """Concurrency 1, 2, 4, ... up to the knee."""

    points: list[Point]
    knee: int = Field(description="The concurrency of the last real throughput gain.")
    knee_point: Point
    judged_at: int | None = _optional(
        "Where the SLOs are judged: the highest stable point at or below the knee, else the "
        "knee (the V2 ramp only)."
    )
    endpoint: str | None = _optional("The endpoint a streaming ramp measured.")
    paired: list[PairedStep] = Field(
        default_factory=list, description="Steps the windows could not judge, measured paired."
    )


class Skipped(_Row):
    """A phase that did not run, and why."""

    skipped: str


class Growth(_Row):
    """The server's RSS over the soak: the slope after the first third (warm-up)."""

    samples: int
    rss_start_mb: float | None
    rss_end_mb: float | None
    peak_rss_bytes: int
    growth_mb_per_min: float
    growth_ok: bool | None = Field(description="None: not judged (`growth_note` says why).")
    growth_limit_mb_per_min: float
    growth_note: str | None = _optional("Why growth was not judged.")


class Soak(Growth):
    """Load at the knee for `loadtest.soak.seconds` while the server's RSS is sampled."""

    seconds: float
    preset: str | None
    endpoint: str
    load: Point


class Batching(_Row):
    """Throughput at the knee with the server's batching off, against the ramp's (on)."""

    concurrency: int
    on_rps: float
    off_rps: float
    ratio: float | None = Field(description="on / off; None when nothing succeeded off.")
    off: Point


class SloVerdict(_Row):
    """One service-level objective as the load test judged it (stages/loadtesting/slo.py)."""

    slo: str = Field(description="The loadtest.slo field, e.g. `p95_latency_ms`.")
    limit: int | float
    value: int | float | None = Field(
        default=None, description="What was measured; None: not measured."
    )
    ok: bool = Field(description="Met, conclusively (inconclusive is never ok).")
    why: str


class Measured(_Row):
    """Everything measured against one server (plus one without batching)."""

    target: str = Field(description="`local MLServer`, or the external target's URL.")
    grid: list[GridPoint]
    ramp: Ramp
    streaming: Ramp | None = _optional("The OpenAI streaming ramp (generating tasks).")
    soak: Soak | Skipped
    peak_rss_bytes: int
    batching: Batching | Skipped


class LoadTestResults(Measured):
    """`loadtest.json`: the measurements and the SLO verdicts judged on them."""

    slo: list[SloVerdict]


class Headline(_Row):
    """The numbers the model card, the metrics and `shipyard.json` show."""

    target: str
    knee_concurrency: int
    knee_throughput_rps: float | None
    knee_throughput_rps_low: float | None = _optional(
        "The knee's throughput windows span low to high: the noise a rebuild may show."
    )
    knee_throughput_rps_high: float | None = _optional()
    knee_p95_latency_ms: float | None
    knee_stable: bool
    slo_judged_at_concurrency: int | None
    streaming_concurrency: int | None = _optional()
    p95_ttft_ms: float | None = _optional()
    p95_itl_ms: float | None = _optional()
    p95_ttft_ms_low: float | None = _optional("The streaming point's windows, low to high.")
    p95_ttft_ms_high: float | None = _optional()
    tokens_per_s: float | None = _optional()
    tokens_per_s_low: float | None = _optional()
    tokens_per_s_high: float | None = _optional()
    batching_ratio: float | None = _optional()
    peak_rss_mb: float | None = _optional()

    def metrics(self) -> dict[str, int | float]:
        """The numeric fields (booleans too, as 0/1), for `dvc metrics`."""
        return {k: v for k, v in self.model_dump().items() if isinstance(v, int | float)}


class RampRow(_Row):
    """One ramp point as the summary lists it."""

    concurrency: int
    throughput_rps: float
    p95_latency_ms: float | None
    stable: bool
    window_throughput: list[float]
