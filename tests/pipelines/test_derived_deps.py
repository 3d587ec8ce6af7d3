"""Dependencies derived from the code: running a stage imports nothing of ours that its
DVC entry does not declare (the import closure the compiler fingerprints), and the
fingerprint changes exactly when what the code does changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.closure import import_closure, stage_closure
from pipelines.compiler import code_modules, compile_dvc, stage_ios
from pipelines.fingerprint import normalized
from stages import STAGES
from tests.conftest import REPO, Workspace, gpt2_spec


def tree(root: Path, files: dict[str, str]) -> None:
    """A synthetic code tree: each path (repo-relative) with its text."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


SHIPYARD = str(Path(sys.executable).with_name("shipyard"))
# `shipyard run-stage` itself: the command line, which assembles every command's parser
ENTRY_POINT = {
    "pipelines/__init__.py",
    "pipelines/cli.py",
    *(p.relative_to(REPO).as_posix() for p in (REPO / "pipelines" / "commands").glob("*.py")),
}


def declared(stage: str) -> set[str]:
    """The Python modules the stage's DVC entry depends on, through its fingerprint file."""
    import yaml

    deps = yaml.safe_load(compile_dvc(REPO))["stages"][stage]["do"]["deps"]
    assert deps[0] == f"build/.params/${{key}}/{stage}.json"
    assert not [d for d in deps if d.endswith(".py") and not d.startswith("shipyard_runtime/")]
    _, ios = stage_ios(REPO)
    return set(code_modules(REPO, ios)[stage])


# schemas/release.py assembles every section, so every section module is imported at run
# time; the scoped spec lets the stage read only its declared sections (it raises on any other),
# so only those sections' modules are its dependencies (tests below check both halves).
def via_spec_root(loaded: set[str]) -> set[str]:
    return {p for p in loaded if p.startswith("schemas/spec/")}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_run_imports_only_what_its_dvc_entry_declares(
    built_gpt2: Workspace, tmp_path: Path, stage: str
) -> None:
    record = tmp_path / "imports.txt"
    spec = built_gpt2.write(gpt2_spec())
    done = subprocess.run(
        [SHIPYARD, "run-stage", stage, "--release", str(spec)],
        cwd=built_gpt2.root,
        env={
            **os.environ,
            "SHIPYARD_ROOT": str(built_gpt2.root),
            "SHIPYARD_RECORD_IMPORTS": str(record),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = set(record.read_text().split())
    assert f"stages/{stage}.py" in loaded
    assert loaded - ENTRY_POINT - via_spec_root(loaded) - declared(stage) == set()


def test_the_closure_follows_lazy_imports_and_packages(tmp_path: Path) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "schemas").mkdir()
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "schemas" / "__init__.py").write_text("from schemas.errors import E\n")
    (tmp_path / "schemas" / "errors.py").write_text("E = 1\n")
    (tmp_path / "stages" / "_helper.py").write_text("import numpy\n")
    (tmp_path / "stages" / "a.py").write_text(
        "import json\nfrom schemas import E\n\ndef run():\n    from stages import _helper\n"
    )
    assert import_closure(tmp_path, "stages/a.py") == [
        "schemas/__init__.py",
        "schemas/errors.py",
        "stages/__init__.py",
        "stages/_helper.py",
        "stages/a.py",
    ]


def test_a_module_run_as_python_dash_m_is_a_dependency_of_who_runs_it(tmp_path: Path) -> None:
    """`in_child` runs `python -m stages._child`: no import reaches that file, so editing it
    reran nothing (issue 29). A list or tuple holding "-m" and one of our modules counts."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "stages" / "_child.py").write_text("from stages import _deep\n")
    (tmp_path / "stages" / "_deep.py").write_text("X = 1\n")
    (tmp_path / "stages" / "_quiet.py").write_text("Y = 1\n")
    (tmp_path / "stages" / "a.py").write_text(
        "import sys\n\ndef run():\n    cmd = [sys.executable, '-m', 'stages._child', 'x']\n"
        "    other = ('-m', 'json.tool')  # not ours\n"
        "    words = ['stages._quiet', '-m']  # no module after the flag\n"
    )
    assert import_closure(tmp_path, "stages/a.py") == [
        "stages/__init__.py",
        "stages/_child.py",
        "stages/_deep.py",
        "stages/a.py",
    ]
    _, ios = stage_ios(REPO)
    modules = code_modules(REPO, ios)
    assert all("stages/_child.py" in modules[s] for s in ("export", "parity", "kvcheck"))


def test_a_stage_depends_on_the_spec_modules_of_the_sections_it_declares_only() -> None:
    _, ios = stage_ios(REPO)
    modules = code_modules(REPO, ios)
    assert "schemas/spec/capacity.py" in modules["plan"]  # plan reads capacity (and export)
    assert "schemas/spec/export.py" in modules["plan"]
    assert "schemas/spec/bundle.py" not in modules["plan"]
    assert "schemas/spec/loadtest.py" not in modules["export"]
    # a section module imports what it builds on: engine profiles are export DimRanges
    assert "schemas/spec/export.py" in stage_closure(REPO, ["stages/__init__.py"], ("engine",))
    for stage, mods in modules.items():
        assert "schemas/spec/base.py" in mods and "schemas/release.py" in mods, stage


def test_the_fingerprint_ignores_docs_comments_and_layout_but_not_code() -> None:
    base = (
        "from pydantic import BaseModel, Field\n"
        "class A(BaseModel):\n"
        '    """Docs."""\n'
        '    x: int = Field(default=1, ge=0, description="What x is.")\n'
        "def f(a):\n"
        '    """Docs."""\n'
        "    return a + 1  # why\n"
    )
    same = [
        base.replace("What x is.", "Another wording."),
        base.replace('"""Docs."""', '"""Other docs."""'),
        base.replace("  # why", "  # another comment") + "\n# trailing comment\n",
        base.replace("return a + 1", "return (a\n            + 1)"),
        base.replace('    """Docs."""\n    return', "    return"),
    ]
    for text in same:
        assert normalized(text) == normalized(base), text
    different = [
        base.replace("default=1", "default=2"),
        base.replace("ge=0", "ge=1"),
        base.replace("a + 1", "a - 1"),
        base.replace("x: int", "y: int"),
        base + "B = 'a string literal decides things'\n",
        base.replace('description="What x is."', 'title="What x is."'),
    ]
    for text in different:
        assert normalized(text) != normalized(base), text
    # a string literal's content alone (a path, a key, a format) decides things too
    literal = base.replace("return a + 1", "return a + 'one'")
    assert normalized(literal) != normalized(literal.replace("'one'", "'two'"))
    keyword = base.replace("ge=0,", "pattern='^a',")
    assert normalized(keyword) != normalized(keyword.replace("'^a'", "'^b'"))


def test_annotations_nothing_evaluates_cost_no_rerun_but_fields_do() -> None:
    """Typing a stage (issue 29: mypy strict on stages/) must rerun nothing; a pydantic or
    dataclass field's type decides validation and must."""
    base = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING, Any\n"
        "if TYPE_CHECKING:\n"
        "    from schemas import ReleaseSpec\n"
        "from pydantic import BaseModel\n"
        "class A(BaseModel):\n"
        "    x: int = 1\n"
        "    def m(self, k: Any) -> Any:\n"
        "        return k\n"
        "def f(a: Any, *rest: Any, b: Any = None, **kw: Any) -> Any:\n"
        "    y: Any = a + 1\n"
        "    z: Any\n"
        "    def inner(q: Any) -> Any:\n"
        "        w: Any = q\n"
        "        return w\n"
        "    class Local(BaseModel):\n"
        "        v: int = 0\n"
        "    return inner(y)\n"
    )
    same = [
        base.replace("def f(a: Any", "def f(a: ReleaseSpec"),
        base.replace("*rest: Any", "*rest: int").replace("**kw: Any", "**kw: str"),
        base.replace("b: Any = None", "b: int | None = None"),
        base.replace(") -> Any:\n    y", ") -> dict[str, int]:\n    y"),
        base.replace("    y: Any = a + 1", "    y: int = a + 1"),
        base.replace("    z: Any\n", "    z: float\n"),
        base.replace("w: Any = q", "w: str = q").replace("q: Any", "q: str"),
        base.replace("def m(self, k: Any) -> Any", "def m(self, k: int) -> int"),
        base.replace("    from schemas import ReleaseSpec\n", "    from schemas import Other\n"),
    ]
    for text in same:
        assert normalized(text) == normalized(base), text
    different = [
        base.replace("    x: int = 1", "    x: str = 1"),  # a field's type validates
        base.replace("        v: int = 0", "        v: str = 0"),  # in a local class too
        base.replace("    y: Any = a + 1", "    y: Any = a + 2"),  # the value still counts
        base.replace("    z: Any\n", ""),  # a bare annotation makes z local
        base.replace("b: Any = None", "b: Any = 0"),  # defaults count
        base.replace("if TYPE_CHECKING:", "if DEBUG:"),
        base.replace("if TYPE_CHECKING:", "if typing.DEBUG:"),
    ]
    for text in different:
        assert normalized(text) != normalized(base), text
    # the else branch runs: it counts; `typing.TYPE_CHECKING` is the same block
    branches = base.replace(
        "    from schemas import ReleaseSpec\n",
        "    from schemas import ReleaseSpec\nelse:\n    R = 1\n",
    )
    assert normalized(branches) != normalized(branches.replace("R = 1", "R = 2"))
    dotted = base.replace("if TYPE_CHECKING:", "if typing.TYPE_CHECKING:")
    assert normalized(dotted) == normalized(
        dotted.replace("    from schemas import ReleaseSpec\n", "    from schemas import Other\n")
    )
    # adding the first typing-only import to an untyped module costs nothing either: the
    # block and the name it tests go, the else branch stays in its place
    untyped = base.replace("from typing import TYPE_CHECKING, Any\n", "from typing import Any\n")
    untyped = untyped.replace("if TYPE_CHECKING:\n    from schemas import ReleaseSpec\n", "")
    assert normalized(untyped) == normalized(base)
    alone = base.replace(
        "from typing import TYPE_CHECKING, Any\n", "from typing import TYPE_CHECKING\n"
    )
    assert normalized(alone) == normalized(untyped.replace("from typing import Any\n", ""))
    nested = branches.replace("    R = 1\n", "    if TYPE_CHECKING:\n        pass\n    R = 1\n")
    assert normalized(nested) == normalized(branches)  # a block inside the else goes too
    assert normalized(branches) == normalized(
        untyped.replace(
            "from pydantic import BaseModel\n", "R = 1\nfrom pydantic import BaseModel\n"
        )
    )
    assert normalized(base) != normalized(
        base.replace(
            "from typing import TYPE_CHECKING, Any", "from typing import TYPE_CHECKING, cast"
        )
    )


def test_imports_under_type_checking_are_no_dependency(tmp_path: Path) -> None:
    tree(tmp_path, {"stages/__init__.py": "", "schemas/__init__.py": ""})
    tree(tmp_path, {f"schemas/{name}.py": "X = 1\n" for name in ("typed", "plain", "other")})
    (tmp_path / "stages" / "a.py").write_text(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from schemas import typed\nelse:\n    from schemas import plain\n"
        "if typing.TYPE_CHECKING:\n    import schemas.typed\n"
        "if True:\n    from schemas import other\n"
    )
    assert import_closure(tmp_path, "stages/a.py") == [
        "schemas/__init__.py",
        "schemas/other.py",
        "schemas/plain.py",
        "stages/a.py",
    ]


def test_a_spec_section_modules_code_is_in_the_fingerprint_of_the_stages_reading_it(
    tmp_path: Path,
) -> None:
    """What reaches a stage's params file: every module of its closure, the spec section
    modules too, each digest changing with the module's code (a copy of the code edited)."""
    import shutil

    from pipelines.fingerprint import module_digest, stage_fingerprint

    _, ios = stage_ios(REPO)
    modules = code_modules(REPO, ios)
    for package in ("schemas", "stages", "pipelines", "shipyard_runtime"):
        shutil.copytree(REPO / package, tmp_path / package)
    section = "schemas/spec/capacity.py"
    before = stage_fingerprint(tmp_path, modules["plan"])
    assert before[section] == module_digest(REPO / section)
    path = tmp_path / section
    path.write_text(path.read_text() + "\n_RULE = 2\n")
    after = stage_fingerprint(tmp_path, modules["plan"])
    assert [m for m in before if before[m] != after[m]] == [section]
    assert section not in stage_fingerprint(tmp_path, modules["export"])


def test_relative_imports_resolve_against_the_importing_package(tmp_path: Path) -> None:
    """`from . import x`, `from .sub import y` and `from .. import z` (the repository
    imports absolutely today; a relative import must not silently drop a dependency)."""
    tree(tmp_path, {f"{d}/__init__.py": "" for d in ("stages", "stages/pkg", "stages/pkg/sub")})
    tree(
        tmp_path,
        {
            **{
                f"stages/{m}.py": "X = 1\n"
                for m in ("top", "pkg/sibling", "pkg/sub/deep", "pkg/other")
            },
            "stages/pkg/mod.py": (
                "from . import sibling\nfrom .sub import deep\nfrom .. import top\n"
            ),
        },
    )
    assert import_closure(tmp_path, "stages/pkg/mod.py") == [
        "stages/__init__.py",
        "stages/pkg/__init__.py",
        "stages/pkg/mod.py",
        "stages/pkg/sibling.py",
        "stages/pkg/sub/__init__.py",
        "stages/pkg/sub/deep.py",
        "stages/top.py",
    ]


def test_a_plain_import_depends_on_the_module_and_the_packages_above_it(tmp_path: Path) -> None:
    """`import stages.pkg.leaf` runs stages/__init__.py, stages/pkg/__init__.py and the
    leaf; `import stages.top as t` the same for its own path (the repository spells its
    imports as `from`, so this form had no test)."""
    tree(tmp_path, {f"{d}/__init__.py": "" for d in ("stages", "stages/pkg")})
    tree(
        tmp_path,
        {
            "stages/pkg/leaf.py": "X = 1\n",
            "stages/top.py": "Y = 2\n",
            "stages/unused.py": "Z = 3\n",
            "stages/main.py": "import json\nimport stages.pkg.leaf\nimport stages.top as t\n",
        },
    )
    assert import_closure(tmp_path, "stages/main.py") == [
        "stages/__init__.py",
        "stages/main.py",
        "stages/pkg/__init__.py",
        "stages/pkg/leaf.py",
        "stages/top.py",
    ]


def test_only_a_module_named_right_after_dash_m_is_run(tmp_path: Path) -> None:
    tree(tmp_path, {"stages/__init__.py": ""})
    tree(tmp_path, {f"stages/{name}.py": "X = 1\n" for name in ("run", "not_run", "also_not")})
    (tmp_path / "stages" / "a.py").write_text(
        "cmd = ['python', '-m', 'stages.run']\n"
        "other = ['--flag', 'stages.not_run']\n"
        "third = ('-c', 'stages.also_not')\n"
    )
    assert import_closure(tmp_path, "stages/a.py") == [
        "stages/__init__.py",
        "stages/a.py",
        "stages/run.py",
    ]


def test_the_spec_contributes_its_base_and_the_declared_sections_only(tmp_path: Path) -> None:
    """A dotted param (`bundle.serving`) declares its section's module; the spec root is
    a leaf (its imports of every section are not followed), but what its rules use besides
    the sections (the task registry) is."""
    from pipelines.closure import stage_closure

    tree(tmp_path, {f"{d}/__init__.py": "" for d in ("stages", "schemas", "schemas/spec")})
    tree(
        tmp_path,
        {f"schemas/spec/{s}.py": "X = 1\n" for s in ("base", "bundle", "export", "loadtest")},
    )
    tree(tmp_path, {"schemas/tasks.py": "T = 1\n"})
    (tmp_path / "schemas" / "release.py").write_text(
        "from schemas import tasks\nfrom schemas.spec import bundle, export, loadtest\n"
    )
    (tmp_path / "stages" / "s.py").write_text("from schemas.release import R\n")
    got = stage_closure(tmp_path, ["stages/s.py"], ("bundle.serving", "export"))
    assert got == [
        "schemas/__init__.py",
        "schemas/release.py",
        "schemas/spec/__init__.py",
        "schemas/spec/base.py",
        "schemas/spec/bundle.py",
        "schemas/spec/export.py",
        "schemas/tasks.py",
        "stages/s.py",
    ]
    # a stage that never reaches the spec root gets its sections, and nothing of the root's
    (tmp_path / "stages" / "t.py").write_text("X = 1\n")
    assert stage_closure(tmp_path, ["stages/t.py"], ("loadtest",)) == [
        "schemas/spec/base.py",
        "schemas/spec/loadtest.py",
        "stages/t.py",
    ]
