"""The registry's storage seam: what a registry needs of the place it lives, and two places.

`pipelines/registry.py` is the protocol (validation, two-phase publish, recovery,
channels, signature policy, history); it asks a `Store` for a handful of operations and
never which kind of store it has:

    path / rel          a path under the root (nothing may leave it) / as messages show it
    read, exists, ...   plain reads
    write               replace a file atomically (readers never see half of it)
    create              exclusive create: fails, never overwrites, when the path exists
    put_tree            place a folder at a path atomically, verifying what was copied
    append / log        an append-only log, never rewritten
    lock / fence        one writer at a time; a commit point checks the lock is still held
    local_copy          a published folder as a local path (to verify or read it)

`LocalStore` is a folder (rename, hard links, fsync'd appends, an OS file lock);
`ObjectStore` is any other fsspec filesystem (S3 through s3fs): exclusive creates with
`xb`, one object per log entry, an owner-stamped lock object with a renewed lease.
Kedro's dataset classes were the model: one interface, the backend's quirks behind it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import posixpath
import secrets
import shutil
import socket
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from schemas import RegistryError

LOCK_TIMEOUT_S = float(os.environ.get("SHIPYARD_LOCK_TIMEOUT_S", "60"))
# A remote lock older than this is taken to belong to a crashed holder and is broken.
LOCK_STALE_S = float(os.environ.get("SHIPYARD_LOCK_STALE_S", "900"))
STAGING = ".staging-"
LEASES = ".leases"  # an object store's lock holders' leases, one object per holder
UPLOAD = ".upload-"  # releases/<name>/.upload-<version>.json: whose upload is in flight
LOG = "history"  # history.jsonl in a folder, history/<seq>.json in an object store

T = TypeVar("T")


def who() -> str:
    """Who is writing (a record's `by`, a lock's owner)."""
    return os.environ.get("SHIPYARD_USER") or getpass.getuser()


def open_store(url: str) -> Store:
    """The store for an fsspec URL: a folder for local paths, an object store otherwise."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(url)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    local = "file" in protocols or "local" in protocols
    return (LocalStore if local else ObjectStore)(url, fs, root)


class Store(ABC):
    """The operations every store has alike (on fsspec); subclasses add the rest."""

    local = False

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url, self.fs = url, fs
        self.root = self._resolve(posixpath.normpath(root))
        self.fs.makedirs(self.root, exist_ok=True)
        self.warnings: list[str] = []

    # ------------------------------------------------------------------ paths
    def _resolve(self, path: str) -> str:
        """Where `path` really is (a folder follows its symlinks; an object key is itself)."""
        return path

    def path(self, *parts: str) -> str:
        """A path under the root; refuses any part that could leave it."""
        for part in parts:
            if not part or "/" in part or "\\" in part or part in (".", "..") or "\0" in part:
                raise RegistryError(f"registry path part {part!r} is not allowed")
        joined = posixpath.normpath("/".join([self.root.rstrip("/"), *parts]))
        resolved = self._resolve(joined)
        if resolved != self.root and not resolved.startswith(self.root.rstrip("/") + "/"):
            raise RegistryError(f"{'/'.join(parts)} resolves outside the registry {self.url}")
        return joined

    def rel(self, path: str) -> str:
        """`path` as messages name it."""
        return path

    # ------------------------------------------------------------------ reads
    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def read(self, path: str) -> bytes:
        data: bytes = self.fs.cat_file(path)
        return data

    def names(self, folder: str) -> list[str]:
        """The entries of `folder` (base names, sorted); none when it does not exist."""
        if not self.fs.exists(folder):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(folder, detail=False))

    def glob(self, *parts: str) -> list[str]:
        """Paths matching a pattern of parts under the root (`*` allowed in a part)."""
        if not self.fs.exists(self.path(parts[0])):
            return []
        return sorted(self.fs.glob(posixpath.join(self.root, *parts)))

    def remove(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    # ------------------------------------------------------------------ writes
    def write(self, path: str, data: bytes) -> None:
        """Write next to `path`, then move it over: readers never see half a file."""
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    @abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Exclusive create: a RegistryError (nothing overwritten) when `path` exists."""

    @abstractmethod
    def put_tree(self, src: Path, target: str, verify: Callable[[Path], T]) -> T:
        """Place a copy of folder `src` at `target` (where nothing is) and return what
        `verify` says of the copy: what is verified is what lands, byte for byte."""

    @abstractmethod
    def append(self, seq: int, entry: dict[str, Any]) -> None:
        """Append entry number `seq` to the log; nothing already there is rewritten."""

    @abstractmethod
    def log(self) -> list[tuple[str, str]]:
        """The log's entries as (where, text), oldest first; torn ones included as read."""

    # ------------------------------------------------------------------ locking
    def held_token(self) -> str | None:
        """The token of the lock this process holds here (None: none, or a lock that
        cannot be broken under its holder: an OS file lock)."""
        return None

    def lease_left(self, token: str) -> float:
        """Seconds the holder of `token` is known alive for (0: gone, or no such lease)."""
        return 0.0

    @abstractmethod
    def lock(self) -> AbstractContextManager[None]:
        """One writer at a time."""

    @abstractmethod
    def fence(self) -> None:
        """Before a commit point: the lock must still be ours."""

    @abstractmethod
    def unlock(self, force: bool = False) -> str:
        """Remove a lock whose holder died, naming it."""

    @abstractmethod
    def local_copy(self, source: str) -> AbstractContextManager[Path]:
        """The folder at `source` as a local path, for as long as the context lasts."""

    def copy_out(self, source: str, into: Path) -> None:
        """The folder at `source` copied (never linked) to the local path `into`, which
        must not exist; symlinks stay symlinks (a verify refuses them)."""
        with self.local_copy(source) as folder:
            shutil.copytree(folder, into, symlinks=True)


class LocalStore(Store):
    """A registry in a local folder."""

    local = True

    def _resolve(self, path: str) -> str:
        return os.path.realpath(path)

    def rel(self, path: str) -> str:
        return posixpath.relpath(path, self.root)

    def create(self, path: str, data: bytes) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        Path(tmp).write_bytes(data)
        try:
            os.link(tmp, path)  # atomic and exclusive
        except FileExistsError:
            raise RegistryError(f"{path} exists already; refusing to overwrite it") from None
        finally:
            os.unlink(tmp)

    def put_tree(self, src: Path, target: str, verify: Callable[[Path], T]) -> T:
        """Copied to a staging folder beside `target`, verified there, made read-only,
        then renamed into place (atomic; fails if the target exists)."""
        parent, name = posixpath.split(target)
        staging = posixpath.join(parent, f"{STAGING}{name}-{secrets.token_hex(4)}")
        os.makedirs(parent, exist_ok=True)
        try:
            shutil.copytree(src, staging, symlinks=True)
            out = verify(Path(staging))
            _read_only(Path(staging))
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return out

    def append(self, seq: int, entry: dict[str, Any]) -> None:
        path = self.path(f"{LOG}.jsonl")
        with open(path, "ab") as fh:
            # A torn last line (a crash mid-write) must not swallow this entry.
            if fh.tell() and not _ends_with_newline(path):
                fh.write(b"\n")
            fh.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def log(self) -> list[tuple[str, str]]:
        path = self.path(f"{LOG}.jsonl")
        if not self.fs.exists(path):
            return []
        texts = self.read(path).decode("utf-8", errors="replace").splitlines()
        return [(f"{LOG}.jsonl line {i}", t) for i, t in enumerate(texts, 1)]

    @contextmanager
    def lock(self) -> Iterator[None]:
        from filelock import FileLock, Timeout

        path = self.path(".lock")
        try:
            with FileLock(path, timeout=LOCK_TIMEOUT_S):
                yield
        except Timeout:
            raise RegistryError(
                f"registry lock {path} held for over {LOCK_TIMEOUT_S:.0f} s; "
                "another publish or promotion is running"
            ) from None

    def fence(self) -> None:
        """An OS file lock is held until its holder exits: it cannot be lost."""

    def unlock(self, force: bool = False) -> str:
        return (
            f"{self.url}: a local registry's lock is an OS file lock, released when its "
            "holder exits; nothing to unlock"
        )

    @contextmanager
    def local_copy(self, source: str) -> Iterator[Path]:
        yield Path(source)


class ObjectStore(Store):
    """A registry in an object store (any fsspec filesystem but a local one)."""

    def __init__(self, url: str, fs: Any, root: str) -> None:
        super().__init__(url, fs, root)
        self._held: tuple[str, str, _Lease] | None = None

    def create(self, path: str, data: bytes) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(data)
        except FileExistsError:
            raise RegistryError(f"{path} exists already; refusing to overwrite it") from None

    def put_tree(self, src: Path, target: str, verify: Callable[[Path], T]) -> T:
        """A private snapshot is verified, then uploaded. An upload is not atomic: the
        registry's commit point is the record it writes after (`_recover` finishes or
        removes a folder without one)."""
        with tempfile.TemporaryDirectory(prefix="shipyard-publish-") as tmp:
            snapshot = Path(tmp) / "bundle"
            shutil.copytree(src, snapshot, symlinks=True)
            out = verify(snapshot)
            self.fs.put(str(snapshot) + "/", target, recursive=True)
        return out

    def append(self, seq: int, entry: dict[str, Any]) -> None:
        # one object per entry, created exclusively; nothing is rewritten
        self.create(self.path(LOG, f"{seq:010d}.json"), _dump(entry))

    def log(self) -> list[tuple[str, str]]:
        paths = self.glob(LOG, "*.json")
        return [
            (f"{LOG}/{posixpath.basename(p)}", self.read(p).decode("utf-8", errors="replace"))
            for p in paths
        ]

    @contextmanager
    def lock(self) -> Iterator[None]:
        """An owner-stamped lock object, never rewritten once made, and its holder's lease
        in an object of its own (`.leases/<token>.json`), renewed while held. A renewal
        writes only its own lease: it can never overwrite a lock another writer took (a
        read-then-write renewal of the lock object did, after a breaker had taken it, and
        its fence then passed: a version was recorded whose upload the breaker's `registry
        check` had removed)."""
        path = self.path(".lock")
        token = secrets.token_hex(16)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while not self._try_lock(path, token):
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"registry lock {path} held for over {LOCK_TIMEOUT_S:.0f} s by "
                    f"{self.lock_owner(path)}; it expires {LOCK_STALE_S:.0f} s after it was "
                    "last renewed (`shipyard registry unlock` removes one whose holder died)"
                )
            time.sleep(0.2)
        lease = _Lease(self, path, token)
        lease.renew()
        lease.start()
        self._held = (path, token, lease)
        try:
            yield
        finally:
            self._held = None
            lease.stop.set()
            lease.join()
            if self._lock_stamp(path).get("token") == token:
                self.fs.rm(path)
            with contextlib.suppress(FileNotFoundError, OSError):
                self.fs.rm(self._lease_path(token))

    def held_token(self) -> str | None:
        return None if self._held is None else self._held[1]

    def lease_left(self, token: str) -> float:
        try:
            lease = json.loads(self.fs.cat_file(self._lease_path(token)))
        except (FileNotFoundError, ValueError):
            return 0.0
        return max(0.0, float(lease.get("expires", 0)) - time.time())

    def _lease_path(self, token: str) -> str:
        return self.path(LEASES, f"{token}.json")

    def fence(self) -> None:
        """A holder stalled past its lease (its renewals failed) may have been broken by
        another writer; it must not commit over that writer's work."""
        if self._held is None:
            return
        path, token, lease = self._held
        if lease.lost or self._lock_stamp(path).get("token") != token:
            raise RegistryError(
                f"lost the registry lock {path} (not renewed within {LOCK_STALE_S:.0f} s, then "
                "taken by another writer); nothing was recorded: run the command again"
            )

    def unlock(self, force: bool = False) -> str:
        path = self.path(".lock")
        held = self.lock_owner(path)
        if not held and not self.fs.exists(path):
            return f"{self.url}: not locked"
        who_ = f"{held.get('owner')}@{held.get('host')} (pid {held.get('pid')})"
        left = float(held.get("expires", 0)) - time.time()
        if left > 0 and not force:
            raise RegistryError(
                f"the registry lock is held by {who_}, renewed {LOCK_STALE_S - left:.0f} s ago "
                f"and live for {left:.0f} s more: its holder is working. If you know it is "
                "dead (the machine is gone), `shipyard registry unlock --force`"
            )
        # the holder's lease stays: while it is live, `registry check` leaves that holder's
        # upload alone (the holder, if alive, fails its fence and records nothing)
        self.fs.rm(path)
        return f"{self.url}: removed the registry lock held by {who_}" + (
            " (forced: it was live)" if left > 0 else " (expired)"
        )

    def _try_lock(self, path: str, token: str) -> bool:
        stamp = {
            "owner": who(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": token,
            "taken": time.time(),
            "expires": time.time() + LOCK_STALE_S,  # until its first lease is written
        }
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(_dump(stamp))
            return True
        except FileExistsError:
            held = self.lock_owner(path)
            # a breaker reads the holder's lease: only a lock whose lease has lapsed goes
            if held and held.get("expires", 0) < time.time():
                self.warnings.append(
                    f"broke a stale registry lock held by {held.get('owner')}@{held.get('host')} "
                    f"since {held.get('taken')}"
                )
                self.fs.rm(path)
                with contextlib.suppress(FileNotFoundError, OSError):  # lapsed: its holder gone
                    self.fs.rm(self._lease_path(str(held.get("token"))))
            return False

    def _lock_stamp(self, path: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.fs.cat_file(path))
            return data
        except (FileNotFoundError, ValueError):
            return {}

    def lock_owner(self, path: str) -> dict[str, Any]:
        """The lock's stamp, its expiry the later of its own and its holder's lease."""
        stamp = self._lock_stamp(path)
        if stamp.get("token"):
            lease = self.lease_left(str(stamp["token"]))
            if lease:
                stamp["expires"] = max(float(stamp.get("expires", 0)), time.time() + lease)
        return stamp

    @contextmanager
    def local_copy(self, source: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(source + "/", tmp + "/bundle", recursive=True)
            yield Path(tmp) / "bundle"


class _Lease(threading.Thread):
    """Renews a remote lock holder's lease while it works: every third of LOCK_STALE_S its
    own lease object gets a new expiry, so a publish longer than the lease is never taken
    for a dead one (a breaker only breaks a lock whose lease has lapsed). A renewal that
    finds the lock holding another token marks it lost (`ObjectStore.fence`), and goes on
    renewing the lease: the holder is alive, and `registry check` leaves its upload alone
    until it has stopped."""

    def __init__(self, store: ObjectStore, path: str, token: str) -> None:
        super().__init__(daemon=True, name="registry-lease")
        self.store, self.path, self.token = store, path, token
        self.stop = threading.Event()
        self.lost = False

    def renew(self) -> None:
        now_s = time.time()
        lease = {"token": self.token, "expires": now_s + LOCK_STALE_S, "renewed": now_s}
        # the store unreachable: the next renewal tries again
        with contextlib.suppress(Exception):
            self.store.fs.pipe_file(self.store._lease_path(self.token), _dump(lease))

    def run(self) -> None:
        while not self.stop.wait(LOCK_STALE_S / 3):
            try:
                if self.store._lock_stamp(self.path).get("token") != self.token:
                    self.lost = True
            except Exception:  # noqa: BLE001 - unreachable: the holder cannot know it holds
                self.lost = True
            self.renew()


def _read_only(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            p.chmod(0o444)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _dump(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
