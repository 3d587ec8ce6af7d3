"""Rendering configs from stages/templates (sandboxed Jinja, StrictUndefined, every value
through its format's escaping) and parsing Triton configs back with Triton's own protobuf.
Shared by the serve, engine and bundle stages (no stage imports another)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas import Refused
from stages.rendering.escape import FILTERS

TEMPLATES = Path(__file__).parents[1] / "templates"


def render(
    work: Path,
    outputs: dict[str, str],
    context: dict[str, Any],
    trim: bool = True,
) -> list[Path]:
    """Render each template in a sandbox; an undefined variable is an error, not ''."""
    from jinja2 import FileSystemLoader, StrictUndefined, TemplateError
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(
        loader=FileSystemLoader(TEMPLATES),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=trim,
        autoescape=False,
    )
    env.filters.update(FILTERS)  # every value goes through its format's escaping
    paths = []
    for out, template in outputs.items():
        try:
            text = env.get_template(template).render(context)
        except TemplateError as exc:
            raise Refused(
                f"template stages/templates/{template} does not render: {exc}",
                "fix the template or the value it names",
            ) from None
        path = work / out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def parse_triton(text: str) -> Any:
    """Parse with Triton's own ModelConfig protobuf; text_format errors carry line:col."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"Triton's model_config.proto rejects it at {exc}") from None
