"""`capacity`: the device the release must fit."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field

from schemas.spec.base import PositiveBytes, Strict

KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


class CapacityConfig(Strict):
    """The device the release must fit, for the plan stage's memory budget."""

    device_memory: PositiveBytes = Field(
        description="Memory of one device, e.g. `24GiB` or `80GB`."
    )
    headroom: float = Field(
        default=0.85, gt=0, le=1, description="Fraction of device memory the plan may use."
    )
    max_context: int | None = Field(
        default=None, ge=1, description="Tokens per sequence; default the export's maximum."
    )
    max_batch: int | None = Field(
        default=None,
        ge=1,
        description="Rows served at once. A generation engine: default the most (up to 16) "
        "whose KV budget holds one sequence at the full context and 256 tokens a row; a "
        "one-pass model: default export.dims.batch.max.",
    )
    kv_dtype: Literal["float32", "float16", "bfloat16", "fp8", "int8"] = Field(
        default="float32", description="Element type of the KV cache."
    )
    runtime_overhead: ByteSize = Field(
        default=ByteSize(256 << 20), description="Runtime, allocator and workspace reserve."
    )
