"""`quantization`: the PTQ method, its calibration data and accuracy budget."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, model_validator

from schemas.spec.base import RepoPath, Strict


class CalibrationData(Strict):
    path: RepoPath = Field(
        description="JSONL of texts (with `tokenizer`) or NPZ of input tensors (first axis = "
        "sample), relative to the repo root. Never replaced by random data."
    )
    tokenizer: RepoPath | None = Field(
        default=None, description="Folder with tokenizer.json; required for JSONL."
    )
    text_field: str = Field(default="text", description="JSONL key holding the text.")
    samples: int = Field(default=128, ge=1, description="Samples used to calibrate.")
    holdout: int = Field(
        default=32, ge=1, description="Further samples, never calibrated on, for the final check."
    )
    sensitivity_samples: int = Field(
        default=16, ge=1, description="Calibration samples used to rank node sensitivity."
    )
    max_length: int | None = Field(
        default=None, ge=1, description="Longest sample in tokens; default export sequence max."
    )

    @model_validator(mode="after")
    def _enough(self) -> CalibrationData:
        """Rule: sensitivity_samples <= samples; a .jsonl calibration set needs `tokenizer`; the
        path ends in .jsonl or .npz."""
        if self.sensitivity_samples > self.samples:
            raise ValueError(
                f"sensitivity_samples ({self.sensitivity_samples}) cannot exceed samples "
                f"({self.samples}); they are drawn from the calibration samples"
            )
        if self.path.endswith(".jsonl") and not self.tokenizer:
            raise ValueError("a JSONL calibration set needs `tokenizer` (a tokenizer.json folder)")
        if not self.path.endswith((".jsonl", ".npz")):
            raise ValueError(f"path {self.path!r}: use a .jsonl (texts) or .npz (tensors) file")
        return self


class AccuracyBudget(Strict):
    """Quantized vs FP32 ONNX on the same inputs; every bound given must hold."""

    top1_agreement_min: float | None = Field(
        default=None, ge=0, le=1, description="Share of positions with the same argmax."
    )
    greedy_agreement_min: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="causal-lm: share of the tokens FP32 generates greedily (16 after each "
        "of up to 16 prompts) that the quantized model also picks, fed the same text.",
    )
    logit_cosine_min: float | None = Field(
        default=None, ge=-1, le=1, description="Mean cosine similarity of output vectors."
    )
    snr_db_min: float | None = Field(
        default=None, description="Signal-to-noise ratio of the outputs, in dB."
    )
    perplexity_increase_max: float | None = Field(
        default=None, ge=0, description="Relative perplexity increase (0.01 = +1 %); causal-lm."
    )

    @model_validator(mode="after")
    def _some(self) -> AccuracyBudget:
        """Rule: An accuracy budget gives at least one bound."""
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("give at least one bound, e.g. `top1_agreement_min: 0.99`")
        return self


class QuantizedBase(Strict):
    calibration: CalibrationData = Field(description="Real input samples (never random).")
    budget: AccuracyBudget | None = Field(
        default=None,
        description="Accuracy the quantized model must keep; default: the task's "
        "(schemas/tasks.py, e.g. top1_agreement_min 0.98).",
    )
    max_size_ratio: float = Field(
        default=0.9,
        gt=0,
        description="Fail when the quantized file is larger than this x the FP32 file.",
    )
    max_float_nodes: int = Field(
        default=8, ge=0, description="Cap on nodes mixed precision may keep in float."
    )
    op_types: list[str] = Field(
        default_factory=lambda: ["MatMul", "Gemm"],
        description="Op types to quantize (MatMul/Gemm measured faster and closer on CPU).",
    )


class NoQuantization(Strict):
    DTYPE: ClassVar[str] = "float32"  # what the shipped weights are stored as
    method: Literal["none"] = Field(description="Ship the FP32 model.")


def _smooth_alpha() -> Any:
    """The INT8 methods' SmoothQuant setting (one definition, a field on each)."""
    return Field(
        default=None,
        gt=0,
        lt=1,
        description="SmoothQuant before quantizing: move activation outliers into the weights "
        "with per-channel factors max|X|^alpha / max|W|^(1-alpha) (0.5 is the paper's default; "
        "higher moves more). None: no smoothing.",
    )


class Int8Dynamic(QuantizedBase):
    DTYPE: ClassVar[str] = "int8"  # what the shipped weights are stored as
    method: Literal["int8-dynamic"] = Field(description="Weights INT8, activations at run time.")
    per_channel: bool = Field(default=False, description="Per-output-channel weight scales.")
    smooth_alpha: float | None = _smooth_alpha()


class Int8Static(QuantizedBase):
    DTYPE: ClassVar[str] = "int8"  # what the shipped weights are stored as
    method: Literal["int8-static"] = Field(description="QDQ with calibrated activation ranges.")
    per_channel: bool = Field(default=True, description="Per-output-channel weight scales.")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        default="minmax", description="How activation ranges are chosen."
    )
    percentile: float = Field(
        default=99.999, gt=90, le=100, description="Percentile for `percentile` calibration."
    )
    smooth_alpha: float | None = _smooth_alpha()


def _power_of_two(block_size: int) -> None:
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of 2 (16, 32, 64…)")


class WeightOnly(QuantizedBase):
    """Block-wise MatMul weights (MatMulNBits); `compute` says what the kernel multiplies."""

    block_size: int = Field(default=32, ge=16, description="Weights per scale (power of 2).")
    symmetric: bool = Field(default=True, description="Symmetric (no zero point) blocks.")
    compute: Literal["int8", "float"] = Field(
        default="int8",
        description="What MatMulNBits multiplies: `int8` quantizes each row's activations "
        "in blocks of block_size inside the kernel (onnxruntime's accuracy_level 4: its "
        "integer kernels; a row never depends on its batch-mates); `float` dequantizes the "
        "weights and multiplies in float32 (activations exact; at one row about 2x (4-bit) "
        "and 50x (8-bit) slower than `int8` on an AVX-512 VNNI CPU).",
    )
    op_types: list[str] = Field(
        default_factory=lambda: ["MatMul"], description="Only MatMul (MatMulNBits)."
    )
    graph: Literal["traced", "fused"] = Field(
        default="traced",
        description="`traced`: the export's graph with its MatMuls quantized (mixed "
        "precision may keep the most damaging in float). `fused` (causal-lm; Llama, Mistral, "
        "Qwen2/3, Phi-3, Gemma checkpoints): the decoder rebuilt from the checkpoint "
        "by onnxruntime-genai's model builder, one kernel per norm, attention (its KV cache "
        "updated in place by the engine, rows right-padded) and projection, every projection "
        "quantized: 341 kernels a step instead of ~4,800 on a 30-layer decoder, 1.1-1.3x "
        "llama.cpp's one-stream speed here (docs/benchmarks.md). Held to the same budget.",
    )

    @model_validator(mode="after")
    def _block(self) -> WeightOnly:
        """Rule: a weight-only block_size is a power of 2."""
        _power_of_two(self.block_size)
        return self


class Int4WeightOnly(WeightOnly):
    DTYPE: ClassVar[str] = "int4"  # what the shipped weights are stored as
    method: Literal["int4-weight-only"] = Field(description="Block-wise 4-bit MatMul weights.")


class Int8WeightOnly(WeightOnly):
    DTYPE: ClassVar[str] = "int8"  # what the shipped weights are stored as
    method: Literal["int8-weight-only"] = Field(
        description="Block-wise 8-bit MatMul weights (MatMulNBits)."
    )


Recipe = Literal[
    "int4-weight-only-fused",
    "int8-dynamic-per-channel",
    "int8-dynamic-smoothquant",
    "int8-dynamic",
    "int8-static",
    "int8-weight-only",
    "int4-weight-only",
]
RECIPE_ORDER: list[Recipe] = [
    "int8-dynamic-per-channel",
    "int8-dynamic-smoothquant",
    "int8-dynamic",
    "int8-static",
    "int8-weight-only",
    "int4-weight-only",
]


class AutoQuantization(QuantizedBase):
    method: Literal["auto"] = Field(
        description="Try recipes in order; ship the first that meets the budget with a margin "
        "on calibration and held-out data and is fast enough; else keep the most damaging "
        "class of layers in float."
    )
    recipes: list[Recipe] = Field(
        default_factory=lambda: list(RECIPE_ORDER),
        min_length=1,
        description="Recipes to try, in order (expected gain first). "
        "`int4-weight-only-fused`: INT4 weight-only as the fused graph (`graph: fused`: the "
        "decoder rebuilt by onnxruntime-genai's builder, its cache updated in place); not in "
        "the default list, which any model takes; `shipyard init` puts it first for a "
        "causal-lm family the builder writes. It keeps nothing in float, so it is never the "
        "recipe that falls back on keeping layer classes in float.",
    )
    margin: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Share of each bound's room a recipe must keep: agreement >= bound + "
        "margin x (1 - bound); perplexity increase <= bound x (1 - margin).",
    )
    min_speedup: float = Field(
        default=1.0,
        ge=0,
        description="A recipe must run at least this x FP32's speed (0: any speed).",
    )
    fallback: Literal["fp32", "fail"] = Field(
        default="fp32",
        description="What happens when no recipe is accurate, fast and small enough: fp32 "
        "ships the FP32 export unchanged (the report and model card say why, recipe by "
        "recipe; it meets every accuracy bound); fail fails the stage.",
    )
    block_size: int = Field(default=32, ge=16, description="int4-weight-only block size.")
    smooth_alpha: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="SmoothQuant migration strength for the int8-dynamic-smoothquant recipe.",
    )

    @model_validator(mode="after")
    def _recipes(self) -> AutoQuantization:
        """Rule: auto recipes are distinct; the weight-only block_size is a power of 2."""
        if len(set(self.recipes)) != len(self.recipes):
            raise ValueError(f"recipes {self.recipes} name one recipe twice")
        _power_of_two(self.block_size)
        return self


Quantization = Annotated[
    NoQuantization | Int8Dynamic | Int8Static | Int4WeightOnly | Int8WeightOnly | AutoQuantization,
    Field(discriminator="method"),
]


def dtype_of(method: str) -> str:
    """The stored weight type of an explicit method (`int8-dynamic` -> int8), from the
    models' DTYPE: one place, whatever method a recipe search ends on."""
    for cls in (NoQuantization, Int8Dynamic, Int8Static, Int4WeightOnly, Int8WeightOnly):
        if method in get_args(cls.model_fields["method"].annotation):
            return cls.DTYPE
    raise KeyError(f"{method!r} is not an explicit quantization method")
