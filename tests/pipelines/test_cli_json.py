"""`--json` where a command reports (issue 44 item 4): status, history, gate and verify
print one JSON document holding what their lines say; `--verbose` is taken after the
command as well as before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.registry import Registry
from tests.conftest import Workspace, gpt2_spec
from tests.pipelines.test_gate_units import RELEASE, all_passed, report
from tests.pipelines.test_registry_units import make_bundle


def test_status_and_history_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "registry")
    registry = Registry(url)
    registry.publish(make_bundle(tmp_path / "b"), "demo", "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    assert main(["status", "--json", "--registry", url]) == 0
    [channel] = json.loads(capsys.readouterr().out)
    assert (channel["release"], channel["channel"], channel["version"]) == (
        "demo", "production", "1.0.0",
    )  # fmt: skip
    assert main(["history", "--registry", url, "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert (entry["action"], entry["to"], entry["reason"]) == ("promote", "demo@1.0.0", "first")
    # the lines for people are unchanged
    assert main(["status", "--registry", url]) == 0
    assert "demo" in capsys.readouterr().out


def test_gate_as_json_keeps_its_exit_code(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHIPYARD_ROOT", str(ws.root))
    ws.write(gpt2_spec())
    all_passed(ws)
    report(ws, "loadtest", "failed", reasons=["p95 over"])
    registry = ["--registry", str(ws.root / "registry")]
    assert main(["gate", RELEASE, *registry, "--json"]) == 4
    out, err = capsys.readouterr()
    data = json.loads(out)  # nothing but the document on stdout
    assert data["ok"] is False and data["base"] is None
    row = next(r for r in data["rows"] if r["check"] == "loadtest")
    assert (row["verdict"], row["detail"], row["release"]) == ("FAIL", "p95 over", RELEASE)
    assert "gate failed" in err


def test_verify_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = make_bundle(tmp_path / "b")
    assert main(["verify", str(bundle), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bundle"] == str(bundle) and len(data["digest"]) == 64
    assert data["signed_by"] is None
    (bundle / "model.onnx").chmod(0o644)
    (bundle / "model.onnx").write_bytes(b"tampered")
    assert main(["verify", str(bundle), "--json"]) == 5  # refused as before, no document
    out, err = capsys.readouterr()
    assert out == "" and "does not match its manifest" in err


def test_verbose_is_taken_after_the_command_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nothing")
    assert main(["verify", missing, "--verbose"]) == 5
    err = capsys.readouterr().err
    assert "Traceback" in err and "no such bundle folder" in err  # the traceback was asked for
    assert main(["verify", missing]) == 5
    assert "Traceback" not in capsys.readouterr().err
    assert main(["registry", "check", "--verbose", "--registry", str(tmp_path / "r")]) == 0


def test_help_lists_the_exit_codes_each_error_class_uses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from schemas import GateError, RegistryError, SpecError, StageError
    from schemas.errors import EXIT_CODES

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for cls in (SpecError, StageError, GateError, RegistryError):
        assert f"  {cls.exit_code}  {EXIT_CODES[cls.exit_code]}" in text
    assert len(set(EXIT_CODES)) == 6
