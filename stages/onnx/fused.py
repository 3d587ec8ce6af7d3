"""The fused decoder graph (issue 41 item 4): one kernel per norm, per attention, per
projection, built by onnxruntime-genai's model builder from the checkpoint.

The traced export of a 30-layer GQA decoder runs about 4,800 kernels a decode step, 4,200 of
them small shape and copy kernels at 1-2 us each (docs/benchmarks.md); at one stream that
overhead, not the weights, kept the INT4 graph at 0.6-0.8x llama.cpp. The model builder
writes the graph onnxruntime-genai serves: SkipSimplifiedLayerNormalization,
GroupQueryAttention with rotary inside it, MatMulNBits with packed q/k/v: 341 kernels on
that decoder.

Two things differ from the traced export, and everything that runs a graph reads them from
the graph (`padding_side`):
- **rows are right-padded.** GroupQueryAttention takes each row's length from the mask
  (its sum) and its positions from that length: a row's tokens sit at the start of its
  cache, its padding after them. A left-padded row would be read wrongly, so a graph marked
  `right` is never fed one.
- **the KV cache can be updated in place.** Bound as both the past input and the present
  output of a [rows, kv_heads, capacity, head_dim] buffer, the kernel writes each row's new
  keys at the row's length and copies nothing (the engine's `Slots`).

`build` runs the builder in a child process (its progress output goes to a log), then gives
the graph the export's names for its dims, the head size where the builder left a symbol,
and the marks this module reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# model metadata the repository reads (the shipped runtime keeps its own copy of the key,
# held equal by a test)
PADDING_KEY = "shipyard.padding"
BUILDER_KEY = "shipyard.builder"
# the builder's dim names -> the export's (stages/onnx/shapes.py)
DIMS = {
    "batch_size": "batch",
    "sequence_length": "sequence",
    "total_sequence_length": "total_sequence",
    "past_sequence_length": "past_sequence",
}
# architectures the builder writes a decoder for, by transformers' class name (a subset of
# its list: the families this repository's matrix builds and kvcheck has held)
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
)  # not Gemma 2: the builder keeps its sliding-window layers' cache in another shape
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class FusedError(Exception):
    """The builder could not write the graph: the reason and the fix, for the stage."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def padding_side(path: Path) -> str:
    """`right` for a graph this module built, else `left` (the traced export accepts either,
    and the checks pad on the left)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((p.value for p in model.metadata_props if p.key == PADDING_KEY), "left")


def architecture(checkpoint: Path) -> str:
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    return str((config.get("architectures") or [""])[0])


def supported(checkpoint: Path) -> str | None:
    """None when the builder writes this checkpoint's decoder, else why not."""
    arch = architecture(checkpoint)
    if arch not in ARCHITECTURES:
        return (
            f"architecture {arch or '(none in config.json)'} has no fused graph here "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return None


def build(
    checkpoint: Path,
    out: Path,
    *,
    bits: int | None,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    tokenizer: Path | None = None,
    log: Path | None = None,
) -> Path:
    """`out`/model.onnx (+ model.onnx.data): the checkpoint's decoder as one fused graph,
    MatMul weights in `bits`-bit blocks of `block_size` (MatMulNBits; `accuracy_level` 4:
    int8 compute, each row's activations quantized alone; 0: float), or float32 weights
    (`bits` None: the same kernels' float graph, what the tests compare). The builder reads a
    tokenizer with the checkpoint: `tokenizer` (a folder) lends one where the checkpoint
    has none."""
    why = supported(checkpoint)
    if why:
        raise FusedError(why, "use `graph: traced` (the export's own graph)")
    with tempfile.TemporaryDirectory(prefix="shipyard-fused-") as tmp:
        source = Path(tmp) / "checkpoint"
        source.mkdir()
        for f in checkpoint.iterdir():  # links: the builder reads, never writes, its input
            if f.is_file():
                os.symlink(f.resolve(), source / f.name)
        if not (source / "tokenizer.json").exists():
            lender = tokenizer if tokenizer and (tokenizer / "tokenizer.json").exists() else None
            if lender is None:
                raise FusedError(
                    f"{checkpoint} has no tokenizer.json, which onnxruntime-genai's builder reads",
                    "add the model's tokenizer.json to its folder, or give "
                    "quantization.calibration.tokenizer",
                )
            for name in TOKENIZER_FILES:
                if (lender / name).exists() and not (source / name).exists():
                    os.symlink((lender / name).resolve(), source / name)
        # the builder writes float weights (its own int4 path held the checkpoint, the float
        # graph and the quantized one at once: 3.1x the checkpoint on llama-30, 1.95x for
        # float); onnxruntime's MatMulNBitsQuantizer then quantizes them in a second child
        # (1.5x), the same quantizer the builder calls, with the same settings: the same
        # graph, its logits equal to the bit (tests/stages/test_fused_graph.py)
        built = Path(tmp) / "built"
        options = ["hf_token=false"]
        command = [
            sys.executable, "-m", "onnxruntime_genai.models.builder",
            "-i", str(source), "-o", str(built), "-p", "fp32", "-e", "cpu",
            "-c", str(Path(tmp) / "cache"), "--extra_options", *options,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if log is not None:
            log.write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not (built / "model.onnx").exists():
            last = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()][-3:]
            raise FusedError(
                f"onnxruntime-genai's builder failed on {checkpoint}: {' | '.join(last)[:400]}",
                "use `graph: traced` (the export's own graph)",
            )
        if bits is not None:
            quantized = Path(tmp) / "quantized"
            quantized.mkdir()
            here = str(Path(__file__).resolve().parents[2])
            args = [str(built / "model.onnx"), str(quantized / "model.onnx")]
            args += [str(bits), str(block_size), str(int(symmetric)), str(accuracy_level)]
            done = subprocess.run(
                [sys.executable, "-m", "stages.onnx.fused", *args],
                capture_output=True,
                text=True,
                env={**env, "PYTHONPATH": here},
                check=False,
            )
            if done.returncode != 0:
                last = [ln for ln in done.stderr.splitlines() if ln.strip()][-3:]
                raise FusedError(
                    f"quantizing the fused graph's weights failed: {' | '.join(last)[:400]}",
                    "use `graph: traced` (the export's own graph)",
                )
            built = quantized
        _mark(built / "model.onnx", checkpoint)
        _smoke(built / "model.onnx")
        out.mkdir(parents=True, exist_ok=True)
        for f in out.glob("model.onnx*"):
            f.unlink()
        for name in ("model.onnx", "model.onnx.data"):
            shutil.move(str(built / name), out / name)
    return out / "model.onnx"


def _mark(path: Path, checkpoint: Path) -> None:
    """The export's interface: its dim names, the head size for the builder's symbol, and
    a `position_ids` input, which the graph does not read (each row's positions are its
    own length's: right-padded rows), so that every caller feeds it as it feeds the
    export; and the marks."""
    import json
    from importlib.metadata import version

    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    config = json.loads((checkpoint / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "kv_cache_dim":
                dim.Clear()
                dim.dim_value = int(head)
            elif dim.dim_param in DIMS:
                dim.dim_param = DIMS[dim.dim_param]
    strange = sorted(
        {
            d.dim_param
            for v in [*model.graph.input, *model.graph.output]
            for d in v.type.tensor_type.shape.dim
            if d.dim_param and d.dim_param not in DIMS.values()
        }
    )
    if strange:  # e.g. Gemma 2's sliding-window layers: a cache of another shape
        raise FusedError(
            f"the builder wrote a graph whose inputs have dims {strange} (a sliding-window or "
            "other cache the engine and the checks do not hold)",
            "use `graph: traced` (drop recipe int4-weight-only-fused)",
        )
    if all(i.name != "position_ids" for i in model.graph.input):
        positions = helper.make_tensor_value_info(
            "position_ids", TensorProto.INT64, ["batch", "sequence"]
        )
        positions.doc_string = (
            "not read: each row's positions count from the start of its own tokens (rows "
            "right-padded, the padding after them)"
        )
        at = 1 + next(i for i, v in enumerate(model.graph.input) if v.name == "attention_mask")
        model.graph.input.insert(at, positions)
    marks = {
        PADDING_KEY: "right",
        BUILDER_KEY: f"onnxruntime-genai {version('onnxruntime-genai')}",
    }
    kept = [p for p in model.metadata_props if p.key not in marks]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in marks.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def _smoke(path: Path) -> None:
    """One pass of two tokens, then one cached step: a graph its own kernels refuse (a
    setting the builder wrote that onnxruntime cannot run) is a FusedError here, not a
    crash in the measurements after."""
    import numpy as np
    import onnxruntime as ort

    def tokens(ids: list[int], total: int) -> dict[str, np.ndarray]:
        row = np.array([ids], np.int64)
        mask = np.ones((1, total), np.int64)
        return {"input_ids": row, "attention_mask": mask, "position_ids": row * 0}

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        empty = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
        names = [o.name for o in session.get_outputs()]
        out = dict(zip(names, session.run(names, empty | tokens([1, 2], 2)), strict=True))
        cache = {i.name: out[i.name.replace("past_key_values.", "present.")] for i in pasts}
        session.run(["logits"], cache | tokens([3], 3))
    except Exception as exc:  # onnxruntime's own refusals: a clear reason, never a traceback
        why = " ".join(str(exc).split())[:300]
        raise FusedError(
            f"onnxruntime cannot run the graph the builder wrote: {why}",
            "use `graph: traced` (drop recipe int4-weight-only-fused)",
        ) from None


def builder_of(path: Path) -> str:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((p.value for p in model.metadata_props if p.key == BUILDER_KEY), "unknown")


def describe(path: Path) -> dict[str, Any]:
    """Kernel counts by op type: what the stage reports of the graph it ships."""
    import collections

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return dict(collections.Counter(n.op_type for n in model.graph.node).most_common())


def _quantize(src: Path, dst: Path, bits: int, block: int, symmetric: bool, level: int) -> None:
    """The float graph's MatMul weights in `bits`-bit blocks (MatMulNBits), as the model
    builder quantizes them, written with external data beside `dst`."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(src)),
        block_size=block,
        is_symmetric=symmetric,
        bits=bits,
        accuracy_level=level,
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


if __name__ == "__main__":  # the quantizing child of `build`
    src, dst, bits, block, symmetric, level = sys.argv[1:7]
    _quantize(Path(src), Path(dst), int(bits), int(block), bool(int(symmetric)), int(level))
