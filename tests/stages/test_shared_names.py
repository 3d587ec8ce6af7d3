"""Names spelled once (issue 44 item 3): the KV-cache prefixes on the build side, which the
shipped runtime repeats (it imports nothing of the repository) and must agree with; the
stored weight type of each quantization method, on its model."""

from __future__ import annotations

from typing import get_args

import pytest

from schemas.spec import quantization as q


def test_the_runtime_and_the_build_name_the_kv_cache_alike() -> None:
    from shipyard_runtime.generation import runner
    from stages.onnx import kvcache
    from stages.quant import accuracy, recipes

    assert (runner.PAST, runner.PRESENT) == (kvcache.PAST, kvcache.PRESENT)
    assert accuracy.PAST is kvcache.PAST and recipes.PRESENT is kvcache.PRESENT


def test_every_explicit_method_says_what_its_weights_are_stored_as() -> None:
    union = get_args(get_args(q.Quantization)[0])
    explicit = [c for c in union if c is not q.AutoQuantization]
    methods = {get_args(c.model_fields["method"].annotation)[0]: c.DTYPE for c in explicit}
    assert methods == {
        "none": "float32",
        "int8-dynamic": "int8",
        "int8-static": "int8",
        "int4-weight-only": "int4",
        "int8-weight-only": "int8",
    }
    assert all(q.dtype_of(m) == d for m, d in methods.items())
    with pytest.raises(KeyError, match="auto"):
        q.dtype_of("auto")  # a search ends on an explicit method, never on auto itself


def test_the_engines_series_table_is_what_it_registers_and_what_monitoring_reads() -> None:
    import prometheus_client as prom

    from shipyard_runtime import metrics
    from stages.bundling import monitoring

    metrics.Metrics("series-table-test")
    registered = {f.name: f.type for f in prom.REGISTRY.collect() if f.name.startswith("shipyard_")}
    table = {s.name: s.kind.lower() for s in metrics.SERIES.values()}
    assert registered == table  # one table: nothing registered outside it, nothing unused
    assert {k: s.sample for k, s in metrics.SERIES.items()} == monitoring.N
    assert metrics.SERIES["requests_finished"].sample == "shipyard_requests_finished_total"
    assert metrics.SERIES["requests_finished"].labels == ("reason",)


def test_the_artifact_list_is_every_artifact_class() -> None:
    import inspect

    from schemas import artifacts

    declared = [
        c
        for _, c in inspect.getmembers(artifacts, inspect.isclass)
        if issubclass(c, artifacts.Artifact)
        and c is not artifacts.Artifact
        and c.__module__ == artifacts.__name__
    ]
    assert set(artifacts.ARTIFACTS) == set(declared) and len(artifacts.ARTIFACTS) == len(declared)
    assert all(a.STAGE and a.FILE for a in artifacts.ARTIFACTS)
