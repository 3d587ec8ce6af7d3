"""The registry: immutable published bundles, channel pointers and an append-only history.

Any fsspec URL works (a local folder by default). Layout:
    releases/<name>/<version>/     the bundle, byte for byte (verifiable with its manifest)
    releases/<name>/<version>.json who published it, when, and its manifest digest
    channels/<name>/<channel>.json the version of release <name> a channel points at
    history.jsonl                  one line per promotion or rollback, never rewritten
"""

from __future__ import annotations

import getpass
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas import RegistryError
from stages.write_manifest import load_manifest, verify_bundle

LOCK_TIMEOUT_S = 60


def who() -> str:
    return os.environ.get("SHIPYARD_USER") or getpass.getuser()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Registry:
    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, self.root = url_to_fs(url)
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    # ------------------------------------------------------------------ publish
    def publish(self, bundle: Path, name: str, version: str) -> dict[str, Any]:
        """Copy a verified, passing bundle in as name@version; never overwrite another."""
        _refuse_if_broken(bundle, f"build bundle {bundle}")
        digest = _digest(bundle)
        target = self.path("releases", name, version)
        if self.fs.exists(target):
            existing = json.loads(self.fs.cat_file(self.path("releases", name, f"{version}.json")))
            if existing["digest"] == digest:
                return {**existing, "already": True}
            raise RegistryError(
                f"{name}@{version} is already published with digest {existing['digest'][:16]}; "
                f"this bundle's is {digest[:16]}. Published versions are immutable: bump "
                "`version` in the release spec"
            )
        staging = self.path("releases", name, f".{version}.{os.getpid()}.tmp")
        self.fs.put(str(bundle), staging, recursive=True)
        self.fs.mv(staging, target, recursive=True)
        record = {"release": name, "version": version, "digest": digest, "by": who(), "at": now()}
        self._write(self.path("releases", name, f"{version}.json"), record)
        return record

    # ------------------------------------------------------------------ channels
    def channel(self, name: str, channel: str) -> dict[str, Any] | None:
        path = self.path("channels", name, f"{channel}.json")
        return json.loads(self.fs.cat_file(path)) if self.fs.exists(path) else None

    def channels(self) -> list[dict[str, Any]]:
        """Every (release, channel) pointer."""
        folder = self.path("channels")
        found = self.fs.glob(self.path("channels", "*", "*.json")) if self.fs.exists(folder) else []
        return [{"channel": Path(p).stem, **json.loads(self.fs.cat_file(p))} for p in sorted(found)]

    def promote(self, name: str, version: str, channel: str, reason: str) -> dict[str, Any]:
        """Re-verify name@version, then point name's `channel` at it and record why."""
        with self.lock():
            target = self._checked(name, version)
            return self._move(channel, target, "promote", reason)

    def rollback(self, name: str, channel: str, reason: str) -> dict[str, Any]:
        """Point name's `channel` back at what it held before its current version."""
        with self.lock():
            stack = self._stack(name, channel)
            if len(stack) < 2:
                raise RegistryError(
                    f"{name}'s channel {channel!r} has no earlier version to "
                    f"roll back to ({len(stack)} in its history)"
                )
            target = self._checked(name, stack[-2])
            return self._move(channel, target, "rollback", reason)

    def history(self) -> list[dict[str, Any]]:
        path = self.path("history.jsonl")
        if not self.fs.exists(path):
            return []
        text = self.fs.cat_file(path).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def manifest(self, name: str, version: str) -> Any:
        with self._local_copy(name, version) as folder:
            return load_manifest(folder / "manifest.json")

    # ------------------------------------------------------------------ internals
    def _checked(self, name: str, version: str) -> dict[str, Any]:
        meta = self.path("releases", name, f"{version}.json")
        if not self.fs.exists(meta):
            raise RegistryError(
                f"{name}@{version} is not published in {self.url}; run "
                f"`shipyard publish {name}` first"
            )
        with self._local_copy(name, version) as folder:
            _refuse_if_broken(folder, f"published {name}@{version}")
            digest = _digest(folder)
        return {"release": name, "version": version, "digest": digest}

    def _move(
        self, channel: str, target: dict[str, Any], action: str, reason: str
    ) -> dict[str, Any]:
        current = self.channel(target["release"], channel)
        entry = {
            "seq": len(self.history()) + 1,
            "at": now(),
            "who": who(),
            "action": action,
            "channel": channel,
            "from": _label(current),
            "to": _label(target),
            "digest": target["digest"],
            "reason": reason,
        }
        self._write(
            self.path("channels", target["release"], f"{channel}.json"),
            {**target, "since": entry["at"]},
        )
        self._append(entry)
        return entry

    def _stack(self, name: str, channel: str) -> list[str]:
        """Versions the channel moved through: a promotion pushes, a rollback pops."""
        stack: list[str] = []
        for entry in self.history():
            if entry["channel"] != channel or entry["to"].rsplit("@", 1)[0] != name:
                continue
            if entry["action"] == "rollback":
                stack.pop()
            else:
                stack.append(entry["to"].rsplit("@", 1)[1])
        return stack

    def _write(self, path: str, data: dict[str, Any]) -> None:
        """Write JSON next to `path`, then move it over: readers never see half a file."""
        tmp = f"{path}.{os.getpid()}.tmp"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(tmp, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
        self.fs.mv(tmp, path)

    def _append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, sort_keys=True) + "\n"
        path = self.path("history.jsonl")
        if self.local:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            return
        old = self.fs.cat_file(path) if self.fs.exists(path) else b""
        self.fs.pipe_file(path, old + line.encode())  # safe: callers hold the lock

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialize channel moves: flock locally, an exclusive marker file elsewhere."""
        path = self.path(".lock")
        if self.local:
            import fcntl

            with open(path, "a+") as fh:
                _wait(lambda: _try_flock(fcntl, fh), path)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
            return
        _wait(lambda: self._try_marker(path), path)
        try:
            yield
        finally:
            self.fs.rm(path)

    def _try_marker(self, path: str) -> bool:
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(f"{who()} {now()}".encode())
            return True
        except FileExistsError:
            return False

    @contextmanager
    def _local_copy(self, name: str, version: str) -> Iterator[Path]:
        source = self.path("releases", name, version)
        if self.local:
            yield Path(source)
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(source, tmp + "/bundle", recursive=True)
            yield Path(tmp) / "bundle"


def _try_flock(fcntl: Any, fh: Any) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait(attempt: Any, path: str) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while not attempt():
        if time.monotonic() > deadline:
            raise RegistryError(
                f"registry lock {path} held for over {LOCK_TIMEOUT_S} s; "
                "another promotion is running (or crashed: remove the file)"
            )
        time.sleep(0.05)


def _refuse_if_broken(folder: Path, what: str) -> None:
    problems = verify_bundle(folder)
    if problems:
        raise RegistryError(
            f"{what} does not match its manifest; refusing it:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    reports = {
        p.stem: json.loads(p.read_text()) for p in sorted((folder / "reports").glob("*.json"))
    }
    failed = [
        f"{name}: {r['status']}"
        for name, r in reports.items()
        # an optional skip (the engine where no GPU is) is what the manifest accepted too
        if r["status"] != "passed"
        and not (r["status"] == "skipped" and r.get("details", {}).get("optional") is True)
    ]
    if failed:
        raise RegistryError(
            f"{what} has stages that did not pass ({', '.join(failed)}); "
            "only a release whose gate passed can be published or promoted"
        )


def _digest(folder: Path) -> str:
    digest: str = load_manifest(folder / "manifest.json").subject[0].digest["sha256"]
    return digest


def _label(entry: dict[str, Any] | None) -> str | None:
    return f"{entry['release']}@{entry['version']}" if entry else None
