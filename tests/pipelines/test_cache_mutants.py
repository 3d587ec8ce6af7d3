"""The shared DVC cache (pipelines/cache.py) on a small DVC project of its own: the remote's
configuration, what dvc.lock names, the eviction of an untrusted output with its cached
objects and run-cache entries, the screen's verdict per stage, and push/pull with the
run-cache's uncached outputs. Fast enough to run per mutant (scripts/mutation.py); the
trust chain on a real build is tests/pipelines/test_provenance.py."""

from __future__ import annotations

import configparser
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines import cache, provenance
from schemas import ShipyardError

DVC = str(Path(sys.executable).with_name("dvc"))
SECTION = "'remote \"shipyard\"'"
MD5_A = "a" * 32
MD5_B = "b" * 32


def dvc(root: Path, *args: str) -> str:
    done = subprocess.run([DVC, *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DVC project (no git) with one tracked file; the remote a folder beside it."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")  # no analytics daemon per DVC command
    root = tmp_path / "project"
    root.mkdir()
    dvc(root, "init", "-q", "--no-scm")
    (root / "data.txt").write_text("the tracked data\n")
    dvc(root, "add", "-q", "data.txt")
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", str(tmp_path / "remote"))
    monkeypatch.delenv("SHIPYARD_DVC_ENDPOINT", raising=False)
    monkeypatch.chdir(tmp_path)  # DVC run anywhere but in `root` finds no project
    return root


def local_config(root: Path) -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(root / ".dvc" / "config.local")
    return config


def test_the_remote_is_the_environments_or_one_per_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", "s3://bucket/dvc")
    assert cache.remote_url() == "s3://bucket/dvc"
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.remote_url() == str(tmp_path / ".cache" / "shipyard" / "dvc-remote")
    monkeypatch.delenv("SHIPYARD_DVC_REMOTE")
    assert cache.remote_url() == str(tmp_path / ".cache" / "shipyard" / "dvc-remote")


def test_configure_makes_the_folder_the_default_verified_remote_and_keeps_user_options(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cache.configure(project) == str(tmp_path / "remote")
    assert (tmp_path / "remote").is_dir()
    config = local_config(project)
    assert config[SECTION]["url"] == str(tmp_path / "remote")
    assert config[SECTION]["verify"] == "true"
    assert config["core"]["remote"] == "shipyard"
    assert "endpointurl" not in config[SECTION]
    dvc(project, "remote", "modify", "--local", "shipyard", "jobs", "3")
    dvc(project, "remote", "default", "--local", "--unset")
    other = tmp_path / "shared" / "dvc" / "remote"  # its parents made too
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", str(other))
    cache.configure(project)  # again: the url moves, the user's option stays
    assert other.is_dir()
    config = local_config(project)
    assert config[SECTION]["url"] == str(other)
    assert config[SECTION]["jobs"] == "3" and config[SECTION]["verify"] == "true"
    assert config["core"]["remote"] == "shipyard"


def test_an_object_store_url_makes_no_local_folder(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", "s3://bucket/dvc")
    monkeypatch.setenv("SHIPYARD_DVC_ENDPOINT", "http://127.0.0.1:9")
    assert cache.configure(project) == "s3://bucket/dvc"
    assert not (tmp_path / "s3:").exists() and not (project / "s3:").exists()
    config = local_config(project)
    assert config[SECTION]["url"] == "s3://bucket/dvc"
    assert config[SECTION]["endpointurl"] == "http://127.0.0.1:9"


def test_a_failing_dvc_command_is_a_shipyard_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ShipyardError) as info:
        cache._dvc(tmp_path, "remote", "list", "--local")  # not a DVC project
    message = str(info.value)
    assert message.startswith("`dvc remote list --local` failed: ERROR: ")


def lock(root: Path, stages: object) -> None:
    (root / "dvc.lock").write_text(
        yaml.safe_dump({"schema": "2.0", "stages": stages}, sort_keys=False)
    )


def test_the_locked_stage_instances_are_those_of_a_foreach_with_their_outs(
    tmp_path: Path,
) -> None:
    assert cache._locked(tmp_path) == []  # no dvc.lock
    (tmp_path / "dvc.lock").write_text("- a list\n")
    assert cache._locked(tmp_path) == []
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")  # no stage locked yet
    assert cache._locked(tmp_path) == []
    lock(
        tmp_path,
        {
            "code": {"outs": [{"path": "build/.params"}]},  # not a foreach instance
            "export@rel": {"outs": [{"path": "build/rel/export"}, "junk", {"path": 7}]},
            "pin@rel": "not a mapping",
            "plan@other": {"cmd": "x"},
        },
    )
    assert cache._locked(tmp_path) == [
        ("export", "rel", ["build/rel/export", "7"]),
        ("plan", "other", []),
    ]


def cached(root: Path, md5: str, data: bytes = b"object") -> Path:
    path = root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def run_entry(root: Path, name: str, body: object) -> Path:
    path = root / ".dvc" / "cache" / "runs" / name[:2] / name / "entry"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
    return path


def test_evict_removes_the_outputs_their_objects_and_the_run_cache_entries_naming_them(
    tmp_path: Path,
) -> None:
    root = tmp_path
    lock(
        root,
        {
            "export@rel": {
                "outs": [
                    {"path": "build/rel/export", "md5": MD5_A},
                    {"path": "build/rel/attestations/export.json", "md5": "ab"},
                    {"path": "build/rel/metrics/export.json"},
                ]
            },
            "export@other": {"outs": [{"path": "build/other/export", "md5": MD5_B}]},
        },
    )
    for rel in ("build/rel/export/model.onnx", "build/other/export/model.onnx"):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text("graph")
    (root / "build/rel/attestations").mkdir()
    (root / "build/rel/attestations/export.json").write_text("{}")
    a, b, short = cached(root, MD5_A), cached(root, MD5_B), cached(root, "ab" + "c" * 30)
    naming = run_entry(root, "r1", {"outs": [{"path": "x", "md5": MD5_A}, "junk"]})
    other = run_entry(root, "r2", {"outs": [{"path": "y", "md5": MD5_B}]})
    broken = run_entry(root, "a0", "outs: [unclosed\n")  # scanned first: skipped
    empty = run_entry(root, "r4", "")
    unhashed = run_entry(root, "r6", {"outs": [{"path": "build/rel/metrics/export.json"}]})
    # entries a writer of the remote could plant: a YAML list, outs not a list
    planted = run_entry(root, "r7", "- outs\n- " + MD5_A + "\n")
    odd = run_entry(root, "r8", {"outs": MD5_A})
    cache.evict(root, "export", "rel")
    assert planted.exists() and odd.exists()  # not entries DVC wrote: left alone, no crash
    assert not (root / "build/rel/export").exists()
    assert not (root / "build/rel/attestations/export.json").exists()
    assert (root / "build/other/export/model.onnx").is_file()
    assert not a.exists() and b.exists() and short.exists()
    assert not naming.exists()
    assert other.exists() and broken.exists() and empty.exists() and unhashed.exists()
    cache.evict(root, "plan", "rel")  # nothing locked for it: nothing to do
    assert b.exists() and other.exists()


def test_evict_with_no_run_cache_and_a_missing_output_removes_what_there_is(
    tmp_path: Path,
) -> None:
    lock(tmp_path, {"pin@rel": {"outs": [{"path": "build/rel/pin", "md5": MD5_A}]}})
    link = tmp_path / "build" / "rel" / "pin"
    link.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "kept").write_text("not ours")
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    cache.evict(tmp_path, "pin", "rel")  # a link to a folder goes, not what it points at
    assert not link.is_symlink() and (tmp_path / "elsewhere" / "kept").is_file()
    cache.evict(tmp_path, "pin", "rel")  # already gone: no error


def test_without_trusted_builders_the_screen_says_outputs_are_taken_on_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(provenance.TRUST_ENV, raising=False)
    lock(tmp_path, {"pin@rel": {"outs": [{"path": "build/rel/pin", "md5": MD5_A}]}})
    (tmp_path / "build/rel/pin").mkdir(parents=True)
    assert cache.screen(tmp_path) == [
        f"{provenance.TRUST_ENV} is not set: pulled outputs are trusted as the remote gave "
        "them (set it to the builders' public keys to check their provenance)"
    ]
    assert (tmp_path / "build/rel/pin").is_dir()


def test_the_screen_keeps_attested_outputs_and_evicts_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """provenance's verdicts stubbed: the screen's own part is which stages it asks about,
    what it removes, and the line it writes for each."""
    root = tmp_path
    lock(
        root,
        {
            "pin@rel": {"outs": [{"path": "build/rel/pin", "md5": MD5_A}]},
            "export@rel": {"outs": [{"path": "build/rel/export", "md5": MD5_B}]},
            "plan@rel": {"outs": [{"path": "build/rel/plan"}, {"path": "build/rel/p.json"}]},
            "gone@rel": {"outs": [{"path": "build/rel/gone"}]},
            "anon@rel": {"outs": [{"path": "build/rel/anon"}]},
        },
    )
    for out in ("pin", "export", "plan", "gone", "anon"):
        (root / "build/rel" / out).mkdir(parents=True)
    cached(root, MD5_A)
    export_object = cached(root, MD5_B)
    asked: list[tuple[str, str]] = []

    def stage_paths(r: Path, stage: str, release: str) -> object:
        assert r == root
        asked.append((stage, release))
        return None if stage == "gone" else stage

    def check(r: Path, paths: object, trusted: object) -> tuple[str | None, list[str]]:
        assert r == root and trusted == {"k": "key"}
        if paths == "export":
            return None, ["not signed by a trusted builder", "second problem"]
        return (None, []) if paths == "anon" else ("0123456789abcdef0123", [])

    monkeypatch.setattr(provenance, "trusted_keys", lambda: {"k": "key"})
    monkeypatch.setattr(provenance, "stage_paths", stage_paths)
    monkeypatch.setattr(provenance, "check", check)
    lines = cache.screen(root)
    assert lines == [
        "trusted pin@rel: built by 0123456789abcdef",
        "rebuild export@rel: not signed by a trusted builder",
        "trusted anon@rel: built by ?",
    ]
    # plan's second output is missing (DVC restores all or nothing): not asked about
    assert asked == [("pin", "rel"), ("export", "rel"), ("gone", "rel"), ("anon", "rel")]
    assert not (root / "build/rel/export").exists() and not export_object.exists()
    assert (root / "build/rel/pin").is_dir() and (root / "build/rel/gone").is_dir()


def test_push_sends_the_outputs_the_run_cache_and_its_uncached_outputs(
    project: Path, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    metrics = b'{"metric": 1}'
    md5 = hashlib.md5(metrics).hexdigest()
    cached(project, md5, metrics)
    run_entry(project, "e1", {"outs": [{"path": "m.json", "md5": md5}]})
    # DVC's last line (the tracked file and the run-cache entry), then ours
    assert cache.push(project) == (
        f"pushed to {remote}: 2 files pushed; 1 uncached output(s) for the run-cache"
    )
    assert (remote / "files" / "md5" / md5[:2] / md5[2:]).read_bytes() == metrics
    assert (remote / "runs" / "e1" / "e1" / "entry").is_file()  # the run-cache too
    # DVC sends the run-cache entry again; no uncached output: nothing said of them
    assert cache.push(project) == f"pushed to {remote}: 1 file pushed"


def test_pull_restores_what_was_pushed_and_the_run_cache_and_screens_it(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = tmp_path / "remote"
    (project / "more.txt").write_text("more data\n")
    dvc(project, "add", "-q", "more.txt")
    run_entry(project, "e1", {"outs": [{"path": "m.json", "md5": MD5_A}]})
    cache.push(project)
    # a fresh checkout; one output no one pushed stays missing, for `dvc repro` to build
    (project / "unpushed.txt").write_text("built here only\n")
    dvc(project, "add", "-q", "unpushed.txt")
    (project / "unpushed.txt").unlink()
    (project / "data.txt").unlink()
    (project / "more.txt").unlink()
    for path in sorted((project / ".dvc" / "cache").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()

    def screen(root: Path) -> list[str]:  # tested above
        assert root == project
        return ["trusted pin@rel: built by 0123", "rebuild export@rel: not signed"]

    monkeypatch.setattr(cache, "screen", screen)
    assert cache.pull(project).split("\n") == [
        f"pulled from {remote}: 2 files fetched and 2 files added",  # DVC's last line
        "trusted pin@rel: built by 0123",
        "rebuild export@rel: not signed",
    ]
    assert (project / "data.txt").read_text() == "the tracked data\n"
    assert (project / "more.txt").read_text() == "more data\n"
    assert not (project / "unpushed.txt").exists()
    assert (project / ".dvc" / "cache" / "runs" / "e1" / "e1" / "entry").is_file()


def test_each_uncached_output_of_the_run_cache_is_sent_once(tmp_path: Path) -> None:
    """DVC's layout on a folder remote, without DVC: the objects the run-cache entries name
    that the local cache holds and the remote lacks."""
    root, remote = tmp_path / "project", tmp_path / "remote"
    assert cache._push_uncached(root, str(remote)) == 0  # no run-cache at all
    first = b'{"metric": 1}'
    md5 = hashlib.md5(first).hexdigest()
    cached(root, md5, first)
    runs = root / ".dvc" / "cache" / "runs"
    runs.mkdir(parents=True)
    (runs / "unreadable").write_text("outs: [unclosed\n")  # scanned first: passed over
    run_entry(root, "e1", {"outs": [{"path": "m.json", "md5": md5}, {"md5": MD5_B}, "junk"]})
    run_entry(root, "e2", {"cmd": "no outputs"})
    run_entry(root, "e3", f"- {MD5_A}\n")  # not a mapping
    run_entry(root, "e4", {"outs": [{"path": "short", "md5": "ab" + "c" * 29}]})
    cached(root, "ab" + "c" * 29)
    cached(root, MD5_A)
    second = b"second"
    run_entry(root, "e0", {"outs": [{"path": "s", "md5": hashlib.md5(second).hexdigest()}]})
    cached(root, hashlib.md5(second).hexdigest(), second)
    assert cache._push_uncached(root, str(remote)) == 2
    assert sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()) == sorted(
        f"files/md5/{h[:2]}/{h[2:]}" for h in (md5, hashlib.md5(second).hexdigest())
    )
    assert (remote / "files" / "md5" / md5[:2] / md5[2:]).read_bytes() == first
    assert cache._push_uncached(root, str(remote)) == 0  # already there: not sent again
    # one more, in the folder of the one already sent and sorted after it
    later = next(
        data
        for data in (f"m{i}".encode() for i in range(100_000))
        if hashlib.md5(data).hexdigest()[:2] == md5[:2] and hashlib.md5(data).hexdigest() > md5
    )
    mine = hashlib.md5(later).hexdigest()
    cached(root, mine, later)
    run_entry(root, "e5", {"outs": [{"path": "later", "md5": mine}]})
    assert cache._push_uncached(root, str(remote) + "/") == 1
    assert (remote / "files" / "md5" / mine[:2] / mine[2:]).read_bytes() == later


def test_uncached_outputs_reach_the_s3_endpoint_the_environment_names(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no AWS_ENDPOINT_URL (the fixture sets one for the process), the objects go to
    SHIPYARD_DVC_ENDPOINT's S3 API."""
    import boto3

    from tests.conftest import bucket

    name = bucket()
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=name)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("SHIPYARD_DVC_ENDPOINT", s3_server)
    metrics = b"{}"
    md5 = hashlib.md5(metrics).hexdigest()
    cached(tmp_path, md5, metrics)
    run_entry(tmp_path, "e1", {"outs": [{"path": "m.json", "md5": md5}]})
    assert cache._push_uncached(tmp_path, f"s3://{name}/dvc") == 1
    listed = s3.list_objects_v2(Bucket=name)["Contents"]
    assert [o["Key"] for o in listed] == [f"dvc/files/md5/{md5[:2]}/{md5[2:]}"]
    assert cache._push_uncached(tmp_path, f"s3://{name}/dvc/") == 0
