"""The spec loader's refusals at their exact positions and limits (issue 16: mutation
testing showed line, column and size checks that no test pinned down)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import SpecError
from schemas.loader import MAX_SPEC_BYTES, load_release
from tests.conftest import REPO


def refuse(tmp_path: Path, text: str | bytes) -> SpecError:
    path = tmp_path / "spec.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        load_release(path, shown="releases/spec.yaml")
    assert caught.value.path == "releases/spec.yaml"  # every refusal names the file
    return caught.value


@pytest.mark.parametrize(
    ("text", "first"),
    [
        (
            "name: x\nparity:\n  shapes:\n    - {batch: 1, batch: 2}\n",
            "releases/spec.yaml:4: parity.shapes[0].batch: duplicate key; keep one",
        ),
        (
            "name: x\nexport:\n  opset: 18\n  opset: 17\n",
            "releases/spec.yaml:4: export.opset: duplicate key; keep one",
        ),
        (
            "name: x\nversion: 1\x01\n",
            "releases/spec.yaml:2: control character U+0001 at column 11; remove it "
            "(only tabs and newlines are allowed)",
        ),
        (
            "name: x\n  ab\x07c: 1\n",
            "releases/spec.yaml:2: control character U+0007 at column 5; remove it "
            "(only tabs and newlines are allowed)",
        ),
        ("- a\n- b\n", "releases/spec.yaml:1: a release spec is a mapping of sections"),
        (
            "name: x\nexport: [1, 2\n",
            "releases/spec.yaml:3: not valid YAML: did not find expected ',' or ']'",
        ),
    ],
)
def test_each_refusal_names_the_file_and_the_exact_line(
    tmp_path: Path, text: str, first: str
) -> None:
    assert refuse(tmp_path, text).problems[0] == first


def test_not_utf8_names_the_byte_and_its_line(tmp_path: Path) -> None:
    error = refuse(tmp_path, b"name: x\nversion: \xff\n")
    assert error.problems == [
        "releases/spec.yaml:2: not UTF-8 (byte 0xff at line 2); save the file as UTF-8"
    ]


def test_the_size_limit_holds_exactly_at_its_boundary(tmp_path: Path) -> None:
    """A file of exactly MAX_SPEC_BYTES is read (and then judged on its content); one byte
    more is refused before parsing."""
    head = "name: x\n"
    at = head + "#" * (MAX_SPEC_BYTES - len(head) - 1) + "\n"
    assert len(at.encode()) == MAX_SPEC_BYTES
    assert "is over" not in " ".join(refuse(tmp_path, at).problems)
    over = head + "#" * (MAX_SPEC_BYTES - len(head)) + "\n"
    assert (
        refuse(tmp_path, over)
        .problems[0]
        .startswith("releases/spec.yaml:1: the file is over 256 KiB")
    )


def test_a_missing_file_and_a_folder_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_release(tmp_path / "nope.yaml", shown="releases/nope.yaml")
    assert caught.value.path == "releases/nope.yaml"
    assert caught.value.problems == ["releases/nope.yaml: file not found"]
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(SpecError) as caught:
        load_release(tmp_path / "dir.yaml", shown="releases/dir.yaml")
    assert caught.value.path == "releases/dir.yaml"
    assert caught.value.problems[0].startswith("releases/dir.yaml: cannot read: ")


def _spec_with(tmp_path: Path, change: Any) -> tuple[Path, list[str]]:
    spec = yaml.safe_load((REPO / "releases" / "tiny-gpt2.yaml").read_text())
    change(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, path.read_text().splitlines()


@pytest.mark.parametrize(
    ("change", "marker", "want"),
    [
        (
            lambda s: s["quantization"]["calibration"].update(samples=-1),
            "  samples: -1",
            "quantization.calibration.samples: Input should be greater than or equal to 1 "
            "(found -1)",
        ),
        (
            lambda s: s["quantization"].update(bogus=1),
            "bogus: 1",
            "quantization.bogus: unknown key 'bogus'; check the spelling (see `shipyard schema`)",
        ),
        (
            lambda s: s["model"].pop("path"),
            "model:",
            "model.path: required field is missing",
        ),
    ],
)
def test_union_members_never_appear_in_the_field_path(
    tmp_path: Path, change: Any, marker: str, want: str
) -> None:
    """pydantic names the chosen union member (`int8-dynamic`, `hf`) in its locations; the
    user's field path and line must not carry it."""
    path, lines = _spec_with(tmp_path, change)
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == marker.strip())
    with pytest.raises(SpecError) as caught:
        load_release(path, shown="releases/spec.yaml")
    assert caught.value.problems == [f"releases/spec.yaml:{line}: {want}"]


def test_an_error_the_describer_cannot_place_still_gets_a_message() -> None:
    from schemas.loader import _safe_describe

    root = yaml.compose("name: x\n")
    odd = {"loc": ("export", 3), "msg": "something odd"}  # no "type": the describer fails
    assert _safe_describe("r.yaml", root, odd) == "r.yaml:1: export.3: something odd"
    assert _safe_describe("r.yaml", root, {}) == "r.yaml:1: (top level): invalid"


@pytest.mark.parametrize(
    ("section", "want"),
    [
        ("engine", "engine: required section is missing; write `engine: {}` for the defaults"),
        (
            "loadtest",
            "loadtest: required section is missing; write `loadtest: {}` for the defaults",
        ),
        ("parity", "parity: required section is missing; write `parity: {}` for the defaults"),
        (
            "quantization",
            "quantization: required section is missing; write `quantization: {method: none}` "
            "for the defaults",
        ),
        ("export", "export: required field is missing"),  # no defaults: nothing to suggest
        ("capacity", "capacity: required field is missing"),
    ],
)
def test_a_missing_section_with_defaults_names_what_to_write(
    tmp_path: Path, section: str, want: str
) -> None:
    """The hint comes from the models (every required section whose model takes `{}`, or a
    union with a `none` member), never a hand-kept list: one had lacked engine and loadtest."""
    path, _ = _spec_with(tmp_path, lambda s: s.pop(section))
    with pytest.raises(SpecError) as caught:
        load_release(path, shown="releases/spec.yaml")
    assert [p.split(": ", 1)[1] for p in caught.value.problems] == [want]


def test_the_union_literals_are_the_models_own() -> None:
    from typing import get_args

    from schemas.loader import MODEL_KINDS, QUANT_METHODS
    from schemas.spec.quantization import Quantization

    members = get_args(get_args(Quantization)[0])
    assert len(QUANT_METHODS) == len(members) and "auto" in QUANT_METHODS
    assert set(MODEL_KINDS) == {"hf", "python"}
