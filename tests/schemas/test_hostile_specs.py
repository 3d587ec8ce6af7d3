"""Careless and hostile specs: each gets one clear `file:line: field: fix` refusal at
`shipyard validate`, never a traceback, a hang or megabytes of output."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import SpecError
from schemas.loader import MAX_SPEC_BYTES, load_release
from tests.conftest import REPO

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))


def example(name: str = "tiny-gpt2") -> str:
    return (REPO / "releases" / f"{name}.yaml").read_text()


def repo(tmp_path: Path) -> Path:
    """A repository root with the example's model and data, and releases/."""
    (tmp_path / "releases").mkdir()
    shutil.copytree(REPO / "models" / "tiny-gpt2", tmp_path / "models" / "tiny-gpt2")
    shutil.copytree(REPO / "data", tmp_path / "data")
    return tmp_path


def refuse(path: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_release(path)
    return info.value.problems


def write(root: Path, text: str | bytes, name: str = "tiny-gpt2") -> Path:
    path = root / "releases" / f"{name}.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return repo(tmp_path)


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# --------------------------------------------------------------------------- the loader
@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("!!python/object:os.system {}", "python/object"),
        ("!custom 3", "'!custom'"),
        ("!!python/name:os.system ''", "python/name"),
    ],
)
def test_python_and_custom_tags_are_refused_with_their_line(root, tag, message) -> None:
    text = example().replace("\nparity:\n", f"\nextra: {tag}\nparity:\n", 1)
    [problem] = refuse(write(root, text))
    assert problem.startswith(f"{root}/releases/tiny-gpt2.yaml:{line_of(text, 'extra:')}: ")
    assert message in problem and "tags" in problem and "are not allowed" in problem


def test_non_utf8_is_reported_at_its_line(root: Path) -> None:
    text = example().encode()
    at = text.index(b"docstrings")
    bad = text[:at] + b"\xe9" + text[at + 1 :]
    [problem] = refuse(write(root, bad))
    line = text[:at].count(b"\n") + 1
    assert problem == (
        f"{root}/releases/tiny-gpt2.yaml:{line}: not UTF-8 (byte 0xe9 at line {line}); "
        "save the file as UTF-8"
    )


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\x7f", "\ufeff"])
def test_a_control_character_is_reported_at_its_line_not_line_1(root, char) -> None:
    text = example().replace("  opset: 18", f"  opset: 1{char}8")
    [problem] = refuse(write(root, text))
    assert problem.startswith(f"{root}/releases/tiny-gpt2.yaml:{line_of(text, 'opset')}: ")
    assert f"U+{ord(char):04X}" in problem


def test_a_billion_laughs_spec_ends_fast_with_a_short_message(root: Path) -> None:
    lol = "lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, 10):
        refs = ", ".join([f"*l{i - 1}"] * 9)
        lol += f"lol{i}: &l{i} [{refs}]\n"
    path = write(root, lol + example())
    start = time.monotonic()
    done = subprocess.run(
        [SHIPYARD, "validate", str(path)], capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 10  # process start included; the load itself below
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "expands to over 20000 nodes through anchors and aliases" in done.stderr
    assert len(done.stderr) < 500
    start = time.monotonic()
    refuse(path)
    assert time.monotonic() - start < 1.0


def test_aliases_within_the_bound_still_work(root: Path) -> None:
    text = example().replace("  tolerance: {atol", "  tolerance: &tol {atol")
    text = text.replace('"present.*": {atol: 1.0e-5, rtol: 1.0e-4}', '"present.*": *tol')
    assert "*tol" in text
    spec = load_release(write(root, text))
    assert spec.parity.outputs["present.*"] == spec.parity.tolerance


def test_a_recursive_alias_is_refused(root: Path) -> None:
    [problem] = refuse(write(root, "a: &a [*a]\n" + example()))
    assert "alias" in problem


def test_a_file_over_the_cap_is_refused_without_parsing(root: Path) -> None:
    text = example() + "#" + "x" * MAX_SPEC_BYTES + "\n"
    start = time.monotonic()
    [problem] = refuse(write(root, text))
    assert time.monotonic() - start < 1.0
    assert problem == (
        f"{root}/releases/tiny-gpt2.yaml:1: the file is over 256 KiB; a release spec is a few "
        "kilobytes (keep data in data files the spec points at)"
    )


def test_a_spec_just_under_the_cap_validates_quickly(root: Path) -> None:
    text = example()
    text += "#" + "x" * (MAX_SPEC_BYTES - len(text.encode()) - 2) + "\n"
    assert len(text.encode()) == MAX_SPEC_BYTES
    start = time.monotonic()
    assert load_release(write(root, text)).name == "tiny-gpt2"
    assert time.monotonic() - start < 1.0


def test_an_error_never_echoes_more_than_an_excerpt(root: Path) -> None:
    huge = "x" * 200_000
    text = example().replace("  opset: 18", f"  opset: {huge}")
    [problem] = refuse(write(root, text))
    assert len(problem) < 600 and "export.opset" in problem


# --------------------------------------------------------------------------- field rules
FIELD_CASES = [
    ("version: 0.1.0", "version: ''", "version", "Semantic Versioning"),
    ("version: 0.1.0", "version: ../../x", "version", "Semantic Versioning"),
    ("version: 0.1.0", 'version: "1.0"', "version", "Semantic Versioning"),
    ("version: 0.1.0", "version: 1.0", "version", 'quote it, e.g. "1.0"'),
    ("version: 0.1.0", 'version: "0.1.0\\nx: y"', "version", "Semantic Versioning"),
    ("version: 0.1.0", 'version: "1𝟎.0.0"', "version", "Semantic Versioning"),
    ('torch: "==2.13.0"', 'torch: "latest"', "pins.packages.torch", "PEP 440"),
    ('torch: "==2.13.0"', '"to rch": "==2.13.0"', "pins.packages", "should match pattern"),
    ("  device_memory: 1GiB", "  device_memory: 0", "capacity.device_memory", "more than 0 bytes"),
    ("port: 8000", "port: 65534", "bundle.serving.port", "less than or equal to 65533"),
    ("  path: models/tiny-gpt2", "  path: /", "model.path", "is absolute"),
    ("  path: models/tiny-gpt2", "  path: ../..", "model.path", "leaves the repo"),
    ("  path: models/tiny-gpt2", "  path: .", "model.path", "the repo root itself"),
]


@pytest.mark.parametrize(("old", "new", "field", "message"), FIELD_CASES)
def test_a_bad_field_is_refused_at_validate_naming_field_and_fix(
    root: Path, old: str, new: str, field: str, message: str
) -> None:
    text = example()
    assert old in text, old
    text = text.replace(old, new, 1)
    problems = refuse(write(root, text))
    assert any(f": {field}" in p and message in p for p in problems), problems


def test_pins_python_must_be_a_specifier(root: Path) -> None:
    text = example().replace('  python: ">=3.11,<3.12"', "  python: three-eleven", 1)
    problems = refuse(write(root, text))
    assert any("pins.python" in p and "PEP 440" in p for p in problems), problems


def test_checkpoint_names_cannot_leave_the_model_folder(root: Path) -> None:
    spec = yaml.safe_load(example())
    spec["pins"]["checkpoints"] = {"../../etc/passwd": "0" * 64}
    problems = refuse(write(root, yaml.safe_dump(spec)))
    assert any("pins.checkpoints" in p and "leaves the repo" in p for p in problems), problems


def test_unknown_and_duplicate_providers_are_refused(root: Path) -> None:
    spec = yaml.safe_load(example())
    spec["bundle"]["ort_session"] = {"providers": ["CUDAExecutionProviderr"]}
    [problem] = refuse(write(root, yaml.safe_dump(spec)))
    assert "bundle.ort_session.providers[0]" in problem and "CPUExecutionProvider" in problem
    spec["bundle"]["ort_session"] = {"providers": ["CPUExecutionProvider"] * 2}
    [problem] = refuse(write(root, yaml.safe_dump(spec)))
    assert "lists one twice" in problem


def test_duplicate_engine_profile_names_are_refused(root: Path) -> None:
    spec = yaml.safe_load(example())
    profile = spec["engine"]["profiles"][0]
    spec["engine"]["profiles"] = [profile, {**profile}]
    [problem] = refuse(write(root, yaml.safe_dump(spec)))
    assert f"names ['{profile['name']}'] more than once" in problem


def test_serving_rows_beyond_the_export_are_the_plans_to_refuse(root: Path) -> None:
    """A generation release's engine rows are not capped by the export's probe batch at
    validate (the plan sizes and checks them, issue 41 item 5); a one-pass model's are
    (tests/schemas/test_cross_section_boundaries.py)."""
    spec = yaml.safe_load(example())
    limit = spec["export"]["dims"]["batch"]["max"]
    spec["bundle"]["serving"]["max_batch_size"] = limit + 1
    loaded = load_release(write(root, yaml.safe_dump(spec)))
    assert loaded.bundle.serving.max_batch_size == limit + 1


def test_free_text_is_capped(root: Path) -> None:
    spec = yaml.safe_load(example())
    spec["bundle"]["model_card"] = {"description": "x" * 8192}
    assert load_release(write(root, yaml.safe_dump(spec))).bundle.model_card.description
    spec["bundle"]["model_card"] = {"description": "x" * 8193}
    [problem] = refuse(write(root, yaml.safe_dump(spec)))
    assert "bundle.model_card.description" in problem and "at most 8192" in problem


@pytest.mark.parametrize(
    "field",
    [
        ("model", "path"),
        ("quantization", "calibration", "path"),
        ("quantization", "calibration", "tokenizer"),
        ("evaluation", "dataset", "path"),
        ("engine", "timing_cache"),
    ],
)
def test_a_symlink_out_of_the_repository_is_refused_for_every_path_field(
    root: Path, tmp_path_factory: pytest.TempPathFactory, field: tuple[str, ...]
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    spec = yaml.safe_load(example())
    node = spec
    for key in field[:-1]:
        node = node[key]
    value = "escape/thing.jsonl" if field[-1] == "path" and len(field) > 2 else "escape/thing"
    node[field[-1]] = value
    problems = refuse(write(root, yaml.safe_dump(spec)))
    name = ".".join(field)
    assert any(
        f": {name}: {value!r} resolves to {outside.resolve()}/{value[7:]}, outside the repository"
        in p
        for p in problems
    ), problems


# --------------------------------------------------------------------------- properties
def _mutations() -> st.SearchStrategy[str]:
    base = example()
    lines = base.splitlines(keepends=True)
    junk = st.sampled_from(
        [
            "",
            "-",
            ":",
            "{",
            "}",
            "[",
            "]",
            "&a",
            "*a",
            "!!python/object:x",
            "\x00",
            "é",
            "0",
            "-1",
            "1e309",
            "null",
            "~",
            "'",
            '"',
            "\t",
            "  ",
            "?",
            "|",
            ">",
            "%",
            "#",
            "../..",
            "/",
            "x" * 300,
            "\ufeff",
            "\x85",
            "<<: *a",
        ]
    )

    @st.composite
    def mutate(draw: st.DrawFn) -> str:
        out = list(lines)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(out) - 1))
            kind = draw(st.integers(0, 3))
            if kind == 0:
                del out[i]
            elif kind == 1:
                out.insert(i, out[draw(st.integers(0, len(out) - 1))])
            else:
                line = out[i]
                at = draw(st.integers(0, len(line)))
                out[i] = line[:at] + draw(junk) + line[at + (kind == 3) :]
        return "".join(out)

    return mutate()


@settings(
    max_examples=150, deadline=2000, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(text=_mutations())
def test_mutated_specs_never_crash_and_never_take_two_seconds(tmp_path_factory, text) -> None:
    root = tmp_path_factory.getbasetemp() / "mutations"
    if not (root / "releases").is_dir():
        root.mkdir(parents=True)
        repo(root)
    path = write(root, text.encode("utf-8", errors="surrogatepass"))
    start = time.monotonic()
    try:
        load_release(path)
    except SpecError as exc:
        assert exc.problems and all(p.startswith(f"{path}:") for p in exc.problems)
        assert all(len(p) < 1200 for p in exc.problems)
    assert time.monotonic() - start < 2.0


def test_the_spec_rules_document_is_generated_from_the_schema() -> None:
    from schemas.rules import markdown

    text = markdown()
    assert (REPO / "docs" / "spec-rules.md").read_text() == text, (
        "docs/spec-rules.md is stale: run `shipyard schema --rules > docs/spec-rules.md`"
    )
    assert "| `bundle.serving.port` | integer | >= 1; <= 65533 |" in text
    assert "Engine profile names are unique" in text


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_infinite_or_nan_numbers_are_refused(root: Path, value: str) -> None:
    text = example().replace("  tolerance: {atol: 1.0e-4,", f"  tolerance: {{atol: {value},")
    [problem] = refuse(write(root, text))
    assert ": parity.tolerance.atol: " in problem and "finite number" in problem
