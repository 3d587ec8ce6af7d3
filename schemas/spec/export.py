"""`export`: ONNX export settings, the dynamic dims and the graph's tensors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.spec.base import Strict


class DimRange(Strict):
    min: int = Field(ge=0, description="Smallest size the deployed graph must accept.")
    opt: int = Field(ge=0, description="Typical size; the trace and TensorRT opt shape.")
    max: int = Field(ge=1, description="Largest size the deployed graph must accept.")

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        """Rule: min <= opt <= max for every dim range."""
        if not self.min <= self.opt <= self.max:
            raise ValueError(
                f"need min <= opt <= max, found min={self.min}, opt={self.opt}, max={self.max}"
            )
        return self


# past_sequence + sequence: the attention mask's and the present's length in a KV-cache
# graph. Derived, never declared in export.dims; shapes may name it.
DERIVED_DIM = "total_sequence"


class TensorSpec(Strict):
    name: str = Field(description="Graph input name.")
    dtype: Literal["float32", "float16", "int64", "int32", "bool"] = Field(
        default="float32", description="Element type."
    )
    shape: list[int | str] = Field(
        description="Sizes: an int is static, a string names a dim from `export.dims`."
    )
    low: float = Field(
        default=0,
        description="Smallest value of an integer input: probes and the load test draw from "
        "[low, high), and the server refuses a value outside it with 400.",
    )
    high: float = Field(
        default=1, description="Exclusive upper bound of an integer input's values."
    )


class OutputSpec(Strict):
    name: str = Field(description="Graph output name.")
    shape: list[int | str] | None = Field(
        default=None, description="Expected sizes (ints or dim names); checked at every probe."
    )


class ExportConfig(Strict):
    exporter: Literal["legacy", "dynamo"] = Field(
        default="legacy",
        description="`legacy` = TorchScript exporter (dynamo=False), `dynamo` = torch.export.",
    )
    opset: int = Field(default=18, ge=14, le=23, description="ONNX opset version.")
    dims: dict[str, DimRange] = Field(
        description="Named dynamic dims with min/opt/max, e.g. batch, sequence, past_sequence."
    )
    inputs: list[TensorSpec] | None = Field(
        default=None,
        description="Graph inputs. Required for `generic`; derived for transformer tasks.",
    )
    outputs: list[OutputSpec] | None = Field(
        default=None, description="Outputs (generic task); derived for transformer tasks."
    )
    external_data: Literal["auto", "always", "never"] = Field(
        default="auto", description="Weights in a side file: auto = when the model is over 2 GB."
    )
    odd_sizes: bool = Field(
        default=True, description="Also run the graph at odd in-between sizes to prove dynamism."
    )
    pooling: Literal["mean", "cls", "max", "last-token"] | None = Field(
        default=None,
        description="text-embedding: how token embeddings become the sentence embedding, for a "
        "folder without sentence-transformers modules.json (which otherwise decides).",
    )
    normalize: bool | None = Field(
        default=None,
        description="text-embedding: L2-normalize the sentence embedding (plain folders).",
    )
