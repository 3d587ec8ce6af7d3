"""Calibration data: read, check and turn into graph feeds. Never random, never silent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import Refused
from schemas.tasks import TASKS
from stages.bundling.hashing import hash_range
from stages.onnx import shapes as sh

if TYPE_CHECKING:
    from schemas.spec.evaluation import EvalData
    from schemas.spec.export import DimRange
    from schemas.spec.quantization import CalibrationData

    # a data file named in the spec: quantization.calibration or evaluation.dataset
    DataFile = CalibrationData | EvalData


@dataclass(frozen=True)
class Samples:
    """Feeds for the calibration and the held-out samples, and where they came from."""

    calibration: list[dict[str, np.ndarray]]
    holdout: list[dict[str, np.ndarray]]
    sha256: str
    source: str


def load(
    root: Path,
    cfg: CalibrationData,
    task: str,
    lay: sh.Layout,
    dims: dict[str, DimRange],
    vocab: int,
) -> Samples:
    """Read cfg.path, check every sample, split into calibration and hold-out feeds."""
    path = root / cfg.path
    limit = cfg.max_length or (dims["sequence"].max if "sequence" in dims else None)
    rows = read_rows(root, cfg, lay, limit, vocab, "quantization.calibration")
    need = cfg.samples + cfg.holdout
    if len(rows) < need:
        raise Refused(
            f"quantization.calibration.path {cfg.path} has {len(rows)} "
            f"sample(s); samples + holdout need {need}",
            "add real samples, or lower calibration.samples / holdout",
        )
    feeds = [to_feeds(task, lay, row) for row in rows[:need]]
    return Samples(feeds[: cfg.samples], feeds[cfg.samples :], hash_range(path), cfg.path)


def read_rows(
    root: Path, cfg: DataFile, lay: sh.Layout, limit: int | None, vocab: int, section: str
) -> list[dict[str, np.ndarray]]:
    """Every sample of cfg.path (JSONL texts via cfg.tokenizer, or NPZ arrays), checked.

    `section` is the spec section the file was named in, for error messages.
    """
    path = root / cfg.path
    if not path.is_file():
        raise Refused(
            f"{section}.path {cfg.path} does not exist",
            "commit the data file; Shipyard never substitutes random data",
        )
    if path.suffix == ".jsonl":
        return _token_rows(root, cfg, path, limit, vocab, section)
    return _npz_rows(cfg, path, lay, limit, vocab)


def _token_rows(
    root: Path, cfg: DataFile, path: Path, limit: int | None, vocab: int, section: str
) -> list[dict[str, np.ndarray]]:
    from tokenizers import Tokenizer

    if cfg.tokenizer is None:  # the spec requires it for calibration, not (yet) for evaluation
        raise Refused(
            f"{section}.tokenizer is not set: {section}.path {cfg.path} is JSONL text, "
            "which only the model's tokenizer turns into token ids",
            f"set {section}.tokenizer to the folder with the model's tokenizer.json",
        )
    tok_file = root / cfg.tokenizer / "tokenizer.json"
    if not tok_file.is_file():
        raise Refused(
            f"{section}.tokenizer: no tokenizer.json in {cfg.tokenizer}",
            "point it at the model's tokenizer folder",
        )
    tokenizer = Tokenizer.from_file(str(tok_file))
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        ids = np.array(tokenizer.encode(_text(cfg, number, line)).ids, dtype=np.int64)
        _check_tokens(f"{cfg.path}:{number}", ids, limit, vocab)
        rows.append({"input_ids": ids[None, :]})
    if not rows:
        raise Refused(
            f"{section}.path {cfg.path} is empty",
            "add real samples of the deployment's inputs",
        )
    return rows


def _check_tokens(where: str, ids: np.ndarray, limit: int | None, vocab: int) -> None:
    if ids.size == 0:
        raise Refused(f"{where}: the sample has no tokens", "remove it")
    if limit and ids.size > limit:
        raise Refused(
            f"{where}: {ids.size} tokens, longer than the limit {limit} "
            "(calibration.max_length / export.dims.sequence.max)",
            "split the sample; samples are never truncated silently",
        )
    if vocab and (ids.min() < 0 or ids.max() >= vocab):  # vocab 0: unknown (python model)
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise Refused(
            f"{where}: token id {bad} is outside the model's vocabulary of {vocab}",
            "use the tokenizer the model was trained with",
        )


def _text(cfg: DataFile, number: int, line: str) -> str:
    try:
        value = json.loads(line)[cfg.text_field]
    except (ValueError, KeyError, TypeError):
        raise Refused(
            f"{cfg.path}:{number}: not a JSON object with a {cfg.text_field!r} string",
            'one {"text": ...} object per line',
        ) from None
    if not isinstance(value, str):
        raise Refused(f"{cfg.path}:{number}: {cfg.text_field!r} is not a string")
    return value


def _npz_rows(
    cfg: DataFile, path: Path, lay: sh.Layout, limit: int | None, vocab: int
) -> list[dict[str, np.ndarray]]:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    wanted = [
        t.name
        for t in lay.inputs
        if not t.name.startswith("past_key_values")
        and t.name not in ("attention_mask", sh.POSITIONS)
    ]
    missing = [n for n in wanted if n not in arrays]
    if missing:
        raise Refused(
            f"{cfg.path}: no array for input(s) {missing}; found {sorted(arrays)}",
            "save one array per graph input, samples first",
        )
    counts = {len(arrays[n]) for n in wanted}
    if len(counts) != 1 or 0 in counts:
        raise Refused(
            f"{cfg.path}: arrays hold different or zero sample counts {sorted(counts)}",
            "every array's first axis counts the same samples",
        )
    rows = [{n: arrays[n][i : i + 1] for n in wanted} for i in range(counts.pop())]
    for i, row in enumerate(rows):
        if "input_ids" in row:
            _check_tokens(f"{cfg.path}: sample {i}", row["input_ids"][0], limit, vocab)
    return rows


def to_feeds(task: str, lay: sh.Layout, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Complete a sample to the graph's inputs: masks of ones, an empty KV cache."""
    if not TASKS[task].outputs:  # the spec declares the graph's inputs: rows carry them all
        return dict(row)
    ids = row["input_ids"]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for t in lay.inputs:
        if t.name == "token_type_ids":  # one segment
            feeds[t.name] = np.zeros_like(ids)
        elif t.name == sh.POSITIONS:
            feeds[t.name] = sh.positions_from_mask(feeds["attention_mask"], ids.shape[1])
        elif t.name.startswith("past_key_values"):
            shape: list[Any] = [
                ids.shape[0] if a == "batch" else 0 if a == "past_sequence" else a for a in t.axes
            ]
            feeds[t.name] = np.zeros(shape, dtype=np.float32)
    return feeds
