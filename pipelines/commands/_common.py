"""What several commands share: the repository root, the registry and the releases a
command names, the options some commands have in common, and the cluster manifests that
promote, rollback and deploy write."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.registry import Registry
    from schemas import ReleaseSpec


def root() -> Path:
    """The repository the command works in (SHIPYARD_ROOT, else the folder above holding
    releases/): the one place the commands ask for it."""
    from stages import repo_root

    return repo_root()


def registry_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", help="fsspec URL (default $SHIPYARD_REGISTRY or registry/)")


def registry_url(args: argparse.Namespace) -> str:
    import os

    return args.registry or os.environ.get("SHIPYARD_REGISTRY") or str(root() / "registry")


def registry(args: argparse.Namespace) -> Registry:
    from pipelines.registry import Registry

    return Registry(registry_url(args))


def warn(registry: Registry) -> None:
    for warning in registry.warnings:
        print(f"warning: {warning}", file=sys.stderr)


def specs(repo: Path, names: list[str]) -> list[ReleaseSpec]:
    """The named releases of releases/ (every one when none is named)."""
    from pipelines.compiler import discover
    from schemas import SpecError

    found = {spec.name: spec for _, spec in discover(repo)}
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SpecError(
            "",
            [
                f"no release named {n!r} in releases/ (have: {', '.join(sorted(found))})"
                for n in unknown
            ],
        )
    return [found[n] for n in names] if names else list(found.values())


def bundle_folder(given: str) -> Path:
    """The bundle folder a command was given, or an error that says what it is instead."""
    from schemas import RegistryError

    bundle = Path(given)
    if not bundle.is_dir():
        raise RegistryError(
            f"{given}: no such bundle folder"
            + (" (it is a file)" if bundle.exists() else "")
            + "; build one with `dvc repro bundle@<release>` (it lands in build/<release>/bundle)"
        )
    return bundle


def trusted_builder_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trusted-builder",
        action="append",
        default=[],
        metavar="KEY.pub",
        help="a trusted builder's public key PEM (repeatable; default: the keys in "
        "$SHIPYARD_TRUSTED_BUILDERS)",
    )


def trusted(args: argparse.Namespace) -> dict[str, Any]:
    """The trusted builders' public keys by key id: --trusted-builder, else the environment's."""
    from pipelines import provenance
    from schemas import SpecError

    keys = (
        {provenance.key_id(k): k for k in map(_public_key, args.trusted_builder)}
        if args.trusted_builder
        else provenance.trusted_keys()
    )
    if not keys:
        raise SpecError(
            "--trusted-builder",
            [
                "no trusted builder keys: pass --trusted-builder KEY.pub or set "
                f"{provenance.TRUST_ENV}"
            ],
        )
    return keys


def _public_key(path: str) -> Any:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from pipelines.keys import read_key

    return load_pem_public_key(read_key(Path(path)))


def deploy_options(parser: argparse.ArgumentParser) -> None:
    """What a deployment decides (promote, rollback and deploy write cluster manifests)."""
    parser.add_argument(
        "--storage-uri",
        metavar="BASE",
        help="the registry as the cluster reaches it (default: the registry URL; "
        "pvc://CLAIM for a folder registry on a PersistentVolumeClaim)",
    )
    parser.add_argument("--image", help="the runtime image (default: the bundle's)")
    parser.add_argument("--namespace", help="metadata.namespace of every object")
    parser.add_argument(
        "--min-replicas", type=int, metavar="N", help="fewest pods (default: the bundle's, 1)"
    )
    parser.add_argument(
        "--max-replicas", type=int, metavar="N", help="most pods (default: the bundle's, 4)"
    )


def manifests_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--manifests", metavar="DIR", help="also write the cluster manifests of the new state"
    )


def write_manifests(
    args: argparse.Namespace, registry: Registry, target: str, canary: int | None
) -> None:
    """Write `target`'s cluster manifests under `args.manifests` (deploy's `--out`) with
    the deploy options of `args`."""
    from pipelines.deploy import Choices, render

    choices = Choices(
        storage_base=args.storage_uri,
        image=args.image,
        namespace=args.namespace,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        canary_percent=canary,
    )
    out = args.manifests
    done = render(registry, target, Path(out), choices)
    step = "" if canary is None else f" (canaryTrafficPercent {canary})"
    print(
        f"wrote the cluster manifests of {done.label}{step} to "
        f"{out}: storageUri {done.storage_uri}; apply with `kubectl apply -f "
        f"{out}/kserve` (KServe) or `-f {out}/kubernetes`"
    )
