"""The registry's guarantees at their boundaries, in-process and on small synthetic bundles
(issue 16: the trust-chain tests publish a built tiny-gpt2 through the CLI, so mutation
testing reached none of registry.py's code in-process). Each bundle here is real: files, a
manifest that `verify_bundle` accepts, stage reports and facts; only the model is a few bytes.
The object-store paths run in test_registry_trust.py against a real S3 API."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import pipelines.registry as reg
import pipelines.storage as storage
from pipelines.registry import Registry, Unmoved, check_channel, check_name, check_version
from schemas import RegistryError
from schemas.registry import ChannelPointer, HistoryEntry, PublishRecord, RegistryFile
from stages.bundling.oms import load_manifest
from tests.conftest import bucket, remanifest


def make_bundle(
    folder: Path,
    statuses: dict[str, str] | None = None,
    payload: bytes = b"weights",
    details: dict[str, dict[str, Any]] | None = None,
    facts: dict[str, str] | None = None,
    evaluation: dict[str, float] | None = None,
    name: str = "demo",
    version: str = "1.0.0",
    optional: tuple[str, ...] = (),
) -> Path:
    """A bundle that verifies: a model file, one report per stage (`optional`: those stages
    were optional when they ran), facts that repeat each verdict (unless `facts` says
    otherwise) and a manifest over all of it."""
    statuses = statuses or {"export": "passed", "parity": "passed"}
    (folder / "reports").mkdir(parents=True)
    (folder / "model.onnx").write_bytes(payload)
    for stage, status in statuses.items():
        report = {
            "stage": stage,
            "release": "demo",
            "status": status,
            "summary": f"{stage} {status}",
            "details": (details or {}).get(stage, {}),
        }
        if stage in optional:
            report["optional"] = True
        (folder / "reports" / f"{stage}.json").write_text(json.dumps(report))
    verdicts = {**statuses, **(facts or {})}
    shipyard = {
        "release": name,
        "version": version,
        "stages": {s: {"status": v} for s, v in verdicts.items()},
        "evaluation": evaluation or {},
    }
    (folder / "shipyard.json").write_text(json.dumps(shipyard))
    remanifest(folder, f"{name}@{version}")
    return folder


def digest_of(bundle: Path) -> str:
    return load_manifest(bundle / "manifest.json").digest


def moved(result: HistoryEntry | Unmoved) -> HistoryEntry:
    """A promotion's history entry (it moved the channel)."""
    assert isinstance(result, HistoryEntry), result
    return result


def recorded(registry: Registry, name: str, version: str) -> PublishRecord:
    record = registry.record(name, version)
    assert record is not None, f"{name}@{version} has no publish record"
    return record


def pointer(registry: Registry, name: str, channel: str) -> ChannelPointer:
    found = registry.channel(name, channel)
    assert found is not None, f"{name} has no {channel} pointer"
    return found


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(str(tmp_path / "registry"))


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return make_bundle(tmp_path / "bundle")


def cli_error(argv: list[str]) -> tuple[int, str]:
    """`shipyard ARGV` in this process: its exit code and the part of its error that names
    the refusal (the text after `error: ` up to the registry's own words)."""
    import contextlib
    import io

    from pipelines.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    assert code == 0 or (text.startswith("error: ") and "Traceback" not in text), text
    for known in (
        "filed as other-model@9.9.9, but its shipyard.json says demo@1.0.1",
        "manifest.json is not the one published",
    ):
        if known in text:
            return code, known
    return code, text


def published(registry: Registry, tmp_path: Path, *versions: str) -> None:
    for v in versions:
        registry.publish(make_bundle(tmp_path / f"b-{v}", payload=v.encode(), version=v), "demo", v)


# --------------------------------------------------------------------------- names
def test_names_versions_and_channels_at_their_limits() -> None:
    assert check_name("a" * 128) == "a" * 128
    assert check_name("a.b_c-1") == "a.b_c-1"
    for bad in ("a" * 129, "", "A", "-a", ".a", "a..b", "a/b", None):
        with pytest.raises(RegistryError, match="release name .* is not valid"):
            check_name(bad)  # type: ignore[arg-type]
    assert check_version("1.2.0-rc.1+build.5") == "1.2.0-rc.1+build.5"
    # Unicode digits: `\d` took them, so 1\U0001d7ce.0.0 published beside 10.0.0
    for bad in ("1.2", "01.2.0", "1.2.0/..", "", None, "1\U0001d7ce.0.0", "1.0.\u0661", "1.0.0\n"):
        with pytest.raises(RegistryError, match=r"is not Semantic Versioning 2\.0"):
            check_version(bad)  # type: ignore[arg-type]
    assert check_channel("a" + "b" * 62) == "a" + "b" * 62
    assert check_channel("canary-eu") == "canary-eu"
    for bad in ("a" + "b" * 63, "1a", "Production", "a_b", "", None):
        with pytest.raises(RegistryError, match="channel .* is not valid"):
            check_channel(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("part", ["", "a/b", "a\\b", ".", "..", "a\0b"])
def test_no_path_part_can_leave_the_root(registry: Registry, part: str) -> None:
    with pytest.raises(RegistryError, match="is not allowed"):
        registry.path("releases", part)


def test_a_symlink_out_of_the_root_is_refused_and_the_root_itself_is_fine(
    registry: Registry, tmp_path: Path
) -> None:
    assert registry.path() == registry.root
    (tmp_path / "elsewhere").mkdir()
    Path(registry.root, "releases").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RegistryError, match="releases/demo resolves outside the registry"):
        registry.path("releases", "demo")
    # a sibling whose name starts like the root is outside too
    Path(registry.root + "-evil").mkdir()
    Path(registry.root, "channels").symlink_to(registry.root + "-evil")
    with pytest.raises(RegistryError, match="resolves outside"):
        registry.path("channels", "x")


# --------------------------------------------------------------------------- publish
def test_publish_records_the_copied_digest_read_only(
    registry: Registry, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_USER", "ci-bot")
    done = registry.publish(bundle, "demo", "1.0.0")
    record = done.record
    assert record.digest == digest_of(bundle) and record.by == "ci-bot"
    assert (record.release, record.version, done.recovered) == ("demo", "1.0.0", ())
    assert not done.already
    stored = registry.record("demo", "1.0.0")
    assert stored == record and "recovered" not in stored.document()
    folder = Path(registry.path("releases", "demo", "1.0.0"))
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {0o444}, modes
    assert sorted(p.name for p in folder.parent.iterdir()) == ["1.0.0", "1.0.0.json"]
    # the same bundle again: said, not copied
    again = registry.publish(bundle, "demo", "1.0.0")
    assert again.already is True and again.record.digest == record.digest
    assert again.recovered == () and str(record.at).endswith("+00:00")  # UTC
    dirs = [p for p in folder.rglob("*") if p.is_dir()]
    assert dirs and all(p.stat().st_mode & 0o700 == 0o700 for p in dirs)  # still traversable
    # a second handle on the same registry (another command) opens it as it is
    assert Registry(registry.url).record("demo", "1.0.0") == stored
    # the same version from a bundle that no longer verifies: named as the build bundle
    (bundle / "model.onnx").write_bytes(b"edited")
    with pytest.raises(RegistryError) as exc:
        registry.publish(bundle, "demo", "1.0.0")
    assert str(exc.value).startswith(f"build bundle {bundle} does not match its manifest")


def test_a_registry_through_a_symlinked_path_is_rooted_at_the_real_folder(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    registry = Registry(str(tmp_path / "link"))
    assert registry.root == str((tmp_path / "real").resolve())
    assert registry.path("releases") == str((tmp_path / "real" / "releases").resolve())


def test_a_symlink_in_a_bundle_is_published_as_a_symlink_and_refused(
    registry: Registry, bundle: Path, tmp_path: Path
) -> None:
    """The copy keeps links as links: following one would publish a file the source never
    held as a plain file (and verify would then pass it)."""
    (tmp_path / "same.onnx").write_bytes((bundle / "model.onnx").read_bytes())
    (bundle / "model.onnx").unlink()
    (bundle / "model.onnx").symlink_to(tmp_path / "same.onnx")
    with pytest.raises(RegistryError, match="model.onnx: is a symlink"):
        registry.publish(bundle, "demo", "1.0.0")
    assert registry.record("demo", "1.0.0") is None


def test_a_published_version_is_immutable(registry: Registry, bundle: Path, tmp_path: Path) -> None:
    registry.publish(bundle, "demo", "1.0.0")
    other = make_bundle(tmp_path / "other", payload=b"other weights")
    with pytest.raises(RegistryError, match="already published with digest .* bump `version`"):
        registry.publish(other, "demo", "1.0.0")
    assert registry.facts("demo", "1.0.0").release == "demo"
    # a version bump without a rebuild: 1.0.0's content is not 1.0.1
    with pytest.raises(
        RegistryError, match=r"filed as demo@1\.0\.1, but its shipyard.json says demo@1\.0\.0"
    ):
        registry.publish(other, "demo", "1.0.1")
    rebuilt = make_bundle(tmp_path / "rebuilt", payload=b"other weights", version="1.0.1")
    assert registry.publish(rebuilt, "demo", "1.0.1").record.digest == digest_of(rebuilt)


@pytest.mark.parametrize(
    ("statuses", "details", "facts", "refused"),
    [
        ({"parity": "failed"}, {}, {}, "parity: failed"),
        ({"engine": "skipped"}, {}, {}, "engine: skipped"),  # not optional
        ({"parity": "passed"}, {}, {"parity": "failed"}, r"parity: failed \(shipyard.json\)"),
        ({"parity": "passed"}, {}, {"quantize": "skipped"}, r"quantize: skipped \(shipyard"),
    ],
)
def test_only_a_release_whose_stages_passed_is_published(
    registry: Registry,
    tmp_path: Path,
    statuses: dict[str, str],
    details: dict[str, dict[str, Any]],
    facts: dict[str, str],
    refused: str,
) -> None:
    bad = make_bundle(tmp_path / "bad", statuses, details=details, facts=facts)
    with pytest.raises(RegistryError, match=f"has stages that did not pass .*{refused}"):
        registry.publish(bad, "demo", "1.0.0")
    assert registry.record("demo", "1.0.0") is None
    assert os.listdir(registry.path("releases", "demo")) == []


@pytest.mark.parametrize(
    ("shipyard", "named"),
    [
        ({"version": "1.0.0", "stages": {}}, "shipyard.json: release: Field required"),
        (
            {"release": "demo", "version": 1},
            "shipyard.json: version: Input should be a valid string",
        ),
        ({"release": "demo", "version": "1.0.0", "stages": {"pin": "passed"}}, "stages.pin"),
        ({"release": "demo", "version": "1.0.0", "evaluation": {"f1": "high"}}, "evaluation.f1"),
    ],
)
def test_facts_that_are_not_a_bundles_are_refused_naming_the_field(
    registry: Registry, tmp_path: Path, shipyard: dict[str, Any], named: str
) -> None:
    """The registry read shipyard.json with .get(): a bundle without a release said
    "None@None"; one whose verdicts were strings crashed with an AttributeError."""
    folder = make_bundle(tmp_path / "odd")
    (folder / "shipyard.json").write_text(json.dumps(shipyard))
    remanifest(folder, "demo@1.0.0")
    with pytest.raises(RegistryError, match=re.escape(named)):
        registry.publish(folder, "demo", "1.0.0")
    assert registry.record("demo", "1.0.0") is None


def test_an_optional_skipped_stage_is_published(registry: Registry, tmp_path: Path) -> None:
    ok = make_bundle(
        tmp_path / "ok", {"parity": "passed", "engine": "skipped"}, optional=("engine",)
    )
    assert registry.publish(ok, "demo", "1.0.0").record.digest == digest_of(ok)
    # a bundle built before `optional` was a typed field said so in its report's details
    old = make_bundle(
        tmp_path / "old",
        {"parity": "passed", "engine": "skipped"},
        details={"engine": {"optional": True}},
        version="1.0.1",
    )
    assert registry.publish(old, "demo", "1.0.1").record.digest == digest_of(old)


def test_a_bundle_that_does_not_verify_or_holds_a_foreign_report_is_refused(
    registry: Registry, bundle: Path
) -> None:
    (bundle / "model.onnx").write_bytes(b"swapped")
    with pytest.raises(
        RegistryError, match=r"does not match its manifest.*\n  model.onnx: changed"
    ):
        registry.publish(bundle, "demo", "1.0.0")
    (bundle / "reports" / "notes.json").write_text('{"free": "form"}')
    remanifest(bundle, "demo@1.0.0")
    with pytest.raises(RegistryError, match=r"reports/notes.json is not a stage report"):
        registry.publish(bundle, "demo", "1.0.0")


@pytest.mark.parametrize("content", [b"{not json", b'{"release": "demo"}', b"[1]"])
def test_an_unreadable_publish_record_is_an_error_not_a_missing_one(
    registry: Registry, bundle: Path, content: bytes
) -> None:
    registry.publish(bundle, "demo", "1.0.0")
    record = Path(registry.path("releases", "demo", "1.0.0.json"))
    record.chmod(0o644)
    record.write_bytes(content)
    with pytest.raises(RegistryError, match="1.0.0.json is unreadable; restore it"):
        registry.record("demo", "1.0.0")


# --------------------------------------------------------------------------- check
def test_check_finishes_removes_and_reports_each_interrupted_publish(
    registry: Registry, tmp_path: Path
) -> None:
    assert registry.check() == []  # no releases folder yet
    good, bad = make_bundle(tmp_path / "good"), make_bundle(tmp_path / "bad", payload=b"x")
    (bad / "model.onnx").write_bytes(b"y")  # does not verify
    releases = Path(registry.path("releases"))
    (releases / "demo").mkdir(parents=True)
    for name, source in (("1.0.0", good), ("1.1.0", bad)):  # copied, never recorded
        shutil.copytree(source, releases / "demo" / name)
    (releases / "demo" / ".staging-2.0.0-dead").mkdir()
    (releases / "demo" / "3.0.0.json.1.ab.tmp").write_text("{")
    (releases / "demo" / "notes").mkdir()  # neither a version nor a leftover: left alone
    (releases / "Bad_Name").mkdir()
    actions = registry.check()
    assert actions == [
        "releases/Bad_Name: not a valid release name; left alone",
        "removed demo/.staging-2.0.0-dead: leftover of an interrupted publish",
        "finished demo@1.0.0: interrupted publish verified, record written",
        "removed demo@1.1.0: interrupted publish that does not verify "
        "(model.onnx: changed (sha256 differs from the manifest))",
        "removed demo/3.0.0.json.1.ab.tmp: leftover of an interrupted publish",
    ]
    record = registry.record("demo", "1.0.0")
    assert record is not None and record.digest == digest_of(good) and record.recovered
    assert record.by and str(record.at).endswith("+00:00")
    assert sorted(os.listdir(releases / "demo")) == ["1.0.0", "1.0.0.json", "notes"]
    assert registry.check() == ["releases/Bad_Name: not a valid release name; left alone"]


def test_a_failed_unrecorded_publish_is_removed_naming_the_stage(
    registry: Registry, tmp_path: Path
) -> None:
    failed = make_bundle(tmp_path / "failed", {"parity": "failed"})
    target = Path(registry.path("releases", "demo", "1.0.0"))
    target.parent.mkdir(parents=True)
    shutil.copytree(failed, target)
    (actions,) = [
        registry.publish(make_bundle(tmp_path / "b", version="2.0.0"), "demo", "2.0.0").recovered
    ]
    assert actions == (
        "removed demo@1.0.0: interrupted publish that does not verify (unrecorded demo@1.0.0 "
        "has stages that did not pass (parity: failed); only a release whose gate passed can "
        "be published or promoted)",
    )


# --------------------------------------------------------------------------- channels
def test_promote_and_rollback_walk_the_history_per_release_and_channel(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_USER", "alice")
    published(registry, tmp_path, "1.0.0", "1.1.0", "1.2.0")
    first = moved(registry.promote("demo", "1.0.0", "production", "first"))
    assert first.seq == 1 and first.from_ is None and first.to == "demo@1.0.0"
    assert (first.action, first.who, first.reason) == ("promote", "alice", "first")
    assert first.digest == recorded(registry, "demo", "1.0.0").digest
    registry.promote("demo", "1.1.0", "staging", "other channel")
    second = moved(registry.promote("demo", "1.2.0", "production", "second"))
    assert (second.seq, second.from_, second.to) == (3, "demo@1.0.0", "demo@1.2.0")
    assert pointer(registry, "demo", "production").version == "1.2.0"
    assert registry.channel("demo", "canary") is None
    back = registry.rollback("demo", "production", "bad latency")
    assert (back.seq, back.action, back.from_, back.to) == (
        4,
        "rollback",
        "demo@1.2.0",
        "demo@1.0.0",
    )
    # staging's own history holds one version: nothing to roll back to
    with pytest.raises(RegistryError, match=r"'staging' has no earlier version .*\(1 in its"):
        registry.rollback("demo", "staging", "x")
    with pytest.raises(RegistryError, match=r"'production' has no earlier version .*\(1 in"):
        registry.rollback("demo", "production", "again")
    with pytest.raises(RegistryError, match=r"'canary' has no earlier version .*\(0 in"):
        registry.rollback("demo", "canary", "never promoted")
    assert [(c.channel, c.pointer.version) for c in registry.channels()] == [
        ("production", "1.0.0"),
        ("staging", "1.1.0"),
    ]
    assert [e.seq for e in registry.history()] == [1, 2, 3, 4]


def test_a_rollback_follows_pushes_and_pops_not_the_last_entry(
    registry: Registry, tmp_path: Path
) -> None:
    published(registry, tmp_path, "1.0.0", "1.1.0", "1.2.0")
    for v in ("1.0.0", "1.1.0", "1.2.0"):
        registry.promote("demo", v, "production", v)
    assert registry.rollback("demo", "production", "a").to == "demo@1.1.0"
    assert registry.rollback("demo", "production", "b").to == "demo@1.0.0"
    other = make_bundle(tmp_path / "other", payload=b"o", name="other")
    registry.publish(other, "other", "1.0.0")
    registry.promote("other", "1.0.0", "production", "another release, same channel")
    with pytest.raises(RegistryError, match="no earlier version"):
        registry.rollback("demo", "production", "c")


def test_a_retried_promotion_moves_nothing_and_rollback_leaves_the_live_version(
    registry: Registry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Re-promoting the live version (a retried deploy) printed `0.2.0 -> 0.2.0` on the
    next rollback, exited 0 and stayed: the rollback stack held the duplicate. Through the
    CLI, and on a history written before re-promotions became no-ops."""
    from pipelines.cli import main

    published(registry, tmp_path, "0.1.0", "0.2.0")
    url = ["--registry", registry.url]
    for v in ("0.1.0", "0.2.0", "0.2.0"):
        assert main(["promote", f"demo@{v}", "--to", "prod", "--reason", "deploy", *url]) == 0
    out = capsys.readouterr().out
    assert "prod: demo@0.2.0 is already live there; nothing moved or recorded" in out
    assert [e.to for e in registry.history()] == ["demo@0.1.0", "demo@0.2.0"]
    assert main(["rollback", "prod", "--reason", "bad", *url]) == 0
    assert "prod: demo@0.2.0 -> demo@0.1.0 (#3, rollback)" in capsys.readouterr().out
    assert pointer(registry, "demo", "prod").version == "0.1.0"

    # an older registry recorded the retried promotion: its duplicate is not a step back
    with registry.lock():
        target = registry._checked("demo", "0.2.0", "canary")
        registry._move("canary", registry._checked("demo", "0.1.0", "canary"), "promote", "a")
        registry._move("canary", target, "promote", "b")
        registry._move("canary", target, "promote", "b, retried")
    assert main(["rollback", "canary", "--reason", "bad", *url]) == 0
    assert "canary: demo@0.2.0 -> demo@0.1.0" in capsys.readouterr().out


def test_a_crash_between_history_and_pointer_is_found_and_finished(
    registry: Registry,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move appends its history entry, then writes the pointer: a crash between them
    left a history claiming a move that never happened, and `registry check` called the
    registry consistent. Now check (or the next move) finishes it; a target that no
    longer verifies is reported, not pointed at."""
    from pipelines.cli import main

    published(registry, tmp_path, "1.0.0", "1.1.0", "1.2.0")
    registry.promote("demo", "1.0.0", "production", "first")
    real_write = reg.Registry._write

    def crash(self: Registry, path: str, data: RegistryFile) -> None:
        if "/channels/" in path.replace(os.sep, "/"):
            raise KeyboardInterrupt("killed between the history append and the pointer")
        real_write(self, path, data)

    def promote_killed(version: str) -> None:
        with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
            m.setattr(reg.Registry, "_write", crash)
            registry.promote("demo", version, "production", "killed")

    promote_killed("1.1.0")
    assert registry.history()[-1].to == "demo@1.1.0"
    assert pointer(registry, "demo", "production").version == "1.0.0"
    assert main(["registry", "check", "--registry", registry.url]) == 0
    out = capsys.readouterr().out
    assert (
        "finished demo's production: history #2 (promote) moved it to demo@1.1.0, its pointer "
        "says demo@1.0.0: an interrupted move, pointer now demo@1.1.0"
    ) in out
    assert pointer(registry, "demo", "production").version == "1.1.0"
    assert main(["registry", "check", "--registry", registry.url]) == 0
    assert "consistent" in capsys.readouterr().out

    # the next move finishes an interrupted one before its own
    promote_killed("1.2.0")
    back = registry.rollback("demo", "production", "bad")
    assert registry.warnings and registry.warnings[0].startswith("finished demo's production")
    assert (back.from_, back.to) == ("demo@1.2.0", "demo@1.1.0")

    # a crash whose target was then tampered with: reported, the pointer left alone
    with registry.lock():
        registry._append(
            registry.history()[-1].model_copy(
                update={
                    "seq": 99,
                    "to": "demo@1.0.0",
                    "digest": recorded(registry, "demo", "1.0.0").digest,
                }
            )
        )
    target = Path(registry.path("releases", "demo", "1.0.0", "model.onnx"))
    target.chmod(0o644)
    target.write_bytes(b"tampered")
    actions = registry.check()
    assert len(actions) == 1 and "demo@1.0.0 does not verify" in actions[0], actions
    assert pointer(registry, "demo", "production").version == "1.1.0"


def test_torn_or_misplaced_channel_and_policy_files_are_named_never_a_traceback(
    registry: Registry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn channel pointer, a folder where the policy file goes: every command said
    `error: ...` naming the file (not a JSONDecodeError or IsADirectoryError traceback),
    and `registry check` named them instead of calling the registry consistent."""
    from pipelines.cli import main

    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    url = ["--registry", registry.url]
    pointer = Path(registry.path("channels", "demo", "production.json"))
    pointer.write_text('{"release": "demo", "vers')  # a crash mid-write by another tool
    Path(registry.path("policy", "staging.json")).mkdir(parents=True)
    assert main(["status", *url]) == 5  # a registry error, rendered
    assert "channels/demo/production.json is not valid" in capsys.readouterr().err
    assert main(["promote", "demo@1.0.0", "--to", "staging", "--reason", "x", *url]) == 5
    err = capsys.readouterr().err
    assert "policy/staging.json is a folder where the registry keeps a file" in err
    assert "Traceback" not in err
    assert main(["registry", "check", *url]) == 0
    out = capsys.readouterr().out
    assert "channels/demo/production.json is not valid" in out
    assert "policy/staging.json is a folder" in out and "consistent" not in out
    assert main(["promote", "demo@1.0.0", "--to", "canary", "--reason", "x", *url]) == 0


@pytest.mark.parametrize(
    ("kind", "edit", "named"),
    [
        ("pointer", {"digest": "abc"}, "digest: String should match pattern"),
        ("pointer", {"version": None}, "version: Input should be a valid string"),
        ("policy", {"require_signature": "maybe"}, "require_signature: Input should be"),
        ("policy", {"public_keys": "one key"}, "public_keys: Input should be a valid array"),
    ],
)
def test_a_hand_edited_registry_file_is_refused_by_its_model(
    registry: Registry, tmp_path: Path, kind: str, edit: dict, named: str
) -> None:
    """Pointers and policies were checked for the presence of a few keys (a digest of
    "abc" or a `require_signature: "maybe"` went through): each is read by its model."""
    from tests.keys import keypair

    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    _, public = keypair(tmp_path, "k")
    registry.require_signature("production", [public])
    path = Path(
        registry.path("channels", "demo", "production.json")
        if kind == "pointer"
        else registry.path("policy", "production.json")
    )
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    read = registry.channel if kind == "pointer" else registry.policy
    args = ("demo", "production") if kind == "pointer" else ("production",)
    with pytest.raises(RegistryError, match=f"is not valid \\({named}"):
        read(*args)  # type: ignore[operator]
    assert any(named in a for a in registry.check())


def test_a_publish_record_or_history_entry_is_read_by_its_model(
    registry: Registry, tmp_path: Path
) -> None:
    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    path = Path(registry._record_path("demo", "1.0.0"))
    good = path.read_text()
    record = json.loads(good)
    path.chmod(0o644)
    without = {k: v for k, v in record.items() if k != "release"}
    for broken in ({**record, "digest": record["digest"][:-1]}, {**record, "by": 7}, without):
        path.write_text(json.dumps(broken))
        with pytest.raises(RegistryError, match="publish record .* is unreadable"):
            registry.record("demo", "1.0.0")
    # a key a later version adds is kept, not refused
    path.write_text(json.dumps({**record, "added_later": 1}))
    assert recorded(registry, "demo", "1.0.0").document()["added_later"] == 1
    path.write_text(good)
    # exactly its keys, no defaults added
    assert recorded(registry, "demo", "1.0.0").document() == record
    # a history line that names no move it knows is skipped with a warning, like a torn one
    entry = {**registry.history()[0].document(), "seq": 2, "action": "delete"}
    with open(registry.path("history.jsonl"), "a") as fh:
        fh.write(json.dumps(entry) + "\n")
    assert [e.seq for e in registry.history()] == [1]
    assert registry.warnings[-1].startswith("history.jsonl line 2 is torn or not an entry")
    first = registry.history()[0]
    assert first.from_ is None and first.document()["from"] is None  # the alias round-trips


def test_a_file_renamed_inside_a_published_bundle_is_refused(
    registry: Registry, bundle: Path
) -> None:
    """The publish record held the root digest only, which covers the shards' digests but
    not their names: rename a published file and rewrite its names in the manifest (same
    order), and the bundle verified, kept its digest and was promoted."""
    registry.publish(bundle, "demo", "1.0.0")
    folder = Path(registry.path("releases", "demo", "1.0.0"))
    digest = recorded(registry, "demo", "1.0.0").digest
    data = json.loads((folder / "manifest.json").read_text())
    for r in data["predicate"]["resources"]:  # a name that sorts where the old one did
        if r["name"].startswith("model.onnx:"):
            r["name"] = "model2.onnx" + r["name"][len("model.onnx") :]
    (folder / "model.onnx").rename(folder / "model2.onnx")
    (folder / "manifest.json").chmod(0o644)
    (folder / "manifest.json").write_text(json.dumps(data))
    assert load_manifest(folder / "manifest.json").digest == digest  # the attack holds
    with pytest.raises(RegistryError, match="manifest.json is not the one published"):
        registry.promote("demo", "1.0.0", "production", "renamed")
    assert registry.channel("demo", "production") is None
    where = ["--registry", registry.root]
    assert cli_error(["promote", "demo@1.0.0", "--to", "production", *where]) == (
        5, "manifest.json is not the one published"
    )  # fmt: skip


def test_promote_refuses_unpublished_missing_and_replaced_bundles(
    registry: Registry, tmp_path: Path, bundle: Path
) -> None:
    with pytest.raises(RegistryError, match="demo@1.0.0 has no bundle in"):
        registry.promote("demo", "1.0.0", "production", "x")
    target = Path(registry.path("releases", "demo", "1.0.0"))
    target.parent.mkdir(parents=True)
    shutil.copytree(bundle, target)
    with pytest.raises(RegistryError, match="demo@1.0.0 is not published in .*shipyard publish"):
        registry.promote("demo", "1.0.0", "production", "x")
    shutil.rmtree(target)
    registry.publish(bundle, "demo", "1.0.0")
    # an attacker replaces the bundle and rewrites its manifest consistently
    for p in target.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (target / "model.onnx").write_bytes(b"evil")
    remanifest(target, "demo@1.0.0")
    with pytest.raises(RegistryError, match="its publish record says .* replaced after"):
        registry.promote("demo", "1.0.0", "production", "x")
    with pytest.raises(RegistryError, match="replaced after publishing"):
        registry.facts("demo", "1.0.0")
    assert registry.history() == [] and registry.channels() == []


def test_channels_lists_only_valid_channel_files(registry: Registry, tmp_path: Path) -> None:
    assert registry.channels() == []
    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "x")
    Path(registry.path("channels", "demo", "Bad.json")).write_text("{}")
    assert [c.channel for c in registry.channels()] == ["production"]


# --------------------------------------------------------------------------- signatures
def test_a_signature_policy_refuses_unsigned_and_accepts_a_trusted_signature(
    registry: Registry, tmp_path: Path, bundle: Path
) -> None:
    from pipelines.signing import sign
    from tests.keys import keypair

    private, public = keypair(tmp_path, "release")
    _, stranger = keypair(tmp_path, "stranger")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(RegistryError, match="junk.pub: not a PEM public key"):
        registry.require_signature("production", [tmp_path / "junk.pub"])
    assert registry.policy("production") is None
    policy = registry.require_signature("production", [stranger, public])
    assert policy.require_signature and len(policy.public_keys) == 2
    registry.publish(bundle, "demo", "1.0.0")
    with pytest.raises(RegistryError, match="requires a signature .* demo@1.0.0 is not signed"):
        registry.promote("demo", "1.0.0", "production", "x")
    assert registry.promote("demo", "1.0.0", "staging", "no policy").to == "demo@1.0.0"
    signed = make_bundle(tmp_path / "signed", version="1.0.1")
    sign(signed, private_key=private)
    registry.publish(signed, "demo", "1.0.1")
    assert registry.promote("demo", "1.0.1", "production", "signed").to == "demo@1.0.1"
    registry.require_signature("canary", [stranger])
    with pytest.raises(RegistryError, match="demo@1.0.1 is not signed by one"):
        registry.promote("demo", "1.0.1", "canary", "wrong key")

    # a registry writer refiles the signed bundle as another release, record and all: the
    # signature still verifies, the name it signs does not match
    src = Path(registry.path("releases", "demo", "1.0.1"))
    dst = Path(registry.path("releases", "other-model", "9.9.9"))
    shutil.copytree(src, dst)
    record = recorded(registry, "demo", "1.0.1").document()
    record |= {"release": "other-model", "version": "9.9.9"}
    Path(registry._record_path("other-model", "9.9.9")).write_text(json.dumps(record))
    with pytest.raises(
        RegistryError, match="filed as other-model@9.9.9, but its shipyard.json says demo@1.0.1"
    ):
        registry.promote("other-model", "9.9.9", "production", "refiled")
    assert pointer(registry, "demo", "production").version == "1.0.1"
    # and as a user meets it: the command refuses, naming both, and moves nothing
    where = ["--registry", str(tmp_path / "registry")]
    assert cli_error(["promote", "other-model@9.9.9", "--to", "production", *where]) == (
        5, "filed as other-model@9.9.9, but its shipyard.json says demo@1.0.1"
    )  # fmt: skip
    assert registry.channel("other-model", "production") is None


# --------------------------------------------------------------------------- history
def test_history_skips_torn_blank_and_foreign_lines_and_appends_after_them(
    registry: Registry, tmp_path: Path
) -> None:
    assert registry.history() == []
    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    with open(registry.path("history.jsonl"), "ab") as fh:
        fh.write(b"\n" + json.dumps({"seq": 9, "channel": "x", "to": "y"}).encode() + b"\n")
        fh.write(b'{"seq": 2, "at": "2026-')  # a crash mid-append: no newline
    entry = moved(registry.promote("demo", "1.0.0", "staging", "after the tear"))
    assert entry.seq == 2
    assert [e.seq for e in registry.history()] == [1, 2]
    assert len(registry.warnings) == 2
    assert registry.warnings[0].startswith("history.jsonl line 3 is torn or not an entry")
    assert registry.warnings[1].startswith("history.jsonl line 4 is torn or not an entry")
    registry.history()
    assert len(registry.warnings) == 2  # reported once per read, not piled up
    lines = Path(registry.path("history.jsonl")).read_bytes().split(b"\n")
    assert json.loads(lines[4])["reason"] == "after the tear" and lines[-1] == b""


def test_a_record_is_created_exclusively(registry: Registry) -> None:
    path = registry.path("releases", "demo", "1.0.0.json")
    first = PublishRecord(release="demo", version="1.0.0", digest="a" * 64)
    registry._create(path, first)
    with pytest.raises(RegistryError, match="exists already; refusing to overwrite it"):
        registry._create(path, first.model_copy(update={"digest": "b" * 64}))
    assert json.loads(Path(path).read_text()) == first.document()
    assert [p.name for p in Path(path).parent.iterdir()] == ["1.0.0.json"]  # no temp left


def test_a_held_lock_times_out_naming_the_lock(
    registry: Registry, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock\n"
            f"with FileLock({registry.path('.lock')!r}):\n"
            "    print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(storage, "LOCK_TIMEOUT_S", 0.3)
        with pytest.raises(RegistryError, match=r"registry lock .*\.lock held for over 0 s"):
            registry.publish(bundle, "demo", "1.0.0")
    finally:
        holder.kill()
        holder.wait()
    assert registry.publish(bundle, "demo", "1.0.0").record.digest == digest_of(bundle)


# --------------------------------------------------------------------------- exact forms
def test_records_channels_and_history_have_one_exact_form(
    registry: Registry, tmp_path: Path
) -> None:
    """Readers (people, scripts, diffs) rely on these bytes: sorted keys, two-space indent,
    a final newline; one sorted JSON object per history line."""
    published(registry, tmp_path, "1.0.0")
    entry = moved(registry.promote("demo", "1.0.0", "production", "first"))
    for path in (
        registry.path("releases", "demo", "1.0.0.json"),
        registry.path("channels", "demo", "production.json"),
    ):
        text = Path(path).read_text()
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n", path
    channel = json.loads(Path(registry.path("channels", "demo", "production.json")).read_text())
    assert channel["since"] == entry.at and channel["version"] == "1.0.0"
    registry.promote("demo", "1.0.0", "staging", "second")
    lines = Path(registry.path("history.jsonl")).read_text().split("\n")
    assert lines[2] == "" and len(lines) == 3  # two entries, no blank line between
    assert lines[0] == json.dumps(json.loads(lines[0]), sort_keys=True)


def test_refusals_say_exactly_what_and_how_to_fix(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(RegistryError) as exc:
        check_name("Bad")
    assert str(exc.value) == (
        "release name 'Bad' is not valid: use lowercase letters, digits, '.', '_' and '-', "
        "starting with a letter or digit"
    )
    with pytest.raises(RegistryError) as exc:
        check_channel("Bad")
    assert str(exc.value) == (
        "channel 'Bad' is not valid: a lowercase letter, then lowercase letters, digits or "
        "'-' (e.g. production, staging, canary-eu)"
    )
    first, other = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", payload=b"b")
    registry.publish(first, "demo", "1.0.0")
    with pytest.raises(RegistryError) as exc:
        registry.publish(other, "demo", "1.0.0")
    assert str(exc.value) == (
        f"demo@1.0.0 is already published with digest {digest_of(first)[:16]}; this "
        f"bundle's is {digest_of(other)[:16]}. Published versions are immutable: bump "
        "`version` in the release spec"
    )
    record = Path(registry.path("releases", "demo", "1.0.0.json"))
    record.chmod(0o644)
    record.write_text("{")
    with pytest.raises(RegistryError) as exc:
        registry.record("demo", "1.0.0")
    assert str(exc.value) == (
        f"publish record {record} is unreadable; restore it from a backup (published "
        "versions are immutable)"
    )


def test_a_bundle_refusal_names_the_bundle_and_lists_every_problem(
    registry: Registry, bundle: Path, tmp_path: Path
) -> None:
    (bundle / "model.onnx").write_bytes(b"swapped")
    (bundle / "extra.txt").write_text("x")
    with pytest.raises(RegistryError) as exc:
        registry.publish(bundle, "demo", "1.0.0")
    assert str(exc.value) == (  # what was copied is what is checked (and named)
        f"copied bundle {bundle} does not match its manifest; refusing it:\n"
        "  extra.txt: added (not in the manifest)\n"
        "  model.onnx: changed (sha256 differs from the manifest)"
    )
    bad = make_bundle(tmp_path / "bad", {"export": "failed", "parity": "failed"})
    with pytest.raises(RegistryError) as exc:
        registry.publish(bad, "demo", "1.0.0")
    assert str(exc.value) == (
        f"copied bundle {bad} has stages that did not pass (export: failed, parity: failed); "
        "only a release whose gate passed can be published or promoted"
    )


def test_a_replaced_published_bundle_names_both_digests(registry: Registry, bundle: Path) -> None:
    registry.publish(bundle, "demo", "1.0.0")
    target = Path(registry.path("releases", "demo", "1.0.0"))
    for p in target.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (target / "model.onnx").write_bytes(b"evil")
    remanifest(target, "demo@1.0.0")
    with pytest.raises(RegistryError) as exc:
        registry.promote("demo", "1.0.0", "production", "x")
    assert str(exc.value) == (
        f"published demo@1.0.0 has digest {digest_of(target)[:16]}, but its publish record "
        f"says {digest_of(bundle)[:16]}: the bundle and its manifest were replaced after "
        "publishing; refusing it (restore the version from a backup)"
    )


def test_a_torn_history_warning_says_what_was_lost(registry: Registry) -> None:
    Path(registry.path("history.jsonl")).write_text('{"seq": 1, "at": "2026-\n')
    assert registry.history() == []
    assert registry.warnings == [
        'history.jsonl line 1 is torn or not an entry (\'{"seq": 1, "at": "2026-\'); '
        "skipped. History is append-only: the entry it held is lost, later ones are intact"
    ]


def test_a_rollback_keeps_its_reason_and_skips_other_releases_entries(
    registry: Registry, tmp_path: Path
) -> None:
    published(registry, tmp_path, "1.0.0", "1.1.0")
    registry.publish(
        make_bundle(tmp_path / "o", payload=b"o", name="demo-two"), "demo-two", "1.0.0"
    )
    registry.promote("demo", "1.0.0", "production", "a")
    registry.promote("demo-two", "1.0.0", "production", "other release, similar name")
    registry.promote("demo", "1.1.0", "production", "b")
    back = registry.rollback("demo", "production", "latency regression")
    assert (back.to, back.reason) == ("demo@1.0.0", "latency regression")


def test_a_signature_refusal_explains_the_fix(
    registry: Registry, tmp_path: Path, bundle: Path
) -> None:
    from tests.keys import keypair

    _, public = keypair(tmp_path, "trusted")
    registry.require_signature("production", [public])
    registry.publish(bundle, "demo", "1.0.0")
    with pytest.raises(RegistryError) as exc:
        registry.promote("demo", "1.0.0", "production", "x")
    message = str(exc.value)
    assert message.startswith(
        "channel 'production' requires a signature by a trusted key; demo@1.0.0 is not signed ("
    )
    assert message.endswith(
        "). Sign the bundle with `shipyard sign BUNDLE --private-key KEY` before publishing "
        "it as a new version"
    )
    policy = registry.policy("production")
    assert policy is not None and policy.by and policy.at
    Path(registry.path("policy", "production.json")).write_text(
        json.dumps({"require_signature": True})
    )
    with pytest.raises(RegistryError, match=r"is not signed by one \(no trusted keys configured\)"):
        registry.promote("demo", "1.0.0", "production", "x")


# --------------------------------------------------------------------------- object store
@pytest.fixture
def s3(s3_server: str) -> Registry:
    return Registry(f"s3://units-{bucket()}/registry")


def test_object_store_publish_promote_rollback_and_history(
    s3: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_USER", "bob")
    assert not s3.local and s3.root == s3.path() and not s3.root.endswith("/")
    first, second = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", payload=b"b")
    record = s3.publish(first, "demo", "1.0.0").record
    assert record.digest == digest_of(first) and record.by == "bob"
    assert s3.publish(first, "demo", "1.0.0").already is True
    with pytest.raises(RegistryError, match="already published"):
        s3.publish(second, "demo", "1.0.0")
    with pytest.raises(RegistryError, match="filed as demo@1.1.0"):
        s3.publish(second, "demo", "1.1.0")
    second = make_bundle(tmp_path / "c", payload=b"b", version="1.1.0")
    s3.publish(second, "demo", "1.1.0")
    files = s3.fs.find(s3.path("releases", "demo", "1.1.0"))
    assert sorted(f.rsplit("/1.1.0/", 1)[1] for f in files) == sorted(
        p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file()
    )
    assert s3.facts("demo", "1.1.0").release == "demo"
    s3.promote("demo", "1.0.0", "production", "first")
    s3.promote("demo", "1.1.0", "production", "second")
    back = s3.rollback("demo", "production", "back")
    assert (back.seq, back.to, back.reason) == (3, "demo@1.0.0", "back")
    names = sorted(p.rsplit("/", 1)[1] for p in s3.fs.ls(s3.path("history"), detail=False))
    assert names == [f"{i:010d}.json" for i in (1, 2, 3)]
    assert [e.seq for e in s3.history()] == [1, 2, 3] and s3.warnings == []
    text = s3.fs.cat_file(s3.path("history", f"{1:010d}.json")).decode()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert [(c.channel, c.pointer.version) for c in s3.channels()] == [("production", "1.0.0")]
    s3.fs.pipe_file(s3.path("history", f"{4:010d}.json"), b'{"seq": 4, "at')
    assert [e.seq for e in s3.history()] == [1, 2, 3]
    assert s3.warnings[0].startswith("history/0000000004.json is torn or not an entry")


def test_object_store_records_are_created_exclusively(s3: Registry) -> None:
    path = s3.path("releases", "demo", "1.0.0.json")
    first = PublishRecord(release="demo", version="1.0.0", digest="a" * 64)
    s3._create(path, first)
    with pytest.raises(RegistryError) as exc:
        s3._create(path, first.model_copy(update={"digest": "b" * 64}))
    assert str(exc.value) == f"{path} exists already; refusing to overwrite it"
    assert json.loads(s3.fs.cat_file(path)) == first.document()


def test_object_store_check_finishes_and_removes_interrupted_publishes(
    s3: Registry, tmp_path: Path
) -> None:
    good, bad = make_bundle(tmp_path / "good"), make_bundle(tmp_path / "bad", payload=b"x")
    (bad / "model.onnx").write_bytes(b"y")
    s3.fs.put(str(good) + "/", s3.path("releases", "demo", "1.0.0"), recursive=True)
    s3.fs.put(str(bad) + "/", s3.path("releases", "demo", "1.1.0"), recursive=True)
    s3.fs.pipe_file(s3.path("releases", "demo", ".staging-2.0.0-x", "f"), b"x")
    assert s3.check() == [
        "removed demo/.staging-2.0.0-x: leftover of an interrupted publish",
        "finished demo@1.0.0: interrupted publish verified, record written",
        "removed demo@1.1.0: interrupted publish that does not verify "
        "(model.onnx: changed (sha256 differs from the manifest))",
    ]
    record = s3.record("demo", "1.0.0")
    assert record is not None and record.digest == digest_of(good)
    assert (record.release, record.version, record.recovered) == ("demo", "1.0.0", True)
    assert s3.check() == []


def test_check_walks_past_recorded_versions_and_names_three_problems(
    registry: Registry, tmp_path: Path
) -> None:
    published(registry, tmp_path, "1.0.0")  # recorded: sorted before the others
    good = make_bundle(tmp_path / "good", payload=b"g", version="1.1.0")
    bad = make_bundle(tmp_path / "bad", payload=b"b", version="1.2.0")
    for extra in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (bad / extra).write_text("x")
    shutil.copytree(good, Path(registry.path("releases", "demo", "1.1.0")))
    shutil.copytree(bad, Path(registry.path("releases", "demo", "1.2.0")))
    assert registry.check() == [
        "finished demo@1.1.0: interrupted publish verified, record written",
        "removed demo@1.2.0: interrupted publish that does not verify (a.txt: added (not in "
        "the manifest); b.txt: added (not in the manifest); c.txt: added (not in the "
        "manifest))",
    ]


def test_facts_without_stages_or_with_reportless_passed_stages_publish(
    registry: Registry, tmp_path: Path
) -> None:
    bare = make_bundle(tmp_path / "bare")
    facts = json.loads((bare / "shipyard.json").read_text())
    del facts["stages"]
    (bare / "shipyard.json").write_text(json.dumps(facts))
    remanifest(bare, "demo@1.0.0")
    assert registry.publish(bare, "demo", "1.0.0").record.digest == digest_of(bare)
    extra = make_bundle(tmp_path / "extra", payload=b"e", facts={"plan": "passed"}, version="1.0.1")
    assert registry.publish(extra, "demo", "1.0.1").record.digest == digest_of(extra)


def test_a_published_bundle_that_no_longer_verifies_is_named(
    registry: Registry, bundle: Path
) -> None:
    registry.publish(bundle, "demo", "1.0.0")
    published = Path(registry.path("releases", "demo", "1.0.0", "model.onnx"))
    published.chmod(0o644)
    published.write_bytes(b"bitrot")
    with pytest.raises(RegistryError) as exc:
        registry.promote("demo", "1.0.0", "production", "x")
    assert str(exc.value) == (
        "published demo@1.0.0 does not match its manifest; refusing it:\n"
        "  model.onnx: changed (sha256 differs from the manifest)"
    )


def test_not_published_names_the_registry_and_the_fix(registry: Registry, bundle: Path) -> None:
    shutil.copytree(bundle, Path(registry.path("releases", "demo", "1.0.0")))
    # not through check(): a promotion must refuse what has no publish record
    with pytest.raises(RegistryError) as exc:
        registry._checked("demo", "1.0.0", "production")
    assert str(exc.value) == (
        f"demo@1.0.0 is not published in {registry.url}; run `shipyard publish demo` first"
    )


def test_history_survives_bytes_that_are_not_utf8_and_long_torn_lines(
    registry: Registry, tmp_path: Path
) -> None:
    published(registry, tmp_path, "1.0.0")
    registry.promote("demo", "1.0.0", "production", "first")
    torn = '{"seq": 2, "note": "' + "x" * 100
    with open(registry.path("history.jsonl"), "ab") as fh:
        fh.write(b"\xff\xfe not utf-8\n" + torn.encode())
    assert [e.seq for e in registry.history()] == [1]
    assert registry.warnings[0].startswith("history.jsonl line 2 is torn or not an entry ('")
    assert registry.warnings[1] == (
        f"history.jsonl line 3 is torn or not an entry ({torn[:60]!r}); skipped. History is "
        "append-only: the entry it held is lost, later ones are intact"
    )


def test_object_store_history_survives_bytes_that_are_not_utf8(s3: Registry) -> None:
    s3.fs.pipe_file(s3.path("history", f"{1:010d}.json"), b"\xff\xfe{")
    assert s3.history() == []
    assert s3.warnings[0].startswith("history/0000000001.json is torn or not an entry")


def test_object_store_publish_refuses_a_symlinked_file(
    s3: Registry, bundle: Path, tmp_path: Path
) -> None:
    (tmp_path / "same.onnx").write_bytes((bundle / "model.onnx").read_bytes())
    (bundle / "model.onnx").unlink()
    (bundle / "model.onnx").symlink_to(tmp_path / "same.onnx")
    with pytest.raises(RegistryError, match="model.onnx: is a symlink"):
        s3.publish(bundle, "demo", "1.0.0")
    assert not s3.fs.exists(s3.path("releases", "demo", "1.0.0"))


def test_object_store_lock_is_stamped_and_an_unstamped_one_is_stale(
    s3: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_USER", "carol")
    with s3.lock():
        held = json.loads(s3.fs.cat_file(s3.path(".lock")))
    assert sorted(held) == ["expires", "host", "owner", "pid", "taken", "token"]
    assert held["owner"] == "carol" and held["pid"] == os.getpid()
    assert held["taken"] <= time.time() <= held["expires"]
    s3.fs.pipe_file(s3.path(".lock"), json.dumps({"owner": "x", "host": "h", "taken": 5}).encode())
    with s3.lock():  # no expiry stamped: a crashed writer's; broken
        pass
    assert s3.warnings == ["broke a stale registry lock held by x@h since 5"]


def test_an_interrupted_canary_step_is_finished_with_its_share(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A canary step of the version already live (10 % -> 100 %) killed between its history
    entry and its pointer left the pointer at 10 %: recovery compared only version and digest
    and called it finished, and the retried step then recorded a second entry."""
    published(registry, tmp_path, "1.0.0", "1.1.0")
    registry.promote("demo", "1.0.0", "production", "first")
    registry.promote("demo", "1.1.0", "production", "canary", canary=10)
    real_write = reg.Registry._write

    def crash(self: Registry, path: str, data: RegistryFile) -> None:
        if "/channels/" in path.replace(os.sep, "/"):
            raise KeyboardInterrupt("killed between the history append and the pointer")
        real_write(self, path, data)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(reg.Registry, "_write", crash)
        registry.promote("demo", "1.1.0", "production", "all of it", canary=100)
    assert pointer(registry, "demo", "production").canary_percent == 10
    assert registry.check()  # finishes it, saying so
    assert pointer(registry, "demo", "production").canary_percent == 100
    retried = registry.promote("demo", "1.1.0", "production", "retry", canary=100)
    assert isinstance(retried, Unmoved) and len(registry.history()) == 3
    # a rollback moves the channel back with all of the traffic
    registry.rollback("demo", "production", "back")
    assert "canary_percent" not in pointer(registry, "demo", "production").document()
