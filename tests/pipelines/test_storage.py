"""The registry's storage seam (issue 29): each store keeps the same promises, tried on a
local folder and on a real S3 API (moto's server), and the protocol never asks which."""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import pytest

import pipelines.storage as storage
from pipelines.storage import LocalStore, ObjectStore, Store, open_store
from schemas import RegistryError
from tests.conftest import bucket, local_or_s3

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return open_store(local_or_s3(request, tmp_path, "store"))


def test_the_url_picks_the_store(tmp_path: Path, s3_server: str) -> None:
    assert type(open_store(str(tmp_path / "r"))) is LocalStore
    assert type(open_store(f"file://{tmp_path}/r")) is LocalStore
    assert type(open_store(f"s3://pick-{bucket()}/r")) is ObjectStore


@pytest.mark.parametrize(
    "parts", [("..",), ("a", ".."), ("a/b",), ("",), (".",), ("a\\b",), ("a\0",)]
)
def test_no_path_leaves_the_root(store: Store, parts: tuple[str, ...]) -> None:
    with pytest.raises(RegistryError, match="not allowed|outside"):
        store.path(*parts)


def test_a_symlink_out_of_a_local_root_is_refused(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "registry"))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", Path(store.root) / "releases")
    with pytest.raises(RegistryError, match="resolves outside the registry"):
        store.path("releases", "x")


def test_create_is_exclusive_and_write_replaces_whole(store: Store) -> None:
    path = store.path("records", "a.json")
    store.create(path, b"first")
    with pytest.raises(RegistryError, match="exists already; refusing to overwrite"):
        store.create(path, b"second")
    assert store.read(path) == b"first"
    store.write(path, b"replaced")
    assert store.read(path) == b"replaced"
    assert store.names(store.path("records")) == ["a.json"]  # no temporary left beside it


def test_two_racing_creates_make_one_winner(store: Store) -> None:
    path = store.path("race.json")
    won, lost = [], []

    def go(i: int) -> None:
        try:
            store.create(path, str(i).encode())
            won.append(i)
        except RegistryError:
            lost.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 5
    assert store.read(path) == str(won[0]).encode()


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_put_tree_lands_what_was_verified(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "bundle"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))
    seen: list[dict[str, bytes]] = []

    def verify(copy: Path) -> str:
        assert copy != src  # a copy: the source may change after it is checked
        (src / "a.txt").write_bytes(b"changed after the copy")
        seen.append(tree(copy))
        return "verified"

    target = store.path("releases", "demo", "1.0.0")
    assert store.put_tree(src, target, verify) == "verified"
    with store.local_copy(target) as landed:
        assert tree(landed) == seen[0] == {"a.txt": b"a", "sub/b.bin": bytes(range(256))}
    assert store.names(store.path("releases", "demo")) == ["1.0.0"]  # no staging left


def test_put_tree_refused_by_verify_lands_nothing(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "bundle"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")

    def refuse(copy: Path) -> None:
        raise RegistryError("does not verify")

    with pytest.raises(RegistryError, match="does not verify"):
        store.put_tree(src, store.path("releases", "demo", "1.0.0"), refuse)
    assert store.names(store.path("releases", "demo")) == []


def test_the_log_only_grows(store: Store) -> None:
    store.append(1, {"seq": 1, "to": "a"})
    store.append(2, {"seq": 2, "to": "b"})
    texts = [t for _, t in store.log()]
    assert [t.replace(" ", "").replace("\n", "") for t in texts] == [
        '{"seq":1,"to":"a"}',
        '{"seq":2,"to":"b"}',
    ]
    places = [p for p, _ in store.log()]
    assert places[0] in ("history.jsonl line 1", "history/0000000001.json")


def test_a_torn_last_local_entry_does_not_swallow_the_next(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "registry"))
    store.append(1, {"seq": 1})
    with open(store.path("history.jsonl"), "ab") as fh:
        fh.write(b'{"seq": 2, "to')  # a crash mid-write
    store.append(3, {"seq": 3})
    texts = [t for _, t in store.log()]
    assert texts == ['{"seq": 1}', '{"seq": 2, "to', '{"seq": 3}']


def test_an_object_store_log_entry_is_never_rewritten(s3_server: str) -> None:
    store = open_store(f"s3://log-{bucket()}/registry")
    store.append(1, {"seq": 1, "to": "a"})
    with pytest.raises(RegistryError, match="exists already"):
        store.append(1, {"seq": 1, "to": "forged"})
    assert '"a"' in store.log()[0][1]


def test_the_lock_admits_one_writer(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "LOCK_TIMEOUT_S", 0.5)
    other = open_store(store.url)  # another process's view of the same registry
    with store.lock():
        with pytest.raises(RegistryError, match="held for over"), other.lock():
            pass
        store.fence()  # still ours
    with other.lock():  # released
        pass


def test_the_protocol_never_asks_which_store_it_has() -> None:
    """registry.py speaks to its store only: no `local` branch, no filesystem of its own
    (the 8 `if self.local` forks of the 587-line class live behind the seam now)."""
    source = (REPO / "pipelines" / "registry.py").read_text()
    found = [
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Attribute)
        and n.attr in ("local", "fs")
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]
    assert not found, found
    for name in ("os", "shutil", "socket", "threading", "filelock"):
        assert f"import {name}\n" not in source and f"from {name} " not in source, name
