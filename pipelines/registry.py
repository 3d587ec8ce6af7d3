"""The registry: immutable published bundles, channel pointers and an append-only history.

Any fsspec URL works (a local folder by default; `s3://bucket/prefix` through s3fs).
Layout:
    releases/<name>/<version>/       the bundle, byte for byte (verifiable with its manifest)
    releases/<name>/<version>.json   the publish record: digest, who, when (the commit point)
    channels/<name>/<channel>.json   the version of release <name> a channel points at
    policy/<channel>.json            trusted public keys, when a channel requires a signature
    history.jsonl (local) or history/<seq>.json (object stores, one object per entry)

Guarantees, each with a test in tests/pipelines/test_registry_trust.py:
- names, SemVer versions and channels are validated, and every path is checked to stay
  under the root before anything is read or written;
- publish holds the lock and commits in two phases: copy to a staging place, verify what
  was copied (not what was checked before), atomic rename, then the record;
- an interrupted publish (a version without its record, a staging leftover) is finished or
  removed by the next publish or `shipyard registry check`, which say which;
- promote and rollback re-verify the published bundle and compare its digest with both its
  manifest and the publish record; a channel can require a signature from trusted keys;
- history is never rewritten; a torn line is reported and skipped, never blocking.
"""

from __future__ import annotations

import getpass
import json
import os
import posixpath
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas import RegistryError, StageReport
from schemas.spec.base import NAME_PATTERN, SEMVER_PATTERN
from stages.bundling.oms import load_manifest, read_facts, verify_bundle

LOCK_TIMEOUT_S = float(os.environ.get("SHIPYARD_LOCK_TIMEOUT_S", "60"))
# A remote lock older than this is taken to belong to a crashed holder and is broken.
LOCK_STALE_S = float(os.environ.get("SHIPYARD_LOCK_STALE_S", "900"))
CHANNEL_PATTERN = r"[a-z][a-z0-9-]{0,62}"
STAGING = ".staging-"


def who() -> str:
    return os.environ.get("SHIPYARD_USER") or getpass.getuser()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def check_name(name: str) -> str:
    if not isinstance(name, str) or len(name) > 128 or not re.fullmatch(NAME_PATTERN, name):
        raise RegistryError(
            f"release name {name!r} is not valid: use lowercase letters, digits, '.', '_' "
            "and '-', starting with a letter or digit"
        )
    if name in (".", "..") or name.startswith(".") or ".." in name:
        raise RegistryError(f"release name {name!r} is not valid: no '..' or leading '.'")
    return name


def check_version(version: str) -> str:
    if not isinstance(version, str) or not re.fullmatch(SEMVER_PATTERN, version):
        raise RegistryError(
            f"version {version!r} is not Semantic Versioning 2.0 (e.g. 1.2.0 or 1.2.0-rc.1)"
        )
    return version


def check_channel(channel: str) -> str:
    if not isinstance(channel, str) or not re.fullmatch(CHANNEL_PATTERN, channel):
        raise RegistryError(
            f"channel {channel!r} is not valid: a lowercase letter, then lowercase letters, "
            "digits or '-' (e.g. production, staging, canary-eu)"
        )
    return channel


class Registry:
    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, root = url_to_fs(url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        self.root = os.path.realpath(root) if self.local else posixpath.normpath(root)
        self.fs.makedirs(self.root, exist_ok=True)
        self.warnings: list[str] = []
        self._held: tuple[str, str, _Lease] | None = None

    # ------------------------------------------------------------------ paths
    def path(self, *parts: str) -> str:
        """A path under the root; refuses any part that could leave it."""
        for part in parts:
            if not part or "/" in part or "\\" in part or part in (".", "..") or "\0" in part:
                raise RegistryError(f"registry path part {part!r} is not allowed")
        joined = posixpath.normpath("/".join([self.root.rstrip("/"), *parts]))
        resolved = os.path.realpath(joined) if self.local else joined
        if resolved != self.root and not resolved.startswith(self.root.rstrip("/") + "/"):
            raise RegistryError(f"{'/'.join(parts)} resolves outside the registry {self.url}")
        return joined

    def _version_dir(self, name: str, version: str) -> str:
        return self.path("releases", check_name(name), check_version(version))

    def _record_path(self, name: str, version: str) -> str:
        return self.path("releases", check_name(name), f"{check_version(version)}.json")

    # ------------------------------------------------------------------ publish
    def publish(self, bundle: Path, name: str, version: str) -> dict[str, Any]:
        """Copy a verified, passing bundle in as name@version; never overwrite another."""
        target, record_path = self._version_dir(name, version), self._record_path(name, version)
        with self.lock():
            done = self._recover(name)
            record = self.record(name, version)
            if record is not None:
                digest = _verified_digest(bundle, f"build bundle {bundle}", (name, version))
                if record["digest"] == digest:
                    return {**record, "already": True, "recovered": done}
                raise RegistryError(
                    f"{name}@{version} is already published with digest "
                    f"{record['digest'][:16]}; this bundle's is {digest[:16]}. Published "
                    "versions are immutable: bump `version` in the release spec"
                )
            if self.local:
                digest, manifest = self._publish_local(bundle, name, version, target)
            else:
                digest, manifest = self._publish_remote(bundle, target, (name, version))
            record = {
                "release": name,
                "version": version,
                "digest": digest,
                "manifest_sha256": manifest,
                "by": who(),
                "at": now(),
            }
            self._fence()
            self._create(record_path, record)
            return {**record, "recovered": done}

    def _publish_local(self, bundle: Path, name: str, version: str, target: str) -> tuple[str, str]:
        staging = self.path("releases", name, f"{STAGING}{version}-{secrets.token_hex(4)}")
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        try:
            shutil.copytree(bundle, staging, symlinks=True)
            digest = _verified_digest(Path(staging), f"copied bundle {bundle}", (name, version))
            manifest = _manifest_sha(Path(staging))
            _read_only(Path(staging))
            os.rename(staging, target)  # atomic; fails if the target exists
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return digest, manifest

    def _publish_remote(self, bundle: Path, target: str, bound: tuple[str, str]) -> tuple[str, str]:
        """Upload a private snapshot: what is verified is what is uploaded. Nothing is at
        `target`: `_recover` ran under the same lock, and a version without its record was
        finished (then it is published) or removed."""
        with tempfile.TemporaryDirectory(prefix="shipyard-publish-") as tmp:
            snapshot = Path(tmp) / "bundle"
            shutil.copytree(bundle, snapshot, symlinks=True)
            digest = _verified_digest(snapshot, f"copied bundle {bundle}", bound)
            manifest = _manifest_sha(snapshot)
            self.fs.put(str(snapshot) + "/", target, recursive=True)
        return digest, manifest

    def record(self, name: str, version: str) -> dict[str, Any] | None:
        path = self._record_path(name, version)
        if not self.fs.exists(path):
            return None
        try:
            data: dict[str, Any] = json.loads(self.fs.cat_file(path))
            data["digest"]  # noqa: B018 (a record without a digest is not a record)
            return data
        except (ValueError, KeyError, TypeError):
            raise RegistryError(
                f"publish record {path} is unreadable; restore it from a backup "
                "(published versions are immutable)"
            ) from None

    def check(self) -> list[str]:
        """`shipyard registry check`: finish or remove interrupted publishes, say which."""
        releases = self.path("releases")
        names = (
            [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(releases, detail=False)]
            if self.fs.exists(releases)
            else []
        )
        actions: list[str] = []
        with self.lock():
            for name in sorted(names):
                try:
                    check_name(name)
                except RegistryError:
                    actions.append(f"releases/{name}: not a valid release name; left alone")
                    continue
                actions += self._recover(name)
            actions += self._unreadable()
            actions += self._pointers()
        return actions

    def _unreadable(self) -> list[str]:
        """Every channel pointer and policy file that cannot be read, named."""
        found = []
        for pattern in (("channels", "*", "*"), ("policy", "*")):
            base = self.path(pattern[0])
            if self.fs.exists(base):
                found += self.fs.glob(posixpath.join(base, *pattern[1:]))
        problems = []
        for path in sorted(found):
            if path.endswith(".tmp"):
                continue
            try:
                self._json(path, ())
            except RegistryError as exc:
                problems.append(str(exc))
        return problems

    def _pointers(self) -> list[str]:
        """Under the lock: every channel pointer against its history. A move appends its
        history entry (the commit point, like a publish record), then writes the pointer;
        a crash between the two left a pointer behind its last entry, and the history
        claiming a move that never happened. That move is finished here (the target
        re-verified first), or, when the target no longer verifies, reported."""
        last: dict[tuple[str, str], dict[str, Any]] = {}
        for entry in self.history():
            last[(entry["to"].rsplit("@", 1)[0], entry["channel"])] = entry
        actions = []
        for (name, channel), entry in sorted(last.items()):
            try:
                check_name(name), check_channel(channel)
            except RegistryError:
                continue
            version = entry["to"].rsplit("@", 1)[1]
            try:
                pointer = self.channel(name, channel)
            except RegistryError:
                continue  # unreadable: check names it (`_unreadable`); a move rewrites it
            if pointer and (pointer.get("version"), pointer.get("digest")) == (
                version,
                entry.get("digest"),
            ):
                continue
            where = f"{name}'s {channel}: history #{entry['seq']} ({entry['action']}) moved it to "
            where += f"{entry['to']}, its pointer says {_label(pointer) or '(empty)'}"
            try:
                target = self._checked(name, version, channel)
                if target["digest"] != entry.get("digest"):
                    raise RegistryError(f"digest {target['digest'][:16]} is not the history's")
            except RegistryError as exc:
                first = str(exc).splitlines()[0]
                actions.append(f"{where}; {entry['to']} does not verify ({first}): left as is")
                continue
            self._write(
                self.path("channels", name, f"{channel}.json"), {**target, "since": entry["at"]}
            )
            actions.append(f"finished {where}: an interrupted move, pointer now {entry['to']}")
        return actions

    def _recover(self, name: str) -> list[str]:
        """Under the lock: staging leftovers go; a version folder without its record is
        finished when it verifies and passed, removed otherwise."""
        folder = self.path("releases", name)
        if not self.fs.exists(folder):
            return []
        actions = []
        for entry in sorted(self.fs.ls(folder, detail=False)):
            base = posixpath.basename(entry.rstrip("/"))
            if base.startswith(STAGING) or base.endswith(".tmp"):
                self.fs.rm(entry, recursive=True)
                actions.append(f"removed {name}/{base}: leftover of an interrupted publish")
                continue
            if base.endswith(".json") or not re.fullmatch(SEMVER_PATTERN, base):
                continue
            if self.fs.exists(self._record_path(name, base)):
                continue
            try:
                with self._local_copy(name, base) as copy:
                    digest = _verified_digest(copy, f"unrecorded {name}@{base}", (name, base))
                    manifest = _manifest_sha(copy)
            except RegistryError as exc:
                self.fs.rm(entry, recursive=True)
                lines = str(exc).splitlines()
                why = "; ".join(x.strip() for x in lines[1:4]) or lines[0]
                actions.append(
                    f"removed {name}@{base}: interrupted publish that does not verify ({why})"
                )
                continue
            record = {
                "release": name,
                "version": base,
                "digest": digest,
                "manifest_sha256": manifest,
                "by": who(),
                "at": now(),
                "recovered": True,
            }
            self._create(self._record_path(name, base), record)
            actions.append(f"finished {name}@{base}: interrupted publish verified, record written")
        return actions

    # ------------------------------------------------------------------ channels
    def channel(self, name: str, channel: str) -> dict[str, Any] | None:
        path = self.path("channels", check_name(name), f"{check_channel(channel)}.json")
        return self._json(path, ("release", "version", "digest"))

    def _json(self, path: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
        """A registry JSON file (channel pointer, policy) or None when absent; a folder in
        its place, torn or hand-edited JSON, or missing keys are a clear error naming the
        file, never a traceback."""
        if not self.fs.exists(path):
            return None
        rel = posixpath.relpath(path, self.root) if self.local else path
        if self.fs.isdir(path):
            raise RegistryError(
                f"{rel} is a folder where the registry keeps a file; remove it (and restore "
                "the file from a backup, or promote again)"
            )
        try:
            data = json.loads(self.fs.cat_file(path))
            if not isinstance(data, dict) or any(k not in data for k in keys):
                raise ValueError(f"not an object with {', '.join(keys)}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RegistryError(
                f"{rel} is not valid ({' '.join(str(exc).split())[:120]}): torn or edited by "
                "hand; restore it from a backup, or promote again to rewrite it"
            ) from None
        out: dict[str, Any] = data
        return out

    def channels(self) -> list[dict[str, Any]]:
        """Every (release, channel) pointer."""
        folder = self.path("channels")
        found = self.fs.glob(self.path("channels", "*", "*.json")) if self.fs.exists(folder) else []
        out = []
        for p in sorted(found):
            channel = posixpath.basename(p)[: -len(".json")]
            if re.fullmatch(CHANNEL_PATTERN, channel):
                out.append({"channel": channel, **(self._json(p, ("release",)) or {})})
        return out

    def require_signature(self, channel: str, keys: list[Path]) -> dict[str, Any]:
        """From now on, `channel` accepts only bundles signed by one of `keys`."""
        from pipelines.keys import read_key

        pems = [read_key(key).decode("ascii") for key in keys]
        policy = {"require_signature": True, "public_keys": pems, "by": who(), "at": now()}
        with self.lock():
            self._write(self.path("policy", f"{check_channel(channel)}.json"), policy)
        return policy

    def policy(self, channel: str) -> dict[str, Any] | None:
        path = self.path("policy", f"{check_channel(channel)}.json")
        return self._json(path, ("require_signature",))

    def promote(self, name: str, version: str, channel: str, reason: str) -> dict[str, Any]:
        """Re-verify name@version, then point name's `channel` at it and record why."""
        check_name(name), check_version(version), check_channel(channel)
        with self.lock():
            self.warnings += self._pointers()  # an interrupted move first
            target = self._checked(name, version, channel)
            current = self.channel(name, channel)
            if current and (current["version"], current["digest"]) == (version, target["digest"]):
                # a retried deploy: nothing moves and nothing is recorded (a duplicate on
                # the rollback stack made the next rollback a move from 0.2.0 to 0.2.0)
                return {
                    "noop": True,
                    "channel": channel,
                    "from": _label(current),
                    "to": _label(target),
                }
            return self._move(channel, target, "promote", reason)

    def rollback(self, name: str, channel: str, reason: str) -> dict[str, Any]:
        """Point name's `channel` back at what it held before its current version."""
        check_name(name), check_channel(channel)
        with self.lock():
            self.warnings += self._pointers()  # an interrupted move first
            stack = self._stack(name, channel)
            if len(stack) < 2:
                raise RegistryError(
                    f"{name}'s channel {channel!r} has no earlier version to "
                    f"roll back to ({len(stack)} in its history)"
                )
            target = self._checked(name, stack[-2], channel)
            return self._move(channel, target, "rollback", reason)

    def history(self) -> list[dict[str, Any]]:
        """Every entry, oldest first; a torn or foreign line is reported and skipped."""
        self.warnings = [w for w in self.warnings if not w.startswith("history")]
        if self.local:
            path = self.path("history.jsonl")
            if not self.fs.exists(path):
                return []
            texts = self.fs.cat_file(path).decode("utf-8", errors="replace").splitlines()
            where = [f"history.jsonl line {i}" for i in range(1, len(texts) + 1)]
        else:
            paths = sorted(self.fs.glob(self.path("history", "*.json")))
            texts = [self.fs.cat_file(p).decode("utf-8", errors="replace") for p in paths]
            where = [f"history/{posixpath.basename(p)}" for p in paths]
        entries = []
        for text, place in zip(texts, where, strict=True):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
                entry["seq"], entry["channel"], entry["to"], entry["action"]  # noqa: B018
                entries.append(entry)
            except (ValueError, KeyError, TypeError):
                self.warnings.append(
                    f"{place} is torn or not an entry ({text[:60]!r}); skipped. History is "
                    "append-only: the entry it held is lost, later ones are intact"
                )
        return entries

    def facts(self, name: str, version: str) -> dict[str, Any]:
        """`shipyard.json` of a published version, after re-verifying the whole bundle
        against its manifest and its publish record."""
        with self._local_copy(name, version) as folder:
            self._verify_published(folder, name, version)
            return read_facts(folder)

    # ------------------------------------------------------------------ internals
    def _checked(self, name: str, version: str, channel: str) -> dict[str, Any]:
        with self._local_copy(name, version) as folder:
            digest = self._verify_published(folder, name, version)
            policy = self.policy(channel)
            if policy and policy.get("require_signature"):
                _check_signature(folder, policy, f"{name}@{version}", channel, digest)
        return {"release": name, "version": version, "digest": digest}

    def _verify_published(self, folder: Path, name: str, version: str) -> str:
        record = self.record(name, version)
        if record is None:
            raise RegistryError(
                f"{name}@{version} is not published in {self.url}; run "
                f"`shipyard publish {name}` first"
            )
        digest = _verified_digest(folder, f"published {name}@{version}", (name, version))
        if digest != record["digest"]:
            raise RegistryError(
                f"published {name}@{version} has digest {digest[:16]}, but its publish record "
                f"says {record['digest'][:16]}: the bundle and its manifest were replaced after "
                "publishing; refusing it (restore the version from a backup)"
            )
        # the root digest covers the shards' digests, not their names: a renamed file with
        # the manifest's names rewritten keeps it. The manifest's own bytes bind the names.
        want = record.get("manifest_sha256")
        if want is None:
            self.warnings.append(
                f"the publish record of {name}@{version} predates manifest digests: file names "
                "are not bound to it (republish the version under a new number to bind them)"
            )
        elif (have := _manifest_sha(folder)) != want:
            raise RegistryError(
                f"published {name}@{version}'s manifest.json is not the one published (sha256 "
                f"{have[:16]}, the record says {want[:16]}): file names or other "
                "manifest fields were rewritten after publishing; refusing it (restore the "
                "version from a backup)"
            )
        return digest

    def _move(
        self, channel: str, target: dict[str, Any], action: str, reason: str
    ) -> dict[str, Any]:
        current = self.channel(target["release"], channel)
        history = self.history()
        entry = {
            "seq": max((e["seq"] for e in history), default=0) + 1,
            "at": now(),
            "who": who(),
            "action": action,
            "channel": channel,
            "from": _label(current),
            "to": _label(target),
            "digest": target["digest"],
            "reason": reason,
        }
        self._fence()
        self._append(entry)
        self._write(
            self.path("channels", target["release"], f"{channel}.json"),
            {**target, "since": entry["at"]},
        )
        return entry

    def _stack(self, name: str, channel: str) -> list[str]:
        """Versions the channel moved through: a promotion pushes, a rollback pops. A
        promotion of the version already on top (a history written before re-promotions
        became no-ops) is not a move and pushes nothing."""
        stack: list[str] = []
        for entry in self.history():
            if entry["channel"] != channel or entry["to"].rsplit("@", 1)[0] != name:
                continue
            version = entry["to"].rsplit("@", 1)[1]
            if entry["action"] == "rollback":
                if stack:
                    stack.pop()
            elif not stack or stack[-1] != version:
                stack.append(version)
        return stack

    def _write(self, path: str, data: dict[str, Any]) -> None:
        """Write JSON next to `path`, then move it over: readers never see half a file."""
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(tmp, _dump(data))
        self.fs.mv(tmp, path)

    def _create(self, path: str, data: dict[str, Any]) -> None:
        """Exclusive create: fails (never overwrites) when `path` exists."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if self.local:
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            Path(tmp).write_bytes(_dump(data))
            try:
                os.link(tmp, path)  # atomic and exclusive
            except FileExistsError:
                raise RegistryError(f"{path} exists already; refusing to overwrite it") from None
            finally:
                os.unlink(tmp)
            return
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(_dump(data))
        except FileExistsError:
            raise RegistryError(f"{path} exists already; refusing to overwrite it") from None

    def _append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, sort_keys=True)
        if self.local:
            path = self.path("history.jsonl")
            with open(path, "ab") as fh:
                # A torn last line (a crash mid-write) must not swallow this entry.
                if fh.tell() and not _ends_with_newline(path):
                    fh.write(b"\n")
                fh.write(line.encode() + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            return
        # Object stores: one object per entry, created exclusively; nothing is rewritten.
        self._create(self.path("history", f"{entry['seq']:010d}.json"), entry)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialize writers: filelock locally, an owner-stamped lock object elsewhere."""
        if self.local:
            from filelock import FileLock, Timeout

            try:
                with FileLock(self.path(".lock"), timeout=LOCK_TIMEOUT_S):
                    yield
            except Timeout:
                raise RegistryError(
                    f"registry lock {self.path('.lock')} held for over {LOCK_TIMEOUT_S:.0f} s; "
                    "another publish or promotion is running"
                ) from None
            return
        path = self.path(".lock")
        token = secrets.token_hex(16)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while not self._try_remote_lock(path, token):
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"registry lock {path} held for over {LOCK_TIMEOUT_S:.0f} s by "
                    f"{self._lock_owner(path)}; it expires {LOCK_STALE_S:.0f} s after it was "
                    "last renewed (`shipyard registry unlock` removes one whose holder died)"
                )
            time.sleep(0.2)
        lease = _Lease(self, path, token)
        lease.start()
        self._held = (path, token, lease)
        try:
            yield
        finally:
            self._held = None
            lease.stop.set()
            lease.join()
            if self._lock_owner(path).get("token") == token:
                self.fs.rm(path)

    def _fence(self) -> None:
        """Before a commit point (a publish record, a history entry): the lock must still
        be ours. A holder stalled past its lease (its renewals failed) may have been
        broken by another writer; it must not commit over that writer's work."""
        if self._held is None:
            return
        path, token, lease = self._held
        if lease.lost or self._lock_owner(path).get("token") != token:
            raise RegistryError(
                f"lost the registry lock {path} (not renewed within {LOCK_STALE_S:.0f} s, then "
                "taken by another writer); nothing was recorded: run the command again"
            )

    def unlock(self, force: bool = False) -> str:
        """`shipyard registry unlock`: remove a lock whose holder died, naming it."""
        if self.local:
            return (
                f"{self.url}: a local registry's lock is an OS file lock, released when its "
                "holder exits; nothing to unlock"
            )
        path = self.path(".lock")
        held = self._lock_owner(path)
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
        self.fs.rm(path)
        return f"{self.url}: removed the registry lock held by {who_}" + (
            " (forced: it was live)" if left > 0 else " (expired)"
        )

    def _try_remote_lock(self, path: str, token: str) -> bool:
        stamp = {
            "owner": who(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": token,
            "taken": time.time(),
            "expires": time.time() + LOCK_STALE_S,
        }
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(_dump(stamp))
            return True
        except FileExistsError:
            held = self._lock_owner(path)
            if held and held.get("expires", 0) < time.time():
                self.warnings.append(
                    f"broke a stale registry lock held by {held.get('owner')}@{held.get('host')} "
                    f"since {held.get('taken')}"
                )
                self.fs.rm(path)
            return False

    def _lock_owner(self, path: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.fs.cat_file(path))
            return data
        except (FileNotFoundError, ValueError):
            return {}

    @contextmanager
    def _local_copy(self, name: str, version: str) -> Iterator[Path]:
        source = self._version_dir(name, version)
        if not self.fs.exists(source):
            raise RegistryError(f"{name}@{version} has no bundle in {self.url}")
        if self.local:
            yield Path(source)
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(source + "/", tmp + "/bundle", recursive=True)
            yield Path(tmp) / "bundle"


class _Lease(threading.Thread):
    """Renews a remote lock's lease while its holder works: every third of LOCK_STALE_S
    the lock object is rewritten with a new expiry, so a publish longer than the lease is
    never taken for a dead one (a breaker only breaks a lock past its expiry). A renewal
    that finds another token stops and marks the lock lost (`Registry._fence`)."""

    def __init__(self, registry: Registry, path: str, token: str) -> None:
        super().__init__(daemon=True, name="registry-lease")
        self.registry, self.path, self.token = registry, path, token
        self.stop = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self.stop.wait(LOCK_STALE_S / 3):
            held = self.registry._lock_owner(self.path)
            if held.get("token") != self.token:
                self.lost = True
                return
            now_s = time.time()
            stamp = {**held, "expires": now_s + LOCK_STALE_S, "renewed": now_s}
            try:
                self.registry.fs.pipe_file(self.path, _dump(stamp))
            except OSError:  # the store is unreachable: the next renewal tries again
                continue


def _manifest_sha(folder: Path) -> str:
    """sha256 of the bundle's manifest.json bytes (names, sizes, digests, everything)."""
    import hashlib

    return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()


def _verified_digest(folder: Path, what: str, bound: tuple[str, str]) -> str:
    """Strict verify + bound to name@version + every stage acceptable; the root digest.

    `bound` is where the bundle is filed. The bundle says what it is twice, both hashed
    (and signed, when signed): `shipyard.json`'s release and version, and the manifest's
    subject. A bundle filed under any other name or version is refused: a registry writer
    could otherwise refile a signed tiny-gpt2@0.1.0 as other-model@9.9.9, or a version
    bump without a rebuild publish 0.1.0's content as 0.2.0."""
    problems = verify_bundle(folder)
    if problems:
        raise RegistryError(
            f"{what} does not match its manifest; refusing it:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    facts = read_facts(folder)
    label = f"{bound[0]}@{bound[1]}"
    says = f"{facts.get('release')}@{facts.get('version')}"
    subject = load_manifest(folder / "manifest.json").subject[0].name
    if says != label or subject != label:
        raise RegistryError(
            f"{what} is filed as {label}, but its shipyard.json says {says} and its manifest "
            f"{subject}; a bundle is published under the release and version it was built "
            "as: rebuild it (`dvc repro`) after changing `name` or `version` in the spec"
        )
    reports = {}
    for path in sorted((folder / "reports").glob("*.json")):
        try:
            reports[path.stem] = StageReport.model_validate_json(path.read_text())
        except ValueError:
            raise RegistryError(f"{what}: reports/{path.name} is not a stage report") from None
    failed = [f"{n}: {r.status.value}" for n, r in reports.items() if not r.acceptable()]
    # the facts repeat each verdict: both are hashed, and both must say the same
    failed += [
        f"{n}: {v.get('status')} (shipyard.json)"
        for n, v in sorted(facts.get("stages", {}).items())
        if v.get("status") != (reports[n].status.value if n in reports else "passed")
    ]
    if failed:
        raise RegistryError(
            f"{what} has stages that did not pass ({', '.join(failed)}); "
            "only a release whose gate passed can be published or promoted"
        )
    digest: str = load_manifest(folder / "manifest.json").digest
    return digest


def _check_signature(
    folder: Path, policy: dict[str, Any], label: str, channel: str, digest: str
) -> None:
    from pipelines.signing import Identity, verify_signed

    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pem in enumerate(policy.get("public_keys", [])):
            key = Path(tmp) / f"key{i}.pub"
            key.write_text(pem, encoding="ascii")
            try:
                if verify_signed(folder, Identity(public_key=key)) == digest:
                    return
            except RegistryError as exc:
                errors.append(str(exc).splitlines()[0])
                if "is not signed" in errors[-1]:
                    break
    unsigned = any("is not signed" in e for e in errors)
    raise RegistryError(
        f"channel {channel!r} requires a signature by a trusted key; {label} "
        f"{'is not signed' if unsigned else 'is not signed by one'}"
        f" ({'; '.join(errors[:2]) or 'no trusted keys configured'}). Sign the bundle with "
        "`shipyard sign BUNDLE --private-key KEY` before publishing it as a new version"
    )


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


def _label(entry: dict[str, Any] | None) -> str | None:
    return f"{entry['release']}@{entry['version']}" if entry else None
