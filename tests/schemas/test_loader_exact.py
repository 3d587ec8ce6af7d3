"""The spec loader's messages, exactly: lines when the document does not start on line 1,
columns on later lines, the alias-expansion cap at its exact boundary, excerpts at their
exact lengths, and the field paths of nested, unioned and user-named keys (issue 16: the
mutation run of schemas/loader.py left these untested)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from schemas import SpecError
from schemas import loader as ld
from schemas.loader import EXCERPT, MAX_EXPANDED_NODES, load_release
from schemas.spec.base import RepoPath
from tests.conftest import generic_spec, gpt2_spec

SHOWN = "releases/spec.yaml"


def problems(tmp_path: Path, text: str, name: str = "spec") -> list[str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        load_release(path, shown=SHOWN)
    assert caught.value.path == SHOWN  # every refusal names the file as shown
    return caught.value.problems


def dump(spec: dict[str, Any], head: str = "") -> str:
    return head + yaml.safe_dump(spec, sort_keys=False)


def line_of(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


# --------------------------------------------------------------------------- lines
def test_a_name_that_differs_from_the_file_points_at_the_name_line(tmp_path: Path) -> None:
    spec = gpt2_spec()
    spec["name"] = spec.pop("name")  # last, far from line 1
    text = dump(spec, "# a release\n\n")
    assert problems(tmp_path, text) == [
        f"{SHOWN}:{line_of(text, 'name:')}: name: 'tiny-gpt2' must equal the file name 'spec'; "
        "rename the file or the release"
    ]


def test_a_missing_section_points_at_the_first_line_of_the_document(tmp_path: Path) -> None:
    spec = gpt2_spec()
    del spec["export"]
    assert problems(tmp_path, dump(spec, "# a release\n\n"), "tiny-gpt2") == [
        f"{SHOWN}:3: export: required field is missing"
    ]


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("\nname: x\x01\n", 2, 8),  # a blank first line still counts
        ("a: 1\nbb: 2\nc: \x01\n", 3, 4),  # the column counts from the last newline
        ("\x01", 1, 1),
    ],
)
def test_a_control_character_is_placed_exactly(
    tmp_path: Path, text: str, line: int, column: int
) -> None:
    assert problems(tmp_path, text) == [
        f"{SHOWN}:{line}: control character U+0001 at column {column}; remove it (only tabs "
        "and newlines are allowed)"
    ]


def test_a_recursive_alias_names_its_line(tmp_path: Path) -> None:
    assert problems(tmp_path, "name: x\nversion: 1\na: &a [1, *a]\n") == [
        f"{SHOWN}:3: an alias refers to a node containing it"
    ]


def test_a_tag_is_refused_with_the_whole_reason(tmp_path: Path) -> None:
    assert problems(tmp_path, "name: x\nrun: !x 1\n") == [
        f"{SHOWN}:2: not valid YAML: could not determine a constructor for the tag '!x'; "
        "tags (`!!python/...`, custom `!tags`) are not allowed in a release spec"
    ]


def test_a_yaml_error_without_a_problem_mark_uses_its_context_or_line_1() -> None:
    mark = yaml.Mark("spec", 0, 6, 0, None, None)  # line index 6: line 7
    in_context = yaml.MarkedYAMLError(context="while parsing", context_mark=mark)
    assert ld._yaml_problem("s", in_context) == "s:7: not valid YAML: while parsing"
    bare = yaml.YAMLError("first line\nsecond line")
    assert ld._yaml_problem("s", bare) == "s:1: not valid YAML: first line"


# --------------------------------------------------------------------------- the alias cap
def test_the_expansion_cap_holds_at_exactly_its_limit(tmp_path: Path) -> None:
    """root {a: &x [n], b: *x, c: [m]} expands to 1 + (2 + n) * 2 + (2 + m) nodes."""

    def text(m: int) -> str:
        n = 9000
        ones = ", ".join(["1"] * n)
        return f"a: &x [{ones}]\nb: *x\nc: [{', '.join(['1'] * m)}]\n"

    at = 20_000 - 7 - 2 * 9000
    assert 7 + 2 * 9000 + at == MAX_EXPANDED_NODES
    assert not any("expands to over" in p for p in problems(tmp_path, text(at)))
    assert problems(tmp_path, text(at + 1)) == [
        f"{SHOWN}:1: the document expands to over {MAX_EXPANDED_NODES} nodes through anchors "
        "and aliases; write the values out (a release spec needs no such reuse)"
    ]


def test_reaching_the_cap_early_still_counts_what_follows(tmp_path: Path) -> None:
    # after `a` the root holds exactly the cap; `b` takes it over
    n = MAX_EXPANDED_NODES - 3
    text = f"a: [{', '.join(['1'] * n)}]\nb: 1\n"
    assert any("expands to over" in p for p in problems(tmp_path, text))


# --------------------------------------------------------------------------- excerpts
def test_excerpts_keep_exactly_their_length() -> None:
    assert ld._excerpt("x" * EXCERPT) == "x" * EXCERPT
    assert ld._excerpt("x" * (EXCERPT + 1)) == "x" * (EXCERPT - 1) + "…"
    assert ld._excerpt_long("y" * 400) == "y" * 400
    assert ld._excerpt_long("y" * 401) == "y" * 399 + "…"


# --------------------------------------------------------------------------- field paths
def test_field_paths_index_lists_and_join_names() -> None:
    assert ld._field(("export", "inputs", 0, "shape", 2)) == "export.inputs[0].shape[2]"
    assert ld._field(("Xa", "b")) == "Xa.b"  # only the leading dot goes
    assert ld._field(()) == ""


def test_an_unknown_top_level_key_keeps_its_exact_spelling(tmp_path: Path) -> None:
    spec = gpt2_spec()
    spec["Xtra"] = 1
    (problem,) = problems(tmp_path, dump(spec), "tiny-gpt2")
    assert problem.endswith(
        ": Xtra: unknown key 'Xtra'; check the spelling (see `shipyard schema`)"
    )


def test_an_unknown_key_deep_down_is_named_itself(tmp_path: Path) -> None:
    spec = gpt2_spec()
    spec["export"]["dims"]["batch"]["maxx"] = 3
    (problem,) = problems(tmp_path, dump(spec), "tiny-gpt2")
    assert problem.endswith(
        ": export.dims.batch.maxx: unknown key 'maxx'; check the spelling (see `shipyard schema`)"
    )


def test_a_number_where_text_belongs_says_how_to_quote_it(tmp_path: Path) -> None:
    spec = gpt2_spec()
    spec["export"]["inputs"] = [{"name": 5, "shape": ["batch"]}]
    (problem,) = problems(tmp_path, dump(spec), "tiny-gpt2")
    assert problem.endswith(
        ": export.inputs[0].name: Input should be a valid string (found the number 5); quote "
        'it, e.g. "5"'
    )


def test_a_user_named_dim_is_a_field_even_when_it_looks_like_a_union_member(
    tmp_path: Path,
) -> None:
    spec = generic_spec("gen", "small")
    spec["export"]["dims"]["none"] = {"min": 3, "opt": 2, "max": 4}
    (problem,) = problems(tmp_path, dump(spec), "gen")
    assert ": export.dims.none: need min <= opt <= max, found min=3, opt=2, max=4" in problem


def test_a_python_model_error_has_no_union_member_in_its_path(tmp_path: Path) -> None:
    spec = generic_spec("gen", "small")
    spec["model"]["factoryy"] = "x"
    (problem,) = problems(tmp_path, dump(spec), "gen")
    assert re.search(r":\d+: model\.factoryy: unknown key 'factoryy'", problem), problem


def test_describe_handles_validator_wrappers_and_the_top_level() -> None:
    root = yaml.compose("a: 1\nexport:\n  opset: x\n")
    wrapped = {
        "loc": ("export", "function-after[_check(), int]", "opset"),
        "msg": "bad",
        "type": "int_parsing",
    }
    assert ld._describe("s", root, wrapped) == "s:3: export.opset: bad"
    top = {"loc": (), "msg": "Value error, nothing to place", "type": "value_error"}
    assert ld._describe("s", root, top) == "s:1: (top level): nothing to place"
    # an error the describer cannot place keeps a bounded location
    odd = {"loc": ("z" * 300,), "msg": "odd"}
    assert ld._safe_describe("s", root, odd) == f"s:1: {'z' * 200}: odd"


def test_repo_paths_inside_lists_carry_their_index() -> None:
    class Item(BaseModel):
        path: RepoPath

    class Holder(BaseModel):
        items: list[Item]

    holder = Holder(items=[Item(path="data/a"), Item(path="data/b")])
    assert ld._repo_paths(holder, ("top",)) == [
        (("top", "items", 0, "path"), "data/a"),
        (("top", "items", 1, "path"), "data/b"),
    ]


# --------------------------------------------------------------------------- duplicates
def test_complex_keys_and_every_duplicate_are_reported(tmp_path: Path) -> None:
    text = "name: x\nexport:\n  ? [a, b]\n  : 1\n  opset: 1\n  opset: 2\n"
    assert problems(tmp_path, text) == [
        f"{SHOWN}:3: export.(key): a key must be a plain name, not a sequence",
        f"{SHOWN}:6: export.opset: duplicate key; keep one",
        f"{SHOWN}:3: not valid YAML: found unhashable key",
    ]


def test_duplicates_in_every_list_item_are_reported_under_their_key(tmp_path: Path) -> None:
    text = "name: x\nshapeX:\n  - {a: 1, a: 2}\n  - {b: 1, b: 2}\n"
    assert problems(tmp_path, text)[:2] == [
        f"{SHOWN}:3: shapeX[0].a: duplicate key; keep one",
        f"{SHOWN}:4: shapeX[1].b: duplicate key; keep one",
    ]


# --------------------------------------------------------------------------- the repository
def test_the_repository_is_shipyard_root_else_above_releases_else_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHIPYARD_ROOT", raising=False)
    (tmp_path / "repo" / "releases").mkdir(parents=True)
    assert ld.repo_of(tmp_path / "repo" / "releases" / "a.yaml") == (tmp_path / "repo").resolve()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # not a folder of the spec's path: only the cwd
    assert ld.repo_of(tmp_path / "repo" / "other.yaml") == (tmp_path / "cwd").resolve()
    monkeypatch.setenv("SHIPYARD_ROOT", str(tmp_path / "repo" / ".." / "elsewhere"))
    assert (
        ld.repo_of(tmp_path / "repo" / "releases" / "a.yaml") == (tmp_path / "elsewhere").resolve()
    )
