"""Load a release YAML and report every problem as `file:line: field.path: message`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.errors import SpecError
from schemas.release import ReleaseSpec

SECTIONS_WITH_DEFAULTS = {
    "pins": "{}",
    "parity": "{}",
    "bundle": "{}",
    "quantization": "{method: none}",
}
QUANT_METHODS = ("none", "int8-dynamic", "int8-static", "int4-weight-only")
_DOTTED = re.compile(r"[a-z_]+(?:\.[a-z_]+|\[\d+\])+")


def load_release(path: str | Path, shown: str | None = None) -> ReleaseSpec:
    """Parse and validate one release spec; raise SpecError listing every problem.

    `shown` is how messages name the file (default: the path as given).
    """
    path = Path(path)
    shown = shown or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(shown, [f"{shown}: file not found"]) from None
    except OSError as exc:
        raise SpecError(shown, [f"{shown}: cannot read: {exc.strerror}"]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise SpecError(shown, [f"{shown}:{line}: not valid YAML: {exc}"]) from None
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(shown, [f"{shown}:1: a release spec is a mapping of sections"])
    problems = [f"{shown}:{line}: {msg}" for line, msg in _duplicate_keys(root)]
    data = yaml.safe_load(text)
    try:
        spec = ReleaseSpec.model_validate(data)
    except ValidationError as exc:
        problems += [_describe(shown, root, err) for err in exc.errors()]
        raise SpecError(shown, problems) from None
    if spec.name != path.stem:
        problems.append(
            f"{shown}:{_line_of(root, ('name',))}: name: {spec.name!r} must equal the file "
            f"name {path.stem!r}; rename the file or the release"
        )
    if problems:
        raise SpecError(shown, problems)
    return spec


def _describe(shown: str, root: yaml.Node, err: Any) -> str:
    loc = tuple(p for p in err["loc"] if not _is_union_tag(p))
    message = err["msg"].removeprefix("Value error, ")
    if not loc:
        loc = _path_in_message(message)
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    field = field or "(top level)"
    message = message.removeprefix(field + " ").removeprefix(field + ": ")
    if err["type"] == "extra_forbidden":
        message = f"unknown key {loc[-1]!r}; check the spelling (see `shipyard schema`)"
    elif err["type"] == "missing" and len(loc) == 1 and loc[0] in SECTIONS_WITH_DEFAULTS:
        default = SECTIONS_WITH_DEFAULTS[loc[0]]
        message = f"required section is missing; write `{loc[0]}: {default}` for the defaults"
    elif err["type"] == "missing":
        message = "required field is missing"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        message += f" (found {err['input']!r})"
    return f"{shown}:{_line_of(root, loc)}: {field}: {message}"


def _is_union_tag(part: Any) -> bool:
    return part in ("hf", "python", *QUANT_METHODS) or (isinstance(part, str) and "[" in part)


def _path_in_message(message: str) -> tuple[Any, ...]:
    match = _DOTTED.search(message)
    if not match:
        return ()
    parts: list[Any] = []
    for token in re.findall(r"[a-z_]+|\[\d+\]", match.group(0)):
        parts.append(int(token[1:-1]) if token.startswith("[") else token)
    return tuple(parts)


def _line_of(node: yaml.Node, loc: tuple[Any, ...]) -> int:
    """Walk a pydantic location down the composed YAML tree; the deepest node found wins."""
    line = node.start_mark.line + 1
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        key_node, node = child
        line = (key_node or node).start_mark.line + 1
    return line


def _child(node: yaml.Node, part: Any) -> tuple[yaml.Node | None, yaml.Node] | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return key, value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return None, node.value[part]
    return None


def _duplicate_keys(node: yaml.Node, prefix: str = "") -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            if key.value in seen:
                found.append((key.start_mark.line + 1, f"{path}: duplicate key; keep one"))
            seen.add(key.value)
            found += _duplicate_keys(value, path + ".")
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{prefix.rstrip('.')}[{i}].")
    return found
