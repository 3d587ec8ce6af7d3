"""The generation engine the bundle ships (as the package `shipyard_engine`, next to the
server entry that uses it): one scheduler that batches decode steps, not requests.

- `dtypes`: the tensor datatypes, in the ONNX, numpy, V2, Triton and wire spellings;
- `params`: what a request may ask (sampling, stops, limits), refused when unknown;
- `sampler`: temperature, top-k, top-p, repetition penalty, seeded;
- `text`: the shipped tokenizer, incremental detokenization, stop strings, chat templates;
- `kv`: the running batch's KV cache (left-padded rows, joined and filtered between steps);
- `metrics`: Prometheus series an operator watches (TTFT, ITL, queue, batch size, KV use,
  finish reasons, quality counters);
- `scheduler`: the policy over plain state: waiting, prefilling and running sequences,
  admission against the KV budget, ageing, chunked prefill, the block-level prefix cache,
  a request-level policy to compare; each `schedule()` returns a step plan;
- `runner`: the graph, and a plan's prefill passes and decode step on the running batch;
- `output`: logits to events (sampling, logprobs, stops, text, metrics);
- `core`: `Engine`: admission checks, `step()` (plan, run, output), the thread that steps.

It imports only numpy, onnxruntime, pydantic, tokenizers and jinja2: the front ends (the
MLServer runtime, the Triton python model) are thin adapters over `core.Engine`.
"""

from . import (
    core,
    dtypes,
    kv,
    metrics,
    openai_api,
    output,
    params,
    runner,
    sampler,
    scheduler,
    session,
    settings,
    text,
)

__all__ = [
    "core",
    "dtypes",
    "kv",
    "metrics",
    "openai_api",
    "output",
    "params",
    "runner",
    "sampler",
    "scheduler",
    "session",
    "settings",
    "text",
]
