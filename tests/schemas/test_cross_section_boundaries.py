"""Cross-section spec rules at their exact limits (issue 16: mutation testing of
schemas/release.py showed rules tested only far from their boundaries, or not at all)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import SpecError
from schemas.loader import load_release
from tests.conftest import generic_spec, gpt2_spec

Change = Callable[[dict[str, Any]], None]


def check(tmp_path: Path, spec: dict[str, Any]) -> list[str]:
    """The problems of a spec ([] when it validates)."""
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        load_release(path)
    except SpecError as exc:
        return exc.problems
    return []


def calibration_length(n: int) -> Change:
    return lambda s: s["quantization"]["calibration"].update(max_length=n)


def decode_tokens(n: int) -> Change:
    return lambda s: s["evaluation"]["decode"].update(prompt_tokens=8, tokens=n)


def serving(**fields: Any) -> Change:
    return lambda s: s["bundle"].setdefault("serving", {}).update(fields)


# gpt2_spec: batch max 3, sequence max 64, past_sequence max 24
CASES = [
    (
        calibration_length(64),
        calibration_length(65),
        # the loader moves the dotted path that opens a rule's message into the field
        "quantization.calibration.max_length: 65 exceeds export.dims.sequence.max 64; "
        "the graph is not promised to run there",
    ),
    (
        decode_tokens(17),  # 8 + 17 - 1 = 24
        decode_tokens(18),
        "evaluation.decode: prompt_tokens + tokens - 1 = 25 exceeds "
        "export.dims.past_sequence.max 24",
    ),
    (
        serving(max_batch_size=3),
        serving(max_batch_size=4),
        "bundle.serving.max_batch_size: 4 exceeds export.dims.batch.max (3); the exported "
        "graph is not promised to run beyond it: lower max_batch_size or raise the export's "
        "batch max",
    ),
    (
        serving(max_batch_size=2, preferred_batch_sizes=[2]),
        serving(max_batch_size=2, preferred_batch_sizes=[3]),
        "bundle.serving.preferred_batch_sizes: [3] exceed max_batch_size 2",  # section rule
    ),
    (
        serving(preferred_batch_sizes=[3]),  # no max_batch_size: the export's batch max
        serving(preferred_batch_sizes=[4]),
        "bundle.serving.preferred_batch_sizes: 4 is beyond the served max_batch_size 3; "
        "each preferred size must be <= it",
    ),
]


@pytest.mark.parametrize(("at", "past", "message"), CASES)
def test_a_rule_accepts_its_limit_and_refuses_one_past_it(
    tmp_path: Path, at: Change, past: Change, message: str
) -> None:
    ok, bad = gpt2_spec(), gpt2_spec()
    at(ok)
    past(bad)
    assert check(tmp_path, ok) == []
    problems = check(tmp_path, bad)
    assert len(problems) == 1 and problems[0].endswith(message), problems


def test_quantization_rules_do_not_apply_without_quantization(tmp_path: Path) -> None:
    """method none has no calibration or budget to check: the rule must stop, not crash."""
    spec = gpt2_spec()
    spec["quantization"] = {"method": "none"}
    assert check(tmp_path, spec) == []
    assert check(tmp_path, generic_spec("gen", "small")) == []


def test_a_perplexity_budget_belongs_to_language_models_only(tmp_path: Path) -> None:
    lm = gpt2_spec()
    lm["quantization"]["budget"] = {"perplexity_increase_max": 0.01}
    assert check(tmp_path, lm) == []
    other = generic_spec("gen", "small")
    other["quantization"] = {
        "method": "int8-dynamic",
        "budget": {"perplexity_increase_max": 0.01},
        "calibration": {"path": "data/generic.npz", "samples": 16, "holdout": 8},
    }
    problems = check(tmp_path, other)
    assert len(problems) == 1 and problems[0].endswith(
        "quantization.budget.perplexity_increase_max: only applies to task causal-lm; "
        "use snr_db_min or logit_cosine_min"
    ), problems
    other["quantization"]["budget"] = {"snr_db_min": 20.0}
    assert check(tmp_path, other) == []
