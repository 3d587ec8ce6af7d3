"""The registry's JSON files are written from their models (schemas/registry.py) and must
stay what the registry always wrote, byte for byte: readers (people, scripts, diffs, older
Shipyards) rely on them.

tests/fixtures/registry/ holds every file of a registry that `drive` made with the registry
as it was when its functions returned dicts (pipelines/registry.py before the models), with
a fixed clock and user. Each file reads into its model and writes out to the same bytes, and
the registry of today, driven the same way, writes the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipelines.registry as reg
from pipelines.registry import Registry
from tests.conftest import REPO
from tests.pipelines.test_registry_units import make_bundle

FIXTURES = REPO / "tests" / "fixtures" / "registry"
KEY = FIXTURES / "team.pub"
NOW = "2026-01-02T03:04:05+00:00"
USER = "ci-bot"


def drive(tmp: Path, key: Path = KEY) -> Path:
    """Publish three versions (one interrupted and recovered), promote, take a canary step,
    roll back, require a signature, and finish a move killed before its pointer; the
    registry folder. Only calls whose signatures the dict-returning registry had too."""
    registry = Registry(str(tmp / "registry"))
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        registry.publish(make_bundle(tmp / version, version=version), "demo", version)
    Path(registry.path("releases", "demo", "1.2.0.json")).unlink()  # an interrupted publish
    assert registry.check()  # finished: a recovered record
    registry.promote("demo", "1.0.0", "production", "first")
    registry.promote("demo", "1.1.0", "production", "canary", canary=10)
    registry.promote("demo", "1.1.0", "production", "all of it")
    registry.promote("demo", "1.0.0", "staging", "")
    registry.rollback("demo", "production", "back")
    registry.require_signature("staging", [key])
    registry.promote("demo", "1.1.0", "canary-eu", "eu", canary=50)
    Path(registry.path("channels", "demo", "canary-eu.json")).unlink()  # killed before it
    assert registry.check()  # finished: a pointer written by recovery
    return tmp / "registry"


def files(root: Path) -> dict[str, bytes]:
    """The registry's own files (not the bundles' files), by path under the root."""
    found = {}
    for path in sorted(root.rglob("*.json*")):
        rel = path.relative_to(root)
        if rel.parts[0] == "releases" and len(rel.parts) > 3:
            continue  # inside a published bundle
        found[rel.as_posix()] = path.read_bytes()
    return found


def expected() -> dict[str, bytes]:
    return files(FIXTURES / "files")


def test_the_fixtures_hold_every_kind_of_file() -> None:
    assert sorted(expected()) == [
        "channels/demo/canary-eu.json",
        "channels/demo/production.json",
        "channels/demo/staging.json",
        "history.jsonl",
        "policy/staging.json",
        "releases/demo/1.0.0.json",
        "releases/demo/1.1.0.json",
        "releases/demo/1.2.0.json",
    ]
    text = expected()
    assert b'"recovered": true' in text["releases/demo/1.2.0.json"]
    assert b'"canary_percent": 50' in text["channels/demo/canary-eu.json"]
    assert b'"canary_percent"' not in text["channels/demo/production.json"]


def test_each_registry_file_round_trips_through_its_model_byte_for_byte() -> None:
    from pipelines.storage import _dump
    from schemas.registry import (
        ChannelPointer,
        HistoryEntry,
        PublishRecord,
        RegistryFile,
        SignaturePolicy,
    )

    model: type[RegistryFile]
    for rel, data in expected().items():
        if rel == "history.jsonl":
            lines = data.decode().splitlines()
            assert len(lines) == 6
            for line in lines:
                entry = HistoryEntry.model_validate_json(line)
                # a line of history.jsonl (a folder registry), and history/<seq>.json (an
                # object store) of the same entry
                assert json.dumps(entry.document(), sort_keys=True) == line
                assert reg._file(entry) == _dump(json.loads(line))
            continue
        model = {"channels": ChannelPointer, "policy": SignaturePolicy}.get(
            rel.split("/")[0], PublishRecord
        )
        assert reg._file(model.model_validate_json(data)) == data, rel


def test_the_registry_writes_the_files_it_always_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reg, "now", lambda: NOW)
    monkeypatch.setenv("SHIPYARD_USER", USER)
    written = files(drive(tmp_path))
    assert sorted(written) == sorted(expected())
    # the bundles' digests are the manifest's (stages/bundling): should its form change,
    # the digests differ, and they alone
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        rel = f"releases/demo/{version}.json"
        now, then = json.loads(written[rel]), json.loads(expected()[rel])
        for key in ("digest", "manifest_sha256"):
            written = {
                r: d.replace(now[key].encode(), then[key].encode()) for r, d in written.items()
            }
    for rel, data in expected().items():
        assert written[rel] == data, rel
