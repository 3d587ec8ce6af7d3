"""The registry: immutable published bundles, channel pointers and an append-only history.

Any fsspec URL works (a local folder by default; `s3://bucket/prefix` through s3fs): this
module is the protocol, and `pipelines/storage.py` the places it is kept (a folder, an
object store), behind one interface with no `if local` here.
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

Every file is read and written through its model (schemas/registry.py), byte for byte what
the registry always wrote (tests/pipelines/test_registry_files.py); a call returns those
models, or one of the frozen results below (Published, Verified, CheckedOut, Unmoved,
ChannelState), never a dict.
"""

from __future__ import annotations

import posixpath
import re
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from pipelines.storage import STAGING, UPLOAD, Store, _dump, open_store, who
from schemas import RegistryError, SpecError, StageReport
from schemas.facts import FactsHead
from schemas.problems import first_problem
from schemas.registry import (
    ChannelPointer,
    HistoryEntry,
    PublishRecord,
    RegistryFile,
    SignaturePolicy,
    UploadMarker,
)
from schemas.spec.base import NAME_PATTERN, SEMVER_PATTERN
from stages.bundling.oms import load_manifest, read_facts, verify_bundle

CHANNEL_PATTERN = r"[a-z][a-z0-9-]{0,62}"
File = TypeVar("File", bound=BaseModel)


@dataclass(frozen=True)
class Verified:
    """A published version whose bundle was just re-verified: its digest is its manifest's
    and its publish record's."""

    release: str
    version: str
    digest: str

    @property
    def label(self) -> str:
        return f"{self.release}@{self.version}"


@dataclass(frozen=True)
class CheckedOut(Verified):
    """A verified private copy (`Registry.checkout`), named by `channel` (None: by its
    version)."""

    channel: str | None = None


@dataclass(frozen=True)
class Published:
    """What `publish` did: the version's publish record; `already` when the same bundle was
    published before (nothing copied); `recovered`, what it finished or removed first (the
    lines `registry check` prints)."""

    record: PublishRecord
    already: bool = False
    recovered: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unmoved:
    """A promotion of the version (and canary share) the channel already serves: nothing
    moved, nothing was recorded."""

    channel: str
    from_: str | None
    to: str


@dataclass(frozen=True)
class ChannelState:
    """One channel of one release: its name and its pointer."""

    channel: str
    pointer: ChannelPointer

    def document(self) -> dict[str, Any]:
        """`shipyard status --json`'s object: the channel, then the pointer file's keys."""
        return {"channel": self.channel, **self.pointer.document()}


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
        self.url = url
        self.store: Store = open_store(url)
        # one list: the store's (a stale lock it broke) and the protocol's own warnings
        self.warnings: list[str] = self.store.warnings

    # the store's, for callers and tests that reach the files themselves
    @property
    def fs(self) -> Any:
        return self.store.fs

    @property
    def root(self) -> str:
        return self.store.root

    @property
    def local(self) -> bool:
        return self.store.local

    # ------------------------------------------------------------------ paths
    def path(self, *parts: str) -> str:
        """A path under the root; refuses any part that could leave it."""
        return self.store.path(*parts)

    def _version_dir(self, name: str, version: str) -> str:
        return self.path("releases", check_name(name), check_version(version))

    def _record_path(self, name: str, version: str) -> str:
        return self.path("releases", check_name(name), f"{check_version(version)}.json")

    # ------------------------------------------------------------------ publish
    def publish(self, bundle: Path, name: str, version: str) -> Published:
        """Copy a verified, passing bundle in as name@version; never overwrite another."""
        target, record_path = self._version_dir(name, version), self._record_path(name, version)
        if not bundle.is_dir():  # a missing bundle is refused as a tampered one is
            raise RegistryError(
                f"{bundle}: no such bundle folder; build it with `dvc repro bundle@{name}`"
            )
        with self.lock():
            done = tuple(self._recover(name))
            record = self.record(name, version)
            if record is not None:
                digest = _verified_digest(bundle, f"build bundle {bundle}", (name, version))
                if record.digest == digest:
                    return Published(record, already=True, recovered=done)
                raise RegistryError(
                    f"{name}@{version} is already published with digest "
                    f"{record.digest[:16]}; this bundle's is {digest[:16]}. Published "
                    "versions are immutable: bump `version` in the release spec"
                )
            uploader = self._in_flight(name, version)
            if uploader is not None:  # left alone by _recover: another publish, alive
                raise RegistryError(
                    f"{name}@{version} is being uploaded by {uploader}; its lock was taken "
                    "from it, and it will record nothing: once its lease lapses, "
                    "`shipyard registry check` clears it and this publish can run"
                )
            # nothing is at `target`: `_recover` ran under the same lock, and a version
            # without its record was finished (then it is published) or removed. Where the
            # lock can be broken under a live holder (an object store), whose upload this is
            # is written first: `registry check` leaves it alone while that lease is live
            marker = self._upload_marker(name, version)
            token = self.store.held_token()
            if token is not None:
                self.store.write(marker, _file(UploadMarker(token=token, by=who(), at=now())))
            digest, manifest = self.store.put_tree(
                bundle,
                target,
                lambda copy: (
                    _verified_digest(copy, f"copied bundle {bundle}", (name, version)),
                    _manifest_sha(copy),
                ),
            )
            record = PublishRecord(
                release=name,
                version=version,
                digest=digest,
                manifest_sha256=manifest,
                by=who(),
                at=now(),
            )
            self.store.fence()
            self._create(record_path, record)
            if token is not None:
                self.store.remove(marker)
            return Published(record, recovered=done)

    def _upload_marker(self, name: str, version: str) -> str:
        return self.path("releases", name, f"{UPLOAD}{version}.json")

    def _in_flight(self, name: str, version: str) -> str | None:
        """Who is uploading `name@version` with a live lease (their lock may have been
        broken, but they are alive and will not record it), or None."""
        marker = self._upload_marker(name, version)
        if not self.store.exists(marker):
            return None
        try:
            upload = UploadMarker.model_validate_json(self.store.read(marker))
        except ValueError:  # pydantic's ValidationError is one
            return None
        left = self.store.lease_left(upload.token)
        return f"{upload.by} (lease live for {left:.0f} s)" if left > 0 else None

    def record(self, name: str, version: str) -> PublishRecord | None:
        path = self._record_path(name, version)
        if not self.store.exists(path):
            return None
        try:
            return PublishRecord.model_validate_json(self.store.read(path))
        except ValueError:  # pydantic's ValidationError is one
            raise RegistryError(
                f"publish record {path} is unreadable; restore it from a backup "
                "(published versions are immutable)"
            ) from None

    def check(self) -> list[str]:
        """`shipyard registry check`: finish or remove interrupted publishes, say which."""
        names = self.store.names(self.path("releases"))
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
        found: list[tuple[str, type[BaseModel]]] = [
            *((p, ChannelPointer) for p in self.store.glob("channels", "*", "*")),
            *((p, SignaturePolicy) for p in self.store.glob("policy", "*")),
        ]
        problems = []
        for path, model in sorted(found, key=lambda f: f[0]):
            if path.endswith(".tmp"):
                continue
            try:
                self._json(path, model)
            except RegistryError as exc:
                problems.append(str(exc))
        return problems

    def _pointers(self) -> list[str]:
        """Under the lock: every channel pointer against its history. A move appends its
        history entry (the commit point, like a publish record), then writes the pointer;
        a crash between the two left a pointer behind its last entry, and the history
        claiming a move that never happened. That move is finished here (the target
        re-verified first), or, when the target no longer verifies, reported."""
        last: dict[tuple[str, str], HistoryEntry] = {}
        for entry in self.history():
            last[(entry.to.rsplit("@", 1)[0], entry.channel)] = entry
        actions = []
        for (name, channel), entry in sorted(last.items()):
            try:
                check_name(name), check_channel(channel)
            except RegistryError:
                continue
            version = entry.to.rsplit("@", 1)[1]
            try:
                pointer = self.channel(name, channel)
            except RegistryError:
                continue  # unreadable: check names it (`_unreadable`); a move rewrites it
            canary = entry.canary_percent  # a canary step is a move of its own
            if pointer and (pointer.version, pointer.digest, pointer.canary_percent) == (
                version,
                entry.digest,
                canary,
            ):
                continue
            where = f"{name}'s {channel}: history #{entry.seq} ({entry.action}) moved it to "
            where += f"{entry.to}, its pointer says {_label(pointer) or '(empty)'}"
            try:
                target = self._checked(name, version, channel)
                if target.digest != entry.digest:
                    raise RegistryError(f"digest {target.digest[:16]} is not the history's")
            except RegistryError as exc:
                first = str(exc).splitlines()[0]
                actions.append(f"{where}; {entry.to} does not verify ({first}): left as is")
                continue
            self._write(
                self.path("channels", name, f"{channel}.json"),
                _pointer(target, canary, since=entry.at),
            )
            actions.append(f"finished {where}: an interrupted move, pointer now {entry.to}")
        return actions

    def _recover(self, name: str) -> list[str]:
        """Under the lock: staging leftovers go; a version folder without its record is
        finished when it verifies and passed, removed otherwise."""
        folder = self.path("releases", name)
        actions = []
        names = self.store.names(folder)
        for base in names:
            entry = posixpath.join(folder, base)
            if base.startswith(UPLOAD):  # an upload's marker: goes with its version, or alone
                version = base.removeprefix(UPLOAD).removesuffix(".json")
                recorded = self.store.exists(posixpath.join(folder, f"{version}.json"))
                gone = version not in names or recorded
                if gone and self._in_flight(name, version) is None:
                    self.store.remove(entry)
                continue
            if base.startswith(STAGING) or base.endswith(".tmp"):
                self.store.remove(entry)
                actions.append(f"removed {name}/{base}: leftover of an interrupted publish")
                continue
            if base.endswith(".json") or not re.fullmatch(SEMVER_PATTERN, base):
                continue
            if self.store.exists(self._record_path(name, base)):
                continue
            uploader = self._in_flight(name, base)
            if uploader is not None:
                actions.append(f"left {name}@{base} alone: an upload in flight by {uploader}")
                continue
            if self.store.exists(self._upload_marker(name, base)):
                self.store.remove(self._upload_marker(name, base))
            try:
                with self._local_copy(name, base) as copy:
                    digest = _verified_digest(copy, f"unrecorded {name}@{base}", (name, base))
                    manifest = _manifest_sha(copy)
            except RegistryError as exc:
                self.store.remove(entry)
                lines = str(exc).splitlines()
                why = "; ".join(x.strip() for x in lines[1:4]) or lines[0]
                actions.append(
                    f"removed {name}@{base}: interrupted publish that does not verify ({why})"
                )
                continue
            record = PublishRecord(
                release=name,
                version=base,
                digest=digest,
                manifest_sha256=manifest,
                by=who(),
                at=now(),
                recovered=True,
            )
            self._create(self._record_path(name, base), record)
            actions.append(f"finished {name}@{base}: interrupted publish verified, record written")
        return actions

    # ------------------------------------------------------------------ channels
    def channel(self, name: str, channel: str) -> ChannelPointer | None:
        path = self.path("channels", check_name(name), f"{check_channel(channel)}.json")
        return self._json(path, ChannelPointer)

    def _json(self, path: str, model: type[File]) -> File | None:
        """A registry JSON file (channel pointer, policy) or None when absent; a folder in
        its place, torn or hand-edited JSON, or missing keys are a clear error naming the
        file, never a traceback."""
        if not self.store.exists(path):
            return None
        rel = self.store.rel(path)
        if self.store.isdir(path):
            raise RegistryError(
                f"{rel} is a folder where the registry keeps a file; remove it (and restore "
                "the file from a backup, or promote again)"
            )
        try:
            return model.model_validate_json(self.store.read(path))
        except ValueError as exc:  # pydantic's ValidationError is one
            raise RegistryError(
                f"{rel} is not valid ({first_problem(exc)[:120]}): torn or edited by "
                "hand; restore it from a backup, or promote again to rewrite it"
            ) from None

    def channels(self) -> list[ChannelState]:
        """Every (release, channel) pointer."""
        out = []
        for p in self.store.glob("channels", "*", "*.json"):
            channel = posixpath.basename(p)[: -len(".json")]
            if re.fullmatch(CHANNEL_PATTERN, channel):
                pointer = self._json(p, ChannelPointer)
                if pointer is not None:  # None: removed since the listing
                    out.append(ChannelState(channel, pointer))
        return out

    def require_signature(self, channel: str, keys: list[Path]) -> SignaturePolicy:
        """From now on, `channel` accepts only bundles signed by one of `keys`."""
        from pipelines.keys import read_key

        pems = [read_key(key).decode("ascii") for key in keys]
        policy = SignaturePolicy(require_signature=True, public_keys=pems, by=who(), at=now())
        with self.lock():
            self._write(self.path("policy", f"{check_channel(channel)}.json"), policy)
        return policy

    def policy(self, channel: str) -> SignaturePolicy | None:
        path = self.path("policy", f"{check_channel(channel)}.json")
        return self._json(path, SignaturePolicy)

    def promote(
        self, name: str, version: str, channel: str, reason: str, canary: int | None = None
    ) -> HistoryEntry | Unmoved:
        """Re-verify name@version, then point name's `channel` at it and record why; with
        `canary` (a percent), the move is a canary step: the cluster sends that share of
        traffic to it (`shipyard deploy`), and a later step of the same version (a larger
        share, or None: all) is recorded as a move of its own."""
        check_name(name), check_version(version), check_channel(channel)
        if canary is not None and not 0 <= canary <= 100:
            raise SpecError("--canary", [f"--canary {canary}: a percent of traffic, 0 to 100"])
        with self.lock():
            self.warnings += self._pointers()  # an interrupted move first
            target = self._checked(name, version, channel)
            current = self.channel(name, channel)
            if current and (current.version, current.digest, current.canary_percent) == (
                version,
                target.digest,
                canary,
            ):
                # a retried deploy: nothing moves and nothing is recorded (a duplicate on
                # the rollback stack made the next rollback a move from 0.2.0 to 0.2.0)
                return Unmoved(channel=channel, from_=_label(current), to=target.label)
            return self._move(channel, target, "promote", reason, canary)

    def rollback(self, name: str, channel: str, reason: str) -> HistoryEntry:
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

    def history(self) -> list[HistoryEntry]:
        """Every entry, oldest first; a torn or foreign line is reported and skipped."""
        self.warnings[:] = [w for w in self.warnings if not w.startswith("history")]
        entries = []
        for place, text in self.store.log():
            if not text.strip():
                continue
            try:
                entries.append(HistoryEntry.model_validate_json(text))
            except ValueError:
                self.warnings.append(
                    f"{place} is torn or not an entry ({text[:60]!r}); skipped. History is "
                    "append-only: the entry it held is lost, later ones are intact"
                )
        return entries

    def facts(self, name: str, version: str) -> FactsHead:
        """`shipyard.json` of a published version, after re-verifying the whole bundle
        against its manifest and its publish record."""
        with self._local_copy(name, version) as folder:
            self._verify_published(folder, name, version)
            return read_facts(folder, FactsHead)

    def checkout(self, name: str, ref: str, into: Path) -> CheckedOut:
        """A private copy of `name@ref` at `into` (absent: made here), verified as a
        promotion verifies it: `ref` a version (Semantic Versioning, a digit first) or a
        channel (a letter first: its live version, whose digest the pointer names, and
        its signature where the channel requires one). Copied, never linked: a server of
        the copy cannot write into the registry, nor a registry writer change what was
        verified."""
        check_name(name)
        channel: str | None = None
        pointer: ChannelPointer | None = None
        if re.fullmatch(SEMVER_PATTERN, ref):
            version = ref
        else:
            channel = check_channel(ref)
            pointer = self.channel(name, channel)
            if pointer is None:
                raise RegistryError(
                    f"{name} has no {channel!r} channel in {self.url}: promote a version to it "
                    f"first (`shipyard promote {name}@VERSION --to {channel}`), or name a "
                    "version"
                )
            version = pointer.version
        source = self._version_dir(name, version)
        if not self.store.exists(source):
            raise RegistryError(f"{name}@{version} has no bundle in {self.url}")
        self.store.copy_out(source, into)
        digest = self._verify_published(into, name, version)
        if channel is not None and pointer is not None:
            if digest != pointer.digest:
                raise RegistryError(
                    f"{name}'s {channel} channel points at {version} with digest "
                    f"{pointer.digest[:16]}, but that version holds {digest[:16]}: "
                    "refusing it (promote again, or restore the version from a backup)"
                )
            policy = self.policy(channel)
            if policy and policy.require_signature:
                _check_signature(into, policy, f"{name}@{version}", channel, digest)
        return CheckedOut(release=name, version=version, digest=digest, channel=channel)

    # ------------------------------------------------------------------ internals
    def _checked(self, name: str, version: str, channel: str) -> Verified:
        with self._local_copy(name, version) as folder:
            digest = self._verify_published(folder, name, version)
            policy = self.policy(channel)
            if policy and policy.require_signature:
                _check_signature(folder, policy, f"{name}@{version}", channel, digest)
        return Verified(release=name, version=version, digest=digest)

    def _verify_published(self, folder: Path, name: str, version: str) -> str:
        record = self.record(name, version)
        if record is None:
            raise RegistryError(
                f"{name}@{version} is not published in {self.url}; run "
                f"`shipyard publish {name}` first"
            )
        digest = _verified_digest(folder, f"published {name}@{version}", (name, version))
        if digest != record.digest:
            raise RegistryError(
                f"published {name}@{version} has digest {digest[:16]}, but its publish record "
                f"says {record.digest[:16]}: the bundle and its manifest were replaced after "
                "publishing; refusing it (restore the version from a backup)"
            )
        # the root digest covers the shards' digests, not their names: a renamed file with
        # the manifest's names rewritten keeps it. The manifest's own bytes bind the names.
        want = record.manifest_sha256
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
        self,
        channel: str,
        target: Verified,
        action: Literal["promote", "rollback"],
        reason: str,
        canary: int | None = None,
    ) -> HistoryEntry:
        current = self.channel(target.release, channel)
        history = self.history()
        step = {} if canary is None else {"canary_percent": canary}
        entry = HistoryEntry.model_validate(  # by the file's keys: "from" is a keyword
            {
                "seq": max((e.seq for e in history), default=0) + 1,
                "at": now(),
                "who": who(),
                "action": action,
                "channel": channel,
                "from": _label(current),
                "to": target.label,
                "digest": target.digest,
                "reason": reason,
                **step,
            }
        )
        self.store.fence()
        self._append(entry)
        self._write(
            self.path("channels", target.release, f"{channel}.json"),
            _pointer(target, canary, since=entry.at),
        )
        return entry

    def _stack(self, name: str, channel: str) -> list[str]:
        """Versions the channel moved through: a promotion pushes, a rollback pops. A
        promotion of the version already on top (a history written before re-promotions
        became no-ops) is not a move and pushes nothing."""
        stack: list[str] = []
        for entry in self.history():
            if entry.channel != channel or entry.to.rsplit("@", 1)[0] != name:
                continue
            version = entry.to.rsplit("@", 1)[1]
            if entry.action == "rollback":
                if stack:
                    stack.pop()
            elif not stack or stack[-1] != version:
                stack.append(version)
        return stack

    def _write(self, path: str, data: RegistryFile) -> None:
        """Replace a registry JSON file atomically: readers never see half a file."""
        self.store.write(path, _file(data))

    def _create(self, path: str, data: RegistryFile) -> None:
        """Exclusive create: fails (never overwrites) when `path` exists."""
        self.store.create(path, _file(data))

    def _append(self, entry: HistoryEntry) -> None:
        self.store.append(entry.seq, entry.document())

    def lock(self) -> AbstractContextManager[None]:
        """Serialize writers (the store's lock)."""
        return self.store.lock()

    def unlock(self, force: bool = False) -> str:
        """`shipyard registry unlock`: remove a lock whose holder died, naming it."""
        return self.store.unlock(force)

    @contextmanager
    def _local_copy(self, name: str, version: str) -> Iterator[Path]:
        source = self._version_dir(name, version)
        if not self.store.exists(source):
            raise RegistryError(f"{name}@{version} has no bundle in {self.url}")
        with self.store.local_copy(source) as folder:
            yield folder


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
    try:
        facts = read_facts(folder, FactsHead)
    except ValueError as exc:
        raise RegistryError(f"{what}: {exc}; it is not a Shipyard bundle's facts") from None
    label = f"{bound[0]}@{bound[1]}"
    says = f"{facts.release}@{facts.version}"
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
        f"{n}: {v.status} (shipyard.json)"
        for n, v in sorted(facts.stages.items())
        if v.status != (reports[n].status.value if n in reports else "passed")
    ]
    if failed:
        raise RegistryError(
            f"{what} has stages that did not pass ({', '.join(failed)}); "
            "only a release whose gate passed can be published or promoted"
        )
    digest: str = load_manifest(folder / "manifest.json").digest
    return digest


def _check_signature(
    folder: Path, policy: SignaturePolicy, label: str, channel: str, digest: str
) -> None:
    from pipelines.signing import Identity, verify_signed

    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pem in enumerate(policy.public_keys):
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


def _file(data: RegistryFile) -> bytes:
    """A registry JSON file's bytes: its keys sorted, indented (what the registry always
    wrote)."""
    return _dump(data.document())


def _pointer(target: Verified, canary: int | None, since: str) -> ChannelPointer:
    """The pointer of a channel moved to `target` (a canary step: `canary` percent)."""
    step = {} if canary is None else {"canary_percent": canary}
    return ChannelPointer(
        release=target.release, version=target.version, digest=target.digest, since=since, **step
    )


def _label(entry: ChannelPointer | Verified | None) -> str | None:
    return f"{entry.release}@{entry.version}" if entry else None
