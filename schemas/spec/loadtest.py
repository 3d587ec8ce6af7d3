"""`loadtest`: the load test's target, grid, ramp, soak and SLOs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from schemas.spec.base import Strict


class LoadTarget(Strict):
    url: str = Field(
        pattern=r"^https?://[^/\s]+$",
        description="Base URL of an Open Inference Protocol (KServe V2) server, no path.",
    )
    model: str | None = Field(default=None, description="Model name there; default the release.")


class LoadGrid(Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 4, 8, 16, 32],
        min_length=1,
        description="Batch sizes; values beyond export.dims.batch.max are trimmed to it.",
    )
    input_lengths: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [128, 512, 1024, 2048],
        min_length=1,
        description="Input lengths; values beyond export.dims.sequence.max are trimmed to it.",
    )
    requests: int = Field(default=8, ge=1, le=10_000, description="Requests per grid point.")


class LoadMix(Strict):
    """One request shape of a causal-lm load mix, drawn with probability weight / total."""

    input_length: int = Field(ge=1, description="Prompt tokens.")
    output_tokens: int = Field(ge=1, description="Tokens generated (streamed).")
    weight: float = Field(default=1.0, gt=0, description="Relative frequency in the mix.")


class LoadRamp(Strict):
    max_concurrency: int = Field(default=32, ge=1, le=4096, description="Cap of the ramp.")
    window_seconds: float = Field(default=2.0, gt=0, description="One measurement window.")
    max_windows: int = Field(
        default=10, ge=3, le=100, description="Windows per point before it is inconclusive."
    )
    stability: float = Field(
        default=0.10, gt=0, lt=1, description="Last 3 windows must agree within this fraction."
    )
    knee_gain: float = Field(
        default=0.05, ge=0, description="A step gaining less throughput than this is flat."
    )
    knee_patience: int = Field(default=4, ge=1, description="Flat steps before the ramp stops.")
    input_length: int = Field(default=32, ge=1, description="Input tokens (or rows) per request.")
    output_tokens: int = Field(
        default=16, ge=1, description="causal-lm: tokens generated per request (streamed)."
    )
    mix: list[LoadMix] | None = Field(
        default=None,
        max_length=64,
        description="causal-lm: the streaming ramp's prompt/output lengths, drawn by weight "
        "(seeded); default: input_length and output_tokens alone.",
    )


# What a preset sets, unless the spec sets it itself: `release-candidate` is the long soak a
# release candidate runs before it ships (30 minutes, a growth limit a leak of a few KB per
# request would break).
# A memory-growth slope fitted to a few seconds of RSS samples is allocator noise (one
# second of a streaming soak read 51 MB/min): growth is judged only over a steady part (the
# soak after its first third) at least this long.
GROWTH_MIN_STEADY_SECONDS = 20.0
SOAK_PRESETS: dict[str, dict[str, float]] = {
    "release-candidate": {"seconds": 1800.0, "max_growth_mb_per_min": 5.0},
}


class LoadSoak(Strict):
    preset: Literal["release-candidate"] | None = Field(
        default=None,
        description="release-candidate: a 30-minute soak with a 5 MB/min growth limit "
        "(seconds and max_growth_mb_per_min, when given, win).",
    )
    seconds: float = Field(default=10.0, ge=0, description="Soak length; 0 skips the soak.")
    concurrency: int | None = Field(default=None, ge=1, description="Default: the knee.")
    max_growth_mb_per_min: float = Field(
        default=50.0,
        gt=0,
        description="Steady RSS growth of the server above this fails; judged only when the "
        f"soak's steady part (after its first third) lasts {GROWTH_MIN_STEADY_SECONDS:g} s or "
        "more, else reported as not judged.",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in SOAK_PRESETS:
            data = {**SOAK_PRESETS[data["preset"]], **data}
        return data


class LoadSlo(Strict):
    """Service-level objectives; each unset one is not checked. Latencies at the knee."""

    p95_latency_ms: float | None = Field(default=None, gt=0, description="End-to-end p95.")
    p95_ttft_ms: float | None = Field(default=None, gt=0, description="causal-lm: first token.")
    p95_itl_ms: float | None = Field(
        default=None, gt=0, description="causal-lm: p95 inter-token (per-token) latency."
    )
    min_throughput_rps: float | None = Field(default=None, gt=0, description="Requests/s.")
    min_tokens_per_s: float | None = Field(default=None, gt=0, description="Output tokens/s.")
    max_memory_fraction: float | None = Field(
        default=None, gt=0, le=1, description="Server peak RSS / capacity.device_memory."
    )


class LoadTestConfig(Strict):
    target: LoadTarget | None = Field(
        default=None, description="An external V2 endpoint instead of the bundle's own server."
    )
    grid: LoadGrid = Field(default_factory=LoadGrid, description="Batch x input-length grid.")
    ramp: LoadRamp = Field(default_factory=LoadRamp, description="Closed-loop concurrency ramp.")
    soak: LoadSoak = Field(default_factory=LoadSoak, description="Memory-growth soak.")
    slo: LoadSlo = Field(default_factory=LoadSlo, description="Gates on the measured numbers.")
    batching_comparison: bool = Field(
        default=True, description="Measure dynamic batching on vs off at the knee."
    )
    startup_seconds: float = Field(default=120.0, gt=0, description="Server start timeout.")
    request_timeout_seconds: float = Field(
        default=60.0, gt=0, description="One request's timeout; a timeout counts as an error."
    )
