"""`engine`: the TensorRT engine, its profiles and CUDA graphs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ByteSize, Field

from schemas.spec.base import PositiveBytes, RepoPath, Strict
from schemas.spec.export import DimRange
from schemas.spec.parity import Tolerance


class EngineProfile(Strict):
    name: str = Field(pattern=r"^[a-z0-9_-]+$", description="e.g. prefill or decode.")
    dims: dict[str, DimRange] = Field(
        default_factory=dict,
        description="min/opt/max per named dim; a dim left out takes the export's range.",
    )


class CudaGraphs(Strict):
    enabled: bool = Field(default=True, description="Capture and replay each decode step.")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1], description="Batch sizes to capture; inside a profile."
    )


class EngineConfig(Strict):
    """A TensorRT engine built from the (quantized) ONNX; strongly typed, so INT8 comes from
    the graph's Q/DQ nodes, never from builder flags or a calibrator."""

    backend: Literal["tensorrt", "none"] = Field(
        default="tensorrt", description="`none` builds no engine (the stage is skipped)."
    )
    required: bool = Field(
        default=False, description="Fail, rather than skip, where TensorRT or a GPU is missing."
    )
    profiles: list[EngineProfile] = Field(
        default_factory=lambda: [EngineProfile(name="default")],
        min_length=1,
        description="Optimization profiles; one spanning the export's ranges by default.",
    )
    workspace: PositiveBytes = Field(default=ByteSize(4 << 30), description="Workspace pool limit.")
    optimization_level: int = Field(default=3, ge=0, le=5, description="Builder level 0-5.")
    timing_cache: RepoPath | None = Field(
        default=None, description="Timing-cache file reused across builds (repo-relative)."
    )
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = Field(
        default="none", description="TensorRT HardwareCompatibilityLevel."
    )
    version_compatible: bool = Field(default=False, description="BuilderFlag.VERSION_COMPATIBLE.")
    cuda_graphs: CudaGraphs = Field(default_factory=CudaGraphs, description="CUDA Graphs.")
    parity: Tolerance | None = Field(
        default=None, description="TensorRT vs ONNX Runtime tolerance; default parity.tolerance."
    )
