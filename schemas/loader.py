"""Load a release YAML and report every problem as `file:line: field.path: message`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from schemas.errors import SpecError
from schemas.release import ReleaseSpec
from schemas.spec.model import ModelSource
from schemas.spec.quantization import Quantization


def _literals(union: Any, key: str) -> tuple[str, ...]:
    """The values of a discriminated union's key, in its members' order (each member a
    pydantic model whose `key` is a Literal)."""
    members = get_args(get_args(union)[0])  # Annotated[A | B, Field(discriminator=key)]
    return tuple(v for m in members for v in get_args(m.model_fields[key].annotation))


def _default_hint(field: FieldInfo) -> str | None:
    """What to write for a required section to take its defaults: `{}` when the section's
    model accepts an empty mapping, `{<key>: none}` for a discriminated union with a `none`
    member, else None (the section has no defaults)."""
    if isinstance(field.discriminator, str):
        values = [
            v
            for m in get_args(field.annotation)
            for v in get_args(m.model_fields[field.discriminator].annotation)
        ]
        return f"{{{field.discriminator}: none}}" if "none" in values else None
    model = field.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    try:
        model.model_validate({})
    except ValidationError:
        return None
    return "{}"


# Derived from the models, never kept by hand (a hand-kept list had drifted: it lacked
# engine and loadtest, which accept `{}`).
SECTIONS_WITH_DEFAULTS = {
    name: hint
    for name, field in ReleaseSpec.model_fields.items()
    if field.is_required() and (hint := _default_hint(field)) is not None
}
QUANT_METHODS = _literals(Quantization, "method")
MODEL_KINDS = _literals(ModelSource, "kind")
# How pydantic names validator wrappers in error locations (never a user's key).
_VALIDATOR_TAG = re.compile(
    r"^(function-(after|before|wrap|plain)|tagged-union|union|lax-or-strict|constrained-\w+|"
    r"nullable|default|chain|json-or-python)\[.*\]$"
)
_DOTTED = re.compile(r"[a-z_]+(?:\.[a-z_]+|\[\d+\])+")
_FIELD_PATH = re.compile(r"@[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\[\d+\])*")


MAX_SPEC_BYTES = 256 * 1024
# Nodes the document may expand to through aliases (a "billion laughs" spec expands to
# billions); a real spec has a few hundred.
MAX_EXPANDED_NODES = 20_000
EXCERPT = 80
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff\ufffe\uffff]")


def load_release(
    path: str | Path, shown: str | None = None, final: Path | None = None
) -> ReleaseSpec:
    """Parse and validate one release spec; raise SpecError listing every problem.

    `shown` is how messages name the file (default: the path as given); `final` is where a
    spec still being written will live (its name and repository are checked against that).
    """
    path = Path(path)
    where = final or path
    shown = shown or str(path)
    root = _compose(path, shown)
    problems = [f"{shown}:{line}: {msg}" for line, msg in _duplicate_keys(root)]
    try:
        data = _construct(root, shown)
    except SpecError as exc:  # every problem at once: the duplicates found above too
        raise SpecError(shown, problems + exc.problems) from None
    try:
        spec = ReleaseSpec.model_validate(data)
    except ValidationError as exc:
        problems += [_safe_describe(shown, root, err) for err in exc.errors()]
        raise SpecError(shown, problems) from None
    if spec.name != where.stem:
        problems.append(
            f"{shown}:{_line_of(root, ('name',))}: name: {spec.name!r} must equal the file "
            f"name {where.stem!r}; rename the file or the release"
        )
    problems += [
        f"{shown}:{_line_of(root, loc)}: {_field(loc)}: {msg}"
        for loc, msg in _paths_outside(spec, repo_of(where))
    ]
    if problems:
        raise SpecError(shown, problems)
    return spec


def repo_of(spec_path: Path) -> Path:
    """The repository a spec belongs to: $SHIPYARD_ROOT, else the folder above releases/."""
    env = os.environ.get("SHIPYARD_ROOT")
    if env:
        return Path(env).resolve()
    folder = spec_path.resolve().parent
    return folder.parent if folder.name == "releases" else Path.cwd().resolve()


def _compose(path: Path, shown: str) -> yaml.Node:
    """Read (capped), decode, screen and compose the YAML once, with LibYAML when present."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(shown, [f"{shown}: file not found"]) from None
    except OSError as exc:
        raise SpecError(shown, [f"{shown}: cannot read: {exc.strerror}"]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(
            shown,
            [
                f"{shown}:1: the file is over {MAX_SPEC_BYTES // 1024} KiB; a release spec is a "
                "few kilobytes (keep data in data files the spec points at)"
            ],
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(
            shown,
            [
                f"{shown}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at line {line}); "
                "save the file as UTF-8"
            ],
        ) from None
    bad = _CONTROL.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise SpecError(
            shown,
            [
                f"{shown}:{line}: control character U+{ord(bad.group()):04X} at column "
                f"{column}; remove it (only tabs and newlines are allowed)"
            ],
        )
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise SpecError(shown, [_yaml_problem(shown, exc)]) from None
    finally:
        loader.dispose()
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(shown, [f"{shown}:1: a release spec is a mapping of sections"])
    size = _expanded_size(root, shown)
    if size > MAX_EXPANDED_NODES:
        raise SpecError(
            shown,
            [
                f"{shown}:1: the document expands to over {MAX_EXPANDED_NODES} nodes through "
                "anchors and aliases; write the values out (a release spec needs no such reuse)"
            ],
        )
    return root


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _construct(root: yaml.Node, shown: str) -> Any:
    """Python data from the composed tree: safe tags only, no second parse."""
    constructor = yaml.SafeLoader("")
    try:
        return constructor.construct_document(root)
    except yaml.YAMLError as exc:
        raise SpecError(shown, [_yaml_problem(shown, exc)]) from None
    finally:
        constructor.dispose()


def _yaml_problem(shown: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = mark.line + 1 if mark else 1
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    problem = _excerpt(str(problem))
    if "could not determine a constructor for the tag" in problem:
        problem += "; tags (`!!python/...`, custom `!tags`) are not allowed in a release spec"
    return f"{shown}:{line}: not valid YAML: {problem}"


def _expanded_size(root: yaml.Node, shown: str) -> int:
    """Nodes the tree has with every alias expanded, counted without expanding (memoized
    per node), stopping at the cap; a node that contains itself is refused."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            line = node.start_mark.line + 1
            raise SpecError(shown, [f"{shown}:{line}: an alias refers to a node containing it"])
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > MAX_EXPANDED_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_EXPANDED_NODES:
                    break
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT else text[: EXCERPT - 1] + "…"


def _field(loc: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _paths_outside(spec: BaseModel, repo: Path) -> list[tuple[tuple[Any, ...], str]]:
    """Every repo path of the spec, resolved with symlinks followed, must stay inside."""
    found = []
    for loc, value in _repo_paths(spec, ()):
        resolved = (repo / value).resolve()
        if resolved != repo and repo not in resolved.parents:
            found.append(
                (
                    loc,
                    f"{_excerpt(value)!r} resolves to {resolved}, outside the repository "
                    f"{repo} (a symlink?); keep data and models inside the repository",
                )
            )
    return found


def _is_repo_path(info: FieldInfo) -> bool:
    """A field typed `RepoPath` (or `RepoPath | None`)."""

    def marked(meta: Any) -> bool:
        extra = getattr(meta, "json_schema_extra", None)
        return isinstance(extra, dict) and bool(extra.get("x-repo-path"))

    if any(marked(m) for m in [info, *info.metadata]):
        return True
    return any(
        marked(m) for arg in get_args(info.annotation) for m in getattr(arg, "__metadata__", ())
    )


def _repo_paths(model: BaseModel, loc: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], str]]:
    out: list[tuple[tuple[Any, ...], str]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if _is_repo_path(info) and isinstance(value, str):
            out.append(((*loc, name), value))
        elif isinstance(value, BaseModel):
            out += _repo_paths(value, (*loc, name))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += _repo_paths(item, (*loc, name, i))
    return out


def _safe_describe(shown: str, root: yaml.Node, err: Any) -> str:
    """A message for every error, even one whose location this module does not foresee."""
    try:
        return _describe(shown, root, err)
    except (IndexError, KeyError, TypeError, ValueError):
        where = ".".join(str(p) for p in err.get("loc", ()))[:200] or "(top level)"
        return f"{shown}:1: {where}: {_excerpt_long(str(err.get('msg', 'invalid')))}"


def _describe(shown: str, root: yaml.Node, err: Any) -> str:
    raw = err["loc"]
    loc = tuple(p for i, p in enumerate(raw) if not _is_union_tag(p, raw[i - 1] if i else None))
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
    elif err["type"] == "string_type" and isinstance(err.get("input"), int | float):
        message += f' (found the number {err["input"]!r}); quote it, e.g. "{err["input"]}"'
    elif "input" in err and err["type"] != "value_error":  # a rule's message says enough
        message += f" (found {_excerpt(repr(err['input']))})"
    message = _excerpt_long(_other_lines(root, loc, message))
    return f"{shown}:{_line_of(root, loc)}: {field}: {message}"


def _other_lines(root: yaml.Node, loc: tuple[Any, ...], message: str) -> str:
    """A rule about two fields marks the other one `@quantization.budget.x`: it is shown
    with its own line, `quantization.budget.x (line 47)` (the deepest part of its path the
    file writes; no line when the file writes none of it)."""

    def at(match: re.Match[str]) -> str:
        text = match.group(0)[1:]
        path = tuple(
            int(p[1:-1]) if p.startswith("[") else p
            for p in re.findall(r"[a-z_][a-z0-9_]*|\[\d+\]", text)
        )
        if path[0] not in _top_keys(root):
            return text
        return f"{text} (line {_line_of(root, path)})"

    return _FIELD_PATH.sub(at, message)


def _top_keys(root: yaml.Node) -> set[str]:
    return {k.value for k, _ in root.value} if isinstance(root, yaml.MappingNode) else set()


def _excerpt_long(message: str) -> str:
    """Messages quote the input: never more than a short excerpt of it."""
    return message if len(message) <= 400 else message[:399] + "…"


def _is_union_tag(part: Any, parent: Any) -> bool:
    """pydantic puts the chosen member of a discriminated union (and validator wrappers)
    into error locations; they are not fields of the spec."""
    if parent == "model" and part in MODEL_KINDS:
        return True
    if parent == "quantization" and part in QUANT_METHODS:
        return True
    return isinstance(part, str) and bool(_VALIDATOR_TAG.match(part))


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
    line = int(node.start_mark.line) + 1
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        key_node, node = child
        line = int((key_node or node).start_mark.line) + 1
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
            if not isinstance(key, yaml.ScalarNode):
                line = key.start_mark.line + 1
                found.append((line, f"{prefix}(key): a key must be a plain name, not a {key.id}"))
                continue
            path = f"{prefix}{key.value}"
            if key.value in seen:
                found.append((key.start_mark.line + 1, f"{path}: duplicate key; keep one"))
            seen.add(key.value)
            found += _duplicate_keys(value, path + ".")
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{prefix.rstrip('.')}[{i}].")
    return found
