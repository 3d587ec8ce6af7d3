"""The architecture matrix (issue 13): real model families, tiny and random, through every
stage that applies; the README's table is exactly what this run measured."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures import architectures as matrix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return matrix.run_matrix()


def test_every_architecture_passes_every_stage_that_applies(rows: list[dict[str, Any]]) -> None:
    from schemas.tasks import TASKS

    def fine(task: str, stage: str, status: str) -> bool:
        # kvcheck has nothing to check without a KV cache: skipped, never passed
        no_cache = stage == "kvcheck" and not TASKS[task].kv_cache
        return status == ("skipped" if no_cache else "passed")

    failed = {
        (row["architecture"], row["task"], stage): result["why"]
        for row in rows
        for stage, result in row["stages"].items()
        if not fine(row["task"], stage, result["status"])
    }
    assert failed == {}


def test_the_readme_table_is_what_this_run_measured(rows: list[dict[str, Any]]) -> None:
    assert matrix.readme_table() == matrix.table(rows), (
        "README.md's architecture table is stale: run `python scripts/architecture_matrix.py`"
    )


def test_the_matrix_covers_the_families_people_ship() -> None:
    names = {a.name for a in matrix.ARCHITECTURES}
    assert names >= {
        "GPT-2",
        "Llama",
        "Qwen2",
        "Mistral",
        "Phi-3",
        "Gemma",
        "Qwen3",
        "Gemma 2",
        "Gemma 3",
        "GPT-NeoX",
        "OPT",
        "BERT",
        "RoBERTa",
        "DistilBERT",
        "XLM-RoBERTa",
    }
