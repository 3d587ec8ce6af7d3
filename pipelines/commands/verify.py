"""`shipyard verify BUNDLE`: re-hash a bundle against its manifest, its signature and (with
--provenance) the build provenance it carries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.commands import _common

if TYPE_CHECKING:
    from pipelines.signing import Identity

TAKES_JSON = True


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="re-hash a bundle against its manifest (and signature)",
        description="Re-hash every file of a bundle against its manifest.json and print "
        "the bundle's digest; with a key, a certificate chain or a Sigstore identity, also "
        "check its signature (model.sig); with --provenance, that a trusted builder built "
        "every stage and that every shipped file is the one attested. Exits 5 when anything "
        "does not hold.",
    )
    parser.add_argument("bundle", help="the bundle folder (build/<release>/bundle)")
    parser.add_argument("--public-key", help="PEM public key the signature must verify with")
    parser.add_argument(
        "--certificate-chain", nargs="+", help="PEM chain for certificate signatures"
    )
    parser.add_argument("--sigstore-identity", help="Sigstore signer identity (e.g. an email)")
    parser.add_argument("--sigstore-issuer", help="OIDC issuer of the Sigstore identity")
    parser.add_argument(
        "--provenance",
        action="store_true",
        help="also check the build provenance the bundle carries (who built each stage)",
    )
    _common.trusted_builder_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from schemas import RegistryError
    from stages.bundling.oms import load_manifest, verify_bundle

    bundle = _common.bundle_folder(args.bundle)
    identity = _identity(args)
    trusted = _common.trusted(args) if args.provenance else {}
    say = _Say(args.json)
    if identity is not None:
        from pipelines.signing import verify_signed

        digest = verify_signed(bundle, identity)
        say(f"{bundle}: signed by {identity.describe()}; every file matches manifest.json")
        say(f"bundle digest {digest}")
        say.data |= {"bundle": str(bundle), "digest": digest, "signed_by": identity.describe()}
    else:
        problems = verify_bundle(bundle)
        if problems:
            raise RegistryError(
                f"bundle {args.bundle} does not match its manifest:\n"
                + "\n".join(f"  {p}" for p in problems)
            )
        digest = load_manifest(bundle / "manifest.json").digest
        say(f"{bundle}: every file matches manifest.json (signature not checked: no key given)")
        say(f"bundle digest {digest}")
        say.data |= {"bundle": str(bundle), "digest": digest, "signed_by": None}
    if args.provenance:
        _chain(bundle, trusted, say)
    say.done()
    return 0


class _Say:
    """A command's report: lines for people, or (`--json`) one JSON document at the end."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.data: dict[str, Any] = {}

    def __call__(self, line: str) -> None:
        if not self.as_json:
            print(line)

    def done(self) -> None:
        if self.as_json:
            print(json.dumps(self.data, indent=2, sort_keys=True))


def _chain(bundle: Path, trusted: dict[str, Any], say: _Say) -> None:
    from pipelines.bundle_provenance import bundle_chain
    from schemas import RegistryError
    from stages.bundling.files import CHECKED

    lines, problems = bundle_chain(bundle, trusted, (*CHECKED, "manifest", "bundle"))
    for line in lines:
        say(f"  {line}")
    if problems:
        raise RegistryError(
            f"bundle {bundle}: its provenance does not hold:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    say(f"{bundle}: every stage attested by a trusted builder; every shipped file attested")
    say.data["provenance"] = lines


def _identity(args: argparse.Namespace) -> Identity | None:
    from pipelines.signing import Identity
    from schemas import SpecError

    chain = tuple(Path(c) for c in args.certificate_chain or ())
    given = sum(bool(x) for x in (args.public_key, chain, args.sigstore_identity))
    if given > 1:
        raise SpecError("", ["give one of --public-key, --certificate-chain, --sigstore-identity"])
    if args.sigstore_identity and not args.sigstore_issuer:
        raise SpecError(
            "--sigstore-identity",
            ["--sigstore-identity needs --sigstore-issuer (the OIDC issuer URL)"],
        )
    if not given:
        return None
    return Identity(
        public_key=Path(args.public_key) if args.public_key else None,
        certificate_chain=chain,
        sigstore_identity=args.sigstore_identity,
        sigstore_issuer=args.sigstore_issuer,
    )
