"""One accuracy contract (issue 40): an evaluation threshold that evaluate judges must not be
stricter than quantization.budget, nor judge damage the budget does not bound; `shipyard
validate` refuses such a spec, naming both fields with their lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.contract import budget_of, disagreements
from schemas.release import MetricThreshold
from schemas.spec.quantization import AccuracyBudget, Int8Dynamic, NoQuantization
from tests.conftest import REPO
from tests.pipelines.test_cli import shipyard

Q = {"calibration": {"path": "data/x.npz"}, "method": "int8-dynamic"}


def quant(**budget: float) -> Int8Dynamic:
    return Int8Dynamic.model_validate({**Q, "budget": budget or None})


def t(metric: str, **kw: Any) -> MetricThreshold:
    kw.setdefault("greater_is_better", metric != "perplexity")
    return MetricThreshold(metric=metric, **kw)


@pytest.mark.parametrize(
    "budget,threshold,problem",
    [
        # the bound itself: agrees; a hair stricter: refused
        ({"top1_agreement_min": 0.97}, t("top1_agreement", threshold=0.97), None),
        ({"top1_agreement_min": 0.97}, t("top1_agreement", threshold=0.9701), " is 0."),
        ({"top1_agreement_min": 0.97}, t("top1_agreement", threshold=0.5), None),
        # a bound the budget does not give (the init default has none for top-1)
        ({"greedy_agreement_min": 0.9}, t("top1_agreement", threshold=0.97), "not set"),
        # a change against the reference: 1 + change is the least value accepted
        (
            {"top1_agreement_min": 0.98},
            t("top1_agreement", min_absolute_change=-0.02, baseline="reference"),
            None,
        ),
        (
            {"top1_agreement_min": 0.98},
            t("top1_agreement", min_absolute_change=-0.019, baseline="reference"),
            " is 0.",
        ),
        ({"logit_cosine_min": 0.99}, t("cosine_to_reference", threshold=0.995), " is 0."),
        ({"snr_db_min": 20}, t("snr_db", threshold=20), None),
        (
            {"snr_db_min": 20},
            t("snr_db", min_absolute_change=-10, baseline="reference"),
            "cannot state",
        ),
        # perplexity against the reference: a relative change is the budget's increase
        (
            {"perplexity_increase_max": 0.02},
            t("perplexity", min_relative_change=-0.02, baseline="reference"),
            None,
        ),
        (
            {"perplexity_increase_max": 0.02},
            t("perplexity", min_relative_change=-0.019, baseline="reference"),
            " is 0.",
        ),
        (
            {"greedy_agreement_min": 0.9},
            t("perplexity", min_relative_change=-0.05, baseline="reference"),
            "not set",
        ),
        (
            {"perplexity_increase_max": 0.02},
            t("perplexity", min_absolute_change=-0.5, baseline="reference"),
            "cannot state",
        ),
        # free-running generation: no bound measures it
        ({"greedy_agreement_min": 0.9}, t("greedy_token_match", threshold=0.5), "free-running"),
        # not evaluate's to judge: production changes (the gate) and absolute perplexity
        ({"greedy_agreement_min": 0.9}, t("greedy_token_match", min_absolute_change=-0.02), None),
        ({"greedy_agreement_min": 0.9}, t("top1_agreement", min_absolute_change=0.0), None),
        ({"greedy_agreement_min": 0.9}, t("perplexity", threshold=30.0), None),
    ],
)
def test_a_threshold_evaluate_judges_agrees_with_the_budget(
    budget: dict[str, float], threshold: MetricThreshold, problem: str | None
) -> None:
    found = disagreements(quant(**budget), "causal-lm", [threshold])
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith("evaluation.thresholds[0]: ")
        assert problem in found[0], found


def test_the_contract_is_the_budget_or_the_tasks_default() -> None:
    assert budget_of(quant(snr_db_min=30), "causal-lm") == AccuracyBudget(snr_db_min=30)
    default = AccuracyBudget(greedy_agreement_min=0.9, perplexity_increase_max=0.02)
    assert budget_of(quant(), "causal-lm") == default
    # the task default disagrees with a top-1 threshold too (what init used to write)
    assert disagreements(quant(), "causal-lm", [t("top1_agreement", threshold=0.97)])
    # nothing quantized: no budget to disagree with
    none = NoQuantization(method="none")
    assert disagreements(none, "causal-lm", [t("top1_agreement", threshold=0.97)]) == []


def test_validate_refuses_stages_that_disagree_naming_both_lines(tmp_path: Path) -> None:
    """Through the CLI: exit 2, `file:line: field:` of the threshold, the budget's own line,
    and the fix; no traceback. Exactly at the budget's bound it validates."""
    text = (REPO / "releases/tiny-gpt2.yaml").read_text()
    spec = yaml.safe_load(text)
    lines = text.splitlines()
    budget_line = lines.index("  budget:") + 1
    threshold_line = next(i for i, x in enumerate(lines) if "metric: top1_agreement" in x) + 1
    at = text.replace("threshold: 0.97,", "threshold: 0.98,")  # the budget's 0.98
    past = text.replace("threshold: 0.97,", "threshold: 0.981,")
    assert spec["quantization"]["budget"]["top1_agreement_min"] == 0.98 and at != text != past
    for name, body, code in (("at", at, 0), ("past", past, 2)):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "tiny-gpt2.yaml"
        path.write_text(body)
        done = shipyard("validate", str(path))
        assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        f"tiny-gpt2.yaml:{threshold_line}: evaluation.thresholds[0]: requires top1_agreement "
        f">= 0.981 but quantization.budget.top1_agreement_min (line {budget_line + 1}) is 0.98"
    ) in done.stderr
    assert "fix: set quantization.budget.top1_agreement_min to 0.981" in done.stderr
