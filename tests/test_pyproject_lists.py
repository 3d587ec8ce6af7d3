"""pyproject.toml names the stage modules and the subsystem packages for import-linter: a
list kept by hand, so it is held to the stage registry and the folders, both ways (a stage
missing from a contract would escape it; a name listed there that is gone would be kept
forever)."""

from __future__ import annotations

import tomllib

from stages import STAGES
from tests.conftest import REPO


def contracts() -> dict[str, dict[str, object]]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {c["name"]: c for c in data["tool"]["importlinter"]["contracts"]}


def test_both_stage_lists_are_the_stage_registry_in_pipeline_order() -> None:
    found = contracts()
    want = [f"stages.{name}" for name in STAGES]
    independent = next(c for n, c in found.items() if n.startswith("no stage imports another"))
    libraries = next(c for n, c in found.items() if n.startswith("subsystems are libraries"))
    assert independent["modules"] == want
    assert libraries["forbidden_modules"] == want


def test_every_subsystem_package_is_held_to_being_a_library() -> None:
    libraries = next(c for n, c in contracts().items() if n.startswith("subsystems are libraries"))
    packages = {
        f"stages.{p.name}" for p in (REPO / "stages").iterdir() if (p / "__init__.py").is_file()
    }
    private = {f"stages.{p.stem}" for p in (REPO / "stages").glob("_*.py") if p.stem != "__init__"}
    listed = set(libraries["source_modules"])  # type: ignore[arg-type]
    assert packages <= listed, packages - listed
    assert listed <= packages | private, listed - packages - private


def test_the_command_lists_are_the_command_modules() -> None:
    """Every module of pipelines/commands/ is a command the parser has and is held to not
    importing another; every library module of pipelines/ is held to not importing them."""
    from pipelines.cli import COMMANDS

    folder = REPO / "pipelines" / "commands"
    commands = {f"pipelines.commands.{p.stem}" for p in folder.glob("[!_]*.py")}
    found = contracts()
    independent = next(c for n, c in found.items() if n.startswith("no command imports another"))
    assert independent["modules"] == sorted(commands)
    assert {m.__name__ for m in COMMANDS} == commands
    libraries = {
        f"pipelines.{p.stem}"
        for p in (REPO / "pipelines").glob("*.py")
        if p.stem not in ("__init__", "cli")
    }
    only_cli = next(c for n, c in found.items() if n.startswith("only the command line"))
    assert only_cli["source_modules"] == sorted(libraries)
