"""Code dependencies derived from the code, Bazel-style: the files of ours a stage module
imports, directly or through other modules of ours, at any depth, including imports inside
functions (stages import heavy libraries lazily, and their helpers the same way), and the
modules of ours it runs as `python -m <module>` (a list or tuple holding "-m" and the name:
`in_child`'s stages._child, which no import reaches).

The compiler fingerprints these (pipelines/fingerprint.py) into one file per stage that the
stage's DVC entry depends on, so a change to what any of them does reruns the stage; a
hand-kept list went stale (issue 12). Templates and other non-Python files a stage reads are
declared in its `io().code`; the same file carries their sha256, byte for byte.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGES = ("schemas", "stages", "pipelines", "shipyard_runtime")


# The spec assembles every section; a stage sees only the sections it declares (`scoped`
# raises on any other), so it depends on those sections' modules, not on all of them.
SPEC_ROOT = "schemas/release.py"
SPEC_SECTIONS = "schemas/spec"


def import_closure(root: Path, source: str, leaves: frozenset[str] = frozenset()) -> list[str]:
    """Repo-relative paths of every module of ours `source` pulls in, itself included.
    A module in `leaves` is included but its own imports are not followed."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path not in leaves:
            todo.extend(_imports(root, path))
    return sorted(seen)


def stage_closure(root: Path, sources: list[str], params: tuple[str, ...]) -> list[str]:
    """The Python modules a stage's behaviour can depend on: the import closure of its
    module and of the runner, where the spec contributes its root module, the shared base
    and only the section modules of the params the stage declares (`bundle.serving` ->
    schemas/spec/bundle.py), with what those import."""
    leaves = frozenset({SPEC_ROOT})
    found: set[str] = set()
    for source in sources:
        found.update(import_closure(root, source, leaves))
    sections = {p.split(".", 1)[0] for p in params}
    for module in ("base", *sorted(sections)):
        path = f"{SPEC_SECTIONS}/{module}.py"
        if (root / path).is_file():
            found.update(import_closure(root, path, leaves))
    if SPEC_ROOT in found:
        found.add(f"{SPEC_SECTIONS}/__init__.py")
        # what the root's cross-section rules use besides the sections (the task registry)
        for module in _imports(root, SPEC_ROOT):
            if not module.startswith(f"{SPEC_SECTIONS}/"):
                found.update(import_closure(root, module, leaves))
    return sorted(found)


@cache
def _module_file(root: Path, dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(root).as_posix()
    return None


def _with_parents(root: Path, dotted: str) -> list[str]:
    """A module and the packages above it (importing a.b runs a/__init__.py first)."""
    parts = dotted.split(".")
    found = []
    for i in range(1, len(parts) + 1):
        path = _module_file(root, ".".join(parts[:i]))
        if path:
            found.append(path)
    return found


def _type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(root: Path, path: str) -> list[str]:
    tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=path)
    package = path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else ""
    found: list[str] = []
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _type_checking(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }  # `if TYPE_CHECKING:` imports never run: annotations cost no dependency
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.List | ast.Tuple):  # [python, "-m", "stages._child", ...]
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, name in zip(words, words[1:], strict=False):
                if flag == "-m" and isinstance(name, str):
                    found += _with_parents(root, name)
        if isinstance(node, ast.Import):
            for alias in node.names:
                found += _with_parents(root, alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative import
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found += _with_parents(root, module)
            for alias in node.names:  # `from stages import _model` imports a module
                sub = _module_file(root, f"{module}.{alias.name}")
                if sub and sub.endswith(f"/{alias.name}.py"):
                    found.append(sub)
    return found
