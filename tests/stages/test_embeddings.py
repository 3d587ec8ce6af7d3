"""text-embedding exports the model's embedding: pooling and normalization inside the graph,
judged by the sentence-transformers library itself on real text (issue 13)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.details import Embedding, ExportDetails
from stages.onnx.pooling import MODES, pool
from tests.conftest import REPO, Workspace
from tests.fixtures import architectures as matrix

ST_MODE = {"mean": "mean", "cls": "cls", "max": "max", "last-token": "lasttoken"}
TEXTS = [
    json.loads(line)["text"]
    for line in (REPO / "data" / "eval" / "docstrings.jsonl").read_text().splitlines()[:6]
]


@pytest.mark.parametrize("mode", MODES)
def test_every_pooling_mode_equals_sentence_transformers(mode: str) -> None:
    import torch
    from sentence_transformers.models import Pooling

    torch.manual_seed(0)
    tokens = torch.randn(3, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 1 + [0] * 6])  # right padding
    theirs = Pooling(16, pooling_mode=ST_MODE[mode])(
        {"token_embeddings": tokens, "attention_mask": mask}
    )["sentence_embedding"]
    assert torch.allclose(pool(tokens, mask, mode), theirs, atol=1e-6)


def st_folder(root: Path, mode: str, normalize: bool) -> Path:
    """A sentence-transformers folder: a tiny BERT at the root, then Pooling (+ Normalize)."""
    folder = root / "models" / f"st-{mode}"
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "BERT" and a.task == "text-embedding")
    matrix.build_model(arch, folder)
    shutil.copy(REPO / "models" / "tiny-gpt2" / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>"})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{k}": False for k in ("mean_tokens", "cls_token", "max_tokens")}
    flags["pooling_mode_lasttoken"] = False
    key = {
        "mean": "mean_tokens",
        "cls": "cls_token",
        "max": "max_tokens",
        "last-token": "lasttoken",
    }
    flags[f"pooling_mode_{key[mode]}"] = True
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags})
    )
    if normalize:
        (folder / "2_Normalize").mkdir()
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("last-token", True)])
def test_a_sentence_transformers_folder_exports_the_embedding_the_library_computes(
    tmp_path: Path, mode: str, normalize: bool
) -> None:
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer

    (tmp_path / "repo").mkdir()
    ws = Workspace(tmp_path / "repo")
    folder = st_folder(ws.root, mode, normalize)
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "BERT" and a.task == "text-embedding")
    spec = matrix.spec_for(arch, "st")
    spec["model"]["path"] = str(folder.relative_to(ws.root))
    del spec["export"]["pooling"]  # the folder decides
    for stage in ("pin", "export", "evalcheck", "parity"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
        if stage == "export":
            embedding = ExportDetails.model_validate(report.details).embedding
            assert embedding == Embedding(
                pooling=mode, normalize=normalize, source="modules.json (sentence-transformers)"
            )
            assert report.details["embedding"]["from"] == embedding.source  # its JSON name
    library = SentenceTransformer(str(folder), device="cpu")
    want = library.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    batch = library.tokenize(TEXTS)  # padded to the longest text: pooling must ignore padding
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    session = ort.InferenceSession(str(ws.out("st", "export") / "model.onnx"))
    names = {i.name for i in session.get_inputs()}
    feeds = {k: v.numpy().astype(np.int64) for k, v in batch.items() if k in names}
    # this BPE tokenizer writes no segment ids; BERT then takes all zeros, as the library does
    feeds.setdefault("token_type_ids", np.zeros_like(feeds["input_ids"]))
    got = session.run(["sentence_embedding"], feeds)[0]
    assert got.shape == want.shape == (len(TEXTS), 64)
    assert np.allclose(got, want, atol=2e-5), np.abs(got - want).max()
    if normalize:
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_a_plain_encoder_without_a_pooling_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    ws = Workspace(tmp_path / "repo")
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "BERT" and a.task == "text-embedding")
    matrix.build_model(arch, ws.root / "models" / "plain")
    spec = matrix.spec_for(arch, "plain")
    del spec["export"]["pooling"]
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    assert "needs a pooling" in report.reasons[0]
    assert "set export.pooling to one of mean, cls, max, last-token" in report.reasons[0]


def test_the_spec_may_not_contradict_the_folder(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    ws = Workspace(tmp_path / "repo")
    folder = st_folder(ws.root, "mean", True)
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "BERT" and a.task == "text-embedding")
    spec = matrix.spec_for(arch, "st")
    spec["model"]["path"] = str(folder.relative_to(ws.root))
    spec["export"]["pooling"] = "cls"
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed" and "contradict" in report.reasons[0]


def test_pooling_is_refused_for_other_tasks(tmp_path: Path) -> None:
    from schemas import SpecError
    from schemas.loader import load_release

    (tmp_path / "repo").mkdir()
    ws = Workspace(tmp_path / "repo")
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "Llama")
    spec = matrix.spec_for(arch, "llama")
    spec["export"]["pooling"] = "mean"
    match = "export.pooling: pooling and export.normalize apply to task text-embedding only"
    with pytest.raises(SpecError, match=match):
        load_release(ws.write(spec))
