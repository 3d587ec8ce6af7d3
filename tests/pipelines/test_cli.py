from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))


def shipyard(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHIPYARD_ROOT": str(cwd)}
    return subprocess.run(
        [SHIPYARD, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_validate_accepts_the_example_release() -> None:
    done = shipyard("validate", "releases/tiny-gpt2.yaml")
    assert done.returncode == 0 and "ok (tiny-gpt2 0.1.0, causal-lm)" in done.stdout


def test_validate_prints_file_line_field_and_no_traceback(tmp_path: Path) -> None:
    text = (REPO / "releases/tiny-gpt2.yaml").read_text().replace("  opset: 18", "  opset: x")
    (tmp_path / "tiny-gpt2.yaml").write_text(text)
    done = shipyard("validate", str(tmp_path / "tiny-gpt2.yaml"))
    line = text.splitlines().index("  opset: x") + 1
    assert done.returncode == 2
    assert f"tiny-gpt2.yaml:{line}: export.opset:" in done.stderr
    assert "Traceback" not in done.stderr


def test_schema_prints_json_schema_with_descriptions() -> None:
    schema = json.loads(shipyard("schema").stdout)
    assert schema["title"] == "ReleaseSpec"
    assert "description" in schema["properties"]["export"]


def test_compile_check_passes_on_the_committed_dvc_yaml() -> None:
    done = shipyard("compile", "--check")
    assert done.returncode == 0, done.stderr


def test_compile_check_fails_when_a_release_was_added(tmp_path: Path) -> None:
    (tmp_path / "releases").mkdir()
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (tmp_path / "releases/tiny-gpt2.yaml").write_text(
        (REPO / "releases/tiny-gpt2.yaml").read_text().replace("tiny-gpt2", "t2")
    )
    (tmp_path / "releases/tiny-gpt2.yaml").rename(tmp_path / "releases/t2.yaml")
    done = shipyard("compile", "--check", cwd=tmp_path)
    assert done.returncode == 1 and "dvc.yaml is stale" in done.stderr


def test_run_stage_with_unknown_stage_exits_2_with_choices() -> None:
    """A wrong argument (2, as `build --until exprot`), not a stage that failed (3)."""
    done = shipyard("run-stage", "exprot", "--release", "releases/tiny-gpt2.yaml")
    assert done.returncode == 2
    assert "exprot: no such stage" in done.stderr and "choose one of: pin, export" in done.stderr
    assert "Traceback" not in done.stderr


def test_verify_of_a_missing_bundle_is_a_clear_error(tmp_path: Path) -> None:
    done = shipyard("verify", str(tmp_path))
    assert done.returncode == 5 and "manifest.json: missing; not a Shipyard bundle" in done.stderr


def test_verify_or_sign_of_a_folder_that_is_not_there_says_so(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    for command in ("verify", "sign"):
        for given, says in (
            (tmp_path / "nope", "no such bundle folder;"),
            (tmp_path / "a-file", "(it is a file)"),
        ):
            done = shipyard(command, str(given))
            assert done.returncode == 5, (command, done.stderr)
            assert says in done.stderr and "dvc repro bundle@<release>" in done.stderr
            assert (
                "does not match its manifest" not in done.stderr and "Traceback" not in done.stderr
            )


def test_readme_quickstart_is_the_two_make_commands() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == [
        "make release",
        "make test",
    ]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_version_prints_the_installed_version_and_exits_0() -> None:
    import tomllib

    done = shipyard("--version")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (done.returncode, done.stdout.strip()) == (0, f"shipyard {version}")


def test_help_speaks_to_a_user_and_every_argument_says_what_it_is() -> None:
    import argparse

    from pipelines.cli import parser

    top = shipyard("--help")
    assert top.returncode == 0
    assert "The only place that catches" not in top.stdout  # an internal docstring
    assert "one YAML spec per release" in top.stdout
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        f"{name} {action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert silent == []


def test_every_command_says_what_it_does_in_the_top_help_and_in_its_own() -> None:
    """`shipyard --help` lists each command with its one line; `shipyard CMD --help` (and
    `shipyard registry SUB --help`) opens with a description of what it does."""
    import argparse

    from pipelines.cli import parser

    def squeezed(text: str) -> str:  # the help wraps lines (and breaks at hyphens)
        return "".join(text.split())

    top = parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    lines = {a.dest: a.help for a in commands._choices_actions}
    shown = squeezed(top.format_help())
    for name, command in commands.choices.items():
        assert lines[name] and squeezed(f"{name} {lines[name]}") in shown, name
        parsers = [command] + [
            nested
            for action in command._actions
            if isinstance(action, argparse._SubParsersAction)
            for nested in action.choices.values()
        ]
        for each in parsers:
            assert each.description and len(each.description) > 40, each.prog
            assert squeezed(each.description) in squeezed(each.format_help()), each.prog
