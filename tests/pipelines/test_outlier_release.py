"""A new user's first real-like model: `shipyard init` + `dvc repro` on a trained Llama with
planted activation outliers ships an INT8 bundle within the default budget, with the recipe
table in the report and the model card.

The spec is init's, unedited: method auto, the task's default budget, min_speedup 1 (the
model is big enough, ~20M parameters, that INT8 runs faster than FP32 on these CPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import StageReport
from schemas.facts import BundleFacts
from schemas.quantsearch import RecipeSearchDetails
from stages.bundling.oms import read_facts
from tests.fixtures import outliers
from tests.pipelines.test_end_to_end import commit_all, copy_worktree, ran, sh

pytestmark = pytest.mark.slow
NAME = "llama-outliers"
DOCS = "data/calibration/docstrings.jsonl"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = copy_worktree(tmp_path_factory.mktemp("outlier-release") / "repo")
    lines = (root / DOCS).read_text().splitlines()
    (root / "data" / "support.jsonl").write_text("\n".join(lines[:240]) + "\n")
    texts = [json.loads(line)["text"] for line in lines[240:]]  # trained on other texts
    outliers.build_llama_with_outliers(
        root / "models" / NAME,
        texts,
        steps=200,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
    )
    return commit_all(root)


def test_init_and_repro_ship_int8_on_a_model_with_outliers(repo: Path) -> None:
    sh(["shipyard", "init", f"models/{NAME}", "--data", "data/support.jsonl"], repo)
    sh(["shipyard", "compile"], repo)
    done = sh(["dvc", "repro", f"bundle@{NAME}"], repo, timeout=1800)  # ~6 min here
    assert "quantize" in ran(done.stdout)
    build = repo / "build" / NAME
    report = StageReport.model_validate_json((build / "quantize" / "report.json").read_text())
    assert report.status.value == "passed", report.reasons
    recipes = RecipeSearchDetails.model_validate(report.details).recipes
    rows = {r.recipe: r for r in recipes}
    chosen = [r for r in recipes if r.chosen]
    assert len(chosen) == 1 and chosen[0].method != "none"
    pick = chosen[0]
    assert pick.recipe != "int8-dynamic"  # per-tensor cannot hold the outliers
    assert pick.holdout["greedy_agreement"] >= 0.92  # the default 0.9 with its margin
    assert pick.holdout["perplexity_increase"] <= 0.016
    assert (pick.speedup or 0) >= 1.0 and pick.size_ratio < 0.6
    if "int8-dynamic" in rows:  # tried only if no earlier recipe shipped
        assert not rows["int8-dynamic"].chosen
    sh(["shipyard", "verify", f"build/{NAME}/bundle"], repo)
    card = (build / "bundle" / "MODEL_CARD.md").read_text()
    table = card[card.index("## Quantization recipes tried") :]
    assert f"| {pick.recipe} |" in table and "| yes |" in table
    facts = read_facts(build / "bundle", BundleFacts)
    assert facts.quantization.dtype == "int8"
    assert [r.recipe for r in facts.quantization.recipes or [] if r.chosen] == [pick.recipe]
