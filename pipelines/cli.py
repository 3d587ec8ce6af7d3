"""The `shipyard` command line. The only place that catches ShipyardError."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas import ShipyardError, StageStatus
from schemas.errors import EXIT_CODES

VERDICT = {StageStatus.PASSED: "PASS", StageStatus.FAILED: "FAIL", StageStatus.SKIPPED: "SKIP"}


def cmd_validate(args: argparse.Namespace) -> int:
    from pipelines.init import past_problem, same_data
    from schemas import SpecError
    from schemas.loader import load_release, repo_of

    problems = []
    for spec in args.specs:
        try:
            release = load_release(spec)
            problem = past_problem(release, repo_of(Path(spec)), Path(spec), str(spec))
            if problem:
                raise SpecError(str(spec), [problem])
            print(f"{spec}: ok ({release.name} {release.version}, {release.task})")
            warning = same_data(release)
            if warning:
                print(f"{spec}: warning: {warning}", file=sys.stderr)
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError("", problems)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from pipelines import compiler
    from stages import repo_root

    root = repo_root()
    if args.matrix:  # one CI job per release: [{"release": ..., "target": ...}, ...]
        releases = [spec.name for _, spec in compiler.discover(root)]
        print(json.dumps([{"release": r, "target": f"bundle@{r}"} for r in releases]))
        return 0
    if args.check:
        if compiler.is_stale(root):
            print(
                "dvc.yaml is stale: it does not match releases/*.yaml and the stages; "
                "run `shipyard compile` and commit the result",
                file=sys.stderr,
            )
            return 1
        print("dvc.yaml is up to date")
        return 0
    print(f"wrote {compiler.write(root).relative_to(root)}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from pipelines import cache
    from stages import repo_root

    print(getattr(cache, args.action)(repo_root()))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from pipelines import build
    from stages import repo_root

    budget = build.parse_memory(args.memory) if args.memory else None
    failed = build.build(
        repo_root(), args.releases, args.jobs, budget, pull=args.pull, until=args.until
    )
    return 1 if failed else 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from pipelines import compiler
    from stages import repo_root

    if args.check:
        stale = compiler.stale_fingerprints(repo_root())
        for problem in stale:
            print(f"stale: {problem}", file=sys.stderr)
        if stale:
            print(
                f"{len(stale)} params file(s) came from another build: run `shipyard "
                "fingerprint`, then `dvc repro` rebuilds what depends on them",
                file=sys.stderr,
            )
            return 1
        print(f"every release's params under {compiler.PARAMS_DIR} are this checkout's")
        return 0
    written = compiler.write_fingerprints(repo_root())
    print(
        f"wrote the code fingerprint and spec sections of each release's stages into "
        f"{len(written)} files under {compiler.PARAMS_DIR}"
    )
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from pipelines.init import init
    from stages import repo_root

    root = repo_root()
    folder = Path(args.model_folder).resolve()
    target = init(
        root,
        folder,
        args.data,
        name=args.name,
        task=args.task,
        device_memory=args.device_memory,
        force=args.force,
        tokenizer=args.tokenizer,
        eval_data=args.eval_data,
    )
    print(f"wrote {target.relative_to(root)}; review it, then `shipyard compile`")
    from pipelines.init import SIZING, same_data

    if SIZING.get(target.stem):
        print(SIZING[target.stem])
    from schemas.loader import load_release

    warning = same_data(load_release(target))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from schemas import ReleaseSpec

    if args.rules:
        from schemas.rules import markdown

        print(markdown(), end="")
        return 0
    print(json.dumps(ReleaseSpec.model_json_schema(), indent=2))
    return 0


def cmd_run_stage(args: argparse.Namespace) -> int:
    from pipelines import provenance
    from schemas.loader import load_release
    from stages import execute, repo_root

    root = repo_root()
    spec_path = Path(args.release)
    key = provenance.builder_key()  # a bad key fails before the stage runs
    report = execute(args.stage, load_release(spec_path), spec_path, root)
    paths = provenance.stage_paths(root, args.stage, report.release)
    if paths is not None:  # outside a DVC project nothing declares what to attest
        if report.status is not StageStatus.FAILED:
            _no_plot_here(root, paths.outs, report.release)
        provenance.write(root, paths, key)
    verdict = VERDICT[report.status]
    print(f"{verdict} {args.stage}@{report.release}: {report.summary}", flush=True)
    for reason in report.reasons:
        print(f"  - {reason}", flush=True)
    return 3 if report.status is StageStatus.FAILED else 0


def _no_plot_here(root: Path, outs: tuple[str, ...], release: str) -> None:
    """A plot file dvc.yaml declares for this stage (one template for every release) that
    this release does not draw (no quantization, no streaming) is an empty list, so DVC
    finds every output and the plot shows no points."""
    from stages._contract import PLOTS_DIR

    for out in outs:
        target = root / out
        if out.startswith(f"build/{release}/{PLOTS_DIR}/") and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("[]\n", encoding="utf-8")


def cmd_verify(args: argparse.Namespace) -> int:
    from schemas import RegistryError
    from stages.bundling.oms import load_manifest, verify_bundle

    bundle = _bundle_folder(args.bundle)
    identity = _identity(args)
    trusted = _trusted(args) if args.provenance else {}
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


def _trusted(args: argparse.Namespace) -> dict[str, Any]:
    from pipelines import provenance
    from schemas import RegistryError

    trusted = (
        {provenance.key_id(k): k for k in map(_public_key, args.trusted_builder)}
        if args.trusted_builder
        else provenance.trusted_keys()
    )
    if not trusted:
        raise RegistryError(
            f"no trusted builder keys: pass --trusted-builder KEY.pub or set {provenance.TRUST_ENV}"
        )
    return trusted


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


def _identity(args: argparse.Namespace) -> Any:
    from pipelines.signing import Identity
    from schemas import RegistryError

    chain = tuple(Path(c) for c in args.certificate_chain or ())
    given = sum(bool(x) for x in (args.public_key, chain, args.sigstore_identity))
    if given > 1:
        raise RegistryError("give one of --public-key, --certificate-chain, --sigstore-identity")
    if args.sigstore_identity and not args.sigstore_issuer:
        raise RegistryError("--sigstore-identity needs --sigstore-issuer (the OIDC issuer URL)")
    if not given:
        return None
    return Identity(
        public_key=Path(args.public_key) if args.public_key else None,
        certificate_chain=chain,
        sigstore_identity=args.sigstore_identity,
        sigstore_issuer=args.sigstore_issuer,
    )


def _bundle_folder(given: str) -> Path:
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


def cmd_sign(args: argparse.Namespace) -> int:
    from pipelines.signing import sign

    digest = sign(
        _bundle_folder(args.bundle),
        private_key=Path(args.private_key) if args.private_key else None,
        signing_certificate=Path(args.signing_certificate) if args.signing_certificate else None,
        certificate_chain=tuple(Path(c) for c in args.certificate_chain or ()),
        sigstore=args.sigstore,
        serialization=args.serialization,
    )
    print(f"{args.bundle}: signed bundle digest {digest} -> {args.bundle}/model.sig")
    return 0


def cmd_registry_unlock(args: argparse.Namespace) -> int:
    print(_registry(args).unlock(force=args.force))
    return 0


def cmd_registry_check(args: argparse.Namespace) -> int:
    registry = _registry(args)
    actions = registry.check()
    for line in actions:
        print(line)
    if not actions:
        print(f"{registry.url}: consistent (no interrupted publish or move, no leftovers)")
    _warn(registry)
    return 0


def cmd_require_signature(args: argparse.Namespace) -> int:
    registry = _registry(args)
    keys = [Path(k) for k in args.public_key]
    policy = registry.require_signature(args.channel, keys)
    print(
        f"channel {args.channel!r} now requires a signature by one of "
        f"{len(policy['public_keys'])} trusted key(s)"
    )
    return 0


def _registry_url(args: argparse.Namespace) -> str:
    import os

    from stages import repo_root

    return args.registry or os.environ.get("SHIPYARD_REGISTRY") or str(repo_root() / "registry")


def _registry(args: argparse.Namespace) -> Any:
    from pipelines.registry import Registry

    return Registry(_registry_url(args))


def _specs(names: list[str]) -> list[Any]:
    from pipelines.compiler import discover
    from schemas import SpecError
    from stages import repo_root

    found = {spec.name: spec for _, spec in discover(repo_root())}
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


def cmd_provenance(args: argparse.Namespace) -> int:
    """Every stage of the releases: built by a trusted builder from these inputs?"""
    from pipelines import compiler, fingerprint, provenance
    from schemas import RegistryError
    from stages import repo_root

    root = repo_root()
    trusted = _trusted(args)
    releases, all_ios = compiler.stage_ios(root)
    wanted = {s.name for _, s in releases} if not args.releases else set(args.releases)
    bad = 0
    # every stage's attestation holds against the params it read; the params themselves
    # must be this checkout's (a restored `code` output makes the whole chain an old build)
    stale = compiler.stale_fingerprints(root, wanted)
    if stale:
        print(
            f"FAIL {fingerprint.CODE_STAGE}: "
            + "; ".join(stale[:3])
            + (f"; {len(stale) - 3} more" if len(stale) > 3 else "")
            + ": not rebuilt since a change, or restored from another build (DVC's "
            "run-cache or a remote); run `shipyard fingerprint`, then `dvc repro` rebuilds "
            "what depends on it"
        )
    for _, spec in releases:
        if spec.name not in wanted:
            continue
        for stage in all_ios:
            paths = provenance.stage_paths(root, stage, spec.name)
            who, problems = (
                provenance.check(root, paths, trusted)
                if paths is not None
                else (None, ["not in dvc.yaml: run `shipyard compile`"])
            )
            if problems:
                bad += 1
                print(f"FAIL {stage}@{spec.name}: " + "; ".join(problems))
                if args.evict:
                    from pipelines import cache

                    cache.evict(root, stage, spec.name)
                    print(f"     removed: `dvc repro {stage}@{spec.name}` rebuilds it")
            else:
                print(f"ok   {stage}@{spec.name}: built by {who}")
    unknown = wanted - {s.name for _, s in releases}
    if unknown:
        raise RegistryError(f"no such release: {', '.join(sorted(unknown))}")
    if stale and not bad:
        raise RegistryError(
            f"{len(stale)} params file(s) under {compiler.PARAMS_DIR} are not this checkout's: "
            "run `shipyard fingerprint`, then `dvc repro`"
        )
    if bad:
        raise RegistryError(
            (f"{len(stale)} stale params file(s) and " if stale else "")
            + f"{bad} stage output(s) without trusted provenance: "
            + (
                "removed with their cached objects and run-cache entries; `dvc repro` rebuilds them"
                if args.evict
                else "rebuild them (`--evict`, then `dvc repro`) on a trusted builder"
            )
        )
    return 0


def _trusted_builder_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trusted-builder",
        action="append",
        default=[],
        metavar="KEY.pub",
        help="a trusted builder's public key PEM (repeatable; default: the keys in "
        "$SHIPYARD_TRUSTED_BUILDERS)",
    )


def _public_key(path: str) -> Any:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from pipelines.keys import read_key

    return load_pem_public_key(read_key(Path(path)))


def cmd_gate(args: argparse.Namespace) -> int:
    from pipelines.gate import gate
    from schemas import GateError
    from stages import repo_root

    result = gate(
        repo_root(), _specs(args.releases), _registry(args), args.require_baseline, args.base
    )
    if result.base_note:
        print(f"warning: not compared with {args.base}: {result.base_note}", file=sys.stderr)
    if args.json:
        from dataclasses import asdict

        rows = [asdict(r) for r in result.rows]
        print(json.dumps({"ok": result.ok, "base": result.base, "rows": rows}, indent=2))
    else:
        for row in result.rows:
            change = f" [{row.change}]" if row.change and row.change != "=" else ""
            print(f"{row.verdict:4} {row.release:16} {row.check:32} {row.detail}{change}")
    if args.report:
        Path(args.report).write_text(result.markdown(), encoding="utf-8")
        if not args.json:
            print(f"wrote {args.report}")
    if not result.ok:
        failed = sum(r.verdict == "FAIL" for r in result.rows)
        raise GateError(f"gate failed: {failed} check(s) did not pass")
    if not args.json:
        print("gate passed")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from stages import repo_root

    [spec] = _specs([args.release])
    registry = _registry(args)
    record = registry.publish(repo_root() / "build" / spec.name / "bundle", spec.name, spec.version)
    for line in record.get("recovered", []):
        print(line)
    state = "already published" if record.get("already") else "published"
    print(f"{spec.name}@{spec.version} {state} (bundle digest {record['digest']})")
    _warn(registry)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pipelines.serving import run

    passed = []
    if args.host:
        passed += ["--host", args.host]
    for name in ("http_port", "grpc_port", "metrics_port"):
        value = getattr(args, name)
        if value is not None:
            passed += [f"--{name.replace('_', '-')}", str(value)]
    passed += ["--admin-api"] * args.admin_api + ["--no-auth"] * args.no_auth
    return run(args.target, _registry_url(args), args.device, passed)


def cmd_promote(args: argparse.Namespace) -> int:
    from schemas import RegistryError

    if "@" not in args.target:
        raise RegistryError(f"{args.target!r}: write NAME@VERSION, e.g. tiny-gpt2@0.1.0")
    name, version = args.target.rsplit("@", 1)
    registry = _registry(args)
    entry = registry.promote(name, version, args.to, args.reason, args.canary)
    step = "" if args.canary is None else f", canary {args.canary} %"
    if entry.get("noop"):
        print(f"{args.to}: {entry['to']}{step} is already live there; nothing moved or recorded")
    else:
        print(f"{args.to}: {entry['from'] or '(empty)'} -> {entry['to']}{step} (#{entry['seq']})")
    _warn(registry)
    if args.manifests:
        _manifests(args, registry, f"{name}@{version}", args.canary)
    return 0


def _deploy_choices(args: argparse.Namespace, canary: int | None) -> Any:
    from pipelines.deploy import Choices

    return Choices(
        storage_base=args.storage_uri,
        image=args.image,
        namespace=args.namespace,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        canary_percent=canary,
    )


def _manifests(args: argparse.Namespace, registry: Any, target: str, canary: int | None) -> None:
    from pipelines.deploy import render

    done = render(registry, target, Path(args.manifests), _deploy_choices(args, canary))
    step = "" if canary is None else f" (canaryTrafficPercent {canary})"
    print(
        f"wrote the cluster manifests of {done['release']}@{done['version']}{step} to "
        f"{args.manifests}: storageUri {done['storage_uri']}; apply with `kubectl apply -f "
        f"{args.manifests}/kserve` (KServe) or `-f {args.manifests}/kubernetes`"
    )


def cmd_deploy(args: argparse.Namespace) -> int:
    _manifests(args, _registry(args), args.target, args.canary)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from schemas import RegistryError

    registry = _registry(args)
    names = sorted({c["release"] for c in registry.channels() if c["channel"] == args.channel})
    name = args.release or (names[0] if len(names) == 1 else None)
    if name is None:
        raise RegistryError(
            f"channel {args.channel!r} exists for {names or 'no release'}; "
            "say which with --release NAME"
        )
    entry = registry.rollback(name, args.channel, args.reason)
    print(f"{args.channel}: {entry['from']} -> {entry['to']} (#{entry['seq']}, rollback)")
    _warn(registry)
    if args.manifests:  # the version rolled back to, with all of the traffic
        _manifests(args, registry, entry["to"], None)
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    registry = _registry(args)
    if args.json:
        print(json.dumps(registry.history(), indent=2))
        _warn(registry)
        return 0
    for e in registry.history():
        print(
            f"#{e['seq']:<3} {e['at']} {e['who']:10} {e['action']:8} {e['channel']:10} "
            f"{e['from'] or '(empty)'} -> {e['to']}  {str(e.get('digest'))[:12]}  "
            f"{e.get('reason', '')}"
            + (f" (canary {e['canary_percent']} %)" if e.get("canary_percent") is not None else "")
        )
    _warn(registry)
    return 0


def _warn(registry: Any) -> None:
    for warning in registry.warnings:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(_registry(args).channels(), indent=2))
        return 0
    for c in _registry(args).channels():
        print(
            f"{c['release']:16} {c['channel']:10} {c['version']:10} {c['digest'][:16]} "
            f"since {c['since']}"
        )
    return 0


def _version() -> str:
    """The installed distribution's version (pyproject's), without importing the package."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shipyard")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shipyard",
        description="Build, check and ship model releases: one YAML spec per release "
        "(releases/<name>.yaml), one command to build them all (`dvc repro`).",
        epilog="Start with `shipyard init models/<folder> --data data/<texts>.jsonl`, then "
        "`shipyard compile` and `dvc repro`; `shipyard <command> --help` for each command.\n\n"
        "exit codes:\n" + "\n".join(f"  {code}  {why}" for code, why in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--verbose", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="validate release specs")
    v.add_argument("specs", nargs="+", help="release spec files (releases/<name>.yaml)")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compile", help="write dvc.yaml from releases/*.yaml")
    c.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml is stale")
    c.add_argument("--matrix", action="store_true", help="print the releases as a CI matrix")
    c.set_defaults(func=cmd_compile)
    ca = sub.add_parser(
        "cache", help="DVC remote + run-cache from SHIPYARD_DVC_REMOTE: pull before, push after"
    )
    ca.add_argument(
        "action",
        choices=["pull", "push", "configure"],
        help="pull / push outputs and run-cache; configure: point DVC at SHIPYARD_DVC_REMOTE",
    )
    ca.set_defaults(func=cmd_cache)
    pv = sub.add_parser(
        "provenance",
        help="check that every stage output was built by a trusted builder from these inputs",
    )
    pv.add_argument("releases", nargs="*", help="release names (default: every release)")
    _trusted_builder_option(pv)
    pv.add_argument(
        "--evict",
        action="store_true",
        help="remove each untrusted output with its cached objects and run-cache entries, "
        "so the next dvc repro rebuilds it",
    )
    pv.set_defaults(func=cmd_provenance)
    b = sub.add_parser(
        "build", help="dvc repro several releases in parallel, within the machine's memory"
    )
    b.add_argument("releases", nargs="*", help="release names (default: all)")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="most at once")
    b.add_argument("--memory", help="memory the builds may use (default: 80%% of available)")
    b.add_argument(
        "--pull",
        action="store_true",
        help="fetch missing outputs and run-cache objects from the shared remote (dvc repro "
        "--pull); with SHIPYARD_TRUSTED_BUILDERS set, each restored output is checked against "
        "its attestation before the next stage reads it, and rebuilt when it fails",
    )
    b.add_argument("--until", metavar="STAGE", help="stop after this stage (default: bundle)")
    b.set_defaults(func=cmd_build)
    ini = sub.add_parser("init", help="write releases/<name>.yaml from a model folder")
    ini.add_argument("model_folder", help="a Hugging Face folder inside the repository")
    ini.add_argument(
        "--data", required=True, help="JSONL of texts in the repo: calibration and evaluation"
    )
    ini.add_argument("--name", help="release name (default: the folder's name)")
    ini.add_argument("--task", help="override the task detected from the checkpoint")
    ini.add_argument("--device-memory", default="16GiB", help="memory of the target device")
    ini.add_argument("--force", action="store_true", help="replace an existing spec")
    ini.add_argument("--tokenizer", help="tokenizer folder, when the model folder has none")
    ini.add_argument(
        "--eval-data",
        help="a separate data file for evaluation (default: --data, with a warning: scores "
        "on calibration data read better than they are)",
    )
    ini.set_defaults(func=cmd_init)
    fp = sub.add_parser(
        "fingerprint",
        help="write build/.params/<release>/<stage>.json (dvc.yaml's `code` stage)",
    )
    fp.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each params file that is not what this checkout "
        "gives (one restored from another build by DVC's run-cache or a remote)",
    )
    fp.set_defaults(func=cmd_fingerprint)
    sch = sub.add_parser("schema", help="print the release spec JSON Schema")
    sch.add_argument("--rules", action="store_true", help="the rules as Markdown instead")
    sch.set_defaults(func=cmd_schema)
    r = sub.add_parser("run-stage", help="run one stage for one release (dvc.yaml's cmd)")
    r.add_argument("stage", help="the stage to run (pin, export, ... bundle: dvc.yaml's order)")
    r.add_argument("--release", required=True, help="path of the release spec")
    r.set_defaults(func=cmd_run_stage)
    f = sub.add_parser("verify", help="re-hash a bundle against its manifest (and signature)")
    f.add_argument("bundle", help="the bundle folder (build/<release>/bundle)")
    f.add_argument("--public-key", help="PEM public key the signature must verify with")
    f.add_argument("--certificate-chain", nargs="+", help="PEM chain for certificate signatures")
    f.add_argument("--sigstore-identity", help="Sigstore signer identity (e.g. an email)")
    f.add_argument("--sigstore-issuer", help="OIDC issuer of the Sigstore identity")
    f.add_argument(
        "--provenance",
        action="store_true",
        help="also check the build provenance the bundle carries (who built each stage)",
    )
    _trusted_builder_option(f)
    f.set_defaults(func=cmd_verify)
    sg = sub.add_parser("sign", help="sign a verified bundle (writes BUNDLE/model.sig)")
    sg.add_argument("bundle", help="the bundle folder to sign (verified first)")
    sg.add_argument("--private-key", help="PEM private key (elliptic curve)")
    sg.add_argument("--signing-certificate", help="PEM certificate of --private-key")
    sg.add_argument("--certificate-chain", nargs="+", help="PEM chain of the certificate")
    sg.add_argument("--sigstore", action="store_true", help="keyless signing with Sigstore")
    sg.add_argument(
        "--serialization",
        choices=["shards", "files"],
        default="shards",
        help="shards: 1 GiB sha256 shards (default); files: whole files, what the "
        "model_signing command line verifies",
    )
    sg.set_defaults(func=cmd_sign)
    g = sub.add_parser("gate", help="check every stage report; exit 4 if anything failed")
    g.add_argument("releases", nargs="*", help="release names (default: all)")
    g.add_argument("--report", help="write a markdown report here (for the PR comment)")
    g.add_argument(
        "--require-baseline",
        action="store_true",
        help="fail a production comparison that cannot run (nothing in production yet)",
    )
    g.add_argument(
        "--base",
        metavar="REV",
        help="show each stage's metrics against this git revision's (`dvc metrics diff`), "
        "e.g. origin/main on a pull request",
    )
    sv = sub.add_parser(
        "serve",
        help="serve a built or published bundle (OpenAI and V2, from a verified private copy)",
    )
    sv.add_argument(
        "target",
        metavar="RELEASE[@VERSION|@CHANNEL]",
        help="a release built here (build/RELEASE/bundle), a published version, or the "
        "version a channel points at",
    )
    sv.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="ONNX Runtime's CPU or CUDA execution provider (cuda: the gpu extra)",
    )
    sv.add_argument("--host", help="interface to bind (default: the bundle's, 127.0.0.1)")
    for port in ("--http-port", "--grpc-port", "--metrics-port"):
        sv.add_argument(port, type=int, help="default: the bundle's settings")
    sv.add_argument("--admin-api", action="store_true", help="serve the model repository API")
    sv.add_argument("--no-auth", action="store_true", help="serve without a token (loopback only)")
    pub = sub.add_parser("publish", help="copy a built bundle into the registry")
    pub.add_argument("release", help="release name: its built bundle is published")
    pro = sub.add_parser("promote", help="move a channel to a published version")
    pro.add_argument("target", metavar="NAME@VERSION", help="a published release version")
    pro.add_argument("--to", required=True, metavar="CHANNEL", help="the channel to move")
    rb = sub.add_parser("rollback", help="move a channel back to its previous version")
    rb.add_argument("channel", help="the channel to move back")
    rb.add_argument("--release", help="release name (needed when several have the channel)")
    dep = sub.add_parser(
        "deploy",
        help="write a published version's cluster manifests (KServe, Kubernetes)",
        description="Check out NAME@VERSION or NAME@CHANNEL from the registry, verify it, and "
        "write its cluster manifests (the bundle's deploy/ folder) under --out, with the "
        "registry URI the cluster fetches it from.",
    )
    dep.add_argument("target", metavar="NAME@VERSION|NAME@CHANNEL", help="what to deploy")
    dep.add_argument("--out", dest="manifests", required=True, metavar="DIR", help="where to write")
    dep.add_argument("--canary", type=int, metavar="PCT", help="canaryTrafficPercent (KServe)")
    pro.add_argument(
        "--canary",
        type=int,
        metavar="PCT",
        help="a canary step: PCT %% of traffic to this version (recorded in the history)",
    )
    for cmd in (pro, rb):
        cmd.add_argument(
            "--manifests", metavar="DIR", help="also write the cluster manifests of the new state"
        )
    for cmd in (pro, rb, dep):
        cmd.add_argument(
            "--storage-uri",
            metavar="BASE",
            help="the registry as the cluster reaches it (default: the registry URL; "
            "pvc://CLAIM for a folder registry on a PersistentVolumeClaim)",
        )
        cmd.add_argument("--image", help="the runtime image (default: the bundle's)")
        cmd.add_argument("--namespace", help="metadata.namespace of every object")
        cmd.add_argument(
            "--min-replicas", type=int, metavar="N", help="fewest pods (default: the bundle's, 1)"
        )
        cmd.add_argument(
            "--max-replicas", type=int, metavar="N", help="most pods (default: the bundle's, 4)"
        )
    hist = sub.add_parser("history", help="print the append-only promotion history")
    st = sub.add_parser("status", help="print every channel pointer")
    reg = sub.add_parser("registry", help="registry maintenance and policy")
    reg_sub = reg.add_subparsers(
        dest="registry_command", required=True, help="check | unlock | require-signature"
    )
    chk = reg_sub.add_parser("check", help="finish or remove interrupted publishes")
    unl = reg_sub.add_parser("unlock", help="remove a remote lock whose holder died")
    unl.add_argument("--force", action="store_true", help="even a live (recently renewed) one")
    req = reg_sub.add_parser("require-signature", help="a channel accepts only signed bundles")
    req.add_argument("channel", help="the channel that will accept only signed bundles")
    req.add_argument("--public-key", nargs="+", required=True, help="trusted PEM public key(s)")
    for cmd, func in (
        (chk, cmd_registry_check),
        (unl, cmd_registry_unlock),
        (req, cmd_require_signature),
        (g, cmd_gate),
        (sv, cmd_serve),
        (pub, cmd_publish),
        (pro, cmd_promote),
        (rb, cmd_rollback),
        (dep, cmd_deploy),
        (hist, cmd_history),
        (st, cmd_status),
    ):
        cmd.add_argument("--registry", help="fsspec URL (default $SHIPYARD_REGISTRY or registry/)")
        cmd.set_defaults(func=func)
    for cmd in (pro, rb):
        cmd.add_argument("--reason", default="", help="why (goes into the history)")
    for cmd in (st, hist, g, f):
        cmd.add_argument("--json", action="store_true", help="print one JSON document")
    for cmd in sub.choices.values():  # `--verbose` after the command as well as before it
        _verbose_option(cmd)
    return p


def _verbose_option(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    for action in cmd._actions:  # the nested `registry check|unlock|...` parsers too
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _verbose_option(nested)


def _record_imports(target: Path) -> None:
    """Write which of our modules this process loaded (the dependency test reads it)."""
    root = Path(__file__).resolve().parents[1]
    files = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in ("schemas", "stages", "pipelines", "shipyard_runtime") and path:
            files.add(Path(path).resolve().relative_to(root).as_posix())
    target.write_text("\n".join(sorted(files)) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import atexit
    import os

    record = os.environ.get("SHIPYARD_RECORD_IMPORTS")
    if record:
        atexit.register(_record_imports, Path(record))
    args = parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ShipyardError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {exc.render()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
