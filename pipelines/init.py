"""`shipyard init MODEL_FOLDER`: a release spec derived from the model folder itself.

The task comes from the checkpoint (`config.architectures`, a sentence-transformers
`modules.json`), the dims from its positions, the pins from its files' digests, the budgets
and metrics from the task registry. The spec is validated exactly like a hand-written one
before it is written, and an existing spec is never overwritten without `--force`.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from schemas import ReleaseSpec, SpecError
from schemas.artifacts import Arch, CapacityPlan, DimSizes
from schemas.tasks import TASKS

# config.architectures suffix -> task
SUFFIXES = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
}
WEIGHTS = (".safetensors",)


# the sizes init reads from config.json (stages/onnx/model.py arch): whole numbers >= 0
SIZES = (
    "hidden_size",
    "n_embd",
    "d_model",
    "dim",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "vocab_size",
    "max_position_embeddings",
    "n_positions",
)


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a mapping whose sizes are whole numbers, or a SpecError naming the
    file, the field and what was found (never a traceback)."""
    shown = str(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(shown, [f"{shown}: not a JSON document ({exc})"]) from None
    if not isinstance(config, dict):
        raise SpecError(shown, [f"{shown}: a {type(config).__name__}, not a mapping of settings"])
    for key in SIZES:
        value = config.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or not 0 <= value <= 10**12:
            raise SpecError(
                shown,
                [
                    f"{shown}: {key} is {json.dumps(value)[:60]}; a size must be a whole number "
                    "from 0 to 10^12; fix the checkpoint's config"
                ],
            )
    return config


def detect_task(folder: Path, config: dict[str, Any]) -> str:
    if (folder / "modules.json").is_file():
        return "text-embedding"
    for name in config.get("architectures") or []:
        for suffix, task in SUFFIXES.items():
            if name.endswith(suffix):
                return task
    return "text-embedding"  # a bare encoder (BertModel, ...): its hidden states, pooled


def build_spec(
    root: Path,
    folder: Path,
    name: str,
    data: str,
    task: str | None = None,
    device_memory: str = "16GiB",
    tokenizer: str | None = None,
    eval_data: str | None = None,
) -> dict[str, Any]:
    """The spec for the model folder (repo-relative paths); not yet validated. `eval_data`:
    a separate file for evaluation (default: `data`, which same_data() then warns about)."""
    from stages.bundling.hashing import hash_files

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecError(
            str(folder), [f"{folder}: no config.json; init needs a Hugging Face folder"]
        )
    config = read_config(config_file)
    task = task or detect_task(folder, config)
    derivable = [n for n, t in TASKS.items() if t.outputs]  # generic: the spec declares I/O
    if task not in derivable:
        raise SpecError(
            str(folder), [f"--task {task!r}: init writes one of {', '.join(derivable)}"]
        )
    spec_task = TASKS[task]
    try:
        rel = folder.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise SpecError(
            str(folder), [f"{folder} is outside the repository {root}; copy it under models/"]
        ) from None
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHTS)
    digests = hash_files({p.name: p for p in [config_file, *weights]})
    if not (root / data).is_file():
        raise SpecError(data, [f"--data {data}: no such file in the repository {root}"])
    tokenizer = tokenizer or (rel if (folder / "tokenizer.json").is_file() else None)
    if not tokenizer and data.endswith(".jsonl"):
        raise SpecError(
            rel,
            [
                f"{rel} has no tokenizer.json to turn {data}'s texts into token ids; pass "
                "--tokenizer FOLDER (a folder with the model's tokenizer.json)"
            ],
        )
    sizing = size_for_device(config, task, device_memory, fp32_bytes(weights, config))
    dims = sizing.dims()
    export: dict[str, Any] = {"exporter": "legacy", "opset": 18, "dims": dims}
    if spec_task.pooled and not (folder / "modules.json").is_file():
        export["pooling"] = "mean"  # a bare encoder: say how it pools (edit if not mean)
    rows = _count_rows(root / data, data)
    # sized from the data: a quarter held out (at most 64), the rest calibrates (at most 128)
    holdout = max(1, min(64, rows // 4))
    calibrate = min(128, rows - holdout)
    dataset: dict[str, Any] = {"path": data, "samples": min(64, rows)}
    if tokenizer:
        dataset["tokenizer"] = tokenizer
    evaluated = dataset
    if eval_data is not None and eval_data != data:
        if not (root / eval_data).is_file():
            raise SpecError(eval_data, [f"--eval-data {eval_data}: no such file in {root}"])
        evaluated = {**dataset, "path": eval_data}
        evaluated["samples"] = min(64, _count_rows(root / eval_data, eval_data))
    # what quantizing may cost is the budget (the one accuracy contract: quantize and
    # evaluate both apply it); evaluation adds only a regression gate against production
    threshold: dict[str, Any] = (
        {
            "metric": "perplexity",
            "min_relative_change": -0.01,
            "greater_is_better": False,
            "baseline": "production",
        }
        if spec_task.language_model
        else {
            "metric": spec_task.metrics[0],
            "min_absolute_change": -0.01,
            "greater_is_better": True,
            "baseline": "production",
        }
    )
    evaluation: dict[str, Any] = {"dataset": evaluated, "thresholds": [threshold]}
    if spec_task.kv_cache:
        evaluation["decode"] = {"prompts": 8, "prompt_tokens": 8, "tokens": 16}
    calibration = {
        **dataset,
        "samples": calibrate,
        "holdout": holdout,
        "sensitivity_samples": min(16, calibrate),
    }
    SIZING[name] = sizing.note
    return {
        "schema_version": 1,
        "name": name,
        "version": "0.1.0",
        "task": task,
        "model": {"kind": "hf", "path": rel},
        "pins": {"checkpoints": digests},  # hash_files returns them sorted
        "export": export,
        "parity": {},
        "quantization": {
            "method": "auto",
            **({"recipes": fused_first()} if spec_task.kv_cache and fusable(folder) else {}),
            "calibration": calibration,
            "budget": dict(spec_task.default_budget),
        },
        "evaluation": evaluation,
        "capacity": {"device_memory": device_memory},
        "bundle": {
            "model_card": {
                "description": f"{config.get('model_type', 'model')} from {rel}",
            }
        },
        "engine": {"required": False},
        "loadtest": first_loadtest(sizing, spec_task.kv_cache),
    }


def fused_first() -> list[str]:
    """The recipe search with the fused INT4 graph first (stages/onnx/fused.py)."""
    from schemas.spec.quantization import RECIPE_ORDER

    return ["int4-weight-only-fused", *RECIPE_ORDER]


def fusable(folder: Path) -> bool:
    """Whether onnxruntime-genai's builder writes this checkpoint's decoder."""
    from stages.onnx.fused import supported

    return (folder / "config.json").is_file() and supported(folder) is None


SIZING: dict[str, str] = {}  # release name -> why init chose its dims (build_spec's note)
TRY_BATCH = 8  # rows of a one-pass model init serves when the device holds them; the probe
# batch of a KV-cache export (whose engine rows are sized by the plan from its KV budget)
MIN_CONTEXT = 2048  # context init keeps before it lowers the batch


@dataclass(frozen=True)
class _Shape:
    dims: dict[str, DimSizes]
    arch: Arch


@dataclass(frozen=True)
class Sizing:
    """What init chose for the export's dims, and why (in the spec's comment). `batch` is
    the export's batch max; `rows` the batch served (a KV-cache model: the engine's rows,
    which the plan stage sizes from its KV budget, at least these)."""

    batch: int
    context: int
    sequence: int
    kv: bool
    note: str
    rows: int = 0

    def dims(self) -> dict[str, Any]:
        out: dict[str, Any] = {"batch": {"min": 1, "opt": 1, "max": self.batch}}
        if self.kv:  # the prompt's pass (the engine's prefill chunk), the rest for the past
            out["past_sequence"] = {"min": 0, "opt": 16, "max": self.context - self.sequence}
        out["sequence"] = {"min": 1, "opt": min(16, self.sequence), "max": self.sequence}
        return out


def fp32_bytes(weights: list[Path], config: dict[str, Any]) -> int:
    """The FP32 export's size, an upper bound of what ships: every parameter in the
    safetensors headers at 4 bytes, plus a second copy of a tied embedding (the legacy
    exporter writes a tied lm_head twice)."""
    params, embedding = 0, 0
    for path in weights:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(size, 100 << 20)) or b"{}")
        for key, entry in header.items():
            if key == "__metadata__" or not isinstance(entry, dict):
                continue
            count = int(np.prod(entry.get("shape") or [1]))
            params += count
            if "embed" in key or key.endswith("wte.weight"):
                embedding = max(embedding, count)
    tied = config.get("tie_word_embeddings", True) is not False
    return 4 * (params + (embedding if tied else 0))


def size_for_device(config: dict[str, Any], task: str, device_memory: str, weights: int) -> Sizing:
    """Rows, context and prompt pass that the plan stage's own model (stages/plan.py) fits
    in `device_memory`: the checkpoint's context at the wanted rows if it fits; else the
    context is lowered (not below 2048) at those rows; then the rows, down to 1; then the
    context again. The wanted rows: a KV-cache model's engine rows (stages.plan.ROWS, each
    row held by the KV budget the plan sizes); a one-pass model's batch, TRY_BATCH. A device
    too small for the weights alone is refused."""
    from schemas.spec.capacity import CapacityConfig
    from stages.onnx.model import arch
    from stages.plan import ROWS, compute

    shape = arch(config)
    positions = shape["positions"] or 512
    kv = TASKS[task].kv_cache
    cap = CapacityConfig(device_memory=device_memory)  # type: ignore[arg-type]
    model = Arch(**shape)
    want = ROWS if kv else TRY_BATCH

    def plan(rows: int, context: int) -> CapacityPlan:
        sizing = _sizing(rows, context, kv, "")
        dims = {k: DimSizes(**v) for k, v in sizing.dims().items()}
        return compute(cap, _Shape(dims, model), task, weights)

    def fits(rows: int, context: int) -> bool:
        p = plan(rows, context)
        if kv:  # the engine's rows beside a KV budget that holds them (stages/plan.py)
            return p.max_batch_that_fits >= rows
        return p.extreme.total <= p.usable_bytes

    full = positions if kv else min(positions, 512)
    floor = min(full, MIN_CONTEXT)
    choice = None
    if fits(want, full):
        choice = (want, full)
    elif fits(want, floor):
        choice = (want, _largest(lambda c: fits(want, c), floor, full))
    else:
        rows = next((b for b in range(want - 1, 0, -1) if fits(b, floor)), 0)
        if rows:
            choice = (rows, floor)
        elif fits(1, min(floor, 64)):
            choice = (1, _largest(lambda c: fits(1, c), min(floor, 64), floor))
    if choice is None:
        p = plan(1, min(floor, 64))
        raise SpecError(
            "--device-memory",
            [
                f"--device-memory {device_memory}: even batch 1 x {min(floor, 64)} tokens needs "
                f"{p.extreme.total / 2**30:.3g} GiB (weights {p.extreme.weights / 2**30:.3g} GiB "
                f"as FP32) but {p.usable_bytes / 2**30:.3g} GiB is usable; give the device's "
                "real memory, or quantize the checkpoint before init"
            ],
        )
    rows, context = choice
    p = plan(rows, context)
    if kv:
        rows = p.batch  # what the plan stage will serve, as sized from the budget
    why = (
        "the checkpoint's full context"
        if context == full
        else f"the checkpoint allows {positions} tokens, but the plan does not hold "
        f"{'rows' if kv else 'batch'} {want} x {full} in {device_memory}"
    )
    served = (
        f"{rows} engine rows x {context} tokens ({why}), a KV budget of {p.kv_budget_tokens} "
        f"tokens ({p.kv_budget_tokens / max(p.cached_tokens, 1):.3g} x the longest sequence; "
        f"the export is probed at batch {min(TRY_BATCH, rows)})"
        if kv
        else f"batch {rows} x {context} tokens ({why})"
    )
    note = (
        f"Sized for capacity.device_memory {device_memory}: {served} needs "
        f"{p.extreme.total / 2**30:.3g} of {p.usable_bytes / 2**30:.3g} GiB "
        f"usable by the plan stage's model (weights as FP32 {p.extreme.weights / 2**30:.3g}, "
        f"KV cache {p.extreme.kv_cache / 2**30:.3g}, activations "
        f"{p.extreme.activations / 2**30:.3g} GiB)."
    )
    return _sizing(rows, context, kv, note)


def _sizing(rows: int, context: int, kv: bool, note: str) -> Sizing:
    # a causal LM: the prompt's pass is half the context, at most 2048 (the engine prefills
    # longer prompts in chunks of it); an encoder takes its whole sequence in one pass. A
    # KV-cache export is probed at TRY_BATCH rows at most (its engine serves more)
    sequence = max(1, min(context // 2, 2048)) if kv else context
    batch = min(rows, TRY_BATCH) if kv else rows
    return Sizing(batch, context, sequence, kv, note, rows)


def _largest(ok: Callable[[int], bool], low: int, high: int) -> int:
    """The largest context in [low, high] (a multiple of 64, or `low`) that `ok` accepts;
    `ok(low)` holds (memory grows with the context: a bisection)."""
    best = low
    lo, hi = low // 64 + 1, high // 64
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid * 64):
            best, lo = mid * 64, mid + 1
        else:
            hi = mid - 1
    return best


def first_loadtest(sizing: Sizing, kv: bool) -> dict[str, Any]:
    """A load test a first build can wait for (minutes, not an hour): the grid at batch 1
    and the served batch, a short and the longest input; the ramp to twice the served rows
    in 1 s windows; a 10 s soak. Its shape follows the export: a request never reads a past
    beyond past_sequence.max. The full sweep is the spec's defaults (delete this section)."""
    short = min(32, sizing.sequence)
    inputs = sorted({short, sizing.sequence})
    ramp: dict[str, Any] = {
        "max_concurrency": 2 * (sizing.rows or sizing.batch),
        "window_seconds": 1.0,
        "input_length": short,
    }
    if kv:  # input + output - 2 <= past_sequence.max (the past the last step reads)
        past = sizing.context - sizing.sequence
        ramp["output_tokens"] = max(1, min(16, past + 2 - short))
    return {
        "grid": {"batch_sizes": sorted({1, sizing.batch}), "input_lengths": inputs, "requests": 4},
        "ramp": ramp,
        "soak": {"seconds": 10},
    }


def commented(text: str, spec: dict[str, Any]) -> str:
    """The dumped spec with a comment above the lines a user should understand before
    trusting the build: the accuracy contract and the regression gate."""
    why = TASKS[spec["task"]].budget_why
    notes = {
        "  budget:": [
            "The accuracy contract: what quantizing may cost, vs the FP32 model. quantize ships",
            "a recipe only when every bound holds with `margin` (0.2) of its room to spare on",
            "calibration and held-out samples; evaluate holds the shipped model to the bounds",
            "themselves on the evaluation set; an evaluation threshold stricter than these is",
            "refused at validate. The model card states them with the measured values.",
            *textwrap.wrap(why, 88),
        ],
        "  dims:": textwrap.wrap(SIZING.get(spec["name"], ""), 88),
        "  recipes:": [
            "int4-weight-only-fused first: this family's decoder rebuilt by onnxruntime-genai's",
            "builder (one kernel per norm, attention and projection; the KV cache updated in",
            "place), shipped when it meets the budget and the speed bar; else the traced",
            "recipes, whose search can keep layer classes in float.",
        ],
        "loadtest:": [
            "A first, short load test (minutes): delete `grid`, `ramp` and `soak` for the full",
            "sweep (batch 1-32, inputs 128-2048, concurrency up to 32) once the build passes.",
        ],
        "  thresholds:": [
            "Regression gates against the release in production (`shipyard gate`); the",
            "accuracy contract above is applied by evaluate itself.",
        ],
    }
    out = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        out += [f"{indent}# {note}" for note in notes.pop(line, [])]
        out.append(line)
    return "\n".join(out) + "\n"


def _count_rows(path: Path, shown: str) -> int:
    """Samples in a JSONL (non-empty lines) or NPZ (first axis) file; at least 2 (one to
    calibrate on, one to hold out)."""
    if path.suffix == ".npz":
        import numpy as np

        try:
            with np.load(path) as arrays:
                rows = min((arrays[k].shape[0] for k in arrays.files), default=0)
        except (OSError, ValueError, IndexError) as exc:
            raise SpecError(shown, [f"--data {shown}: not a readable NPZ file ({exc})"]) from None
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SpecError(shown, [f"--data {shown}: not UTF-8 text"]) from None
        rows = sum(1 for line in text.splitlines() if line.strip())
    if rows < 2:
        raise SpecError(
            shown,
            [
                f"--data {shown} has {rows} sample(s); quantization needs at least 2 (one to "
                "calibrate on, one held out) and real use needs hundreds"
            ],
        )
    return rows


def same_data(release: Any) -> str | None:
    """A warning when evaluation reads the file quantization calibrates on: its scores
    are then measured on samples the recipe was fitted to, and read better than they are."""
    quant = getattr(release, "quantization", None)
    calibration = getattr(quant, "calibration", None)
    dataset = getattr(getattr(release, "evaluation", None), "dataset", None)
    if calibration is None or dataset is None or calibration.path != dataset.path:
        return None
    return (
        f"evaluation.dataset.path and quantization.calibration.path are both "
        f"{dataset.path}: evaluation scores the samples quantization was calibrated on, so "
        "they read better than on new data; give evaluation a file of its own "
        "(`shipyard init --eval-data FILE`, or edit evaluation.dataset.path)"
    )


def init(
    root: Path,
    folder: Path,
    data: str,
    name: str | None = None,
    task: str | None = None,
    device_memory: str = "16GiB",
    force: bool = False,
    tokenizer: str | None = None,
    eval_data: str | None = None,
) -> Path:
    """Write releases/<name>.yaml after validating it; returns its path."""
    from schemas.loader import load_release

    name = name or folder.name.lower().replace("_", "-")
    target = root / "releases" / f"{name}.yaml"
    if target.exists() and not force:
        raise SpecError(
            str(target.relative_to(root)),
            [f"{target.relative_to(root)} exists; pass --force to replace it"],
        )
    spec = build_spec(root, folder, name, data, task, device_memory, tokenizer, eval_data)
    text = (
        f"# Written by `shipyard init {folder.relative_to(root).as_posix()}`; "
        "review the dims, data and budgets.\n"
        + commented(yaml.safe_dump(spec, sort_keys=False, width=100), spec)
    )
    target.parent.mkdir(exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_release(tmp, shown=str(target.relative_to(root)), final=target)  # the usual checks
    except SpecError:
        tmp.unlink()
        raise
    tmp.replace(target)
    return target


def past_problem(release: ReleaseSpec, root: Path, spec: Path, shown: str) -> str | None:
    """A KV-cache release whose export.dims.past_sequence.max no plan could hold in
    `capacity.device_memory`: one sequence at the full context does not fit the KV budget
    even with no weights at all (a config claiming 10M positions wrote 9997952). The
    problem, naming the spec's line and the largest past that does fit; None when it fits
    or cannot be judged (no config.json, no past)."""
    from stages.onnx.model import arch
    from stages.plan import compute

    dims = release.export.dims
    if not TASKS[release.task].kv_cache or "past_sequence" not in dims:
        return None
    path = root / release.model.path / "config.json" if release.model.kind == "hf" else None
    if path is None or not path.is_file():
        return None
    try:
        config = read_config(path)
        model = Arch(**arch(config))
    except (SpecError, ValueError, TypeError, ZeroDivisionError):
        return None  # init's and export's own checks name what is wrong with it

    def holds(past: int) -> bool:
        sized = {k: DimSizes(**v.model_dump()) for k, v in dims.items()}
        sized["past_sequence"] = DimSizes(min=0, opt=min(16, past), max=past)
        cap = release.capacity.model_copy(update={"max_batch": None, "max_context": None})
        plan = compute(cap,
                       _Shape(sized, model), release.task, 0)  # fmt: skip
        return plan.max_batch_that_fits > 0

    past = dims["past_sequence"].max
    if holds(past):
        return None
    low, high = 0, past  # holds(low) is not known: find the largest that holds, or 0
    while low < high:
        mid = (low + high + 1) // 2
        if holds(mid):
            low = mid
        else:
            high = mid - 1
    text = spec.read_text(encoding="utf-8") if spec.is_file() else ""
    line = next((i for i, t in enumerate(text.splitlines(), 1) if "past_sequence" in t), 0)
    fix = (
        f"lower it to {low} (the most whose one sequence fits), or give capacity.device_memory "
        "the device's real memory"
        if low
        else "the device holds no sequence of this model: give capacity.device_memory the "
        "device's real memory"
    )
    return (
        f"{shown}:{line}: export.dims.past_sequence.max: {past}: one sequence at the full "
        f"context needs more KV cache (held 3x for a step) than "
        f"{release.capacity.headroom:g} x capacity.device_memory leaves; {fix}"
    )
