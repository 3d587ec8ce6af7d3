"""`shipyard sign BUNDLE`: sign a verified bundle with OpenSSF model signing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sign",
        help="sign a verified bundle (writes BUNDLE/model.sig)",
        description="Verify a bundle against its manifest, then sign it with OpenSSF model "
        "signing (an elliptic-curve key, a certificate, or keyless with Sigstore) into "
        "BUNDLE/model.sig; a channel that requires a signature accepts only signed bundles.",
    )
    parser.add_argument("bundle", help="the bundle folder to sign (verified first)")
    parser.add_argument("--private-key", help="PEM private key (elliptic curve)")
    parser.add_argument("--signing-certificate", help="PEM certificate of --private-key")
    parser.add_argument("--certificate-chain", nargs="+", help="PEM chain of the certificate")
    parser.add_argument("--sigstore", action="store_true", help="keyless signing with Sigstore")
    parser.add_argument(
        "--serialization",
        choices=["shards", "files"],
        default="shards",
        help="shards: 1 GiB sha256 shards (default); files: whole files, what the "
        "model_signing command line verifies",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.signing import sign

    digest = sign(
        _common.bundle_folder(args.bundle),
        private_key=Path(args.private_key) if args.private_key else None,
        signing_certificate=Path(args.signing_certificate) if args.signing_certificate else None,
        certificate_chain=tuple(Path(c) for c in args.certificate_chain or ()),
        sigstore=args.sigstore,
        serialization=args.serialization,
    )
    print(f"{args.bundle}: signed bundle digest {digest} -> {args.bundle}/model.sig")
    return 0
