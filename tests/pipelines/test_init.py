"""`shipyard init`: a valid spec from a model folder, through the CLI and its exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from schemas.loader import load_release
from tests.conftest import Workspace
from tests.fixtures import architectures as matrix

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))
DATA = "data/eval/docstrings.jsonl"


def shipyard(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHIPYARD_ROOT": str(ws.root)}
    return subprocess.run(
        [SHIPYARD, *args], cwd=ws.root, env=env, capture_output=True, text=True, timeout=300
    )


def arch(name: str, task: str) -> matrix.Arch:
    return next(a for a in matrix.ARCHITECTURES if a.name == name and a.task == task)


@pytest.mark.parametrize(
    "name,task",
    [("Llama", "causal-lm"), ("RoBERTa", "sequence-classification"), ("BERT", "text-embedding")],
)
def test_init_writes_a_spec_that_validates_and_exports(ws: Workspace, name: str, task: str) -> None:
    folder = ws.root / "models" / "my_model"
    matrix.build_model(arch(name, task), folder)
    (folder / "tokenizer.json").write_bytes(
        (ws.root / "models" / "tiny-gpt2" / "tokenizer.json").read_bytes()
    )
    done = shipyard(ws, "init", "models/my_model", "--data", DATA, "--device-memory", "1GiB")
    assert done.returncode == 0, done.stderr
    assert "wrote releases/my-model.yaml" in done.stdout
    # what init chose: a generative model's engine rows, a one-pass model's batch
    chose = "16 engine rows x " if task == "causal-lm" else "batch "
    assert f"Sized for capacity.device_memory 1GiB: {chose}" in done.stdout
    path = ws.root / "releases" / "my-model.yaml"
    spec = load_release(path)
    assert spec.task == task  # detected from config.architectures (a bare encoder: embedding)
    assert spec.model.path == "models/my_model"
    assert set(spec.pins.checkpoints) == {"config.json", "model.safetensors"}
    assert spec.export.dims["sequence"].max <= 256  # within the model's positions
    if task == "causal-lm":
        assert spec.export.dims["sequence"].max + spec.export.dims["past_sequence"].max == 256
    # one accuracy contract: the task's budget written out and explained, and no threshold
    # of evaluate's own (only a regression gate against production)
    from schemas.contract import judged_by_evaluate
    from schemas.tasks import TASKS

    assert spec.quantization.budget is not None
    assert spec.quantization.budget.model_dump(exclude_none=True) == TASKS[task].default_budget
    assert not [t for t in spec.evaluation.thresholds if judged_by_evaluate(t)]
    text = path.read_text().splitlines()
    at = text.index("  budget:")
    assert text[at - 1].startswith("  # ") and "accuracy contract" in "\n".join(text[at - 16 : at])
    # a family onnxruntime-genai's builder writes: the fused INT4 graph tried first, said why
    fused = getattr(spec.quantization, "recipes", [None])[0] == "int4-weight-only-fused"
    assert fused == (name == "Llama")
    if fused:
        at = text.index("  recipes:")
        assert "onnxruntime-genai" in "\n".join(text[at - 4 : at])
    data = yaml.safe_load(path.read_text())
    data["export"]["dims"] = {k: v for k, v in data["export"]["dims"].items()}
    data["export"]["dims"]["sequence"]["max"] = 64  # quick: the data's texts fit in 64
    if "past_sequence" in data["export"]["dims"]:
        data["export"]["dims"]["past_sequence"]["max"] = 32
    data["loadtest"] = {"ramp": {"input_length": 8, "output_tokens": 4}}
    data["evaluation"]["decode"] = (
        {"prompts": 2, "prompt_tokens": 4, "tokens": 4} if (task == "causal-lm") else None
    )
    if data["evaluation"]["decode"] is None:
        del data["evaluation"]["decode"]
    for stage in ("pin", "export"):
        report = ws.run(stage, data)
        assert report.status.value == "passed", (stage, report.reasons)


def test_init_refuses_to_overwrite_and_names_the_fix(ws: Workspace) -> None:
    folder = ws.root / "models" / "llama"
    matrix.build_model(arch("Llama", "causal-lm"), folder)
    no_tokenizer = shipyard(ws, "init", "models/llama", "--data", DATA)
    assert no_tokenizer.returncode != 0 and "pass --tokenizer FOLDER" in no_tokenizer.stderr
    (folder / "tokenizer.json").write_bytes(
        (ws.root / "models" / "tiny-gpt2" / "tokenizer.json").read_bytes()
    )
    assert shipyard(ws, "init", "models/llama", "--data", DATA).returncode == 0
    before = (ws.root / "releases" / "llama.yaml").read_text()
    again = shipyard(ws, "init", "models/llama", "--data", DATA, "--device-memory", "2GiB")
    assert again.returncode != 0 and "pass --force to replace it" in again.stderr
    assert "Traceback" not in again.stderr
    assert (ws.root / "releases" / "llama.yaml").read_text() == before  # nothing lost
    forced = shipyard(
        ws, "init", "models/llama", "--data", DATA, "--force", "--device-memory", "2GiB"
    )
    assert forced.returncode == 0
    assert load_release(ws.root / "releases" / "llama.yaml").capacity.device_memory == 2 << 30


def test_init_refuses_bad_input_without_writing_anything(ws: Workspace) -> None:
    (ws.root / "models" / "empty").mkdir()
    no_config = shipyard(ws, "init", "models/empty", "--data", DATA)
    assert no_config.returncode != 0 and "no config.json" in no_config.stderr
    folder = ws.root / "models" / "llama"
    matrix.build_model(arch("Llama", "causal-lm"), folder)
    tok = ("--tokenizer", "models/tiny-gpt2")
    missing_data = shipyard(ws, "init", "models/llama", "--data", "data/nope.jsonl", *tok)
    assert missing_data.returncode != 0 and "data/nope.jsonl" in missing_data.stderr
    bad_task = shipyard(ws, "init", "models/llama", "--data", DATA, "--task", "generic", *tok)
    assert bad_task.returncode != 0 and "init writes one of" in bad_task.stderr
    assert not list((ws.root / "releases").glob("*.yaml"))
    assert not list((ws.root / "releases").glob(".*"))  # no temp file left behind


def test_init_sizes_calibration_from_the_data_it_is_given(ws: Workspace) -> None:
    folder = ws.root / "models" / "llama"
    matrix.build_model(arch("Llama", "causal-lm"), folder)
    tok = ("--tokenizer", "models/tiny-gpt2")
    done = shipyard(ws, "init", "models/llama", "--data", DATA, *tok)  # 64 texts
    assert done.returncode == 0, done.stderr
    cal = load_release(ws.root / "releases" / "llama.yaml").quantization.calibration
    assert (cal.samples, cal.holdout, cal.sensitivity_samples) == (48, 16, 16)
    big = "data/calibration/docstrings.jsonl"  # 480 texts: the caps hold
    done = shipyard(ws, "init", "models/llama", "--data", big, *tok, "--force")
    cal = load_release(ws.root / "releases" / "llama.yaml").quantization.calibration
    assert (cal.samples, cal.holdout) == (128, 64)
    (ws.root / "data" / "one.jsonl").write_text('{"text": "only one"}\n\n')
    one = shipyard(ws, "init", "models/llama", "--data", "data/one.jsonl", *tok, "--force")
    assert one.returncode != 0 and "has 1 sample(s)" in one.stderr, one.stderr
    assert "Traceback" not in one.stderr
    (ws.root / "data" / "two.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    two = shipyard(ws, "init", "models/llama", "--data", "data/two.jsonl", *tok, "--force")
    assert two.returncode == 0, two.stderr
    cal = load_release(ws.root / "releases" / "llama.yaml").quantization.calibration
    assert (cal.samples, cal.holdout, cal.sensitivity_samples) == (1, 1, 1)


def test_init_warns_when_evaluation_reads_the_calibration_file_and_takes_a_file_of_its_own(
    ws: Workspace,
) -> None:
    folder = ws.root / "models" / "llama"
    matrix.build_model(arch("Llama", "causal-lm"), folder)
    tok = ("--tokenizer", "models/tiny-gpt2")
    big = "data/calibration/docstrings.jsonl"
    same = shipyard(ws, "init", "models/llama", "--data", big, *tok)
    assert same.returncode == 0, same.stderr
    assert "warning: evaluation.dataset.path and quantization.calibration.path are both" in (
        same.stderr
    )
    assert "--eval-data" in same.stderr
    checked = shipyard(ws, "validate", "releases/llama.yaml")  # a hand-kept spec: the same
    assert checked.returncode == 0 and "warning: evaluation.dataset.path" in checked.stderr
    apart = shipyard(
        ws, "init", "models/llama", "--data", big, "--eval-data", DATA, *tok, "--force"
    )
    assert apart.returncode == 0 and "warning" not in apart.stderr, apart.stderr
    spec = load_release(ws.root / "releases" / "llama.yaml")
    assert spec.evaluation.dataset.path == DATA and spec.evaluation.dataset.samples == 64
    assert spec.quantization.calibration.path == big
    missing = shipyard(ws, "init", "models/llama", "--data", big, "--eval-data", "data/nope.jsonl",
                       *tok, "--force")  # fmt: skip
    assert missing.returncode != 0 and "--eval-data data/nope.jsonl: no such file" in missing.stderr


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"model_type": "llama", "hidden_size": "576"}', 'hidden_size is "576"'),
        ('{"hidden_size": [576]}', "hidden_size is [576]"),
        ('{"max_position_embeddings": Infinity}', "max_position_embeddings is Infinity"),
        ('{"max_position_embeddings": 1e400}', "max_position_embeddings is Infinity"),
        ('{"num_hidden_layers": 2.5}', "num_hidden_layers is 2.5"),
        ('{"vocab_size": -1}', "vocab_size is -1"),
        ("[1, 2]", "a list, not a mapping of settings"),
        ("{not json", "not a JSON document"),
    ],
)
def test_init_refuses_a_malformed_config_by_field_without_a_traceback(
    ws: Workspace, config: str, message: str
) -> None:
    """Issue 42 item 11: five malformed config.json shapes gave tracebacks."""
    folder = ws.root / "models" / "bad"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    done = shipyard(ws, "init", "models/bad", "--data", DATA)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "config.json" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (ws.root / "releases" / "bad.yaml").exists()
