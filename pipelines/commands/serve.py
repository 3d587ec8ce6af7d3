"""`shipyard serve RELEASE[@VERSION|@CHANNEL]`: serve a bundle from a verified private copy."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve a built or published bundle (OpenAI and V2, from a verified private copy)",
        description="Copy a bundle built here, a published version or the version a channel "
        "points at into a private folder, verify the copy (for a channel, the digest its "
        "pointer names and its signature policy), then run the bundle's own launcher: the "
        "OpenAI and V2 front doors, behind a token (SHIPYARD_API_TOKEN). Nothing is written "
        "into the bundle or the registry.",
    )
    parser.add_argument(
        "target",
        metavar="RELEASE[@VERSION|@CHANNEL]",
        help="a release built here (build/RELEASE/bundle), a published version, or the "
        "version a channel points at",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="ONNX Runtime's CPU or CUDA execution provider (cuda: the gpu extra)",
    )
    parser.add_argument("--host", help="interface to bind (default: the bundle's, 127.0.0.1)")
    for port in ("--http-port", "--grpc-port", "--metrics-port"):
        parser.add_argument(port, type=int, help="default: the bundle's settings")
    parser.add_argument("--admin-api", action="store_true", help="serve the model repository API")
    parser.add_argument(
        "--no-auth", action="store_true", help="serve without a token (loopback only)"
    )
    _common.registry_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.serving import run as serve

    passed = []
    if args.host:
        passed += ["--host", args.host]
    for name in ("http_port", "grpc_port", "metrics_port"):
        value = getattr(args, name)
        if value is not None:
            passed += [f"--{name.replace('_', '-')}", str(value)]
    passed += ["--admin-api"] * args.admin_api + ["--no-auth"] * args.no_auth
    return serve(args.target, _common.registry_url(args), args.device, passed, _common.root())
