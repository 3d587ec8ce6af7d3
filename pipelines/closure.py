"""Code dependencies derived from the code, Bazel-style: the files of ours a stage module
imports, directly or through other modules of ours, at any depth, including imports inside
functions (stages import heavy libraries lazily, and their helpers the same way).

The compiler makes these a stage's DVC `deps`, so a change to any of them reruns the
stage; a hand-kept list went stale (issue 12). Templates and other non-Python files a stage
reads are still declared in its `io().code`.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGES = ("schemas", "stages", "pipelines")


def import_closure(root: Path, source: str) -> list[str]:
    """Repo-relative paths of every module of ours `source` pulls in, itself included."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_imports(root, path))
    return sorted(seen)


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


def _imports(root: Path, path: str) -> list[str]:
    tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=path)
    package = path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else ""
    found: list[str] = []
    for node in ast.walk(tree):
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
