"""Cross-section spec rules at their exact limits (issue 16: mutation testing of
schemas/release.py showed rules tested only far from their boundaries, or not at all)."""

from __future__ import annotations

import re
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


def ramp(input_length: int, output_tokens: int, **dims: dict[str, int]) -> Change:
    def change(s: dict[str, Any]) -> None:
        s["loadtest"] = {
            **s["loadtest"],
            "ramp": {**s["loadtest"]["ramp"], "input_length": input_length},
        }
        s["loadtest"]["ramp"]["output_tokens"] = output_tokens
        s["export"]["dims"].update(dims)

    return change


def profile(**dims: tuple[int, int]) -> Change:
    """One engine profile `p` with these [min, max] ranges (opt = min)."""
    ranges = {k: {"min": lo, "opt": lo, "max": hi} for k, (lo, hi) in dims.items()}
    return lambda s: s.update(engine={"profiles": [{"name": "p", "dims": ranges}]})


def graphs(*sizes: int, served: int | None = None, **dims: tuple[int, int]) -> Change:
    """CUDA graphs for `sizes`, optionally a served max and one profile `p` over `dims`."""

    def change(s: dict[str, Any]) -> None:
        profile(**dims)(s) if dims else s.update(engine={})
        s["engine"]["cuda_graphs"] = {"batch_sizes": list(sizes)}
        if served is not None:
            serving(max_batch_size=served)(s)

    return change


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
        decode_tokens(18),  # 8 + 18 - 2 = 24: the past the last step reads
        decode_tokens(19),
        "evaluation.decode: prompt_tokens + tokens - 2 = 25 (the past its last step reads) "
        "exceeds export.dims.past_sequence.max 24; lower them or widen it",
    ),
    (
        serving(max_batch_size=2, preferred_batch_sizes=[2]),
        serving(max_batch_size=2, preferred_batch_sizes=[3]),
        "bundle.serving.preferred_batch_sizes: 3 is beyond the served max_batch_size 2; "
        "list sizes up to 2 only, or raise max_batch_size",
    ),
    (
        serving(preferred_batch_sizes=[3]),  # no max_batch_size: the export's batch max
        serving(preferred_batch_sizes=[4]),
        "bundle.serving.preferred_batch_sizes: 4 is beyond the served max_batch_size 3; "
        "list sizes up to 3 only, or raise max_batch_size",
    ),
    (
        ramp(8, 18),  # 8 + 18 - 2 = 24, the past_sequence max
        ramp(8, 19),
        "loadtest.ramp: input_length + output_tokens - 2 = 25 (the past a request's last "
        "decode step reads) exceeds export.dims.past_sequence.max = 24; lower them or widen it",
    ),
    (  # the engine prefills a long prompt in chunks: sequence max is no limit
        ramp(20, 6, sequence={"min": 1, "opt": 4, "max": 8}),
        ramp(20, 7, sequence={"min": 1, "opt": 4, "max": 8}),
        "loadtest.ramp: input_length + output_tokens - 2 = 25 (the past a request's last "
        "decode step reads) exceeds export.dims.past_sequence.max = 24; lower them or widen it",
    ),
    (
        profile(batch=(1, 3)),
        profile(batch=(1, 4)),
        "engine.profiles[0]: (p) dim 'batch' [1, 4] lies outside the export's [1, 3]",
    ),
    (  # the lower end too: the export's batch starts at 2 here (a KV-cache graph's sequence
        # must start at 1: it decodes one token a step)
        lambda s: (s["export"]["dims"]["batch"].update(min=2), graphs(2, batch=(2, 3))(s)),
        lambda s: (s["export"]["dims"]["batch"].update(min=2), graphs(2, batch=(1, 3))(s)),
        "engine.profiles[0]: (p) dim 'batch' [1, 3] lies outside the export's [2, 3]",
    ),
    (
        profile(past_sequence=(0, 24)),
        profile(past_sequence=(0, 24), frames=(1, 2)),
        "engine.profiles[0]: (p) dim 'frames' is not in export.dims "
        "(['batch', 'past_sequence', 'sequence'])",
    ),
    (
        lambda s: s.update(engine={"profiles": [{"name": "a"}, {"name": "b"}]}),
        lambda s: s.update(engine={"profiles": [{"name": "a"}, {"name": "b"}, {"name": "a"}]}),
        "engine.profiles: names ['a'] more than once; profile names must be unique (Triton "
        "and the engine report refer to profiles by name)",
    ),
    (
        graphs(1, 2, batch=(1, 2)),  # the profile's range, not the export's
        graphs(1, 3, batch=(1, 2)),
        "engine.cuda_graphs.batch_sizes: has 3, outside every profile's batch range",
    ),
    (
        graphs(3),  # a profile without `batch` takes the export's [1, 3]
        graphs(4),
        "engine.cuda_graphs.batch_sizes: has 4, outside every profile's batch range",
    ),
    (
        graphs(1, 2, served=2),
        graphs(1, 3, served=2),
        "engine.cuda_graphs.batch_sizes: [3] exceed bundle.serving.max_batch_size 2; a graph "
        "for a batch never served is wasted memory: drop them or raise max_batch_size",
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
    # exactly the message after `file:line: `: a field path repeated in front would show
    assert len(problems) == 1 and re.sub(r"^.*?\.yaml:\d+: ", "", problems[0]) == message, problems


def test_quantization_rules_do_not_apply_without_quantization(tmp_path: Path) -> None:
    """method none has no calibration or budget to check: the rule must stop, not crash."""
    spec = gpt2_spec()
    spec["quantization"] = {"method": "none"}
    assert check(tmp_path, spec) == []
    assert check(tmp_path, generic_spec("gen", "small")) == []


def test_a_perplexity_budget_belongs_to_language_models_only(tmp_path: Path) -> None:
    lm = gpt2_spec()
    # (with the top-1 bound that gpt2_spec's evaluation threshold needs: one contract)
    lm["quantization"]["budget"] = {"perplexity_increase_max": 0.01, "top1_agreement_min": 0.97}
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


def test_a_batch_inside_any_one_profile_is_enough_for_a_cuda_graph(tmp_path: Path) -> None:
    spec = gpt2_spec()
    one, rest = ({"min": 1, "opt": 1, "max": 1}, {"min": 2, "opt": 2, "max": 3})
    spec["engine"] = {
        "profiles": [
            {"name": "one", "dims": {"batch": one}},
            {"name": "rest", "dims": {"batch": rest}},
        ],
        "cuda_graphs": {"batch_sizes": [1, 2, 3]},
    }
    assert check(tmp_path, spec) == []
    spec["engine"]["profiles"][1]["dims"]["batch"].update(min=3, opt=3)  # 2 is in neither
    problems = check(tmp_path, spec)
    assert len(problems) == 1 and problems[0].endswith("has 2, outside every profile's batch range")


def test_disabled_cuda_graphs_are_not_checked(tmp_path: Path) -> None:
    spec = gpt2_spec()
    spec["engine"] = {"cuda_graphs": {"enabled": False, "batch_sizes": [9]}}
    spec["bundle"]["serving"] = {"max_batch_size": 2}
    assert check(tmp_path, spec) == []
    spec["engine"]["cuda_graphs"]["enabled"] = True
    problems = check(tmp_path, spec)
    assert len(problems) == 1 and "[9] exceed bundle.serving.max_batch_size 2" in problems[0]


def test_a_model_without_a_kv_cache_has_no_ramp_length_limit(tmp_path: Path) -> None:
    spec = generic_spec("gen", "small")
    spec["loadtest"] = {**spec["loadtest"], "ramp": {"input_length": 500, "output_tokens": 500}}
    assert check(tmp_path, spec) == []


def test_a_model_without_a_batch_dim_is_served_one_row_at_a_time(tmp_path: Path) -> None:
    """No `batch` axis: the server cannot batch requests, so it serves one row per run, and
    a batch limit above one is refused at validate, as the serve stage would (one rule:
    schemas.spec.bundle.batch_limits)."""
    spec = generic_spec("gen", "small")
    spec["export"]["dims"] = {"rows": {"min": 1, "opt": 2, "max": 4}}
    spec["export"]["inputs"][0]["shape"] = ["rows", 4, 8]
    spec["export"]["outputs"][0]["shape"] = ["rows"]
    spec["bundle"]["serving"] = {"preferred_batch_sizes": [1]}
    assert check(tmp_path, spec) == []
    spec["bundle"]["serving"] = {"preferred_batch_sizes": [64]}
    [problem] = check(tmp_path, spec)
    assert "preferred_batch_sizes: 64 is beyond the served max_batch_size 1" in problem
    spec["bundle"]["serving"] = {"max_batch_size": 2}
    [problem] = check(tmp_path, spec)
    assert "max_batch_size: 2 exceeds 1: the export declares no batch axis" in problem


def test_the_served_batch_rule_caps_a_one_pass_model_at_the_export_not_the_engine() -> None:
    """A one-pass model's served batch may not pass the export's batch max; the generation
    engine's rows may (issue 41 item 5: they are sized from its KV budget, and its graph's
    rows are independent), but not without a batch axis at all."""
    from schemas.spec.bundle import batch_limits

    assert batch_limits(3, [], 3) == ("", "")
    problem, fix = batch_limits(4, [], 3)
    assert problem == (
        "bundle.serving.max_batch_size: 4 exceeds export.dims.batch.max (3); the exported "
        "graph is not promised to run beyond it"
    )
    assert fix == "lower max_batch_size or raise the export's batch max"
    assert batch_limits(64, [16, 64], 3, engine=True) == ("", "")
    assert "beyond the served max_batch_size 64" in batch_limits(64, [65], 3, engine=True)[0]
    assert "the export declares no batch axis" in batch_limits(2, [], None, engine=True)[0]


def test_a_generation_spec_may_serve_more_rows_than_its_export_probes(tmp_path: Path) -> None:
    spec = gpt2_spec()
    serving(max_batch_size=16)(spec)
    assert check(tmp_path, spec) == []
    one_pass = generic_spec("gen", "small")  # batch max 4
    serving(max_batch_size=4)(one_pass)
    assert check(tmp_path, one_pass) == []
    serving(max_batch_size=5)(one_pass)
    [problem] = check(tmp_path, one_pass)
    assert "bundle.serving.max_batch_size: 5 exceeds export.dims.batch.max (4)" in problem
