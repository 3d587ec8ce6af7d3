"""What an operator watches on an LLM deployment, as Prometheus metrics (prometheus_client,
the registry MLServer's metrics endpoint serves):

- `shipyard_time_to_first_token_seconds`, `shipyard_inter_token_latency_seconds`
  (histograms): a request's arrival to its first token, and between its tokens;
- `shipyard_queue_depth` (gauge): requests waiting for admission;
- `shipyard_requests_waiting`, `shipyard_requests_running` (gauges): requests waiting for
  admission, and admitted (prefilling or decoding), as vLLM's num_requests_waiting/running;
- `shipyard_running_batch_size` (histogram, one sample per decode step): the sequences
  decoded together, the number that says whether batching is real;
- `shipyard_generated_tokens_total`, `shipyard_prompt_tokens_total` (counters; tokens/s is
  their rate);
- `shipyard_kv_cache_usage_ratio` (gauge): the padded running cache over the KV budget
  (0 when nothing runs);
- `shipyard_requests_finished_total{reason}` (counter): stop, length, abort or error;
- quality: `shipyard_empty_responses_total` (a sequence that ended with no token but a stop
  token), `shipyard_output_tokens` (histogram: abnormal lengths show as its tails) and
  `shipyard_length_limited_total` (outputs cut at their token limit).

- `shipyard_e2e_request_latency_seconds`, `shipyard_request_queue_time_seconds`,
  `shipyard_request_prefill_time_seconds` (histograms, vLLM's names after the prefix):
  arrival to the end (every finished request, aborted and failed ones too), arrival to
  admission, admission to the first token;
- `shipyard_prefix_cache_queries_total`, `shipyard_prefix_cache_hits_total` (counters, in
  prompt tokens, where prefix caching is on): looked up in the prefix cache, and found
  there (hit rate: their ratio);
- `shipyard_model_info` (gauge, 1): this process serves `model_name`, whatever its task
  (`announce`; a generating model's engine sets it too). Alert rules join on it to scope
  process-wide series (`process_resident_memory_bytes`) to the release's own servers, and
  its absence is the release's target-down alert.

Every series carries the `model_name` label (vLLM's name for it, so one dashboard query
reads both). Without prometheus_client, `for_model` returns None
and the engine measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# seconds: from half a millisecond (a small model's decode step) to a minute (a long
# queue). A p95 alert cannot be set below the first bucket: histogram_quantile puts every
# observation inside it at up to 0.95 x its edge (bundling/monitoring.py clamps to it).
LATENCY = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
)  # fmt: skip
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)

LABEL = "model_name"  # the model's label on every series (vLLM's)
_SHARED: dict[str, Any] = {}  # one family per name per process, however many models load
_TRITON: dict[str, Any] = {}  # the same inside Triton's python backend (for_triton)


def _prometheus(kind: str, name: str, doc: str, **kw: Any) -> Any:
    import prometheus_client as prom

    if name not in _SHARED:
        _SHARED[name] = getattr(prom, kind)(name, doc, [LABEL, *kw.pop("labels", [])], **kw)
    return _SHARED[name]


class _TritonFamily:
    """A prometheus_client-like family over Triton's python-backend metrics
    (`pb_utils.MetricFamily`), served on Triton's own metrics port beside its nv_* series:
    the same names a scrape of an MLServer bundle reads (a counter's `_total` is part of
    its name here: Triton adds no suffix), the same labels and buckets."""

    def __init__(self, pb: Any, kind: str, name: str, doc: str, **kw: Any) -> None:
        kinds = {"Counter": "COUNTER", "Gauge": "GAUGE", "Histogram": "HISTOGRAM"}
        self.family = pb.MetricFamily(
            name=name + ("_total" if kind == "Counter" else ""),
            description=doc,
            kind=getattr(pb.MetricFamily, kinds[kind]),
        )
        self.kind, self.names = kind, [LABEL, *kw.get("labels", [])]
        self.buckets = list(kw["buckets"]) if kind == "Histogram" else None
        self.children: dict[tuple[str, ...], _TritonMetric] = {}

    def labels(self, *values: str) -> _TritonMetric:
        if values not in self.children:
            labels = dict(zip(self.names, values, strict=True))
            made = (
                self.family.Metric(labels=labels, buckets=self.buckets)
                if self.buckets is not None
                else self.family.Metric(labels=labels)
            )
            self.children[values] = _TritonMetric(made)
        return self.children[values]


class _TritonMetric:
    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def inc(self, value: float = 1.0) -> None:
        self.metric.increment(value)

    def set(self, value: float) -> None:
        self.metric.set(value)

    def observe(self, value: float) -> None:
        self.metric.observe(value)


def for_triton(model: str, pb: Any) -> Metrics:
    """The engine's series for `model` inside Triton's python backend (`pb`: its
    triton_python_backend_utils), one family per name per process as with prometheus.
    The families live as long as the process: Triton refuses a metric whose family was
    collected ("MetricFamily has been deleted")."""

    def family(kind: str, name: str, doc: str, **kw: Any) -> Any:
        if name not in _TRITON:
            _TRITON[name] = _TritonFamily(pb, kind, name, doc, **kw)
        return _TRITON[name]

    return Metrics(model, family)


def announce(model: str) -> None:
    """`shipyard_model_info{model} 1`: this process serves `model` (no-op without
    prometheus_client)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return
    info = SERIES["model_info"]
    _prometheus(info.kind, info.name, info.doc).labels(model).set(1)


@dataclass(frozen=True)
class Series:
    """One exported series: the one place its name, kind, help, buckets and extra labels
    are spelled (the engine registers it from here; bundling/monitoring.py's rules and
    dashboard, and the tests, read the names from here too)."""

    name: str
    kind: str  # Counter, Gauge or Histogram
    doc: str
    buckets: tuple[float, ...] | None = None
    labels: tuple[str, ...] = ()

    @property
    def sample(self) -> str:
        """The name a scrape shows: a counter's with `_total` (prometheus_client's)."""
        return f"{self.name}_total" if self.kind == "Counter" else self.name


SERIES: dict[str, Series] = {
    s.name.removeprefix("shipyard_"): s
    for s in (
        Series("shipyard_model_info", "Gauge", "1: this process serves the model."),
        Series(
            "shipyard_time_to_first_token_seconds", "Histogram",
            "Arrival to first token, per request.", LATENCY,
        ),
        Series(
            "shipyard_inter_token_latency_seconds", "Histogram",
            "Between consecutive tokens of one request.", LATENCY,
        ),
        Series("shipyard_queue_depth", "Gauge", "Requests waiting."),
        Series("shipyard_requests_waiting", "Gauge", "Requests waiting for admission."),
        Series("shipyard_requests_running", "Gauge", "Requests admitted: prefilling or decoding."),
        Series(
            "shipyard_running_batch_size", "Histogram",
            "Sequences decoded together, per decode step.", ROWS,
        ),
        Series("shipyard_generated_tokens", "Counter", "Tokens generated."),
        Series("shipyard_prompt_tokens", "Counter", "Prompt tokens taken in."),
        Series(
            "shipyard_kv_cache_usage_ratio", "Gauge", "Padded running KV cache / the KV budget."
        ),
        Series(
            "shipyard_requests_finished", "Counter", "Requests ended, by reason.",
            labels=("reason",),
        ),
        Series(
            "shipyard_empty_responses", "Counter", "Sequences that ended without a real token."
        ),
        Series("shipyard_length_limited", "Counter", "Outputs cut at their token limit."),
        Series("shipyard_output_tokens", "Histogram", "Tokens per finished output.", TOKENS),
        Series(
            "shipyard_e2e_request_latency_seconds", "Histogram",
            "Arrival to the end of a request (any reason).", LATENCY,
        ),
        Series(
            "shipyard_request_queue_time_seconds", "Histogram",
            "Arrival to admission, per request.", LATENCY,
        ),
        Series(
            "shipyard_request_prefill_time_seconds", "Histogram",
            "Admission to the first token, per request.", LATENCY,
        ),
        Series(
            "shipyard_prefix_cache_queries", "Counter",
            "Prompt tokens looked up in the prefix cache.",
        ),
        Series(
            "shipyard_prefix_cache_hits", "Counter", "Prompt tokens found in the prefix cache."
        ),
    )
}  # fmt: skip


class Metrics:
    """The engine's series for one model (SERIES)."""

    def __init__(self, model: str, family: Any = None) -> None:
        """`family(kind, name, doc, **kw)` makes a labelled family: prometheus_client's
        (MLServer's registry) unless given (Triton's python backend: `for_triton`)."""
        make = family or _prometheus

        def series(key: str) -> Any:
            s = SERIES[key]
            kw: dict[str, Any] = {"buckets": s.buckets} if s.buckets is not None else {}
            if s.labels:
                kw["labels"] = list(s.labels)
            return make(s.kind, s.name, s.doc, **kw)

        series("model_info").labels(model).set(1)
        self.model = model
        self.ttft = series("time_to_first_token_seconds").labels(model)
        self.itl = series("inter_token_latency_seconds").labels(model)
        self.queue = series("queue_depth").labels(model)
        self.waiting = series("requests_waiting").labels(model)
        self.running = series("requests_running").labels(model)
        self.rows = series("running_batch_size").labels(model)
        self.generated = series("generated_tokens").labels(model)
        self.prompt = series("prompt_tokens").labels(model)
        self.kv = series("kv_cache_usage_ratio").labels(model)
        self._finished = series("requests_finished")
        self.empty = series("empty_responses").labels(model)
        self.length_limited = series("length_limited").labels(model)
        self.output_tokens = series("output_tokens").labels(model)
        self.e2e = series("e2e_request_latency_seconds").labels(model)
        self.queue_time = series("request_queue_time_seconds").labels(model)
        self.prefill_time = series("request_prefill_time_seconds").labels(model)
        self.prefix_queried = series("prefix_cache_queries").labels(model)
        self.prefix_hits = series("prefix_cache_hits").labels(model)

    def finished(self, reason: str, tokens: int, empty: bool) -> None:
        self._finished.labels(self.model, reason).inc()
        if reason in ("stop", "length"):
            self.output_tokens.observe(tokens)
        if reason == "length":
            self.length_limited.inc()
        if empty:
            self.empty.inc()


def for_model(model: str) -> Metrics | None:
    """The model's metrics, or None where prometheus_client is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return None
    return Metrics(model)
