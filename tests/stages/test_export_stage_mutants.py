"""The export stage itself (stages/export.py) at unit level: what model_info.json says of
the graph, when the weights go to a side file, the context checks against the model's
positions, the model files an HF folder ships, and the accepted range of an integer input.
Fast enough to run per mutant (scripts/mutation.py); tiny-gpt2's export is in
test_export_onnx.py (a whole release)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas import StageError
from schemas.details import ExportDetails, TiedWeight
from stages import export
from stages.onnx import model as m
from stages.onnx import shapes as sh
from tests.conftest import REPO, Workspace, generic_spec, gpt2_spec


def test_model_info_describes_the_exported_graph(
    ws: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = generic_spec("small", "small")
    ws.run("pin", spec)
    capsys.readouterr()
    report = ws.run("export", spec)
    assert report.status.value == "passed", report.reasons
    assert "exporting with the legacy exporter at {'batch': 2}" in capsys.readouterr().err
    out = ws.out("small", "export")
    assert json.loads((out / "model_info.json").read_text()) == {
        "arch": {
            "head_dim": 0,
            "heads": 0,
            "hidden": 0,
            "kv_heads": 0,
            "labels": 2,
            "layers": 0,
            "positions": 0,
            "vocab": 0,
        },
        "dims": {"batch": {"max": 4, "min": 1, "opt": 2}},
        "dtype": "float32",
        "exporter": "legacy",
        "external_data": False,
        "inputs": [{"axes": ["batch", 4, 8], "dtype": "float32", "name": "x"}],
        "opset": 18,
        "outputs": [{"axes": ["batch"], "dtype": "float32", "name": "y"}],
        "parameters": 8 * 16 + 16 + 16 * 4 + 4,
        "task": "generic",
        "weight_bytes": (8 * 16 + 16 + 16 * 4 + 4) * 4,
    }
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model_info.json", "report.json"]
    assert ExportDetails.model_validate(report.details).model_files == []
    assert "tied_weights" not in report.details and "embedding" not in report.details  # unset


@pytest.mark.parametrize(
    ("setting", "limit", "external"),
    [
        ("auto", export.TWO_GB, False),
        ("auto", 847, True),
        ("auto", 848, False),
        ("never", 0, False),
    ],
)
def test_the_weights_go_to_a_side_file_when_asked_or_over_the_limit(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, setting: str, limit: int, external: bool
) -> None:
    """848 bytes of weights: over a limit of 847, not over 848."""
    monkeypatch.setattr(export, "TWO_GB", limit)
    spec = generic_spec("small", "small")
    spec["export"]["external_data"] = setting
    ws.run("pin", spec)
    assert ws.run("export", spec).status.value == "passed"
    out = ws.out("small", "export")
    assert json.loads((out / "model_info.json").read_text())["external_data"] is external
    assert (out / "model.onnx.data").is_file() is external


def gpt2(ws: Workspace, **dims: dict[str, int]) -> tuple[object, dict[str, object]]:
    spec = gpt2_spec()
    spec["export"]["dims"].update(dims)
    release = ws.spec(spec)
    return release, m.model_config(release.model, ws.root)


def test_the_cache_and_the_new_tokens_must_fit_the_models_positions(ws: Workspace) -> None:
    """tiny-gpt2 has 256 positions: past_sequence.max + sequence.max may be 256."""
    release, config = gpt2(
        ws, sequence={"min": 1, "opt": 4, "max": 56}, past_sequence={"min": 0, "opt": 8, "max": 200}
    )
    export._check_context(release, config)
    release, config = gpt2(
        ws, sequence={"min": 1, "opt": 4, "max": 57}, past_sequence={"min": 0, "opt": 8, "max": 200}
    )
    with pytest.raises(StageError) as info:
        export._check_context(release, config)
    assert info.value.stage == "export"
    assert info.value.message == (
        "export.dims: past_sequence.max + sequence.max = 257 exceeds the model's 256 positions"
    )
    assert info.value.hint == "lower export.dims.past_sequence.max or sequence.max"


def test_a_sequence_longer_than_the_positions_is_refused(ws: Workspace) -> None:
    """A task without a KV cache (the release stubbed: only its task and dims are read)."""
    config = m.model_config(ws.spec(gpt2_spec()).model, ws.root)
    fake = SimpleNamespace(
        task="sequence-classification",
        export=SimpleNamespace(dims={"sequence": SimpleNamespace(max=256)}),
    )
    export._check_context(fake, config)
    fake.export.dims["sequence"].max = 257
    with pytest.raises(StageError) as info:
        export._check_context(fake, config)
    assert info.value.stage == "export"
    assert info.value.message == (
        "export.dims: sequence.max = 257 exceeds the model's 256 positions"
    )
    assert info.value.hint == "lower export.dims.sequence.max"
    # a model without positions (a python model) or without a sequence dim: nothing to check
    export._check_context(fake, {})
    fake.export.dims = {"batch": SimpleNamespace(max=10**6)}
    export._check_context(fake, config)


def test_a_causal_lm_without_a_cache_checks_its_sequence_alone(ws: Workspace) -> None:
    config = m.model_config(ws.spec(gpt2_spec()).model, ws.root)
    fake = SimpleNamespace(
        task="causal-lm",
        export=SimpleNamespace(dims={"sequence": SimpleNamespace(max=257)}),
    )
    with pytest.raises(StageError, match=r"sequence.max = 257 exceeds the model's 256"):
        export._check_context(fake, config)


def test_an_hf_folders_config_and_tokenizer_files_ship_with_the_graph(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "x"
    folder.mkdir(parents=True)
    for name in ("vocab.txt", "config.json", "weights.safetensors", "tokenizer.json"):
        (folder / name).write_text(name)
    (folder / "merges.txt").mkdir()  # a folder is no file
    work = tmp_path / "work"
    work.mkdir()
    ctx = SimpleNamespace(root=tmp_path, work=work)
    hf = SimpleNamespace(model=SimpleNamespace(kind="hf", path="models/x"))
    assert export._model_files(ctx, hf) == ["config.json", "tokenizer.json", "vocab.txt"]  # type: ignore[arg-type]
    shipped = work / "model_files"
    assert sorted(p.name for p in shipped.iterdir()) == [
        "config.json",
        "tokenizer.json",
        "vocab.txt",
    ]
    assert (shipped / "vocab.txt").read_text() == "vocab.txt"
    other = tmp_path / "other"
    other.mkdir()
    python = SimpleNamespace(model=SimpleNamespace(kind="python", path="models/x"))
    assert export._model_files(SimpleNamespace(root=tmp_path, work=other), python) == []  # type: ignore[arg-type]
    assert list(other.iterdir()) == []


def test_an_integer_input_keeps_the_values_it_accepts() -> None:
    ids = export._tensor(sh.Tensor("input_ids", "int64", ("batch", "sequence"), 0, 512))
    assert (ids.name, ids.dtype, ids.axes, ids.low, ids.high) == (
        "input_ids",
        "int64",
        ["batch", "sequence"],
        0,
        512,
    )
    mask = export._tensor(sh.Tensor("attention_mask", "int64", ("batch", "total_sequence")))
    assert (mask.low, mask.high) == (0, 2)
    x = export._tensor(sh.Tensor("x", "float32", ("batch", 4), -5, 5))
    assert (x.low, x.high, x.axes) == (None, None, ["batch", 4])


def test_export_depends_on_the_pinned_environment_and_the_model() -> None:
    from schemas.artifacts import VersionLock
    from schemas.loader import load_release

    io = export.io(load_release(REPO / "releases" / "tiny-gpt2.yaml"))
    assert io.params == ("model", "task", "export")
    assert io.reads == (VersionLock,) and io.reads_model is True


TIED = """
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight.T)  # the exporter stores both

    def forward(self, x):
        return self.b(self.a(x))


def tied():
    return Tied()
"""


def test_a_tied_weight_is_stored_once_and_the_report_says_which(ws: Workspace) -> None:
    (ws.root / "tiedtrap.py").write_text(TIED)
    spec = generic_spec("tied", "tied")
    spec["model"] = {"kind": "python", "entrypoint": "tiedtrap:tied", "source": "tiedtrap.py"}
    spec["export"]["inputs"] = [{"name": "x", "shape": ["batch", 32]}]
    spec["export"]["outputs"] = [{"name": "y", "shape": ["batch", 32]}]
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "passed", report.reasons
    # legacy export stores Linear weights transposed, as MatMul inputs: one is the other's
    assert ExportDetails.model_validate(report.details).tied_weights == [
        TiedWeight(dropped="onnx::MatMul_8", kept="onnx::MatMul_7", how="transpose")
    ]


def test_a_failed_export_keeps_its_probes_in_the_report(ws: Workspace) -> None:
    spec = generic_spec("baked", "baked_batch")
    ws.run("pin", spec)
    report = ws.run("export", spec)
    assert report.status.value == "failed"
    details = ExportDetails.model_validate(report.details)
    assert details.trace_sizes == {"batch": 2}
    assert len(details.probed) == 6 and not all(r.ok for r in details.probed)
    assert details.model_files == []
