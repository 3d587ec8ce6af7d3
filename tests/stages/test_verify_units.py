"""`verify_bundle` and the manifest's own checks at their boundaries, on small synthetic
bundles (issue 16: the verify tests rebuild tiny-gpt2, which mutation testing cannot afford
per mutant). Each attack edits a real folder or a real manifest and expects one named
problem; the untouched bundle must verify clean in every test."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.manifest import SHARD_SIZE, algorithm_label
from stages.bundling import oms
from stages.bundling.oms import load_manifest, verify_bundle
from tests.conftest import remanifest


def manifest_for(folder: Path, shard: int = SHARD_SIZE) -> None:
    remanifest(folder, "demo@1.0.0", shard)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "bundle"
    (folder / "serving" / "runtime").mkdir(parents=True)
    (folder / "model.onnx").write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    (folder / "serving" / "runtime" / "model.py").write_text("print('hi')\n")
    (folder / "shipyard.json").write_text('{"release": "demo"}')
    manifest_for(folder)
    assert verify_bundle(folder) == []
    return folder


def edit_manifest(folder: Path, change: Any) -> None:
    data = json.loads((folder / "manifest.json").read_text())
    change(data)
    (folder / "manifest.json").write_text(json.dumps(data))


def resources(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = data["predicate"]["resources"]
    return out


# --------------------------------------------------------------------------- files
def test_every_added_missing_or_changed_file_is_named(bundle: Path) -> None:
    (bundle / "serving" / "runtime" / "numpy.py").write_text("")  # empty still counts
    (bundle / "shipyard.json").unlink()
    blob = bytearray((bundle / "model.onnx").read_bytes())
    blob[-1] ^= 1  # the last byte of the last shard
    (bundle / "model.onnx").write_bytes(bytes(blob))
    assert verify_bundle(bundle) == [
        "serving/runtime/numpy.py: added (not in the manifest)",
        "shipyard.json: missing (listed in the manifest)",
        "model.onnx: changed (sha256 differs from the manifest)",
    ]


def test_a_change_in_any_shard_is_found_and_the_shards_are_exact(tmp_path: Path) -> None:
    folder = tmp_path / "b"
    folder.mkdir()
    size = 3 * 4096 + 1000
    (folder / "w.bin").write_bytes(bytes(size))
    manifest_for(folder, shard=4096)  # 4 shards, the last one short
    names = [r.name for r in load_manifest(folder / "manifest.json").predicate.resources]
    assert names == ["w.bin:0:4096", "w.bin:4096:8192", "w.bin:8192:12288", "w.bin:12288:13288"]
    assert verify_bundle(folder) == []
    for offset in (0, 4095, 4096, size - 1):
        blob = bytearray(size)
        blob[offset] = 1
        (folder / "w.bin").write_bytes(bytes(blob))
        assert verify_bundle(folder) == ["w.bin: changed (sha256 differs from the manifest)"]
    (folder / "w.bin").write_bytes(bytes(size + 1))  # one byte longer: the last shard differs
    assert verify_bundle(folder) == ["w.bin: changed (sha256 differs from the manifest)"]


def test_the_manifest_and_signature_are_the_only_unhashed_files(bundle: Path) -> None:
    (bundle / "model.sig").write_text("{}")
    assert verify_bundle(bundle) == []
    (bundle / "serving" / "model.sig").write_text("{}")  # only at the top
    assert verify_bundle(bundle) == ["serving/model.sig: added (not in the manifest)"]


def test_symlinks_and_special_files_are_refused(bundle: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.py").write_text("x = 1\n")
    (bundle / "serving" / "link.py").symlink_to(tmp_path / "outside.py")
    (bundle / "serving" / "dirlink").symlink_to(tmp_path)
    os.mkfifo(bundle / "pipe")
    problems = verify_bundle(bundle)
    assert problems == [
        "pipe: is not a regular file",
        "serving/dirlink: is a symlink; bundles hold plain files only",
        "serving/link.py: is a symlink; bundles hold plain files only",
    ]


def test_a_folder_that_is_not_a_bundle_says_so(bundle: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(bundle)
    assert verify_bundle(tmp_path / "link")[0].endswith(
        "not a directory (or a symlink to one); not a Shipyard bundle"
    )
    assert "not a directory" in verify_bundle(bundle / "model.onnx")[0]
    (bundle / "manifest.json").unlink()
    assert verify_bundle(bundle) == ["manifest.json: missing; not a Shipyard bundle"]


def test_a_manifest_that_is_a_symlink_a_folder_or_too_big_is_refused(
    bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real.json"
    (bundle / "manifest.json").rename(real)
    (bundle / "manifest.json").symlink_to(real)
    assert verify_bundle(bundle) == [
        "manifest.json: not a valid OMS manifest (manifest.json is a symlink; a bundle holds "
        "plain files only)"
    ]
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").mkdir()
    assert verify_bundle(bundle) == [
        "manifest.json: not a valid OMS manifest (manifest.json is not a regular file)"
    ]
    (bundle / "manifest.json").rmdir()
    real.rename(bundle / "manifest.json")
    size = (bundle / "manifest.json").stat().st_size
    monkeypatch.setattr(oms, "MAX_MANIFEST_BYTES", size)
    assert verify_bundle(bundle) == []  # exactly at the limit
    monkeypatch.setattr(oms, "MAX_MANIFEST_BYTES", size - 1)
    assert verify_bundle(bundle) == [
        f"manifest.json: not a valid OMS manifest (manifest.json is {size} bytes (over {size - 1}))"
    ]


@pytest.mark.parametrize("content", [b"{", b"[]", b'{"subject": []}', b"\xff\xfe"])
def test_a_manifest_that_does_not_parse_is_named(bundle: Path, content: bytes) -> None:
    (bundle / "manifest.json").write_bytes(content)
    (problem,) = verify_bundle(bundle)
    assert problem.startswith("manifest.json: not a valid OMS manifest (")


# --------------------------------------------------------------------------- the manifest
def _ignore(data: dict[str, Any]) -> None:
    data["predicate"]["serialization"]["ignore_paths"].append("serving")


def _shard(size: int) -> Any:
    def change(data: dict[str, Any]) -> None:
        data["predicate"]["serialization"]["shard_size"] = size
        for r in resources(data):
            r["algorithm"] = algorithm_label(size)

    return change


def _two_subjects(data: dict[str, Any]) -> None:
    data["subject"].append(data["subject"][0])


def _md5(data: dict[str, Any]) -> None:
    data["subject"][0]["digest"] = {"md5": "0" * 32}


def _twice(data: dict[str, Any]) -> None:
    resources(data).append(resources(data)[-1])


def _label(data: dict[str, Any]) -> None:
    resources(data)[0]["algorithm"] = "sha256"


def _name(data: dict[str, Any]) -> None:
    resources(data)[0]["name"] = "model.onnx"


def _order(data: dict[str, Any]) -> None:
    resources(data).reverse()


def _subject(data: dict[str, Any]) -> None:
    data["subject"][0]["digest"]["sha256"] = "0" * 64


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_ignore, "manifest.json: ignore_paths is ['manifest.json', 'model.sig', 'serving']"),
        (_shard(0), "manifest.json: shard_size 0 is not one Shipyard accepts"),
        (_shard(-1), "manifest.json: shard_size -1 is not one Shipyard accepts"),
        (_shard(1), "manifest.json: shard_size 1 is not one Shipyard accepts"),
        (_shard(4095), "manifest.json: shard_size 4095 is not one Shipyard accepts"),
        (_two_subjects, "manifest.json: needs exactly one subject with a sha256 digest"),
        (_md5, "manifest.json: needs exactly one subject with a sha256 digest"),
        (_twice, "manifest.json: a resource is listed twice"),
        (_label, "manifest.json: every resource must be labelled sha256-sharded-"),
        (_name, "manifest.json: a resource name is not path:start:end"),
        (_order, "manifest.json: resources are not in OMS order (edited?)"),
        (_subject, "manifest.json: subject digest does not match its resources (edited?)"),
    ],
)
def test_an_edited_manifest_is_refused_before_any_file_is_read(
    bundle: Path, change: Any, problem: str
) -> None:
    edit_manifest(bundle, change)
    problems = verify_bundle(bundle)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_a_smaller_shard_size_relabelled_consistently_still_verifies(bundle: Path) -> None:
    manifest_for(bundle, shard=4096)
    assert verify_bundle(bundle) == []
    files = [p for p in bundle.rglob("*") if p.is_file() and p.name not in ("manifest.json",)]
    want = sum(max(1, -(-p.stat().st_size // 4096)) for p in files if p.stat().st_size)
    assert len(load_manifest(bundle / "manifest.json").predicate.resources) == want > len(files)


def test_the_subject_digest_covers_every_resource_in_order(bundle: Path) -> None:
    manifest = load_manifest(bundle / "manifest.json")
    listed = manifest.predicate.resources
    assert oms.root_digest(listed) == manifest.digest
    assert oms.root_digest(list(reversed(listed))) != manifest.digest
    assert oms.root_digest(listed[:-1]) != manifest.digest
    assert oms.root_digest([]) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_empty_files_are_named() -> None:
    assert oms.empty_files({}) == []


def test_file_names_with_colons_verify_and_are_checked(tmp_path: Path) -> None:
    """OMS resource names are `path:start:end`: a colon inside the path must not split it."""
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "a:b").write_bytes(b"12345")
    (folder / "a").write_bytes(b"xyz")
    manifest_for(folder, shard=4096)
    assert verify_bundle(folder) == []
    (folder / "a:b").write_bytes(b"12346")
    assert verify_bundle(folder) == ["a:b: changed (sha256 differs from the manifest)"]


@pytest.mark.parametrize(
    ("shard", "ok"),
    [(4096, True), (4095, False), (2048, False), (10**4, True), (10**9, True), (1 << 34, True),
     (1 << 35, False), (10**10, False), (1, False), (3 << 20, False)],
)  # fmt: skip
def test_the_shard_size_comes_from_the_fixed_set_at_its_boundaries(
    tmp_path: Path, shard: int, ok: bool
) -> None:
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "w").write_bytes(b"abc")
    manifest_for(folder, shard=shard)  # consistent with itself: only the size can be wrong
    problems = verify_bundle(folder)
    assert problems == ([] if ok else [
        f"manifest.json: shard_size {shard} is not one Shipyard accepts: a power of two from "
        "4 KiB to 16 GiB or of ten from 10 kB to 1 GB (fixed in code)"
    ])  # fmt: skip


def test_the_manifest_file_uses_the_oms_field_names(bundle: Path) -> None:
    data = json.loads((bundle / "manifest.json").read_text())
    assert sorted(data) == ["_type", "predicate", "predicateType", "subject"]
    assert data["_type"] == "https://in-toto.io/Statement/v1"
    assert sorted(data["predicate"]["serialization"]) == [
        "allow_symlinks",
        "hash_type",
        "ignore_paths",
        "method",
        "shard_size",
    ]


def test_an_unlabelled_resource_names_the_expected_label(bundle: Path) -> None:
    edit_manifest(bundle, _label)
    assert verify_bundle(bundle) == [
        f"manifest.json: every resource must be labelled {algorithm_label(SHARD_SIZE)}"
    ]


def test_empty_files_are_named_and_only_they(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "one").write_bytes(b"x")
    files = {"empty": tmp_path / "empty", "one": tmp_path / "one"}
    assert oms.empty_files(files) == ["empty"]


# --------------------------------------------------------------------------- permissions
def _as_other_user(fn: Any) -> Any:
    """fn() in a process that is not root (forked, then uid/gid nobody when this runs as
    root, which reads every file whatever its mode), its return value sent back."""
    import pickle

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            if os.getuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            with os.fdopen(write, "wb") as out:
                pickle.dump(fn(), out)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            code = 1
            print(f"child failed: {type(exc).__name__}: {exc}", flush=True)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data
    return pickle.loads(data)


@pytest.fixture
def shared_bundle() -> Iterator[Path]:
    """A bundle in a folder another user can reach (pytest's tmp root is 0700)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="shipyard-verify-"))
    root.chmod(0o755)
    folder = root / "bundle"
    (folder / "serving" / "runtime").mkdir(parents=True)
    (folder / "model.onnx").write_bytes(bytes(range(256)) * 40)
    (folder / "serving" / "runtime" / "model.py").write_text("print('hi')\n")
    (folder / "shipyard.json").write_text('{"release": "demo"}')
    manifest_for(folder)
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield folder
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(root)


def test_verify_refuses_a_folder_or_file_it_cannot_read_as_a_user_who_is_not_root(
    shared_bundle: Path,
) -> None:
    """A package planted in a mode-0311 folder (listable by nobody, importable by name) and
    an unreadable file: os.walk skipped the folder in silence and the bundle verified."""
    from pipelines.cli import main

    # run once here first: the child cannot import what lives in root's home (pyenv)
    assert main(["verify", str(shared_bundle)]) == 0
    assert _as_other_user(lambda: verify_bundle(shared_bundle)) == []
    hidden = shared_bundle / "serving" / "runtime" / "vault"
    (hidden / "numpy").mkdir(parents=True)
    (hidden / "numpy" / "__init__.py").write_text("import os  # runs on import\n")
    (hidden / "numpy" / "__init__.py").chmod(0o644)
    (hidden / "numpy").chmod(0o755)
    hidden.chmod(0o311)  # enter, but not list
    assert _as_other_user(lambda: verify_bundle(shared_bundle)) == [
        "serving/runtime/vault: cannot be listed (Permission denied); verify must see every "
        "entry: fix its permissions or verify as its owner"
    ]
    assert _as_other_user(lambda: main(["verify", str(shared_bundle)])) != 0  # the CLI too
    hidden.chmod(0o755)
    (shared_bundle / "shipyard.json").chmod(0o200)
    problems = _as_other_user(lambda: verify_bundle(shared_bundle))
    assert "serving/runtime/vault/numpy/__init__.py: added (not in the manifest)" in problems
    assert any(p.startswith("shipyard.json: cannot be read (permission denied)") for p in problems)


def test_a_tiny_shard_size_over_a_huge_file_is_refused_before_any_hashing(
    tmp_path: Path,
) -> None:
    """shard_size 1 and a 6 GiB file: verify built six billion hash jobs and died of
    MemoryError before the signature was checked. The size is from a fixed set now, and the
    shard count is compared first: the smallest allowed shards over a grown file."""
    import time

    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "w.bin").write_bytes(bytes(10 * 4096))
    manifest_for(folder, shard=4096)  # 10 shards, consistent
    assert verify_bundle(folder) == []
    with open(folder / "w.bin", "r+b") as fh:
        fh.truncate(6 << 30)  # sparse: no disk is used
    start = time.perf_counter()
    assert verify_bundle(folder) == [
        "w.bin: changed (its size makes 1572864 shards of 4096 bytes; the manifest lists 10)"
    ]
    assert time.perf_counter() - start < 5


def test_a_manifest_listing_more_resources_than_the_cap_is_refused(bundle: Path) -> None:
    def many(data: dict[str, Any]) -> None:
        one = resources(data)[0]
        data["predicate"]["resources"] = [
            {**one, "name": f"x{i:07d}:0:1"} for i in range(oms.MAX_RESOURCES + 1)
        ]

    edit_manifest(bundle, many)
    (problem,) = verify_bundle(bundle)
    assert problem.startswith(f"manifest.json: {oms.MAX_RESOURCES + 1} resources (over")
