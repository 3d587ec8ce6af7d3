"""The output processor: a sequence's logits become its next event (vLLM's
OutputProcessor, TGI's `Batch.filter` side): the sampled token, its logprobs, stop tokens
and strings, the detokenized text delta, the finish reason, and the metrics of it."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shipyard_runtime.generation import sampler
from shipyard_runtime.generation.scheduler import Event, Sequence

_NONE = np.zeros(0, np.int64)


class OutputProcessor:
    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics  # shipyard_runtime.metrics.Metrics, or None: nothing measured

    def take(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Sample, emit; whether the sequence goes on."""
        p = seq.params
        seen = (
            np.array([*seq.prompt, *seq.generated], np.int64)
            if p.repetition_penalty != 1
            else _NONE
        )
        token = sampler.choose(logits, p, seq.rng, seen)
        seq.generated.append(token)
        event = Event(token=token, prompt_tokens=len(seq.prompt), cached_tokens=seq.cached)
        if p.logprobs is not None:
            event.logprob, event.top = sampler.top_logprobs(logits, token, p.logprobs)
        stopped = token in seq.stops
        if seq.detok is not None and not stopped:
            event.text, stopped = seq.detok.add(token)
        if not stopped and len(seq.generated) >= p.max_tokens:
            event.finish = "length"
        elif stopped:
            event.finish = "stop"
        if event.finish and seq.detok is not None:
            event.text += seq.detok.finish()
        event.completion_tokens = len(seq.generated)
        if self.metrics is not None:
            self._measure(seq, event, stopped)
        seq.emit(event)
        return event.finish is None

    def ended(self, seq: Sequence, event: Event, reason: str) -> None:
        """A sequence that ends without a token (cancelled, timed out, failed)."""
        if self.metrics is not None:
            self.metrics.finished(reason, len(seq.generated), False)
            self.metrics.e2e.observe(time.monotonic() - seq.arrival)
        seq.emit(event)

    def _measure(self, seq: Sequence, event: Event, stopped: bool) -> None:
        now, m = time.monotonic(), self.metrics
        if len(seq.generated) == 1:
            m.ttft.observe(now - seq.arrival)
            m.prompt.inc(len(seq.prompt))
            admitted = seq.admitted or seq.arrival
            m.queue_time.observe(max(0.0, admitted - seq.arrival))
            m.prefill_time.observe(max(0.0, now - admitted))
            if seq.looked_up:
                m.prefix_queried.inc(len(seq.prompt))
                m.prefix_hits.inc(seq.cached)
        else:
            m.itl.observe(now - seq.last)
        seq.last = now
        m.generated.inc()
        if event.finish:
            # empty: the first token was already a stop (nothing a user would read)
            m.finished(event.finish, len(seq.generated), stopped and len(seq.generated) == 1)
            m.e2e.observe(now - seq.arrival)
