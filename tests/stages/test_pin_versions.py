from __future__ import annotations

import hashlib
import json

import pytest

from schemas import SpecError
from schemas.details import PinDetails
from tests.conftest import TINY, Workspace, gpt2_spec

DIGEST = hashlib.sha256((TINY / "model.safetensors").read_bytes()).hexdigest()


def test_pin_records_versions_and_checkpoint_digests(ws: Workspace) -> None:
    report = ws.run("pin", gpt2_spec())
    assert report.status.value == "passed"
    lock = json.loads((ws.out("tiny-gpt2", "pin") / "lock.json").read_text())
    assert lock["checkpoints"]["model.safetensors"] == DIGEST
    assert lock["packages"]["torch"].startswith("2.13.0")
    details = PinDetails.model_validate(report.details)  # the pins and the repository's state
    assert details.git.commit and "git" not in lock  # provenance stays out of deps


def test_pin_checkpoint_mismatch_shows_expected_and_found(ws: Workspace) -> None:
    wrong = "0" * 64
    report = ws.run("pin", gpt2_spec(pins={"checkpoints": {"model.safetensors": wrong}}))
    assert report.status.value == "failed"
    assert report.reasons[:-1] == [
        f"pins.checkpoints.model.safetensors: expected {wrong}, found {DIGEST}"
    ]
    assert report.reasons[-1].startswith("what the failed run wrote is kept in build/")


def test_pin_unpinned_weight_file_fails_when_checkpoints_are_pinned(ws: Workspace) -> None:
    (ws.root / "models/tiny-gpt2/extra.safetensors").write_bytes(b"x")
    report = ws.run("pin", gpt2_spec(pins={"checkpoints": {"model.safetensors": DIGEST}}))
    assert report.status.value == "failed"
    assert "weight file extra.safetensors is not pinned" in report.reasons[0]


def test_pin_package_specifier_mismatch_and_missing_package(ws: Workspace) -> None:
    spec = gpt2_spec(pins={"packages": {"torch": ">=3", "no-such-package": "==1"}})
    report = ws.run("pin", spec)
    assert report.reasons[:-1] == [
        "pins.packages.no-such-package: expected ==1, found not installed",
        "pins.packages.torch: expected >=3, found 2.13.0+cpu",
    ]
    assert "failed/pin/" in report.reasons[-1]  # the failed run's files, kept as evidence


def test_pin_invalid_specifier_is_refused_at_validate(ws: Workspace) -> None:
    with pytest.raises(SpecError, match="pins.python: 'three' is not a PEP 440"):
        ws.spec(gpt2_spec(pins={"python": "three"}))


def test_pin_missing_checkpoint_folder_fails_naming_it(ws: Workspace) -> None:
    report = ws.run("pin", gpt2_spec(model={"kind": "hf", "path": "models/gone"}))
    assert report.status.value == "failed"
    assert report.reasons[0].startswith("model checkpoint models/gone does not exist")


def test_lock_json_hashes_every_file_a_later_stage_may_read(ws: Workspace) -> None:
    """export, evalcheck, parity and evaluate depend on lock.json instead of the model folder
    (dvc.yaml), so every file in it counts: a tokenizer edit, a file added in a subfolder.
    A version control store inside the folder does not (DVC skips it too)."""
    lock_path = ws.out("tiny-gpt2", "pin") / "lock.json"

    def files() -> dict[str, str]:
        assert ws.run("pin", gpt2_spec()).status.value == "passed"
        return dict(json.loads(lock_path.read_text())["files"])

    before = files()
    on_disk = sorted(
        p.relative_to(ws.root).as_posix()
        for p in (ws.root / "models" / "tiny-gpt2").rglob("*")
        if p.is_file()
    )
    assert sorted(before) == on_disk and "models/tiny-gpt2/model.safetensors" in before
    assert before["models/tiny-gpt2/model.safetensors"] == DIGEST
    tokenizer = next(n for n in before if "tokenizer" in n or n.endswith("vocab.json"))
    (ws.root / tokenizer).write_bytes((ws.root / tokenizer).read_bytes() + b" ")
    nested = ws.root / "models" / "tiny-gpt2" / "extra" / "chat_template.jinja"
    nested.parent.mkdir()
    nested.write_text("{{ messages }}")
    git = ws.root / "models" / "tiny-gpt2" / ".git" / "objects" / "blob"
    git.parent.mkdir(parents=True)
    git.write_bytes(b"an LFS copy of the weights")
    after = files()
    assert after[tokenizer] != before[tokenizer]
    assert "models/tiny-gpt2/extra/chat_template.jinja" in after
    assert not [n for n in after if "/.git/" in n]
    assert {n: d for n, d in after.items() if n != tokenizer and "extra/" not in n} == {
        n: d for n, d in before.items() if n != tokenizer
    }
