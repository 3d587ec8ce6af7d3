from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from schemas import ReleaseSpec, SpecError
from schemas.loader import load_release
from tests.conftest import REPO, gpt2_spec


def write(tmp_path: Path, text: str, name: str = "tiny-gpt2") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_release(path)
    return info.value.problems


def example_text() -> str:
    return (REPO / "releases" / "tiny-gpt2.yaml").read_text()


@pytest.mark.parametrize("path", sorted((REPO / "releases").glob("*.yaml")), ids=lambda p: p.name)
def test_example_release_validates(path: Path) -> None:
    assert load_release(path).name == path.stem


def test_misspelled_key_is_reported_with_line_and_field(tmp_path: Path) -> None:
    text = example_text().replace("  exporter: legacy", "  exproter: legacy")
    line = text.splitlines().index("  exproter: legacy") + 1
    [problem] = problems_of(write(tmp_path, text))
    assert problem.startswith(f"{tmp_path}/tiny-gpt2.yaml:{line}: export.exproter: unknown key")


def test_wrong_type_names_field_line_and_found_value(tmp_path: Path) -> None:
    text = example_text().replace("  opset: 18", "  opset: eighteen")
    line = text.splitlines().index("  opset: eighteen") + 1
    [problem] = problems_of(write(tmp_path, text))
    assert f":{line}: export.opset:" in problem and "'eighteen'" in problem


def test_every_error_in_the_file_is_reported_at_once(tmp_path: Path) -> None:
    text = (
        example_text()
        .replace("  opset: 18", "  opset: 99")
        .replace("    port: 8000", "    prot: 8000")
        .replace("version: 0.1.0\n", "")
    )
    problems = problems_of(write(tmp_path, text))
    fields = sorted(p.split(": ")[1] for p in problems)
    assert fields == ["bundle.serving.prot", "export.opset", "version"]


def test_missing_section_suggests_an_empty_mapping(tmp_path: Path) -> None:
    spec = gpt2_spec()
    del spec["parity"]
    [problem] = problems_of(write(tmp_path, yaml.safe_dump(spec)))
    assert "parity: required section is missing; write `parity: {}`" in problem


def test_name_must_equal_file_stem(tmp_path: Path) -> None:
    [problem] = problems_of(write(tmp_path, example_text(), name="other"))
    assert "name: 'tiny-gpt2' must equal the file name 'other'" in problem


def test_dim_range_must_be_ordered(tmp_path: Path) -> None:
    text = example_text().replace(
        "batch: {min: 1, opt: 2, max: 8}", "batch: {min: 4, opt: 2, max: 8}"
    )
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "batch: {min: 4" in ln)
    [problem] = problems_of(write(tmp_path, text))
    assert f":{line}: export.dims.batch: need min <= opt <= max" in problem


def test_cross_field_error_points_at_the_field_it_names(tmp_path: Path) -> None:
    text = example_text().replace("    past_sequence: {min: 0, opt: 16, max: 128}\n", "")
    line = text.splitlines().index("  dims:") + 1
    [problem] = problems_of(write(tmp_path, text))
    assert f":{line}: export.dims: task 'causal-lm' needs export.dims past_sequence" in problem


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    text = example_text().replace("  opset: 18", "  opset: 18\n  opset: 17")
    [problem] = problems_of(write(tmp_path, text))
    assert "export.opset: duplicate key" in problem


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    [problem] = problems_of(write(tmp_path, "name: [unclosed\nversion: 1\n"))
    assert problem.startswith(f"{tmp_path}/tiny-gpt2.yaml:") and "not valid YAML" in problem


def test_parity_shape_outside_export_range_is_refused(tmp_path: Path) -> None:
    spec = gpt2_spec(parity={"shapes": [{"batch": 99}]})
    [problem] = problems_of(write(tmp_path, yaml.safe_dump(spec)))
    assert "parity.shapes[0]" in problem and "outside the export.dims ranges" in problem


def test_every_schema_field_has_a_description() -> None:
    schema = ReleaseSpec.model_json_schema()
    missing = [
        f"{model}.{field}"
        for model, body in schema["$defs"].items()
        for field, prop in body.get("properties", {}).items()
        if not prop.get("description")
    ]
    missing += [f for f, p in schema["properties"].items() if not p.get("description")]
    assert missing == []


def test_specs_are_frozen() -> None:
    spec = load_release(REPO / "releases" / "tiny-gpt2.yaml")
    with pytest.raises(Exception, match="frozen"):
        spec.version = "9"  # type: ignore[misc]


def test_threshold_on_an_unknown_metric_names_it_and_the_known_ones(tmp_path: Path) -> None:
    text = example_text().replace("- {metric: top1_agreement,", "- {metric: top_1_agreement,")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "top_1_agreement" in ln)
    [problem] = problems_of(write(tmp_path, text))
    assert f":{line}: evaluation.thresholds[0]: " in problem
    assert "unknown metric 'top_1_agreement' for task 'causal-lm'; known: perplexity," in problem
