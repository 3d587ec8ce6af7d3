"""The monitoring a bundle ships: alert rules from the load test's baseline that promtool
accepts and whose unit tests pass (and fail when a rule is wrong), and a dashboard that
plots only series the runtime exports."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from schemas.loadresults import Headline
from stages.bundling import monitoring


def baseline(**numbers: float | None) -> Headline:
    """A load test's headline with these latency and memory numbers."""
    knee = {"knee_concurrency": 4, "knee_throughput_rps": 50.0, "knee_p95_latency_ms": 80.0}
    return Headline(
        target="local MLServer",
        **knee,
        knee_stable=True,
        slo_judged_at_concurrency=4,
        **numbers,
    )


BASELINE = baseline(p95_ttft_ms=21.105, p95_itl_ms=6.422, peak_rss_mb=177.2)
PROMTOOL = shutil.which("promtool")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus")
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def written(folder: Path, head: Headline, generates: bool = True) -> Path:
    for name, text in monitoring.files("tiny-gpt2", head, 64, generates).items():
        (folder / Path(name).name).write_text(text)
    return folder


@pytest.mark.parametrize("generates", [True, False])
def test_the_rules_pass_promtool_check_and_their_unit_tests(
    tmp_path: Path, generates: bool
) -> None:
    folder = written(tmp_path, BASELINE, generates)
    checked = promtool("check", "rules", "alerts.yml", cwd=folder)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = [
        r["alert"]
        for r in yaml.safe_load((folder / "alerts.yml").read_text())["groups"][0]["rules"]
    ]
    if generates:
        assert names == [
            "ShipyardTargetDown", "ShipyardMemoryHigh", "ShipyardTTFTHigh", "ShipyardITLHigh",
            "ShipyardErrorRateHigh", "ShipyardQueueDeep", "ShipyardEmptyResponses",
        ]  # fmt: skip
    else:
        assert names == [
            "ShipyardTargetDown", "ShipyardMemoryHigh", "ShipyardErrorRateHigh",
            "ShipyardQueueDeep",
        ]  # fmt: skip


def test_thresholds_are_the_baseline_times_the_stated_margins(tmp_path: Path) -> None:
    rules = {r["alert"]: r for r in monitoring.rules("m", BASELINE, 64, True)["groups"][0]["rules"]}
    assert rules["ShipyardTTFTHigh"]["expr"].endswith(f"> {21.105 * 2 / 1000:.6f}".rstrip("0"))
    assert rules["ShipyardITLHigh"]["expr"].endswith(f"> {round(6.422 * 2 / 1000, 6)}")
    assert rules["ShipyardMemoryHigh"]["expr"].endswith(f"> {int(177.2 * 1.5 * 2**20)}")
    assert rules["ShipyardQueueDeep"]["expr"].endswith("> 51")  # 0.8 x max_queue_depth 64
    assert "load-test p95 21.105 ms" in rules["ShipyardTTFTHigh"]["annotations"]["baseline"]
    # a baseline the load test did not measure makes no rule, never a rule at 0
    partial = monitoring.rules("m", baseline(p95_ttft_ms=None, peak_rss_mb=0), 64, True)
    assert {r["alert"] for r in partial["groups"][0]["rules"]} == {
        "ShipyardTargetDown", "ShipyardErrorRateHigh", "ShipyardQueueDeep",
        "ShipyardEmptyResponses",
    }  # fmt: skip


def test_a_baseline_finer_than_the_histogram_alerts_at_its_first_bucket(tmp_path: Path) -> None:
    """A small model's inter-token latency (0.2 ms here, tiny-gpt2's 0.36 ms in a build) is
    below the latency histogram's first bucket: histogram_quantile reads healthy traffic
    there as up to 0.95 x the bucket's edge, so 2 x the baseline would fire all the time. The
    limit is the first bucket, said so in the rule, and promtool's calm case stays quiet."""
    from shipyard_runtime.metrics import LATENCY

    fast = baseline(p95_ttft_ms=0.1, p95_itl_ms=0.2, peak_rss_mb=100.0)
    folder = written(tmp_path, fast)
    tested = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = {r["alert"]: r for r in monitoring.rules("m", fast, 64, True)["groups"][0]["rules"]}
    for name in ("ShipyardTTFTHigh", "ShipyardITLHigh"):
        assert rules[name]["expr"].endswith(f"> {LATENCY[0]}")
        assert "the histogram's first bucket" in rules[name]["annotations"]["baseline"]
    # at the bucket's edge exactly the baseline's own margin holds
    edge = baseline(p95_itl_ms=LATENCY[0] * 1000 / 2)
    (rule,) = monitoring.rules("m", edge, 64, True)["groups"][0]["rules"][1:2]
    assert rule["expr"].endswith(f"> {LATENCY[0]}") and "first bucket" not in str(rule)


def test_the_unit_tests_fail_when_a_rule_is_wrong(tmp_path: Path) -> None:
    folder = written(tmp_path, BASELINE)
    alerts = yaml.safe_load((folder / "alerts.yml").read_text())
    for rule in alerts["groups"][0]["rules"]:  # a threshold ten times too lax
        if rule["alert"] == "ShipyardTargetDown":  # no threshold: another release's name
            rule["expr"] = rule["expr"].replace('model_name="', 'model_name="other-')
            continue
        head, limit = rule["expr"].rsplit(">", 1)
        rule["expr"] = f"{head}> {float(limit) * 10 + 100}"
    (folder / "alerts.yml").write_text(yaml.safe_dump(alerts, sort_keys=False, width=1000))
    tested = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert tested.returncode != 0 and "FAILED" in tested.stdout + tested.stderr


PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "max_over_time", "absent", "by", "on", "group_left", "group_right", "or", "and", "unless",
    "without", "ignoring",
}  # fmt: skip


def series_names(expr: str) -> set[str]:
    """The metric names an expression reads: label matchers, grouping label lists and
    PromQL's own words taken out."""
    import re

    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    words = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare))
    return {w for w in words if w not in PROMQL_WORDS and not w[0].isdigit()}


def exported() -> set[str]:
    """Every sample name the runtime's registry serves (engine series and the process's)."""
    import prometheus_client as prom

    from shipyard_runtime import metrics

    metrics.Metrics("tiny-gpt2")
    metrics.announce("tiny-gpt2-embed")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    names = set()
    for family in prom.REGISTRY.collect():  # a labelled family has no samples until used
        names |= {family.name + end for end in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.mark.parametrize("generates", [True, False])
def test_the_dashboard_imports_and_every_query_parses_and_reads_exported_series(
    tmp_path: Path, generates: bool
) -> None:
    """Issue 43: the dashboard used ${DS_PROMETHEUS} with no __inputs or variable, so no
    panel resolved on import, and one panel was `A or B` (B never shows where A has a
    value). Now: __inputs names the data source, a `datasource` variable defaults to it,
    every panel and query reads it; every query is valid PromQL (promtool checks each as a
    recording rule) and reads only series the runtime exports."""
    board = json.loads(json.dumps(monitoring.dashboard("tiny-gpt2", generates)))
    (source,) = board["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["pluginId"] == "prometheus"
    (variable,) = board["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert variable["current"]["value"] == "${DS_PROMETHEUS}"
    names = exported()
    queries = []
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert " or " not in target["expr"], target["expr"]
            used = series_names(target["expr"])
            assert used and used <= names, (panel["title"], used - names)
            queries.append(target["expr"])
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:q{i}", "expr": q} for i, q in enumerate(queries)],
            }
        ]
    }
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(rules, width=1000))
    checked = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and the rules' series are exported too (a renamed metric breaks an alert silently)
    for rule in monitoring.rules("tiny-gpt2", BASELINE, 64, generates)["groups"][0]["rules"]:
        assert series_names(rule["expr"]) <= names, (rule["alert"], rule["expr"])


def test_a_broken_query_or_an_unexported_series_is_caught(tmp_path: Path) -> None:
    """The dashboard test's own checks bite: promtool refuses bad PromQL, and a name the
    runtime does not export is seen."""
    (tmp_path / "q.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "a:b", "expr": "sum(("}]}]})
    )
    assert promtool("check", "rules", "q.yml", cwd=tmp_path).returncode != 0
    assert series_names('sum by (model) (rate(shipyard_nope_total{model="m"}[5m]))') == {
        "shipyard_nope_total"
    }
    assert "shipyard_nope_total" not in exported()


@pytest.mark.parametrize(
    ("ttft_ms", "itl_ms"),
    [(2.49, 2.49), (4.99, 0.499), (12.49, 24.9), (2.51, 5.01)],  # limits just under an edge
)
def test_latency_rules_fire_whatever_bucket_their_limit_falls_in(
    tmp_path: Path, ttft_ms: float, itl_ms: float
) -> None:
    """The unit tests' slow series must sit wholly above the limit: a limit of 4.98 ms
    (a measured 2.49 ms baseline) lay inside the (2.5, 5] ms bucket, where the quantile
    of observations filling that bucket is 4.875 ms, and the alert did not fire."""
    head = baseline(p95_ttft_ms=ttft_ms, p95_itl_ms=itl_ms, peak_rss_mb=177.2)
    folder = written(tmp_path, head)
    tested = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert tested.returncode == 0, tested.stdout + tested.stderr
