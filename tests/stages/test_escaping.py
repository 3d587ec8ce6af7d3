"""Every template rendered with hostile values and parsed back: each value round-trips
exactly and adds no key, line or heading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from markdown_it import MarkdownIt

from schemas.artifacts import ServingValues
from stages.bundling.layout import templates
from stages.rendering.escape import comment, markdown, markdown_cell, pbtxt, yaml_scalar
from stages.rendering.render import parse_triton, render
from stages.serving.configs import triton_values
from tests.conftest import model_info

HOSTILE = [
    "plain",
    "new\nline: injected",
    '0.1.0\ndefault_model_filename: "evil.onnx"',
    "quote \" and ' both",
    "back\\slash \\n not a newline",
    "{{ 7 * 7 }} {% if true %}x{% endif %}",
    "{ braces: [1, 2] }",
    "# not a comment",
    "100% -- %s %d",
    "ünïcödé ✓ 模型 🚀",
    "\t tab and \r carriage",
    "\u2028line sep\u2029para sep\x85nel",
    "true",
    "1.5",
    "null",
    "- list item",
    "| pipe | table |",
    "## heading\n# another",
    "<script>alert(1)</script>",
    "[link](http://x) ![img](y) `code`",
    "x" * 10_000,
    "1. ordered\n2) also\n+ plus\n---\n===\n> quote",
    "&copy; &amp; &#35; entity",
    "***bold*** __under__ ~~strike~~",
    "```fenced```\n    indented code",
    "trailing hash #\nend \\",
    "",
]
IDS = [repr(h[:12]) for h in HOSTILE]


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_pbtxt_strings_round_trip_through_tritons_parser(value: str) -> None:
    text = f"# {comment(value)}\nname: {pbtxt(value)}\nbackend: {pbtxt(value)}\n"
    config = parse_triton(text)
    assert config.name == value and config.backend == value
    assert sorted(f.name for f, _ in config.ListFields()) == (["backend", "name"] if value else [])


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_yaml_scalars_and_comments_round_trip_and_add_no_key(value: str) -> None:
    text = f"# {comment(value)}\nkey: {yaml_scalar(value)}\nafter: 1\n"
    assert yaml.safe_load(text) == {"key": value, "after": 1}


def test_plain_yaml_values_stay_plain() -> None:
    assert yaml_scalar("serving/triton/tiny-gpt2/1/model.onnx") == (
        "serving/triton/tiny-gpt2/1/model.onnx"
    )
    assert yaml_scalar("int8") == "int8"
    assert yaml_scalar("true") != "true" and yaml.safe_load(yaml_scalar("true")) == "true"


def md_blocks(text: str) -> list[tuple[str, str]]:
    """(block type, inline text) for every block of a markdown document."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    out = []
    for i, tok in enumerate(tokens):
        if tok.type == "inline":
            kind = tokens[i - 1].type
            text = "".join(
                c.content if c.type in ("text", "html_inline") else "\n"
                for c in tok.children or []
                if c.type in ("text", "softbreak", "hardbreak", "html_inline")
            )
            out.append((kind, text))
    return out


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_markdown_text_stays_one_paragraph_of_exactly_that_text(value: str) -> None:
    doc = f"# Title\n\n{markdown(value) or 'none'}\n\n## Next\n"
    blocks = md_blocks(doc)
    lines = [line.strip() for line in value.replace("\r", "\n").split("\n") if line.strip()]
    assert blocks[0] == ("heading_open", "Title") and blocks[-1] == ("heading_open", "Next")
    assert [b[0] for b in blocks[1:-1]] == ["paragraph_open"]
    assert blocks[1][1] == ("\n".join(lines) or "none")


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_markdown_cells_stay_in_their_cell(value: str) -> None:
    doc = f"| a | b |\n|---|---|\n| {markdown_cell(value)} | end |\n"
    tokens = MarkdownIt("commonmark").enable("table").parse(doc)
    cells = [t for t in tokens if t.type == "inline"]
    assert len(cells) == 4 and cells[-1].content == "end"
    text = "".join(c.content for c in cells[2].children or [] if c.type == "text")
    assert text == " ".join(value.split())


def hostile_context(value: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    info = model_info(
        inputs=[{"name": f"in {value}", "dtype": "int64", "axes": ["batch", "sequence"]}],
        outputs=[{"name": f"out {value}", "dtype": "float32", "axes": ["batch", "sequence"]}],
        dims={
            "batch": {"min": 1, "opt": 2, "max": 4},
            "sequence": {"min": 1, "opt": 4, "max": 8},
        },
    )
    values = {
        "model_path": f"models/{value}",
        "dtype": value,
        "port": 8000,
        "max_batch_size": 4,
        "max_queue_depth": 8,
        "max_context_length": 8,
        "kv_cache_budget": 0,
        "request_timeout_seconds": 30.0,
        "max_request_bytes": 4 << 20,
        "read_timeout_seconds": 30.0,
        "idle_timeout_seconds": 5.0,
        "max_connections": 512,
        "streaming": False,
        "dynamic_batching": True,
        "max_queue_delay_microseconds": 100,
        "preferred_batch_sizes": [],
        "instance_count": 1,
        "instance_kind": "KIND_CPU",
        "warmup": True,
        "scheduling": "continuous",
        "prefix_caching": True,
        "max_wait_ms": 1000.0,
    }
    from shipyard_runtime.settings import BatchingSettings, RuntimeSettings

    runtime = RuntimeSettings(
        task="generic",
        serving="labels",
        labels=[value, "plain"],  # from the checkpoint's config.id2label: anything
        input_bounds={value: (0, 2), "plain": (-3, 7)},  # input names from the spec
        ort_session="../../../ort_session.json",
        text=value,
        sampling_defaults={value: 1},
        batching=BatchingSettings(
            max_rows=4, enabled=True, delay_s=0.0, instances=1, max_queue=8, timeout_s=30.0
        ),
    )
    context = {
        **values,
        "release": "r",
        "model_name": "r",
        "version": value,
        "task": "generic",
        "ort": {
            "providers": ["CPUExecutionProvider"],
            "graph_optimization_level": "all",
            "intra_op_num_threads": 0,
            "inter_op_num_threads": 0,
            "execution_mode": "sequential",
        },
        "triton": triton_values(info, ServingValues(**values)),
        "runtime": runtime.model_dump(mode="json"),
        "implementation": f"{value}.Runtime",
        "model_uri": f"../../../models/{value}",
    }
    return info, values, context


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_every_serving_template_round_trips_hostile_values(tmp_path: Path, value: str) -> None:
    from shipyard_runtime.settings import RuntimeSettings

    info, values, context = hostile_context(value)
    render(tmp_path, templates("r", generating=False), context)
    serving = yaml.safe_load((tmp_path / "serving.yaml").read_text())
    assert serving["model_path"] == f"models/{value}" and serving["dtype"] == value
    assert set(serving) == {
        "model_path",
        "dtype",
        "port",
        "max_batch_size",
        "max_queue_depth",
        "max_context_length",
        "kv_cache_budget",
        "request_timeout_seconds",
        "streaming",
        "ort_session_config",
    }
    config = parse_triton((tmp_path / "serving/triton/r/config.pbtxt").read_text())
    assert [i.name for i in config.input] == [f"in {value}"]
    assert [o.name for o in config.output] == [f"out {value}"]
    assert not config.default_model_filename and config.name == "r"
    assert list(config.model_warmup[0].inputs) == [f"in {value}"]
    settings = json.loads((tmp_path / "serving/mlserver/r/model-settings.json").read_text())
    assert settings["parameters"]["version"] == value
    assert settings["parameters"]["extra"]["labels"] == [value, "plain"]
    assert settings["parameters"]["extra"]["input_bounds"] == {value: [0, 2], "plain": [-3, 7]}
    # and the runtime reads it back through the same typed model, hostile values intact
    back = RuntimeSettings.model_validate(settings["parameters"]["extra"])
    assert back.text == value and back.labels == [value, "plain"]
    assert settings["parameters"]["uri"] == f"../../../models/{value}"
    assert settings["implementation"] == f"{value}.Runtime"


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_the_model_card_keeps_its_structure_with_hostile_values(tmp_path: Path, value: str) -> None:
    typed, values, context = hostile_context(value)
    info = typed.model_dump() | {"parameters": 10, "weight_bytes": 40}
    info["inputs"][0]["axes"] = ["batch", value]
    context |= {
        "release": "r",
        "version": value,
        "info": info,
        "card": {
            "description": value,
            "license": value,
            "intended_use": value,
            "limitations": value,
        },
        "quant": {"method": value, "float_nodes": [{"node": value, "why": value}]},
        "content_digest": "0" * 64,
        "stages": {"parity": {"status": value, "summary": value}},
        "loadtest": {
            "summary": {"target": value, value or "k": value},
            "slo": [{"slo": value, "ok": True, "why": value}],
        },
    }
    render(tmp_path, {"MODEL_CARD.md": "MODEL_CARD.md.j2"}, context, trim=False)
    blocks = md_blocks((tmp_path / "MODEL_CARD.md").read_text())
    headings = [text for kind, text in blocks if kind == "heading_open"]
    assert headings == [
        f"r {' '.join(value.split())}".strip(),
        "Intended use",
        "Limitations",
        "Inputs",
        "Dynamic dims",
        "Checks",
        "Nodes kept in float",
        "Serving",
    ]
    flat = [line.strip() for line in value.replace("\r", "\n").split("\n") if line.strip()]
    paragraphs = [text for kind, text in blocks if kind == "paragraph_open"]
    assert paragraphs[0] == ("\n".join(flat) or "No description given.")
