"""The generation engine: one scheduler that batches decode steps, not requests.

- `params`: what a request may ask (sampling, stops, limits), refused when unknown;
- `sampler`: temperature, top-k, top-p, repetition penalty, seeded;
- `text`: the shipped tokenizer, incremental detokenization, stop strings, chat templates;
- `kv`: the running batch's KV cache (left-padded rows, joined and filtered between steps);
- `scheduler`: the policy over plain state: waiting, prefilling and running sequences,
  admission against the KV budget, ageing, chunked prefill, the block-level prefix cache,
  a request-level policy to compare; each `schedule()` returns a step plan;
- `runner`: the graph, and a plan's prefill passes and decode step on the running batch;
- `output`: logits to events (sampling, logprobs, stops, text, metrics);
- `core`: `Engine`: admission checks, `step()` (plan, run, output), the thread that steps.

The adapters (`shipyard_runtime.mlserver`, `shipyard_runtime.triton`) import these modules
by their full names; this package imports nothing at import time.
"""
