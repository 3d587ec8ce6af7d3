"""Signing and signature verification of bundles through OpenSSF model signing.

The signature is model_signing's own Sigstore bundle, written where its tools look for it
(`<bundle>/model.sig`). What it signs is the bundle's manifest statement: shard
serialization with 1 GiB shards, `manifest.json` and `model.sig` unhashed. So a bundle
signed here verifies with model_signing's verifier, and one signed with model_signing (that
serialization) verifies here. Key-based signing works offline; certificate and Sigstore
modes are passed through to the library.

On top of the library's check, `verify_signed` requires the signed statement to be exactly
`manifest.json` (same resources, same root digest) and then runs Shipyard's stricter
`verify_bundle` (fixed skip list, no symlinks, no unlisted file, empty ones included).
"""

from __future__ import annotations

import base64
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the key-file checks live apart, so that what every stage run imports (pipelines/provenance)
# does not depend on this module
from pipelines.keys import read_key
from schemas import RegistryError, SpecError
from schemas.manifest import BUNDLE_UNHASHED, MANIFEST_FILE, SHARD_SIZE, SIGNATURE_FILE
from stages.bundling.oms import load_manifest, verify_bundle

MAX_SIGNATURE_BYTES = 64 << 20


@dataclass(frozen=True)
class Identity:
    """Who may have signed: exactly one of a public key, a certificate chain or a Sigstore
    identity (with its OIDC issuer)."""

    public_key: Path | None = None
    certificate_chain: tuple[Path, ...] = field(default_factory=tuple)
    sigstore_identity: str | None = None
    sigstore_issuer: str | None = None

    def describe(self) -> str:
        if self.public_key:
            return f"public key {self.public_key}"
        if self.certificate_chain:
            return f"certificate chain {', '.join(map(str, self.certificate_chain))}"
        return f"Sigstore identity {self.sigstore_identity} ({self.sigstore_issuer})"


def hashing_config(shard_size: int = SHARD_SIZE) -> Any:
    """The serialization Shipyard manifests use, as a model_signing hashing config."""
    import model_signing

    return (
        model_signing.hashing.Config()
        .use_shard_serialization(shard_size=shard_size)
        .set_ignored_paths(paths=list(BUNDLE_UNHASHED), ignore_git_paths=False)
    )


def sign(
    bundle: Path,
    *,
    private_key: Path | None = None,
    signing_certificate: Path | None = None,
    certificate_chain: tuple[Path, ...] = (),
    sigstore: bool = False,
    identity_token: str | None = None,
    serialization: str = "shards",
) -> str:
    """Sign a verified bundle in place (`model.sig`); returns the bundle digest. `shards`:
    1 GiB sha256 shards (hashed in parallel; model_signing's library verifies it);
    `files`: whole files, what model_signing's command line signs and verifies."""
    import model_signing

    problems = verify_bundle(bundle)
    if problems:
        raise RegistryError(
            f"bundle {bundle} does not match its manifest; refusing to sign it:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    hashing = (
        model_signing.hashing.Config()
        .use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
        .set_ignored_paths(paths=list(BUNDLE_UNHASHED), ignore_git_paths=False)
        if serialization == "files"
        else hashing_config()
    )
    config = model_signing.signing.Config().set_hashing_config(hashing)
    if sigstore:
        config = config.use_sigstore_signer(identity_token=identity_token)
    elif signing_certificate is not None:
        if private_key is None:
            raise SpecError(
                "--signing-certificate",
                ["--signing-certificate needs --private-key (the certificate's key)"],
            )
        config = config.use_certificate_signer(
            private_key=private_key,
            signing_certificate=signing_certificate,
            certificate_chain=list(certificate_chain),
        )
    elif private_key is not None:
        read_key(private_key, private=True)
        config = config.use_elliptic_key_signer(private_key=private_key)
    else:
        raise SpecError("", ["say how to sign: --private-key PEM, a certificate, or --sigstore"])
    # Written next to the bundle first, then moved in: a failed signing leaves no model.sig.
    fd, tmp = tempfile.mkstemp(prefix=".model.sig.", dir=bundle.parent)
    os.close(fd)
    try:
        try:
            config.sign(bundle, Path(tmp))
        except (ValueError, OSError, TypeError) as exc:
            raise RegistryError(f"signing {bundle} failed: {exc}") from None
        os.replace(tmp, bundle / SIGNATURE_FILE)
    finally:
        Path(tmp).unlink(missing_ok=True)
    statement = signed_statement(bundle)
    if serialization == "files":
        _covers_manifest(bundle, statement)
    else:
        _same_as_manifest(bundle, statement)
    digest: str = load_manifest(bundle / MANIFEST_FILE).digest
    return digest


def signed_statement(bundle: Path) -> dict[str, Any]:
    """The in-toto statement inside `model.sig` (not yet authenticated)."""
    path = bundle / SIGNATURE_FILE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise RegistryError(
            f"{bundle} is not signed: no {SIGNATURE_FILE}; sign it with "
            f"`shipyard sign {bundle} --private-key KEY.pem`"
        ) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise RegistryError(f"{SIGNATURE_FILE}: not a regular file (a symlink?); refusing it")
    if info.st_size > MAX_SIGNATURE_BYTES:
        raise RegistryError(f"{SIGNATURE_FILE}: {info.st_size} bytes; not a signature")
    try:
        envelope = json.loads(path.read_text(encoding="utf-8"))["dsseEnvelope"]
        data: dict[str, Any] = json.loads(base64.b64decode(envelope["payload"]))
        data["subject"][0]["digest"]["sha256"]
        return data
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RegistryError(f"{SIGNATURE_FILE}: not a model_signing signature ({exc})") from None


def verify_signed(bundle: Path, identity: Identity) -> str:
    """Signature (by `identity`) + files + Shipyard's strict check; returns the digest."""
    import model_signing

    if identity.public_key is not None:
        read_key(identity.public_key)  # a key that can never verify is said first
    statement = signed_statement(bundle)
    serialization = statement.get("predicate", {}).get("serialization", {})
    files = _file_serialization(serialization)
    expected = {
        "method": "shards",
        "hash_type": "sha256",
        "shard_size": SHARD_SIZE,
        "allow_symlinks": False,
    }
    if not files and (
        {k: serialization.get(k) for k in expected} != expected
        or sorted(serialization.get("ignore_paths", [])) != sorted(BUNDLE_UNHASHED)
    ):
        raise RegistryError(
            f"{SIGNATURE_FILE} signs a different serialization ({serialization}); a Shipyard "
            f"bundle is signed with 1 GiB sha256 shards ignoring only {sorted(BUNDLE_UNHASHED)} "
            "(`shipyard sign`), or whole files ignoring at most those and git files (the "
            "model_signing command line, `shipyard sign --serialization files`)"
        )
    config = model_signing.verifying.Config()
    # whole-file signatures: the library reads their serialization (and what they ignore)
    # from the signature itself, as its command line does; _file_serialization vetted it
    config = config if files else config.set_hashing_config(hashing_config())
    if identity.public_key is not None:
        config = config.use_elliptic_key_verifier(public_key=identity.public_key)
    elif identity.certificate_chain:
        config = config.use_certificate_verifier(certificate_chain=identity.certificate_chain)
    elif identity.sigstore_identity and identity.sigstore_issuer:
        config = config.use_sigstore_verifier(
            identity=identity.sigstore_identity, oidc_issuer=identity.sigstore_issuer
        )
    else:
        raise SpecError("", ["say whose signature to accept: --public-key, a chain or sigstore"])
    try:
        config.verify(bundle, bundle / SIGNATURE_FILE)
    except Exception as exc:  # the library raises bare ValueError/exceptions of its deps
        first = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
        raise RegistryError(
            f"{bundle}: signature does not verify with {identity.describe()}: {first}"
        ) from None
    if files:
        _covers_manifest(bundle, statement)
    else:
        _same_as_manifest(bundle, statement)
    problems = verify_bundle(bundle)
    if problems:
        listing = "\n".join(f"  {p}" for p in problems)
        raise RegistryError(f"bundle {bundle} does not match its manifest:\n{listing}")
    # the bundle's digest (the manifest's root, what the registry records), whichever
    # serialization the signature used: both cover the same files, checked above
    digest: str = load_manifest(bundle / MANIFEST_FILE).digest
    return digest


GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")  # the library's git ignores


def _file_serialization(serialization: dict[str, Any]) -> bool:
    """Whether a signature uses whole-file sha256 serialization (model_signing's command
    line) ignoring nothing but the manifest, the signature and git files."""
    if serialization.get("method") != "files":
        return False
    ignored = set(serialization.get("ignore_paths", []))
    allowed = {*BUNDLE_UNHASHED, *GIT_PATHS}
    if serialization.get("hash_type") != "sha256" or serialization.get("allow_symlinks"):
        raise RegistryError(
            f"{SIGNATURE_FILE}: a whole-file signature must use sha256 without symlinks "
            f"({serialization})"
        )
    if not ignored <= allowed:
        raise RegistryError(
            f"{SIGNATURE_FILE} leaves {sorted(ignored - allowed)} out of what it signs; a "
            f"bundle's signature may leave out only {sorted(allowed)}"
        )
    return True


def _covers_manifest(bundle: Path, statement: dict[str, Any]) -> None:
    """A whole-file signature names every file manifest.json lists (and may name
    manifest.json itself): the library checked their digests, verify_bundle the shards."""
    try:
        manifest = load_manifest(bundle / MANIFEST_FILE)
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{MANIFEST_FILE}: {exc}") from None
    signed = {str(r.get("name")) for r in statement["predicate"]["resources"]}
    listed = set(manifest.files())
    if not listed <= signed or signed - listed - {MANIFEST_FILE}:
        raise RegistryError(
            f"{SIGNATURE_FILE} signs other files than {MANIFEST_FILE} lists "
            f"(unsigned: {sorted(listed - signed)[:3]}, extra: "
            f"{sorted(signed - listed - {MANIFEST_FILE})[:3]}); sign the bundle as it is"
        )


def _same_as_manifest(bundle: Path, statement: dict[str, Any]) -> None:
    """The signature must cover exactly what manifest.json lists."""
    try:
        manifest = load_manifest(bundle / MANIFEST_FILE)
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{MANIFEST_FILE}: {exc}") from None
    signed = [(r["name"], r["digest"]) for r in statement["predicate"]["resources"]]
    listed = [(r.name, r.digest) for r in manifest.predicate.resources]
    if statement["subject"][0]["digest"]["sha256"] != manifest.digest or signed != listed:
        raise RegistryError(
            f"{SIGNATURE_FILE} signs digest {statement['subject'][0]['digest']['sha256'][:16]}, "
            f"but {MANIFEST_FILE} says {manifest.digest[:16]}; the manifest was replaced "
            "after signing (or the signature belongs to another bundle)"
        )
