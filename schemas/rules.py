"""The rules a release spec must satisfy, as Markdown, generated from the schema itself:
every field with its type, limits and default (from the JSON Schema), and every
cross-field rule (from the `Rule:` docstrings of the validators). `shipyard schema --rules`
prints it; docs/spec-rules.md is its output, kept current by a test."""

from __future__ import annotations

import inspect
from typing import Any

from schemas import release
from schemas.release import MAX_STR, ReleaseSpec
from schemas.tasks import TASKS

LIMITS = {
    "minimum": ">= {}",
    "maximum": "<= {}",
    "exclusiveMinimum": "> {}",
    "exclusiveMaximum": "< {}",
    "minLength": "at least {} chars",
    "maxLength": "at most {} chars",
    "minItems": "at least {} items",
    "maxItems": "at most {} items",
    "pattern": "matches `{}`",
}


def markdown() -> str:
    schema = ReleaseSpec.model_json_schema()
    defs = schema["$defs"]
    rows: list[str] = []
    _walk(schema, defs, "", rows)
    head = [
        "# Release spec rules",
        "",
        "Generated from `schemas/release.py` by `shipyard schema --rules`; do not edit.",
        "`shipyard validate` checks every rule below and names `file:line: field` and the fix.",
        "",
        "## General",
        "",
        "- Unknown keys are refused in every section; every section is required.",
        f"- Every string is at most {MAX_STR} characters unless a field says otherwise.",
        "- The file is UTF-8, at most 256 KiB, without control characters, YAML tags or",
        "  anchors/aliases that expand beyond 20,000 nodes.",
        "- Every path is relative and resolves (symlinks followed) inside the repository.",
        "",
        "## Fields",
        "",
        "| field | type | limits | default | description |",
        "|---|---|---|---|---|",
    ]
    return "\n".join([*head, *rows, "", "## Cross-field rules", "", *_rules(), "", *_tasks(), ""])


def _tasks() -> list[str]:
    """The task registry (schemas/tasks.py): what each task needs and allows."""
    lines = [
        "## Tasks",
        "",
        "| task | export.dims needs | loads with | graph outputs | metrics (thresholds may "
        "name these) | default quantization.budget | the server returns |",
        "|---|---|---|---|---|---|---|",
    ]
    serving = {
        "generate": "generated text and ids (sampling, stops; streaming; OpenAI endpoints)",
        "labels": "the outputs plus `label` and `score` (top class of id2label)",
        "tensors": "every graph output",
    }
    for name, task in TASKS.items():
        outputs = ", ".join(f"`{o.name}` [{', '.join(o.axes)}]" for o in task.outputs)
        if task.kv_cache:
            outputs += ", `present.*` (KV cache)"
        budget = ", ".join(f"`{k}: {v:g}`" for k, v in task.default_budget.items())
        lines.append(
            f"| `{name}` | {', '.join(task.dims) or '(the spec declares inputs)'} | "
            f"`{task.auto_class}` | {outputs or '`export.outputs`'} | "
            f"{', '.join(f'`{m}`' for m in task.metrics)} | {budget} | {serving[task.serving]} |"
        )
    lines += ["", "### Why each default quantization budget is what it is", ""]
    lines += [f"- `{name}`: {task.budget_why}" for name, task in TASKS.items()]
    return lines


def _walk(node: dict[str, Any], defs: dict[str, Any], prefix: str, rows: list[str]) -> None:
    for name, prop in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        targets = _refs(prop, defs)
        kind, limits = _describe(prop, defs)
        default = prop.get("default")
        shown = "" if default is None or isinstance(default, dict | list) else f"`{default}`"
        description = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{path}` | {kind} | {limits} | {shown} | {description} |")
        for target in targets:
            if "properties" in target:
                _walk(target, defs, f"{path}.", rows)


def _refs(prop: dict[str, Any], defs: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for option in [prop, *prop.get("anyOf", []), *prop.get("oneOf", [])]:
        ref = option.get("$ref")
        if ref:
            found.append(defs[ref.rsplit("/", 1)[1]])
        items = option.get("items", {})
        if "$ref" in items:
            found.append(defs[items["$ref"].rsplit("/", 1)[1]])
    return found


def _describe(prop: dict[str, Any], defs: dict[str, Any]) -> tuple[str, str]:
    options = prop.get("anyOf") or prop.get("oneOf") or [prop]
    kinds, limits = [], []
    for option in options:
        if "$ref" in option:
            kinds.append(option["$ref"].rsplit("/", 1)[1])
        elif "enum" in option:
            kinds.append(" \\| ".join(f"`{v}`" for v in option["enum"]))
        elif "const" in option:
            kinds.append(f"`{option['const']}`")
        elif option.get("type") == "array":
            item = option.get("items", {})
            inner = item.get("$ref", "").rsplit("/", 1)[-1] or item.get("type", "any")
            if "enum" in item:
                inner = "one of " + ", ".join(f"`{v}`" for v in item["enum"][:4]) + ", …"
            kinds.append(f"list of {inner}")
        elif option.get("type"):
            kinds.append(str(option["type"]))
        for key, fmt in LIMITS.items():
            value = option.get(key, prop.get(key) if option is not prop else None)
            if value is not None and key in option:
                limits.append(fmt.format(str(value).replace("|", "\\|")))
    if any(o.get("x-repo-path") for o in [prop, *options]):
        limits.append("relative path inside the repository")
    if "pattern" in prop and not any("matches" in x for x in limits):
        limits.append(LIMITS["pattern"].format(prop["pattern"].replace("|", "\\|")))
    return " or ".join(dict.fromkeys(kinds)) or "any", "; ".join(dict.fromkeys(limits))


def _rules() -> list[str]:
    lines = []
    for cls_name, cls in sorted(vars(release).items()):
        if not (inspect.isclass(cls) and issubclass(cls, release.Strict)):
            continue
        for _name, member in sorted(vars(cls).items()):
            func = getattr(member, "wrapped", None) or getattr(member, "__func__", member)
            doc = inspect.getdoc(func) if callable(func) else None
            if doc and doc.startswith("Rule:"):
                text = " ".join(doc.removeprefix("Rule:").split())
                lines.append(f"- `{cls_name}`: {text}")
    return lines
