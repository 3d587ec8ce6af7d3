"""The monitoring a bundle ships: alert rules from the load test's baseline that promtool
accepts and whose unit tests pass (and fail when a rule is wrong), and a dashboard that
plots only series the runtime exports."""

from __future__ import annotations

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
            "ShipyardMemoryHigh", "ShipyardTTFTHigh", "ShipyardITLHigh", "ShipyardErrorRateHigh",
            "ShipyardQueueDeep", "ShipyardEmptyResponses",
        ]  # fmt: skip
    else:
        assert names == ["ShipyardMemoryHigh"]


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
        "ShipyardErrorRateHigh", "ShipyardQueueDeep", "ShipyardEmptyResponses",
    }  # fmt: skip


def test_a_baseline_finer_than_the_histogram_alerts_at_its_first_bucket(tmp_path: Path) -> None:
    """A small model's inter-token latency (0.2 ms here, tiny-gpt2's 0.36 ms in a build) is
    below the latency histogram's first bucket: histogram_quantile reads healthy traffic
    there as up to 0.95 x the bucket's edge, so 2 x the baseline would fire all the time. The
    limit is the first bucket, said so in the rule, and promtool's calm case stays quiet."""
    from stages.serving.engine.metrics import LATENCY

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
    (rule,) = monitoring.rules("m", edge, 64, True)["groups"][0]["rules"][:1]
    assert rule["expr"].endswith(f"> {LATENCY[0]}") and "first bucket" not in str(rule)


def test_the_unit_tests_fail_when_a_rule_is_wrong(tmp_path: Path) -> None:
    folder = written(tmp_path, BASELINE)
    alerts = yaml.safe_load((folder / "alerts.yml").read_text())
    for rule in alerts["groups"][0]["rules"]:  # a threshold ten times too lax
        head, limit = rule["expr"].rsplit(">", 1)
        rule["expr"] = f"{head}> {float(limit) * 10 + 100}"
    (folder / "alerts.yml").write_text(yaml.safe_dump(alerts, sort_keys=False, width=1000))
    tested = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert tested.returncode != 0 and "FAILED" in tested.stdout + tested.stderr


def test_the_dashboard_plots_only_series_the_runtime_exports() -> None:
    import re

    board = monitoring.dashboard("tiny-gpt2", True)
    exported = {
        "process_resident_memory_bytes",
        *(f"{f}_bucket" for f in ("shipyard_time_to_first_token_seconds",
                                  "shipyard_inter_token_latency_seconds",
                                  "shipyard_running_batch_size", "shipyard_output_tokens")),
        "shipyard_queue_depth", "shipyard_kv_cache_usage_ratio",
        "shipyard_requests_waiting", "shipyard_requests_running",
        *(f"shipyard_{c}_total" for c in ("generated_tokens", "prompt_tokens",
                                          "requests_finished", "empty_responses",
                                          "length_limited")),
    }  # fmt: skip
    used = set()
    for panel in board["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\b(shipyard_\w+|process_\w+)\{?", target["expr"]))
    assert used and used <= exported, used - exported
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


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
