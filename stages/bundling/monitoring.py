"""The monitoring a bundle ships (`monitoring/`): Prometheus alert rules whose thresholds
come from the release's own load-test baseline with stated margins, promtool unit tests for
them, and a Grafana dashboard of the runtime's series (shipyard_runtime/metrics.py).

Margins: time to first token and inter-token latency alert at p95 above MARGIN_LATENCY x
the load test's p95; resident memory above MARGIN_MEMORY x its peak; the error share of
finished requests above MAX_ERROR_SHARE; the queue above QUEUE_SHARE of max_queue_depth;
empty responses above MAX_EMPTY_SHARE of answered ones. Each rule says its baseline and
margin in its annotations, so an operator reading a page knows what "normal" was.

Scope (issue 43): every rule names the release. The process-wide memory series has no
`model_name` label, so its rule joins on `shipyard_model_info{model_name}` by the scrape's
`instance` and `job`: another process over the limit (a node exporter, another release) never fires
it. `ShipyardTargetDown` fires when no scraped process has announced the release for
TARGET_DOWN_FOR (its servers are down, or none is scraped).

The dashboard loads through Grafana's import: `__inputs` asks for the Prometheus data
source, and a `datasource` variable (defaulting to it) lets the viewer switch; every panel
reads `${datasource}`, and a panel of two series has two queries, not `A or B` (which
drops B wherever A has a value).
"""

from __future__ import annotations

import json
from typing import Any

from schemas.loadresults import Headline
from shipyard_runtime.metrics import SERIES

N = {key: s.sample for key, s in SERIES.items()}  # the scraped names, from the engine's table

FOLDER = "monitoring/"  # where a bundle carries these files
MARGIN_LATENCY = 2.0
MARGIN_MEMORY = 1.5
MAX_ERROR_SHARE = 0.01
QUEUE_SHARE = 0.8
MAX_EMPTY_SHARE = 0.05
WINDOW = "5m"
TARGET_DOWN_FOR = "5m"
SCRAPE = ("instance", "job")  # the labels Prometheus adds to every scraped series
ERRORS = "error|timeout|rejected"
ANSWERED = "stop|length"


def _quantile(metric: str, model: str) -> str:
    return (
        f"histogram_quantile(0.95, sum by (le, model_name) "
        f'(rate({metric}_bucket{{model_name="{model}"}}[{WINDOW}])))'
    )


def rules(model: str, baseline: Headline, max_queue: int, generates: bool) -> dict[str, Any]:
    """The alert rule group for `model` (a Prometheus rules file)."""
    out: list[dict[str, Any]] = []

    def rule(name: str, expr: str, hold: str, summary: str, why: str) -> None:
        out.append(
            {
                "alert": name,
                "expr": expr,
                "for": hold,
                "labels": {"severity": "warning", "release": model},
                "annotations": {"summary": summary, "baseline": why},
            }
        )

    info = f'{N["model_info"]}{{model_name="{model}"}}'
    rule(
        "ShipyardTargetDown",
        f"absent({info})",
        TARGET_DOWN_FOR,
        f"{model}: no scraped server announces it (down, or not scraped)",
        "a serving process exports shipyard_model_info for every model it loaded",
    )
    rss = baseline.peak_rss_mb
    if rss is not None and rss > 0:
        limit = int(rss * MARGIN_MEMORY * 2**20)
        on = ", ".join(SCRAPE)
        rule(
            "ShipyardMemoryHigh",
            f"process_resident_memory_bytes * on ({on}) group_left () "
            f"max by ({on}) ({info}) > {limit}",
            "10m",
            f"{model}: server memory above {MARGIN_MEMORY}x the load test's peak",
            f"load-test peak RSS {rss} MB; alert above {limit} bytes",
        )
    if generates:
        for value, name, metric, label in (
            (
                baseline.p95_ttft_ms,
                "ShipyardTTFTHigh",
                N["time_to_first_token_seconds"],
                "time to first token",
            ),
            (
                baseline.p95_itl_ms,
                "ShipyardITLHigh",
                N["inter_token_latency_seconds"],
                "inter-token latency",
            ),
        ):
            if value is None or value <= 0:
                continue
            from shipyard_runtime.metrics import LATENCY

            limit_s = round(value * MARGIN_LATENCY / 1000, 6)
            why = f"load-test p95 {value} ms; alert above {limit_s} s"
            if limit_s < LATENCY[0]:
                # below the histogram's first bucket, healthy traffic reads as up to 0.95 x
                # its edge: such a rule would fire all the time
                limit_s = LATENCY[0]
                why = (
                    f"load-test p95 {value} ms; alert above {limit_s} s, the histogram's "
                    f"first bucket ({MARGIN_LATENCY}x the baseline is below what it resolves)"
                )
            rule(
                name,
                f"{_quantile(metric, model)} > {limit_s}",
                "10m",
                f"{model}: p95 {label} above {MARGIN_LATENCY}x the load test's",
                why,
            )
    # every task: a one-pass bundle's batcher counts its requests and queue as the engine does
    finished = f'{N["requests_finished"]}{{model_name="{model}"'
    rule(
        "ShipyardErrorRateHigh",
        f'sum(rate({finished},reason=~"{ERRORS}"}}[{WINDOW}])) / '
        f"sum(rate({finished}}}[{WINDOW}])) > {MAX_ERROR_SHARE}",
        "5m",
        f"{model}: more than {MAX_ERROR_SHARE:.0%} of requests fail, time out or are refused",
        f"the load test ran without errors; alert above {MAX_ERROR_SHARE}",
    )
    depth = max(1, int(max_queue * QUEUE_SHARE))
    rule(
        "ShipyardQueueDeep",
        f'max_over_time({N["queue_depth"]}{{model_name="{model}"}}[{WINDOW}]) > {depth}',
        "5m",
        f"{model}: the queue stays near max_queue_depth ({max_queue}): 503s follow",
        f"max_queue_depth {max_queue}; alert above {depth} waiting",
    )
    if generates:
        rule(
            "ShipyardEmptyResponses",
            f'sum(rate({N["empty_responses"]}{{model_name="{model}"}}[{WINDOW}])) / '
            f'sum(rate({finished},reason=~"{ANSWERED}"}}[{WINDOW}])) > {MAX_EMPTY_SHARE}',
            "15m",
            f"{model}: more than {MAX_EMPTY_SHARE:.0%} of answers are empty",
            f"alert above {MAX_EMPTY_SHARE} of answered requests",
        )
    return {"groups": [{"name": f"shipyard-{model}", "rules": out}]}


def rule_tests(rule_file: str, group: dict[str, Any]) -> dict[str, Any]:
    """promtool unit tests: each rule fires on series past its threshold, and stays quiet
    on series within it."""
    tests = []
    for r in group["groups"][0]["rules"]:
        model = r["labels"]["release"]
        bad, good = _series(r["alert"], r["expr"], model)
        labels = {**r["labels"]}
        if r["alert"] == "ShipyardMemoryHigh":
            labels |= {"instance": "server:8002", "job": "shipyard"}
        elif "sum(" not in r["expr"]:
            labels["model_name"] = model
        if r["alert"].startswith(("ShipyardTTFT", "ShipyardITL")):
            labels["model_name"] = model
        expected = [{"exp_labels": labels, "exp_annotations": r["annotations"]}]
        for series, alerts in ((bad, expected), (good, [])):
            tests.append(
                {
                    "interval": "1m",
                    "input_series": series,
                    "alert_rule_test": [
                        {"eval_time": "30m", "alertname": r["alert"], "exp_alerts": alerts}
                    ],
                }
            )
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}


def _series(alert: str, expr: str, model: str) -> tuple[list[Any], list[Any]]:
    """(breaching, calm) input series for one rule."""
    scrape = ',instance="server:8002",job="shipyard"}'
    info = f'{N["model_info"]}{{model_name="{model}"{scrape}'
    other = f'{N["model_info"]}{{model_name="other-{model}"{scrape.replace("server", "other")}'
    if alert == "ShipyardTargetDown":  # down: only another release's server is scraped
        return [{"series": other, "values": "1x40"}], [{"series": info, "values": "1x40"}]
    threshold = float(expr.rsplit(">", 1)[1])
    if alert == "ShipyardMemoryHigh":
        high, low = int(threshold * 2), int(threshold / 2)
        s = 'process_resident_memory_bytes{instance="server:8002",job="shipyard"}'
        # processes that do not serve this release, far over its limit: never its alert
        strangers = [
            {"series": 'process_resident_memory_bytes{instance="node:9100",job="node"}',
             "values": f"{high * 10}x40"},
            {"series": 'process_resident_memory_bytes{instance="other:8002",job="shipyard"}',
             "values": f"{high * 10}x40"},
            {"series": other, "values": "1x40"},
            {"series": info, "values": "1x40"},
        ]  # fmt: skip
        return (
            [{"series": s, "values": f"{high}x40"}, *strangers],
            [{"series": s, "values": f"{low}x40"}, *strangers],
        )
    if alert == "ShipyardQueueDeep":
        s = f'{N["queue_depth"]}{{model_name="{model}"}}'
        return (
            [{"series": s, "values": f"{int(threshold) + 1}x40"}],
            [{"series": s, "values": f"{max(0, int(threshold) - 1)}x40"}],
        )
    if alert.startswith(("ShipyardTTFT", "ShipyardITL")):
        metric = expr.split("rate(", 1)[1].split("_bucket", 1)[0]
        from shipyard_runtime.metrics import LATENCY

        def buckets(slow: bool) -> list[Any]:
            # every observation in the first bucket wholly above (slow) or below (calm) the
            # limit: histogram_quantile interpolates inside a bucket, so observations in
            # the bucket that holds the limit read as up to 0.95 of the way through it (a
            # 4.98 ms limit in (2.5, 5] ms read 4.875 ms: the slow case did not fire)
            edge = (
                next(b for lo, b in zip(LATENCY, LATENCY[1:], strict=False) if lo >= threshold)
                if slow
                else LATENCY[0]
            )
            out = []
            for le in [*LATENCY, "+Inf"]:
                n = 10 if le == "+Inf" or float(str(le)) >= edge else 0
                out.append({"series": f'{metric}_bucket{{model_name="{model}",le="{le}"}}',
                            "values": f"0+{n}x40"})  # fmt: skip
            return out

        return buckets(True), buckets(False)
    finished = f'{N["requests_finished"]}{{model_name="{model}",reason='
    if alert == "ShipyardErrorRateHigh":
        return (
            [{"series": finished + '"stop"}', "values": "0+90x40"},
             {"series": finished + '"error"}', "values": "0+10x40"}],
            [{"series": finished + '"stop"}', "values": "0+1000x40"},
             {"series": finished + '"error"}', "values": "0+1x40"}],
        )  # fmt: skip
    empty = f'{N["empty_responses"]}{{model_name="{model}"}}'
    return (
        [{"series": finished + '"stop"}', "values": "0+10x40"},
         {"series": empty, "values": "0+5x40"}],
        [{"series": finished + '"stop"}', "values": "0+100x40"},
         {"series": empty, "values": "0+1x40"}],
    )  # fmt: skip


def dashboard(model: str, generates: bool) -> dict[str, Any]:
    """A Grafana dashboard (JSON model) of the runtime's series for `model`."""
    m = f'model_name="{model}"'
    on = ", ".join(SCRAPE)
    memory = (
        f"process_resident_memory_bytes * on ({on}) group_left () "
        f"max by ({on}) ({N['model_info']}{{{m}}})"
    )
    panels: list[tuple[str, list[str], str]] = [("Resident memory", [memory], "bytes")]
    # every task: requests, their latency and queue, batch sizes (one-pass bundles count
    # them in their batcher, generating ones in the engine)
    rows = (
        f"histogram_quantile(0.95, sum by (le) (rate({N['running_batch_size']}_bucket{{{m}}}[5m])))"
    )
    reasons = f"sum by (reason) (rate({N['requests_finished']}{{{m}}}[5m]))"
    running = f"{N['requests_running']}{{{m}}}"
    waiting = f"{N['requests_waiting']}{{{m}}}"
    e2e = _quantile(N["e2e_request_latency_seconds"], model)
    queued = _quantile(N["request_queue_time_seconds"], model)
    common: list[tuple[str, list[str], str]] = [
        ("End-to-end request latency (p95)", [e2e], "s"),
        ("Queue time (p95)", [queued], "s"),
    ]
    if generates:
        ttft = _quantile(N["time_to_first_token_seconds"], model)
        itl = _quantile(N["inter_token_latency_seconds"], model)
        empty = f"sum(rate({N['empty_responses']}{{{m}}}[5m]))"
        limited = f"sum(rate({N['length_limited']}{{{m}}}[5m]))"
        hit_rate = (
            f"sum(rate({N['prefix_cache_hits']}{{{m}}}[5m])) / "
            f"sum(rate({N['prefix_cache_queries']}{{{m}}}[5m]))"
        )
        panels = [
            *common,
            ("Time to first token (p95)", [ttft], "s"),
            ("Inter-token latency (p95)", [itl], "s"),
            (
                "Output tokens/s",
                [f"sum(rate({N['generated_tokens']}{{{m}}}[1m]))"],
                "none",
            ),
            ("Running batch size (p95)", [rows], "none"),
            ("Requests running and waiting", [running, waiting], "none"),
            ("KV cache use", [f"{N['kv_cache_usage_ratio']}{{{m}}}"], "percentunit"),
            ("Finished requests by reason", [reasons], "reqps"),
            ("Empty and length-limited outputs", [empty, limited], "reqps"),
            ("Prefix cache hit rate (prompt tokens)", [hit_rate], "percentunit"),
            *panels,
        ]
    else:
        panels = [
            *common,
            ("Input tokens/s", [f"sum(rate({N['prompt_tokens']}{{{m}}}[1m]))"], "none"),
            ("Rows a batch (p95)", [rows], "none"),
            ("Requests running and waiting", [running, waiting], "none"),
            ("Finished requests by reason", [reasons], "reqps"),
            *panels,
        ]
    source = {"type": "prometheus", "uid": "${datasource}"}
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the release's servers",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
        ],
        "title": f"Shipyard: {model}",
        "uid": f"shipyard-{model}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {
                        "selected": True,
                        "text": "${DS_PROMETHEUS}",
                        "value": "${DS_PROMETHEUS}",
                    },
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }  # fmt: skip
            ]
        },
        "panels": [
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": source,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + k), "datasource": source, "expr": expr}
                    for k, expr in enumerate(exprs)
                ],
            }
            for i, (title, exprs, unit) in enumerate(panels)
        ],
    }


def files(model: str, baseline: Headline, max_queue: int, generates: bool) -> dict[str, str]:
    """monitoring/ path -> text."""
    import yaml

    group = rules(model, baseline, max_queue, generates)
    return {
        f"{FOLDER}alerts.yml": yaml.safe_dump(group, sort_keys=False, width=1000),
        f"{FOLDER}alerts_test.yml": yaml.safe_dump(
            rule_tests("alerts.yml", group), sort_keys=False, width=1000
        ),
        f"{FOLDER}dashboard.json": json.dumps(dashboard(model, generates), indent=2) + "\n",
    }
