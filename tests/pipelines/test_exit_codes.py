"""One class of mistake, one exit code, whatever the command (issue 44 item 4). The table is
schemas/errors.py's EXIT_CODES, which `shipyard --help` prints: 2 a release spec, a flag or
an argument is wrong (an unknown release among them); 5 the registry or a bundle refused
(missing, tampered, not published)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.cli import main
from schemas import RegistryError, SpecError
from tests.conftest import Workspace, gpt2_spec
from tests.keys import keypair
from tests.pipelines.test_registry_units import make_bundle

WRONG = SpecError.exit_code
REFUSED = RegistryError.exit_code


@pytest.fixture
def repo(ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Workspace:
    """A repository with one release, tiny-gpt2, nothing built; an empty registry."""
    monkeypatch.setenv("SHIPYARD_ROOT", str(ws.root))
    monkeypatch.setenv("SHIPYARD_SERVE_DIR", str(tmp_path / "served"))
    monkeypatch.setenv("SHIPYARD_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.delenv("SHIPYARD_TRUSTED_BUILDERS", raising=False)
    monkeypatch.delenv("SHIPYARD_BUILDER_KEY", raising=False)
    ws.write(gpt2_spec())
    return ws


def codes(
    commands: dict[str, list[str]], capsys: pytest.CaptureFixture[str], says: str = ""
) -> dict[str, int]:
    """Each command's exit code; each says what was wrong (`says`), without a traceback."""
    got = {}
    for name, argv in commands.items():
        got[name] = main(argv)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, (name, err)
        assert says in err, (name, err)
    return got


def test_an_unknown_release_exits_2_in_every_command(
    repo: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, builder = keypair(tmp_path, "builder")
    missing = str(repo.root / "releases" / "no-such.yaml")
    commands = {
        "validate": ["validate", missing],
        "run-stage": ["run-stage", "pin", "--release", missing],
        "build": ["build", "no-such"],
        "gate": ["gate", "no-such"],
        "publish": ["publish", "no-such"],
        "provenance": ["provenance", "no-such", "--trusted-builder", str(builder)],
        "serve": ["serve", "no-such"],
    }
    assert codes(commands, capsys, says="no-such") == dict.fromkeys(commands, WRONG)


def test_a_wrong_flag_or_argument_exits_2_in_every_command(
    repo: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = str(make_bundle(tmp_path / "bundle"))
    commands = {
        "build -j": ["build", "tiny-gpt2", "-j", "0"],
        "build --memory": ["build", "tiny-gpt2", "--memory", "lots"],
        "build --until": ["build", "tiny-gpt2", "--until", "exprot"],
        "run-stage": ["run-stage", "exprot", "--release", "releases/tiny-gpt2.yaml"],
        "promote target": ["promote", "tiny-gpt2", "--to", "production"],
        "promote --canary": ["promote", "tiny-gpt2@0.1.0", "--to", "production", "--canary", "101"],
        "deploy target": ["deploy", "tiny-gpt2", "--out", str(tmp_path / "out")],
        "deploy --min-replicas": [
            "deploy",
            "tiny-gpt2@0.1.0",
            "--out",
            str(tmp_path / "out"),
            "--min-replicas",
            "0",
        ],  # fmt: skip
        "serve target": ["serve", "tiny-gpt2@"],
        "verify identities": [
            "verify",
            bundle,
            "--public-key",
            "k.pub",
            "--sigstore-identity",
            "x",
        ],
        "verify --sigstore-issuer": ["verify", bundle, "--sigstore-identity", "me@example.com"],
        "verify --trusted-builder": ["verify", bundle, "--provenance"],
        "provenance --trusted-builder": ["provenance", "tiny-gpt2"],
        "sign": ["sign", bundle],
    }
    assert codes(commands, capsys) == dict.fromkeys(commands, WRONG)


def test_a_missing_or_unpublished_bundle_exits_5_in_every_command(
    repo: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny-gpt2 is a release, but nothing is built or published."""
    nothing = str(tmp_path / "nothing")
    out = str(tmp_path / "out")
    commands = {
        "verify": ["verify", nothing],
        "sign": ["sign", nothing, "--private-key", "k.pem"],
        "serve (built)": ["serve", "tiny-gpt2"],
        "publish": ["publish", "tiny-gpt2"],
        "serve (published)": ["serve", "tiny-gpt2@0.1.0"],
        "promote": ["promote", "tiny-gpt2@0.1.0", "--to", "production"],
        "deploy": ["deploy", "tiny-gpt2@0.1.0", "--out", out, "--storage-uri", "pvc://models"],
        "rollback": ["rollback", "production", "--release", "tiny-gpt2"],
    }
    assert codes(commands, capsys) == dict.fromkeys(commands, REFUSED)
    # a channel no release has is the registry's lack; several releases having it, a
    # missing --release
    assert main(["rollback", "production"]) == REFUSED
    assert "exists for no release" in capsys.readouterr().err
