"""The trust chain, attacked: each test tries one attack on a bundle or the registry and
asserts the refusal and its message. The same registry tests run against a local folder
and against a real S3 API on localhost (moto's server mode)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from pipelines.gate import gate
from pipelines.registry import Registry
from pipelines.signing import sign
from schemas import RegistryError
from stages.bundling.oms import verify_bundle
from tests.conftest import (
    Workspace,
    bucket,
    built_as,
    gpt2_spec,
    local_or_s3,
    remanifest,
    writable_copy,
)
from tests.keys import keypair

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))
ONNX = "serving/triton/tiny-gpt2/1/model.onnx"
RUNTIME_DIR = "serving/mlserver/tiny-gpt2"


@pytest.fixture
def bundle(built_gpt2: Workspace, tmp_path: Path) -> Path:
    return writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "bundle")


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [SHIPYARD, *args],
        text=True,
        capture_output=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


# --------------------------------------------------------------------------- S3 (moto)


@pytest.fixture(params=["local", "s3"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Registry:
    return Registry(local_or_s3(request, tmp_path, "shipyard"))


# --------------------------------------------------------------------------- attack 1
def test_attack_1_a_hidden_module_listed_in_ignore_paths_fails_verify(bundle: Path) -> None:
    (bundle / RUNTIME_DIR / "numpy.py").write_text("import os; os.system('id')\n")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["predicate"]["serialization"]["ignore_paths"].append(f"{RUNTIME_DIR}/numpy.py")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(bundle)
    assert problems[0].startswith("manifest.json: ignore_paths is [")
    assert "skips only ['manifest.json', 'model.sig']" in problems[0]
    done = cli("verify", str(bundle))
    assert done.returncode == 5 and "ignore_paths" in done.stderr


def test_attack_1b_an_added_file_fails_even_when_empty(bundle: Path) -> None:
    (bundle / RUNTIME_DIR / "numpy.py").write_bytes(b"")  # OMS lists no empty files
    assert verify_bundle(bundle) == [f"{RUNTIME_DIR}/numpy.py: added (not in the manifest)"]
    (bundle / RUNTIME_DIR / "numpy.py").unlink()
    (bundle / "model.sig").write_text("not a signature")  # one of the two fixed skips
    assert verify_bundle(bundle) == []


# --------------------------------------------------------------------------- attack 2
def test_attack_2_edited_facts_fail_verify(bundle: Path) -> None:
    facts = bundle / "shipyard.json"
    data = json.loads(facts.read_text())
    data["stages"]["parity"]["status"] = "passed"
    data["evaluation"]["perplexity"] = 1.0
    facts.write_text(json.dumps(data))
    assert verify_bundle(bundle) == ["shipyard.json: changed (sha256 differs from the manifest)"]


def test_attack_2_the_gate_baseline_comes_only_from_a_verified_bundle(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    registry = Registry(str(tmp_path / "registry"))
    registry.publish(built_gpt2.out("tiny-gpt2", "bundle"), "tiny-gpt2", "0.1.0")
    registry.promote("tiny-gpt2", "0.1.0", "production", "baseline")
    published = Path(registry.path("releases", "tiny-gpt2", "0.1.0"))
    facts = published / "shipyard.json"
    facts.chmod(0o644)
    data = json.loads(facts.read_text())
    data["evaluation"]["perplexity"] = 1e9  # a terrible baseline makes any candidate pass
    facts.write_text(json.dumps(data))
    spec = gpt2_spec()
    spec["evaluation"]["thresholds"] = [
        {
            "metric": "perplexity",
            "min_relative_change": -0.01,
            "greater_is_better": False,
            "baseline": "production",
        }
    ]
    result = gate(built_gpt2.root, [built_gpt2.spec(spec)], registry)
    row = next(r for r in result.rows if r.check.startswith("perplexity vs production"))
    assert row.verdict == "FAIL" and not result.ok
    assert "shipyard.json: changed" in row.detail


# --------------------------------------------------------------------------- attack 3
def test_attack_3_a_replaced_bundle_with_a_rewritten_manifest_is_not_promoted(
    built_gpt2: Workspace, registry: Registry, tmp_path: Path
) -> None:
    registry.publish(built_gpt2.out("tiny-gpt2", "bundle"), "tiny-gpt2", "0.1.0")
    evil = writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "evil")
    card = evil / "MODEL_CARD.md"
    card.write_text(card.read_text() + "\nreplaced\n")
    remanifest(evil)
    assert verify_bundle(evil) == []  # self-consistent: only the publish record tells
    target = registry.path("releases", "tiny-gpt2", "0.1.0")
    if registry.local:
        shutil.rmtree(target)
        shutil.copytree(evil, target)
    else:
        registry.fs.rm(target, recursive=True)
        registry.fs.put(str(evil) + "/", target, recursive=True)
    with pytest.raises(RegistryError, match="but its publish record says") as info:
        registry.promote("tiny-gpt2", "0.1.0", "production", "should fail")
    assert "replaced after publishing" in str(info.value)
    assert registry.channel("tiny-gpt2", "production") is None and registry.history() == []


# --------------------------------------------------------------------------- attack 4
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("promote", "../../outside@0.1.0", "--to", "production"), "release name '../../outside'"),
        (("promote", "tiny-gpt2@../../x", "--to", "production"), "version '../../x'"),
        (("promote", "tiny-gpt2@0.1.0", "--to", "../../x"), "channel '../../x' is not valid"),
        (("promote", "tiny-gpt2@0.1.0", "--to", "a/b"), "channel 'a/b' is not valid"),
        (("promote", "tiny-gpt2@0.1.0", "--to", "Production"), "channel 'Production'"),
        (("rollback", "../x", "--release", "tiny-gpt2"), "channel '../x' is not valid"),
    ],
)
def test_attack_4_registry_paths_cannot_leave_the_root(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    root = tmp_path / "deep" / "registry"
    done = cli(*args, "--registry", str(root), cwd=tmp_path)
    assert done.returncode == 5, done.stderr
    assert message in done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) in ([], [".lock"])


def test_attack_4_a_spec_version_that_walks_out_is_refused_at_validate(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    path = ws.write(gpt2_spec(version="../../x"))
    done = cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "version" in done.stderr
    registry = Registry(str(tmp_path / "registry"))
    with pytest.raises(RegistryError, match="is not Semantic Versioning"):
        registry.publish(tmp_path, "tiny-gpt2", "../../x")
    with pytest.raises(RegistryError, match="resolves outside the registry"):
        (Path(registry.root) / "releases").mkdir()
        (Path(registry.root) / "releases" / "tiny-gpt2").symlink_to(tmp_path)
        registry.promote("tiny-gpt2", "0.1.0", "production", "via a symlink")


# --------------------------------------------------------------------------- attack 5
def test_attack_5_two_concurrent_publishes_of_one_version_leave_one_good_copy(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    url = str(tmp_path / "registry")
    env = {"SHIPYARD_REGISTRY": url, "SHIPYARD_ROOT": str(built_gpt2.root)}
    procs = [
        subprocess.Popen(
            [SHIPYARD, "publish", "tiny-gpt2"],
            env={**os.environ, **env},
            cwd=built_gpt2.root,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    said = sorted(o[0].split(" (")[0] for o in outputs)
    assert said == ["tiny-gpt2@0.1.0 already published", "tiny-gpt2@0.1.0 published"]
    registry = Registry(url)
    assert verify_bundle(Path(registry.path("releases", "tiny-gpt2", "0.1.0"))) == []
    assert [p.name for p in Path(registry.path("releases", "tiny-gpt2")).iterdir()] != []
    leftovers = [p.name for p in Path(registry.path("releases", "tiny-gpt2")).iterdir()]
    assert sorted(leftovers) == ["0.1.0", "0.1.0.json"]


def test_attack_5_an_interrupted_publish_is_finished_or_removed_saying_which(
    built_gpt2: Workspace, registry: Registry, tmp_path: Path
) -> None:
    source = built_gpt2.out("tiny-gpt2", "bundle")
    # Crash after the bundle landed, before its record: intact, so it is finished.
    registry.fs.put(
        str(built_as(source, tmp_path / "v1.0.0", "1.0.0")) + "/",
        registry.path("releases", "tiny-gpt2", "1.0.0"),
        recursive=True,
    )
    # Crash mid-copy: a file is missing, so it is removed.
    broken = writable_copy(source, tmp_path / "broken")
    (broken / "MODEL_CARD.md").unlink()
    registry.fs.put(
        str(broken) + "/", registry.path("releases", "tiny-gpt2", "1.1.0"), recursive=True
    )
    registry.fs.makedirs(registry.path("releases", "tiny-gpt2", ".staging-2.0.0-dead"))
    registry.fs.pipe_file(registry.path("releases", "tiny-gpt2", ".staging-2.0.0-dead", "x"), b"x")
    actions = registry.check()
    assert "finished tiny-gpt2@1.0.0: interrupted publish verified, record written" in actions
    assert any(
        a.startswith("removed tiny-gpt2@1.1.0: interrupted publish that does not verify")
        and "MODEL_CARD.md: missing" in a
        for a in actions
    ), actions
    assert "removed tiny-gpt2/.staging-2.0.0-dead: leftover of an interrupted publish" in actions
    assert (
        registry.record("tiny-gpt2", "1.0.0").digest  # type: ignore[union-attr]
        == json.loads((tmp_path / "v1.0.0" / "manifest.json").read_text())["subject"][0]["digest"][
            "sha256"
        ]
    )
    assert registry.check() == []
    # 1.1.0 can now be published for real, and 1.0.0 promoted
    again = built_as(source, tmp_path / "v1.1.0", "1.1.0")
    assert not registry.publish(again, "tiny-gpt2", "1.1.0").already
    assert registry.promote("tiny-gpt2", "1.0.0", "staging", "recovered").to == "tiny-gpt2@1.0.0"


# --------------------------------------------------------------------------- attack 6
def test_attack_6_a_torn_history_line_is_reported_never_blocking(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    url = str(tmp_path / "registry")
    registry = Registry(url)
    for version in ("1.0.0", "1.1.0"):
        copy = built_as(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / version, version)
        registry.publish(copy, "tiny-gpt2", version)
    registry.promote("tiny-gpt2", "1.0.0", "production", "first")
    with open(registry.path("history.jsonl"), "ab") as fh:
        fh.write(b'{"seq": 2, "at": "2026-')  # a crash mid-append
    registry.promote("tiny-gpt2", "1.1.0", "production", "second")
    assert [e.seq for e in registry.history()] == [1, 2]
    assert registry.warnings and "history.jsonl line 2 is torn" in registry.warnings[0]
    assert registry.rollback("tiny-gpt2", "production", "back").to == "tiny-gpt2@1.0.0"
    done = cli("history", "--registry", url)
    assert done.returncode == 0 and "rollback" in done.stdout
    assert "warning: history.jsonl line 2 is torn" in done.stderr


def test_attack_6_object_store_history_appends_one_object_per_entry(
    built_gpt2: Workspace, s3_server: str
) -> None:
    registry = Registry(f"s3://history-{bucket()}/reg")
    scratch = Path(tempfile.mkdtemp(prefix="shipyard-v1.0.0-"))
    first_build = built_as(built_gpt2.out("tiny-gpt2", "bundle"), scratch / "b", "1.0.0")
    registry.publish(first_build, "tiny-gpt2", "1.0.0")
    registry.promote("tiny-gpt2", "1.0.0", "production", "first")
    first = registry.fs.info(registry.path("history", f"{1:010d}.json"))
    registry.promote("tiny-gpt2", "1.0.0", "staging", "second")
    objects = sorted(registry.fs.ls(registry.path("history"), detail=False))
    assert [o.rsplit("/", 1)[1] for o in objects] == [f"{1:010d}.json", f"{2:010d}.json"]
    assert registry.fs.info(registry.path("history", f"{1:010d}.json"))["ETag"] == first["ETag"]
    registry.fs.pipe_file(registry.path("history", f"{3:010d}.json"), b'{"seq": 3, "at')
    assert [e.seq for e in registry.history()] == [1, 2]
    assert "history/0000000003.json is torn" in registry.warnings[0]


def test_a_remote_lock_is_renewed_while_held_fenced_and_unlocked_by_name(
    s3_server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The S3 lock was never renewed: a publish longer than SHIPYARD_LOCK_STALE_S had its
    live lock broken (and `registry check` then deleted the upload in progress). A killed
    holder blocked every writer for the lease, with no unlock command."""
    import threading

    import pipelines.storage as storage
    from pipelines.cli import main

    monkeypatch.setattr(storage, "LOCK_STALE_S", 0.6)
    monkeypatch.setattr(storage, "LOCK_TIMEOUT_S", 10.0)
    url = f"s3://lease-{bucket()}/reg"
    holder, other = Registry(url), Registry(url)
    released: list[float] = []
    inside = threading.Event()

    def long_publish() -> None:
        with holder.lock():
            inside.set()
            time.sleep(2.0)  # over three leases
            holder.store.fence()  # still ours: renewed, never broken
            released.append(time.monotonic())

    worker = threading.Thread(target=long_publish)
    worker.start()
    assert inside.wait(5)
    with other.lock():
        got = time.monotonic()
    worker.join()
    assert released and got >= released[0], "the live lock was broken"
    assert not any("broke a stale" in w for w in other.warnings), other.warnings

    # fencing: a holder whose lease lapsed (stalled, then broken and taken) commits nothing
    with holder.lock():
        path, _, lease = holder.store._held  # type: ignore[attr-defined]
        lease.stop.set()
        lease.join()
        taken = {"owner": "next", "host": "h", "token": "theirs", "expires": time.time() + 60}
        holder.fs.pipe_file(path, json.dumps(taken).encode())
        with pytest.raises(RegistryError, match="lost the registry lock"):
            holder.store.fence()
        holder.fs.rm(path)

    # unlock: a dead holder's lock is removed, naming it; a live one only with --force
    lock = holder.path(".lock")
    dead = {"owner": "ghost", "host": "gone", "pid": 7, "token": "t", "taken": 0, "expires": 1}
    holder.fs.pipe_file(lock, json.dumps(dead).encode())
    assert main(["registry", "unlock", "--registry", url]) == 0
    assert (
        "removed the registry lock held by ghost@gone (pid 7) (expired)" in capsys.readouterr().out
    )
    live = {**dead, "expires": time.time() + 600}
    holder.fs.pipe_file(lock, json.dumps(live).encode())
    assert main(["registry", "unlock", "--registry", url]) == 5
    assert "held by ghost@gone (pid 7)" in capsys.readouterr().err
    assert holder.fs.exists(lock)
    assert main(["registry", "unlock", "--force", "--registry", url]) == 0
    assert not holder.fs.exists(lock)
    assert main(["registry", "unlock", "--registry", url]) == 0
    assert "not locked" in capsys.readouterr().out


def test_remote_lock_is_owner_stamped_and_a_stale_one_expires(
    s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines.storage as storage

    registry = Registry(f"s3://lock-{bucket()}/reg")
    stale = {"owner": "ghost", "host": "gone", "token": "t", "taken": 0, "expires": 1}
    registry.fs.pipe_file(registry.path(".lock"), json.dumps(stale).encode())
    with registry.lock():
        held = json.loads(registry.fs.cat_file(registry.path(".lock")))
        assert held["owner"] != "ghost" and held["expires"] > time.time()
    assert "broke a stale registry lock held by ghost@gone" in registry.warnings[0]
    assert not registry.fs.exists(registry.path(".lock"))
    live = {**stale, "expires": time.time() + 600}
    registry.fs.pipe_file(registry.path(".lock"), json.dumps(live).encode())
    monkeypatch.setattr(storage, "LOCK_TIMEOUT_S", 0.5)
    with pytest.raises(RegistryError, match="held for over 0 s by .*ghost"), registry.lock():
        pass


# --------------------------------------------------------------------------- attack 7
def test_attack_7_publish_hashes_what_it_copied_not_what_it_checked(
    built_gpt2: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines.storage as storage

    real_copytree = shutil.copytree

    def copy_then_tamper(src, dst, *args, **kwargs):  # the file changes while it is copied
        out = real_copytree(src, dst, *args, **kwargs)
        if not Path(dst).name.startswith(".staging-"):
            return out
        path = Path(dst) / ONNX
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return out

    monkeypatch.setattr(storage.shutil, "copytree", copy_then_tamper)
    registry = Registry(str(tmp_path / "registry"))
    with pytest.raises(RegistryError, match=f"copied bundle (?s:.*){ONNX}: changed"):
        registry.publish(built_gpt2.out("tiny-gpt2", "bundle"), "tiny-gpt2", "0.1.0")
    assert registry.record("tiny-gpt2", "0.1.0") is None
    assert list(Path(registry.path("releases", "tiny-gpt2")).iterdir()) == []


# --------------------------------------------------------------------------- attack 8
def test_attack_8_a_symlinked_manifest_or_file_is_refused(bundle: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    shutil.move(bundle / "manifest.json", outside)
    (bundle / "manifest.json").symlink_to(outside)
    [problem] = verify_bundle(bundle)
    assert problem.startswith("manifest.json: not a valid OMS manifest (manifest.json is a symlink")
    (bundle / "manifest.json").unlink()
    shutil.move(outside, bundle / "manifest.json")
    card = bundle / "MODEL_CARD.md"
    shutil.move(card, tmp_path / "card.md")
    card.symlink_to(tmp_path / "card.md")
    assert verify_bundle(bundle) == [
        "MODEL_CARD.md: is a symlink; bundles hold plain files only",
        "MODEL_CARD.md: missing (listed in the manifest)",
    ]


# --------------------------------------------------------------------------- signatures
def test_a_channel_requiring_a_signature_refuses_unsigned_and_wrongly_signed_bundles(
    built_gpt2: Workspace, registry: Registry, tmp_path: Path
) -> None:
    team_key, team_pub = keypair(tmp_path, "team")
    rogue_key, _ = keypair(tmp_path, "rogue")
    registry.require_signature("production", [team_pub])
    source = built_gpt2.out("tiny-gpt2", "bundle")
    registry.publish(built_as(source, tmp_path / "v1", "1.0.0"), "tiny-gpt2", "1.0.0")
    with pytest.raises(
        RegistryError, match="requires a signature by a trusted key; tiny-gpt2@1.0.0 is not signed "
    ):
        registry.promote("tiny-gpt2", "1.0.0", "production", "unsigned")
    assert registry.promote("tiny-gpt2", "1.0.0", "staging", "no policy there").to
    rogue = built_as(source, tmp_path / "rogue", "1.1.0")
    sign(rogue, private_key=rogue_key)
    registry.publish(rogue, "tiny-gpt2", "1.1.0")
    with pytest.raises(RegistryError, match="is not signed by one .*signature does not verify"):
        registry.promote("tiny-gpt2", "1.1.0", "production", "rogue key")
    good = built_as(source, tmp_path / "good", "1.2.0")
    sign(good, private_key=team_key)
    registry.publish(good, "tiny-gpt2", "1.2.0")
    assert registry.promote("tiny-gpt2", "1.2.0", "production", "signed").to == "tiny-gpt2@1.2.0"
    assert [e.to for e in registry.history()] == ["tiny-gpt2@1.0.0", "tiny-gpt2@1.2.0"]


def test_s3_registry_publish_promote_rollback_status_through_the_cli(
    built_gpt2: Workspace, s3_server: str
) -> None:
    url = f"s3://cli-{bucket()}/registry"
    env = {"SHIPYARD_REGISTRY": url, "SHIPYARD_ROOT": str(built_gpt2.root)}
    spec = built_gpt2.root / "releases" / "tiny-gpt2.yaml"
    assert spec.is_file()
    done = cli("publish", "tiny-gpt2", env=env, cwd=built_gpt2.root)
    assert done.returncode == 0, done.stderr
    registry = Registry(url)
    scratch = Path(tempfile.mkdtemp(prefix="shipyard-v0.2.0-"))
    second = built_as(built_gpt2.out("tiny-gpt2", "bundle"), scratch / "b", "0.2.0")
    registry.publish(second, "tiny-gpt2", "0.2.0")
    for version in ("0.1.0", "0.2.0"):
        done = cli(
            "promote", f"tiny-gpt2@{version}", "--to", "production", env=env, cwd=built_gpt2.root
        )
        assert done.returncode == 0, done.stderr
    done = cli("rollback", "production", "--reason", "p99", env=env, cwd=built_gpt2.root)
    assert done.returncode == 0 and "tiny-gpt2@0.2.0 -> tiny-gpt2@0.1.0" in done.stdout
    assert "tiny-gpt2        production 0.1.0" in cli("status", env=env).stdout
    history = cli("history", env=env).stdout
    assert history.count("promote") == 2 and "rollback" in history


def test_a_bundle_whose_report_says_failed_is_neither_published_nor_promoted(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    evil = writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "evil")
    report = evil / "reports" / "parity.json"
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "status": "failed", "reasons": ["out of tolerance"]}))
    remanifest(evil)  # consistent with itself: only the verdicts tell
    assert verify_bundle(evil) == []
    registry = Registry(str(tmp_path / "registry"))
    with pytest.raises(RegistryError, match=r"stages that did not pass \(parity: failed"):
        registry.publish(evil, "tiny-gpt2", "0.1.0")
    # the same refusal at promote, for a bundle slipped into the registry by hand
    shutil.copytree(evil, registry.path("releases", "tiny-gpt2", "0.1.0"))
    digest = json.loads((evil / "manifest.json").read_text())["subject"][0]["digest"]["sha256"]
    record = {"release": "tiny-gpt2", "version": "0.1.0", "digest": digest}
    Path(registry.path("releases", "tiny-gpt2", "0.1.0.json")).write_text(json.dumps(record))
    with pytest.raises(RegistryError, match=r"parity: failed"):
        registry.promote("tiny-gpt2", "0.1.0", "production", "should fail")


def test_a_renewal_never_overwrites_a_lock_another_writer_took(
    s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42 item 7: the renewal read the lock object and wrote it back with its own
    token: after a breaker had taken it, the late holder's renewal overwrote the breaker's
    lock, and its fence passed. The lease is an object of its own now: the lock stays the
    breaker's, and the late holder's fence fails."""
    import pipelines.storage as storage

    monkeypatch.setattr(storage, "LOCK_STALE_S", 30.0)
    url = f"s3://renew-{bucket()}/reg"
    holder = Registry(url)
    with holder.lock():
        path, token, lease = holder.store._held  # type: ignore[attr-defined]
        holder.fs.rm(path)  # a breaker removed it ...
        taken = {"owner": "breaker", "token": "theirs", "taken": time.time(), "expires": 0}
        holder.fs.pipe_file(path, json.dumps(taken).encode())  # ... and took it
        lease.renew()  # the late holder's renewal
        assert json.loads(holder.fs.cat_file(path))["token"] == "theirs"
        with pytest.raises(RegistryError, match="lost the registry lock"):
            holder.store.fence()
        holder.fs.rm(path)


def test_check_leaves_an_upload_alone_while_its_uploader_lease_is_live(
    s3_server: str, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42 item 7: `registry check` broke a live publisher's lock and removed its
    upload in flight; the publish then recorded a version with no manifest. Now:
    - while the uploader's lease is live, check leaves the upload alone (even with the lock
      itself forced away), and the publisher's fence refuses to record after losing it;
    - once its lease has lapsed (the holder is gone), check removes the upload."""
    import threading

    import pipelines.storage as storage

    monkeypatch.setattr(storage, "LOCK_STALE_S", 1.5)
    monkeypatch.setattr(storage, "LOCK_TIMEOUT_S", 20.0)
    url = f"s3://inflight-{bucket()}/reg"
    holder, breaker = Registry(url), Registry(url)
    uploading, go_on = threading.Event(), threading.Event()
    put = type(holder.store).put_tree

    def slow_put(self: Any, src: Path, target: str, verify: Any) -> Any:
        out = put(self, src, target, verify)
        uploading.set()
        assert go_on.wait(30)
        return out

    monkeypatch.setattr(type(holder.store), "put_tree", slow_put)
    failed: list[BaseException] = []

    def publish() -> None:
        try:
            holder.publish(bundle, "tiny-gpt2", "0.1.0")
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failed.append(exc)

    worker = threading.Thread(target=publish)
    worker.start()
    assert uploading.wait(60)
    time.sleep(2.0)  # past one lease: renewals keep it live
    breaker.store.unlock(force=True)  # the lock forced away under its live holder
    actions = breaker.check()
    assert any("left tiny-gpt2@0.1.0 alone: an upload in flight" in a for a in actions), actions
    assert holder.fs.exists(holder.path("releases", "tiny-gpt2", "0.1.0", "manifest.json"))
    # nor may another publish of the same version write into that upload
    with pytest.raises(RegistryError, match="tiny-gpt2@0.1.0 is being uploaded by"):
        breaker.publish(bundle, "tiny-gpt2", "0.1.0")
    go_on.set()
    worker.join(60)
    assert failed and "lost the registry lock" in str(failed[0]), failed
    assert holder.record("tiny-gpt2", "0.1.0") is None  # nothing recorded
    # the holder has stopped: its lease lapses, and check then clears what it left
    time.sleep(1.6)
    actions = breaker.check()
    # the upload was whole: check verifies and records it, and its marker goes
    assert any("finished tiny-gpt2@0.1.0" in a for a in actions), actions
    assert breaker.record("tiny-gpt2", "0.1.0") is not None
    marker = holder.path("releases", "tiny-gpt2", ".upload-0.1.0.json")
    assert not holder.fs.exists(marker)


@pytest.mark.parametrize(
    "tamper",
    ["model card", "alert rules", "added file", "renamed attested file", "deleted file"],
)
def test_a_resealed_bundle_fails_verify_provenance(
    built_gpt2: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: str
) -> None:
    """Issue 42 item 2: `verify --provenance` passed a bundle whose model card, alert
    rules, an added, a renamed or a deleted file differed from what was attested, once
    its manifest was rebuilt. The bundle carries the file list its builder signed
    (attestations/bundle.json); every shipped file is held to it by name and digest."""
    from pipelines.bundle_provenance import bundle_chain
    from stages.bundling.dsse import key_id

    key, pub = keypair(tmp_path, "builder")
    monkeypatch.setenv("SHIPYARD_BUILDER_KEY", str(key))
    assert built_gpt2.run("bundle", gpt2_spec()).status.value == "passed"
    monkeypatch.delenv("SHIPYARD_BUILDER_KEY")
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    public = load_pem_public_key(pub.read_bytes())
    trusted = {key_id(public): public}
    bundle = writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "bundle")
    lines, problems = bundle_chain(bundle, trusted, ("bundle",))
    assert problems == [] and lines == [f"bundle: built by {key_id(public)}"]
    card = "MODEL_CARD.md"
    alerts = next(p for p in bundle.rglob("*.yml") if "alert" in p.name or "rules" in p.name)
    if tamper == "model card":
        (bundle / card).write_text((bundle / card).read_text() + "\nSafe for medical use.\n")
    elif tamper == "alert rules":
        alerts.write_text(alerts.read_text().replace("for:", "for: 99h #", 1))
    elif tamper == "added file":
        (bundle / "serving" / "extra.py").write_text("import os\n")
    elif tamper == "renamed attested file":
        (bundle / card).rename(bundle / "README.md")
    else:
        (bundle / card).unlink()
    remanifest(bundle)  # re-sealed: `shipyard verify` alone now passes
    assert verify_bundle(bundle) == []
    _, problems = bundle_chain(bundle, trusted, ("bundle",))
    assert problems, tamper
    assert all(p.startswith("shipped file ") for p in problems), problems
    built_gpt2.run("bundle", gpt2_spec())  # the shared workspace as it was (unsigned)
