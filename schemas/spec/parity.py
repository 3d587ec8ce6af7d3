"""`parity`: how closely ONNX must match PyTorch, per output."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.spec.base import Strict


class Tolerance(Strict):
    atol: float = Field(default=1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(default=1e-3, ge=0, description="Relative tolerance (of the reference).")
    scale: Literal["rms", "none"] = Field(
        default="rms",
        description="What atol is measured in. `rms`: atol times the reference tensor's RMS "
        "where that is above 1, since float32 rounding grows with the magnitude of the values "
        "a result is computed from, not with the element (an element near zero in a tensor "
        "of magnitude 100 carries the tensor's rounding); `none`: atol as it is "
        "(numpy.allclose).",
    )


class KVCheck(Strict):
    """The kvcheck stage (causal-lm): cached decoding against a full recompute."""

    steps: int = Field(
        default=4,
        ge=0,
        le=64,
        description="Single-token decode steps after a short prompt, each compared with a full "
        "recompute (no cache, the whole sequence in one pass) at that length.",
    )
    past_lengths: list[int] | None = Field(
        default=None,
        description="Past lengths to decode one token at, each compared with a full pass; "
        "default: odd lengths spread out to export.dims.past_sequence.max, the max included.",
    )
    padded: bool = Field(
        default=True,
        description="Also check that a left-padded row of a batch equals the same row alone "
        "(needs export.dims.batch.max >= 2).",
    )
    tolerance: Tolerance = Field(
        default_factory=Tolerance,
        description="How close cached logits and presents must be to the full recompute's "
        "(parity.statistic applies).",
    )
    seed: int = Field(default=0, description="Seed of the token ids the model decodes.")


class ParityConfig(Strict):
    shapes: list[dict[str, int]] | None = Field(
        default=None,
        description="Dim assignments to compare at; default: min, opt, max and an odd size.",
    )
    tolerance: Tolerance = Field(default_factory=Tolerance, description="Default tolerance.")
    outputs: dict[str, Tolerance] = Field(
        default_factory=dict,
        description="Per-output tolerance; keys are output names or globs like `present.*`.",
    )
    statistic: Literal["max", "mean", "quantile"] = Field(
        default="max",
        description="Statistic of the normalized error |a-b| / (atol*s + rtol*|b|) that "
        "must stay <= 1, s the tolerance's scale (max with scale none = numpy.allclose).",
    )
    quantile: float = Field(default=0.99, gt=0, lt=1, description="Quantile for `quantile`.")
    layerwise: Literal["on-failure", "always", "never"] = Field(
        default="on-failure", description="When to compare layer by layer."
    )
    seed: int = Field(default=0, description="Seed for generated inputs.")
    kv: KVCheck = Field(
        default_factory=KVCheck,
        description="The KV-cache check of the kvcheck stage (causal-lm releases).",
    )
