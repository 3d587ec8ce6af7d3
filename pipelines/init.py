"""`shipyard init MODEL_FOLDER`: a release spec derived from the model folder itself.

The task comes from the checkpoint (`config.architectures`, a sentence-transformers
`modules.json`), the dims from its positions, the pins from its files' digests, the budgets
and metrics from the task registry. The spec is validated exactly like a hand-written one
before it is written, and an existing spec is never overwritten without `--force`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from schemas import SpecError
from schemas.tasks import TASKS

# config.architectures suffix -> task
SUFFIXES = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
}
WEIGHTS = (".safetensors",)


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
    from stages.onnx.model import arch

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecError(
            str(folder), [f"{folder}: no config.json; init needs a Hugging Face folder"]
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    task = task or detect_task(folder, config)
    derivable = [n for n, t in TASKS.items() if t.outputs]  # generic: the spec declares I/O
    if task not in derivable:
        raise SpecError(
            str(folder), [f"--task {task!r}: init writes one of {', '.join(derivable)}"]
        )
    spec_task = TASKS[task]
    positions = arch(config)["positions"] or 512
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
    sequence = min(positions, 512)
    dims: dict[str, Any] = {"batch": {"min": 1, "opt": 1, "max": 8}}
    if spec_task.kv_cache:  # half the positions for the prompt, the rest for the past
        sequence = min(positions // 2, 2048)
        dims["past_sequence"] = {"min": 0, "opt": 16, "max": positions - sequence}
    dims["sequence"] = {"min": 1, "opt": min(16, sequence), "max": sequence}
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
    metric = spec_task.metrics[0]
    threshold: dict[str, Any] = (
        {"metric": "top1_agreement", "threshold": 0.97, "greater_is_better": True}
        if spec_task.language_model
        else {"metric": metric, "threshold": 0.98, "greater_is_better": True}
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
    return {
        "schema_version": 1,
        "name": name,
        "version": "0.1.0",
        "task": task,
        "model": {"kind": "hf", "path": rel},
        "pins": {"checkpoints": digests},  # hash_files returns them sorted
        "export": export,
        "parity": {},
        "quantization": {"method": "auto", "calibration": calibration},
        "evaluation": evaluation,
        "capacity": {"device_memory": device_memory},
        "bundle": {
            "model_card": {
                "description": f"{config.get('model_type', 'model')} from {rel}",
            }
        },
        "engine": {"required": False},
        "loadtest": {},
    }


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
        "review the dims, data and budgets.\n" + yaml.safe_dump(spec, sort_keys=False, width=100)
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
