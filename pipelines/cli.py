"""The `shipyard` command line: the parser assembled from the command modules
(`pipelines/commands/`, one per command), the global options, and the one place that
catches ShipyardError and turns it into the exit code of its class."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from pipelines.commands import (
    build,
    cache,
    deploy,
    fingerprint,
    gate,
    history,
    init,
    promote,
    provenance,
    publish,
    registry,
    rollback,
    run_stage,
    schema,
    serve,
    sign,
    status,
    validate,
    verify,
)
from pipelines.commands import compile as compile_  # not the builtin
from schemas import ShipyardError
from schemas.errors import EXIT_CODES

# the order `shipyard --help` lists them in
COMMANDS: tuple[ModuleType, ...] = (
    validate,
    compile_,
    cache,
    provenance,
    build,
    init,
    fingerprint,
    schema,
    run_stage,
    verify,
    sign,
    gate,
    serve,
    publish,
    promote,
    rollback,
    deploy,
    history,
    status,
    registry,
)


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
    for module in COMMANDS:
        command: argparse.ArgumentParser = module.add_parser(sub)
        command.set_defaults(func=module.run)
        if getattr(module, "TAKES_JSON", False):
            command.add_argument("--json", action="store_true", help="print one JSON document")
        _verbose_option(command)  # `--verbose` after the command as well as before it
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
