"""Build provenance: one in-toto statement per stage run, signed by the builder.

After a stage runs (`shipyard run-stage`), `build/<release>/attestations/<stage>.json` (a DVC
out of the stage's own, outside the folders other stages read) gets a DSSE
envelope (payload type `application/vnd.in-toto+json`) holding an in-toto Statement v1
whose subjects are every file the stage wrote (its DVC outs and its metrics file) and whose
predicate names the stage, the release and the sha256 of every file it depended on (its
params file, which carries the code fingerprint and the spec sections it reads; the model;
upstream outputs), exactly the deps dvc.yaml declares. With `SHIPYARD_BUILDER_KEY` (an EC
private key PEM, as for `shipyard sign`) the envelope is signed, deterministically
(RFC 6979), so a rebuild on the same inputs writes the same bytes; without it, it carries
no signature and can only be checked for digests.

`check` is what trusts an output from elsewhere (a shared DVC remote, DVC's run-cache): the
signature by one of the trusted builder keys (`SHIPYARD_TRUSTED_BUILDERS`: public key
PEMs, separated by the OS path separator), the stage and release it claims, the files of
its outputs byte for byte, and its inputs against the files this checkout has now. Each
stage's inputs include its upstream outputs, so a chain of checked stages is a chain of
trusted builds from the model and the spec to the bundle.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import RegistryError
from stages._contract import attestation_file
from stages.bundling.dsse import PAYLOAD_TYPE, ecdsa, envelope, key_id, pae

__all__ = ["PAYLOAD_TYPE", "key_id", "pae"]
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://shipyard.dev/provenance/stage-run/v1"
KEY_ENV = "SHIPYARD_BUILDER_KEY"
TRUST_ENV = "SHIPYARD_TRUSTED_BUILDERS"
MAX_ENVELOPE_BYTES = 16 << 20


@dataclass(frozen=True)
class StagePaths:
    """One stage run's files, relative to the repository root, as dvc.yaml lists them."""

    stage: str
    release: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]  # DVC outs (folders, its attestation) and the metrics file

    @property
    def envelope(self) -> str:
        """Where its provenance lives: build/<release>/attestations/<stage>.json."""
        return f"build/{self.release}/{attestation_file(self.stage)}"


def stage_paths(root: Path, stage: str, release: str) -> StagePaths | None:
    """The deps and outs dvc.yaml declares for this stage of this release (its `foreach`
    item substituted into the template), or None outside a DVC project. Read from dvc.yaml,
    what DVC runs, so a stage run loads nothing but itself and this module."""
    import yaml

    path = root / "dvc.yaml"
    if not path.is_file():
        return None
    entry = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages", {}).get(stage)
    if not isinstance(entry, dict) or release not in (entry.get("foreach") or {}):
        return None
    item, template = entry["foreach"][release], entry["do"]

    def resolve(text: str) -> str:
        text = text.replace("${key}", release)
        for slot, value in (item or {}).items():
            text = text.replace(f"${{item.{slot}}}", str(value))
        return text

    def named(entries: list[Any]) -> list[str]:  # a path, or {path: {cache: false}}
        return [resolve(next(iter(e)) if isinstance(e, dict) else e) for e in entries]

    paths = StagePaths(
        stage,
        release,
        tuple(named(template.get("deps", []))),
        # outs, plots (committed data, `cache: false`) and the metrics file, as DVC has them
        tuple(named([e for k in ("outs", "plots", "metrics") for e in template.get(k, [])])),
    )
    # a dvc.yaml compiled before attestations were outs declares nowhere to write one
    return paths if paths.envelope in paths.outs else None


def _digests(root: Path, paths: tuple[str, ...], skip: str = "") -> dict[str, str]:
    """sha256 of every file under each path (a folder's files, recursively), by path."""
    from stages.bundling.hashing import hash_files

    files: dict[str, Path] = {}
    for rel in paths:
        top = root / rel
        if rel == skip:
            continue
        if top.is_file():
            files[rel] = top
        elif top.is_dir():
            for f in sorted(top.rglob("*")):
                name = f.relative_to(root).as_posix()
                if f.is_file() and name != skip:
                    files[name] = f
    return hash_files(files)


def statement(root: Path, paths: StagePaths) -> dict[str, Any]:
    outs = _digests(root, paths.outs, skip=paths.envelope)
    deps = _digests(root, paths.deps)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": n, "digest": {"sha256": d}} for n, d in sorted(outs.items())],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "stage": paths.stage,
            "release": paths.release,
            "command": f"shipyard run-stage {paths.stage}",
            "inputs": [{"name": n, "digest": {"sha256": d}} for n, d in sorted(deps.items())],
        },
    }


def builder_key(env: dict[str, str] | os._Environ[str] = os.environ) -> Any:
    """The builder's private key (SHIPYARD_BUILDER_KEY), or None: attestations unsigned."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from pipelines.keys import read_key

    path = env.get(KEY_ENV)
    if not path:
        return None
    return load_pem_private_key(read_key(Path(path), private=True), password=None)


def trusted_keys(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """The trusted builders' public keys by key id (SHIPYARD_TRUSTED_BUILDERS)."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from pipelines.keys import read_key

    keys = {}
    for path in filter(None, env.get(TRUST_ENV, "").split(os.pathsep)):
        public = load_pem_public_key(read_key(Path(path)))
        keys[key_id(public)] = public
    return keys


def write(root: Path, paths: StagePaths, key: Any) -> Path:
    """The stage's provenance envelope, beside its report."""
    text = envelope(statement(root, paths), key)
    target = root / paths.envelope
    target.parent.mkdir(parents=True, exist_ok=True)
    # a new file, never a write through the old one: DVC links outputs out of its cache
    # (hardlinks), so writing in place would rewrite the cached object of an earlier run
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    return target


def read(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
    """(statement, signatures, payload) of an envelope, or RegistryError saying why not."""
    try:
        if path.stat().st_size > MAX_ENVELOPE_BYTES:
            raise RegistryError(f"{path}: larger than {MAX_ENVELOPE_BYTES} bytes")
        envelope = json.loads(path.read_text(encoding="utf-8"))
        if envelope.get("payloadType") != PAYLOAD_TYPE:
            raise RegistryError(f"{path}: payloadType is not {PAYLOAD_TYPE}")
        payload = base64.b64decode(envelope["payload"], validate=True)
        stmt = json.loads(payload)
        signatures = envelope.get("signatures")
        if not isinstance(stmt, dict) or not isinstance(signatures, list):
            raise RegistryError(f"{path}: not a DSSE envelope of an in-toto statement")
    except FileNotFoundError:
        raise RegistryError(
            f"{path}: no provenance (built before provenance, or not by Shipyard)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RegistryError(f"{path}: unreadable provenance ({type(exc).__name__})") from None
    if stmt.get("_type") != STATEMENT_TYPE or stmt.get("predicateType") != PREDICATE_TYPE:
        raise RegistryError(f"{path}: not a Shipyard stage-run statement")
    return stmt, signatures, payload


def signer(signatures: list[Any], payload: bytes, trusted: dict[str, Any]) -> str | None:
    """The key id of the first signature a trusted key verifies, or None."""
    from cryptography.exceptions import InvalidSignature

    for entry in signatures:
        if not isinstance(entry, dict):
            continue
        public = trusted.get(str(entry.get("keyid")))
        if public is None:
            continue
        try:
            public.verify(
                base64.b64decode(str(entry.get("sig")), validate=True), pae(payload), ecdsa()
            )
        except (InvalidSignature, ValueError):
            continue
        return str(entry["keyid"])
    return None


def listed(entries: Any) -> dict[str, str]:
    if not isinstance(entries, list):
        return {}
    return {
        str(e.get("name")): str((e.get("digest") or {}).get("sha256"))
        for e in entries
        if isinstance(e, dict)
    }


def check(root: Path, paths: StagePaths, trusted: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(the trusted builder's key id, problems): empty problems means this stage's outputs
    are what a trusted builder produced from the inputs this checkout has now."""
    try:
        stmt, signatures, payload = read(root / paths.envelope)
    except RegistryError as exc:
        return None, [str(exc)]
    problems = []
    who = signer(signatures, payload, trusted)
    if who is None:
        problems.append(
            "not signed by a trusted builder"
            + ("" if trusted else f" (no {TRUST_ENV} set)")
            + (" (it carries no signature)" if not signatures else "")
        )
    predicate = stmt.get("predicate") or {}
    if (predicate.get("stage"), predicate.get("release")) != (paths.stage, paths.release):
        problems.append(
            f"it attests {predicate.get('stage')}@{predicate.get('release')}, "
            f"not {paths.stage}@{paths.release}"
        )
    problems += compare(
        "output", listed(stmt.get("subject")), _digests(root, paths.outs, paths.envelope)
    )
    problems += compare("input", listed(predicate.get("inputs")), _digests(root, paths.deps))
    return who, problems


def compare(kind: str, attested: dict[str, str], found: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(attested) | set(found)):
        if name not in found:
            out.append(f"{kind} {name} is attested but missing here")
        elif name not in attested:
            out.append(f"{kind} {name} is not in the attestation")
        elif attested[name] != found[name]:
            out.append(f"{kind} {name} differs from what was attested")
    return out[:8] + ([f"... and {len(out) - 8} more"] if len(out) > 8 else [])
