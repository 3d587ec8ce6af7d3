"""Fingerprints of Python code that ignore what cannot change behaviour.

A stage's DVC deps on Python code are not the source files themselves but one file per
release and stage (`build/.params/<release>/<stage>.json`, see pipelines/compiler.py),
written by the `code` stage of dvc.yaml: the digests of the stage's import closure and the
spec sections the stage reads. Each module is
hashed as its syntax tree with comments, formatting, docstrings and pydantic `description=`
texts removed, so rewording a field description or a comment changes no fingerprint and
reruns no release stage; any change to what the code does changes the tree, its
fingerprint, and reruns every stage that imports it.

Type annotations that nothing evaluates are removed too: a function's parameter and return
annotations, a variable's annotation inside a function, and `if TYPE_CHECKING:` blocks with
the `TYPE_CHECKING` import itself (every module has `from __future__ import annotations`,
and nothing in the fingerprinted code introspects signatures' annotations:
tests/pipelines/test_derived_deps.py). Class-body annotations stay: they are pydantic's,
dataclasses' and NamedTuples' fields. So typing a stage (mypy strict) reruns nothing, the
first typing-only import of a module included.

Files a stage reads as data (templates, the MLServer runtime it ships byte for byte;
`io().code`) are not fingerprinted: the same file carries their sha256 over their bytes
(pipelines/compiler.py `file_digests`), so every change to them, a comment included, reruns
the stage.
"""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

CODE_STAGE = "code"  # the dvc.yaml stage that writes the fingerprints
# The code that decides what a fingerprint (and a stage's spec-sections file) is: a change to
# it reruns the `code` stage, which rewrites the files whose content changes.
FINGERPRINT_CODE = ("pipelines/closure.py", "pipelines/compiler.py", "pipelines/fingerprint.py")

# Keyword arguments that document and never decide: pydantic's Field(description=...).
DOC_KEYWORDS = frozenset({"description"})


class _StripDocs(ast.NodeTransformer):
    def _body(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:]  # type: ignore[attr-defined]
        self.generic_visit(node)
        return node

    visit_Module = _body
    visit_ClassDef = _body
    visit_FunctionDef = _body
    visit_AsyncFunctionDef = _body

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node.keywords = [k for k in node.keywords if k.arg not in DOC_KEYWORDS]
        self.generic_visit(node)
        return node


class _StripTypes(ast.NodeTransformer):
    """Annotations nothing evaluates: signatures, variables inside functions, and
    `if TYPE_CHECKING:` blocks (their else branch is what runs) with the name they test.
    Class-body annotations (fields) are kept."""

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.returns = None
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
            if arg is not None:
                arg.annotation = None
        node.body = [_Untyped().visit(stmt) for stmt in node.body]
        self.generic_visit(node)  # nested functions and classes
        return node

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        self.generic_visit(node)  # nested blocks first, their statement lists flattened
        if name == "TYPE_CHECKING":  # at run time: the else branch, if any
            return node.orelse
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | None:
        """`TYPE_CHECKING` imported from typing serves only the blocks removed above."""
        if node.module == "typing":
            node.names = [a for a in node.names if a.name != "TYPE_CHECKING"]
            if not node.names:
                return None
        return node


class _Untyped(ast.NodeTransformer):
    """Inside a function body: `x: T = v` is `x = v` at run time; a bare `x: T` still makes
    `x` local, so it stays with its annotation blanked. Nested defs and classes are left to
    _StripTypes (a class body's annotations are its fields)."""

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.annotation = ast.Constant(value=None)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return node


def normalized(source: str, filename: str = "<source>") -> str:
    """The module's syntax tree without comments, layout, docstrings or descriptions."""
    tree = _StripTypes().visit(_StripDocs().visit(ast.parse(source, filename=filename)))
    return ast.dump(tree, annotate_fields=True, include_attributes=False)


def module_digest(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return hashlib.sha256(normalized(text, str(path)).encode("utf-8")).hexdigest()


def stage_fingerprint(code: Path, modules: list[str]) -> dict[str, str]:
    """Each module of a stage's import closure with its digest."""
    return {m: module_digest(code / m) for m in modules}


def write_if_changed(target: Path, text: str) -> Path:
    """Replace `target` atomically, and only when its content changes (its mtime then
    means something too)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target
