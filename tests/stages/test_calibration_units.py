"""Calibration data rules at their boundaries, calling the loader directly (issue 16: the
quantize-stage tests export tiny-gpt2 first, which mutation testing cannot afford per
mutant). The tokenizer is tiny-gpt2's real tokenizer.json; the files are real JSONL and NPZ;
the layouts are the ones the export writes for a causal LM and a generic model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas import StageError
from schemas.spec.evaluation import EvalData
from schemas.spec.export import DimRange
from schemas.spec.quantization import CalibrationData
from stages.bundling.hashing import hash_range
from stages.onnx.shapes import Layout, Tensor
from stages.quant import calibration
from tests.conftest import REPO

VOCAB = 512
LM = Layout(
    inputs=(
        Tensor("input_ids", "int64", ("batch", "sequence")),
        Tensor("attention_mask", "int64", ("batch", "total_sequence")),
        Tensor("past_key_values.0.key", "float32", ("batch", 2, "past_sequence", 8)),
    ),
    outputs=(Tensor("logits", "float32", ("batch", "sequence", VOCAB)),),
)
ENCODER = Layout(
    inputs=(
        Tensor("input_ids", "int64", ("batch", "sequence")),
        Tensor("attention_mask", "int64", ("batch", "sequence")),
        Tensor("token_type_ids", "int64", ("batch", "sequence")),
    ),
    outputs=(Tensor("embeddings", "float32", ("batch", 16)),),
)
GENERIC = Layout(
    inputs=(Tensor("x", "float32", ("batch", 4, 8)),),
    outputs=(Tensor("y", "float32", ("batch",)),),
)
DIMS = {"sequence": DimRange(min=1, opt=4, max=16)}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "tok").mkdir()
    shutil.copy(REPO / "models" / "tiny-gpt2" / "tokenizer.json", tmp_path / "tok")
    (tmp_path / "data").mkdir()
    return tmp_path


def cfg(path: str, **fields: Any) -> CalibrationData:
    fields.setdefault("samples", 3)
    fields.setdefault("holdout", 2)
    fields.setdefault("sensitivity_samples", 1)
    tokenizer = "tok" if path.endswith(".jsonl") else None
    return CalibrationData(path=path, tokenizer=tokenizer, **fields)


def texts(root: Path, lines: list[str]) -> str:
    (root / "data" / "c.jsonl").write_text("".join(f"{line}\n" for line in lines))
    return "data/c.jsonl"


def words(n: int) -> str:
    return json.dumps({"text": " ".join(["a"] * n)})  # " a" is one token: n tokens


def load(root: Path, c: CalibrationData, lay: Layout = LM, task: str = "causal-lm", **kw: Any):
    return calibration.load(root, c, task, lay, kw.get("dims", DIMS), VOCAB)


def error(message: str, fix: str = "") -> str:
    """How a refusal of the calibration reader reads: message, fix (the runner reports it
    as the failure of the stage that read the data)."""
    return message + (f"\n  fix: {fix}" if fix else "")


def refusal(root: Path, c: CalibrationData, **kw: Any) -> str:
    with pytest.raises(StageError) as exc:
        load(root, c, **kw)
    return str(exc.value)


def test_exactly_samples_plus_holdout_load_and_split(root: Path) -> None:
    path = texts(root, [words(i + 1) for i in range(5)])
    got = load(root, cfg(path))
    assert [f["input_ids"].shape for f in got.calibration] == [(1, 1), (1, 2), (1, 3)]
    assert [f["input_ids"].shape for f in got.holdout] == [(1, 4), (1, 5)]
    assert got.sha256 == hash_range(root / path) and got.source == path
    assert all(f["input_ids"].dtype == np.int64 for f in got.calibration + got.holdout)
    # one more line than needed: the extra is not used
    path = texts(root, [words(i + 1) for i in range(6)])
    assert [f["input_ids"].shape[1] for f in load(root, cfg(path)).holdout] == [4, 5]


def test_one_sample_short_names_both_counts(root: Path) -> None:
    path = texts(root, [words(2)] * 4)  # more than samples (3), less than 3 + 2
    assert refusal(root, cfg(path)) == error(
        "quantization.calibration.path data/c.jsonl has 4 sample(s); samples + holdout need 5",
        "add real samples, or lower calibration.samples / holdout",
    )


def test_blank_lines_are_skipped_not_counted(root: Path) -> None:
    path = texts(root, [words(2), "", "   ", words(2), words(2), words(2), words(2)])
    assert len(load(root, cfg(path)).calibration) == 3
    path = texts(root, ["", "  "])
    assert refusal(root, cfg(path)) == error(
        "quantization.calibration.path data/c.jsonl is empty",
        "add real samples of the deployment's inputs",
    )


def test_the_length_limit_is_max_length_else_the_sequence_max(root: Path) -> None:
    path = texts(root, [words(16)] * 5)
    assert len(load(root, cfg(path)).calibration) == 3  # exactly the sequence max
    path = texts(root, [words(16)] * 4 + [words(17)])
    reason = refusal(root, cfg(path))
    assert "data/c.jsonl:5: 17 tokens, longer than the limit 16" in reason
    path = texts(root, [words(8)] * 5)
    assert len(load(root, cfg(path, max_length=8)).calibration) == 3
    path = texts(root, [words(8)] * 4 + [words(9)])
    assert refusal(root, cfg(path, max_length=8)) == error(
        "data/c.jsonl:5: 9 tokens, longer than the limit 8 (calibration.max_length / "
        "export.dims.sequence.max)",
        "split the sample; samples are never truncated silently",
    )
    # no sequence dim and no max_length: no limit
    path = texts(root, [words(40)] * 5)
    assert len(load(root, cfg(path), dims={}).calibration) == 3


def test_every_line_problem_names_its_line(root: Path) -> None:
    shape = 'one {"text": ...} object per line'
    cases = {
        "not json": ("data/c.jsonl:2: not a JSON object with a 'text' string", shape),
        "[1, 2]": ("data/c.jsonl:2: not a JSON object with a 'text' string", shape),
        '{"body": "x"}': ("data/c.jsonl:2: not a JSON object with a 'text' string", shape),
        '{"text": 3}': ("data/c.jsonl:2: 'text' is not a string", ""),
        '{"text": ""}': ("data/c.jsonl:2: the sample has no tokens", "remove it"),
    }
    for line, (message, fix) in cases.items():
        path = texts(root, [words(2), line] + [words(2)] * 3)
        assert refusal(root, cfg(path)) == error(message, fix), line
    path = texts(root, [json.dumps({"body": "a b"})] * 5)
    assert len(load(root, cfg(path, text_field="body")).calibration) == 3


def test_missing_file_and_tokenizer_are_named(root: Path) -> None:
    assert refusal(root, cfg("data/none.jsonl")) == error(
        "quantization.calibration.path data/none.jsonl does not exist",
        "commit the data file; Shipyard never substitutes random data",
    )
    path = texts(root, [words(2)] * 5)
    (root / "tok" / "tokenizer.json").unlink()
    assert refusal(root, cfg(path)) == error(
        "quantization.calibration.tokenizer: no tokenizer.json in tok",
        "point it at the model's tokenizer folder",
    )


def test_a_jsonl_evaluation_set_without_tokenizer_is_refused_naming_its_section(
    root: Path,
) -> None:
    # the spec refuses it (EvalData's rule, as quantization.calibration's); the reader
    # refuses it by name too, instead of failing on `root / None` (a TypeError), for a
    # config that did not come through validation
    path = texts(root, [words(2)] * 5)
    with pytest.raises(ValueError, match="a JSONL evaluation set needs `tokenizer`"):
        EvalData(path=path)
    unchecked = EvalData.model_construct(path=path, tokenizer=None, text_field="text", samples=64)
    with pytest.raises(StageError) as exc:
        calibration.read_rows(root, unchecked, LM, 16, VOCAB, "evaluation.dataset")
    assert str(exc.value) == error(
        "evaluation.dataset.tokenizer is not set: evaluation.dataset.path data/c.jsonl is "
        "JSONL text, which only the model's tokenizer turns into token ids",
        "set evaluation.dataset.tokenizer to the folder with the model's tokenizer.json",
    )
    # with the tokenizer, the same file reads
    rows = calibration.read_rows(
        root, EvalData(path=path, tokenizer="tok"), LM, 16, VOCAB, "evaluation.dataset"
    )
    assert [r["input_ids"].shape for r in rows] == [(1, 2)] * 5


def test_token_ids_must_lie_inside_the_vocabulary(root: Path) -> None:
    ids = np.full((5, 4), VOCAB - 1, dtype=np.int64)  # the last valid id
    ids[0, 0] = 0  # and the first
    np.savez(root / "data" / "ids.npz", input_ids=ids)
    assert len(load(root, cfg("data/ids.npz")).calibration) == 3
    for bad in (VOCAB, -1):
        ids[3, 1] = bad
        np.savez(root / "data" / "ids.npz", input_ids=ids)
        assert refusal(root, cfg("data/ids.npz")) == error(
            f"data/ids.npz: sample 3: token id {bad} is outside the model's vocabulary of {VOCAB}",
            "use the tokenizer the model was trained with",
        )
    # vocabulary 0 (a python model): unknown, not checked
    got = calibration.load(root, cfg("data/ids.npz"), "causal-lm", LM, DIMS, 0)
    assert len(got.holdout) == 2
    # texts too: tiny-gpt2's tokenizer gives ids beyond a 10-token vocabulary
    path = texts(root, [words(2)] * 5)
    with pytest.raises(StageError, match="data/c.jsonl:1: token id .* vocabulary of 10"):
        calibration.load(root, cfg(path), "causal-lm", LM, DIMS, 10)


def test_npz_samples_obey_the_length_limit_too(root: Path) -> None:
    np.savez(root / "data" / "ids.npz", input_ids=np.ones((5, 16), dtype=np.int64))
    assert len(load(root, cfg("data/ids.npz")).calibration) == 3
    np.savez(root / "data" / "ids.npz", input_ids=np.ones((5, 17), dtype=np.int64))
    assert refusal(root, cfg("data/ids.npz")) == error(
        "data/ids.npz: sample 0: 17 tokens, longer than the limit 16 (calibration.max_length / "
        "export.dims.sequence.max)",
        "split the sample; samples are never truncated silently",
    )


def test_npz_arrays_must_cover_every_input_with_one_sample_count(root: Path) -> None:
    x = np.ones((5, 4, 8), dtype=np.float32)
    np.savez(root / "data" / "g.npz", x=x, extra=np.ones(2))
    got = load(root, cfg("data/g.npz"), GENERIC, "generic")
    assert [f["x"].shape for f in got.calibration] == [(1, 4, 8)] * 3
    assert set(got.calibration[0]) == {"x"}  # only the graph's inputs
    np.savez(root / "data" / "g.npz", y=x)
    assert refusal(root, cfg("data/g.npz"), lay=GENERIC, task="generic") == error(
        "data/g.npz: no array for input(s) ['x']; found ['y']",
        "save one array per graph input, samples first",
    )
    two = Layout(inputs=(*GENERIC.inputs, Tensor("z", "float32", ("batch",))), outputs=())
    np.savez(root / "data" / "g.npz", x=x, z=np.ones(4, dtype=np.float32))
    counts = "every array's first axis counts the same samples"
    assert refusal(root, cfg("data/g.npz"), lay=two, task="generic") == error(
        "data/g.npz: arrays hold different or zero sample counts [4, 5]", counts
    )
    np.savez(root / "data" / "g.npz", x=x[:0])
    assert refusal(root, cfg("data/g.npz"), lay=GENERIC, task="generic") == error(
        "data/g.npz: arrays hold different or zero sample counts [0]", counts
    )


def test_feeds_complete_the_graph_inputs(root: Path) -> None:
    ids = np.array([[5, 6, 7]])
    lm = calibration.to_feeds("causal-lm", LM, {"input_ids": ids})
    assert sorted(lm) == ["attention_mask", "input_ids", "past_key_values.0.key"]
    assert lm["attention_mask"].tolist() == [[1, 1, 1]]
    assert lm["past_key_values.0.key"].shape == (1, 2, 0, 8)
    assert lm["past_key_values.0.key"].dtype == np.float32
    enc = calibration.to_feeds("text-embedding", ENCODER, {"input_ids": ids})
    assert enc["token_type_ids"].tolist() == [[0, 0, 0]]
    assert enc["attention_mask"].tolist() == [[1, 1, 1]]
    row = {"x": np.ones((1, 4, 8))}
    assert calibration.to_feeds("generic", GENERIC, row) == row


def test_packed_windows_keep_every_per_token_input_with_its_tokens() -> None:
    """A BERT-family encoder takes token_type_ids beside input_ids: packing texts of
    different lengths into windows must pack it too (it kept the first text's, and a
    59-token type row beside a 63-token window crashed onnxruntime: `shipyard init`'s
    BERT specs failed quantize). An empty KV cache is shared as it is."""
    from stages.quant.methods import _packed

    def text(ids: list[int], kind: int) -> dict[str, np.ndarray]:
        n = len(ids)
        return {
            "input_ids": np.array([ids], np.int64),
            "token_type_ids": np.full((1, n), kind, np.int64),
            "attention_mask": np.ones((1, n), np.int64),
            "past_key_values.0.key": np.zeros((1, 2, 0, 4), np.float32),
        }

    samples = [text([1, 2, 3], 7), text([4, 5, 6, 7, 8], 8), text([9, 10], 9)]
    windows = _packed(samples)
    assert [w["input_ids"].tolist() for w in windows] == [[[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10]]]
    assert [w["token_type_ids"].tolist() for w in windows] == [[[7, 7, 7, 8, 8]], [[8, 8, 8, 9, 9]]]
    for w in windows:
        assert w["attention_mask"].tolist() == [[1] * 5]
        assert w["past_key_values.0.key"].shape == (1, 2, 0, 4)
