"""The engine: admission checks, then `step()` = the scheduler's plan, the runner's passes,
the output processor's tokens. A thread calls `step()` while there is work (`start=True`,
what the servers do); a test makes its own steps (`start=False`), with no sleeps and no
queues to wait on.

One lock guards the scheduler's state: requests are submitted and cancelled from the
servers' threads while the engine's thread plans; the graph runs outside it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shipyard_runtime.generation.output import OutputProcessor
from shipyard_runtime.generation.params import BadParameter, GenerationParams, check_rows
from shipyard_runtime.generation.runner import Graph, Runner
from shipyard_runtime.generation.scheduler import (
    EngineSettings,
    ErrorKind,
    Event,
    QueueFull,
    Scheduler,
    Sequence,
)
from shipyard_runtime.generation.text import Detokenizer, Text

__all__ = ["Engine", "EngineSettings", "Event", "Graph", "Handle", "QueueFull"]


class Handle:
    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self._engine, self._seq = engine, seq

    def cancel(self) -> None:
        """The client went away: the sequence leaves at the next step."""
        self._seq.cancelled = True
        self._engine._wake()


class Engine:
    def __init__(
        self,
        graph: Graph,
        settings: EngineSettings,
        text: Text | None = None,
        metrics: Any = None,
        start: bool = True,
    ) -> None:
        self.graph, self.settings, self.text = graph, settings, text
        self.metrics = metrics  # shipyard_runtime.metrics.Metrics, or None: nothing measured
        self.eos = frozenset(settings.eos_token_ids)
        # a sequence caches its prompt and tokens but the last: at most the past a step may
        # read + 2 (`check`), and never more than the served context
        most = min(settings.max_context, settings.max_past + 2) if settings.max_past else None
        self.runner = Runner(graph, most or settings.max_context)
        self.scheduler = Scheduler(
            settings, graph.positions, self.runner.batch, in_place=graph.in_place
        )
        self.output = OutputProcessor(metrics)
        self.steps = 0
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="shipyard-engine", daemon=True)
            self._thread.start()

    # views the tests and the servers read
    @property
    def prefix(self) -> Any:
        return self.scheduler.prefix

    @property
    def batch(self) -> Any:
        return self.runner.batch

    # ------------------------------------------------------------------ requests in
    def admit(self, prompts: list[list[int]], params: GenerationParams, rows: int) -> None:
        """The one admission check of a request: at most `rows` prompts (the served
        max_batch_size), each one the graph can serve; BadParameter (a 400) otherwise."""
        check_rows(len(prompts), rows)
        for prompt in prompts:
            self.check(prompt, params)

    def check(self, prompt: list[int], params: GenerationParams) -> None:
        """BadParameter for a request the graph cannot serve (the front ends answer 400)."""
        s, n = self.settings, len(prompt)
        if n < 1:
            raise BadParameter("the prompt is empty: send at least one token")
        if self.graph.vocab and not 0 <= min(prompt) <= max(prompt) < self.graph.vocab:
            raise BadParameter(f"token ids must lie in [0, {self.graph.vocab}) (the vocabulary)")
        if n + params.max_tokens - 1 > s.max_context:
            raise BadParameter(
                f"prompt {n} + max_tokens {params.max_tokens} - 1 exceeds the served context "
                f"{s.max_context}"
            )
        if n + params.max_tokens - 2 > s.max_past:
            raise BadParameter(
                f"prompt {n} + max_tokens {params.max_tokens} needs a past of "
                f"{n + params.max_tokens - 2} tokens; the export's past_sequence max is "
                f"{s.max_past}"
            )
        if n + params.max_tokens > s.kv_budget_tokens:
            raise BadParameter(
                f"prompt {n} + max_tokens {params.max_tokens} needs {n + params.max_tokens} "
                f"tokens of KV cache; the served budget is {s.kv_budget_tokens}"
            )
        if params.stop and self.text is None:
            raise BadParameter("stop strings need the model's tokenizer, which is not shipped")

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length may generate: what `check` allows under
        the served context, the export's past and the KV budget (0: none)."""
        s, n = self.settings, prompt_tokens
        return max(0, min(s.max_context - n + 1, s.max_past - n + 2, s.kv_budget_tokens - n))

    def submit(
        self, prompt: list[int], params: GenerationParams, emit: Callable[[Event], None]
    ) -> Handle:
        self.check(prompt, params)
        with self._cv:
            seq = Sequence(
                next(self._ids),
                list(prompt),
                params,
                emit,
                time.monotonic(),
                np.random.default_rng(params.seed),
                Detokenizer(self.text, params.stop) if self.text is not None else None,
                frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos),
            )
            try:
                self.scheduler.add(seq)
            except QueueFull:
                if self.metrics is not None:
                    self.metrics.finished("rejected", 0, False)
                raise
            self._gauges()
            self._cv.notify()
        return Handle(self, seq)

    def step_profile(self) -> dict[str, float]:
        """Where a decode step's time went, in ms a step: the graph, its inputs (the
        token, mask and positions built, the presents taken as the cache), the cache's own
        copies (rows leaving, compaction), the output processor (sampling, stops, text)
        and the rest of the engine's Python; `join`: rows joining after their prefill,
        between steps (not in `step`); `rows`: sequences a step; `slots`: the cache a step
        read, rows (free slots included) x its length."""
        t, steps = self.runner.times, max(self.steps, 1)
        parts = {k: 1000 * t[k] / steps for k in ("graph", "inputs", "cache", "output")}
        parts["python"] = max(0.0, 1000 * t["step"] / steps - sum(parts.values()))
        parts["step"] = 1000 * t["step"] / steps
        parts["join"] = 1000 * t["join"] / steps
        parts["rows"] = t["rows"] / steps
        parts["slots"] = t["slots"] / steps
        return parts

    # ------------------------------------------------------------------ a step
    def step(self, now: float | None = None) -> bool:
        """One iteration: the plan, its prefills, one decode step of the running batch,
        the events. Whether it did anything (False: idle). `now` (time.monotonic()'s
        clock) lets a test age requests without sleeping."""
        with self._cv:
            plan = self.scheduler.schedule(time.monotonic() if now is None else now)
            self._gauges()
        for seq, event, reason in plan.ended:
            self.output.ended(seq, event, reason)
        running = self.scheduler.running
        decoded = False
        try:
            if plan.group:
                self._prefill_together(plan.group)
            for seq, n in plan.chunks:
                self._prefill_chunk(seq, n)
            if running:
                decoded = True
                start = time.perf_counter()
                with self._cv:
                    self.scheduler.compact_free_slots()
                times = self.runner.times
                last = {k: q.generated[-1] for k, q in running.items()}
                decoded_rows = self.runner.decode(last)
                if self.metrics is not None:  # before any token of the step reaches a client
                    self.metrics.rows.observe(len(last))
                for key, logits in decoded_rows:
                    t = time.perf_counter()
                    going = self.output.take(running[key], logits)
                    times["output"] += time.perf_counter() - t
                    if not going:
                        self.scheduler.finished(key)
                        self.runner.leave(key)
                self.steps += 1
                times["step"] += time.perf_counter() - start
                times["rows"] += len(last)
        except Exception as exc:  # the graph failed: every running request learns why
            self._fail_all(f"{type(exc).__name__}: {exc}", "internal")
        with self._cv:
            self._gauges()  # what the step left (all zero once idle)
        return decoded or not plan.empty

    def _prefill_together(self, group: list[Sequence]) -> None:
        done = group[0].done
        results = self.runner.prefill_together(
            [q.prompt for q in group], done, [q.past for q in group]
        )
        going = []
        for seq, (logits, past) in zip(group, results, strict=True):
            seq.done = len(seq.prompt)
            if self._prefilled(seq, logits):
                going.append((seq.key, past))
        # rows only for the sequences that go on (one that stopped at its first token, a
        # max_tokens 1, EOS or a stop, takes none), made in one copy of the cache
        self.runner.join(going, self._coming())
        with self._cv:
            for seq, (_, past) in zip(group, results, strict=True):
                self.scheduler.keep_prefix(seq, past)

    def _prefill_chunk(self, seq: Sequence, n: int) -> None:
        logits, seq.past = self.runner.prefill_chunk(seq.prompt, seq.done, n, seq.past)
        seq.done += n
        if seq.done == len(seq.prompt):
            past = seq.past
            if self._prefilled(seq, logits):
                self.runner.join([(seq.key, past)], self._coming())
            with self._cv:
                self.scheduler.keep_prefix(seq, past)

    def _coming(self) -> tuple[int, int]:
        """Rows and the longest prompt of the sequences still prefilling whose rest fits
        one step's chunk: admitted (the scheduler priced their rows and length), they join
        at the next step. A long prompt prefilled over many steps is not counted: its row
        and columns would ride along in every decode step until it joins."""
        with self._cv:
            chunk = self.settings.chunk
            soon = [q for q in self.scheduler.prefilling if len(q.prompt) - q.done <= chunk]
        return len(soon), max((len(q.prompt) for q in soon), default=0)

    def _prefilled(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Its prompt is in the cache: the first token; whether it goes on."""
        goes_on = self.output.take(seq, logits)
        with self._cv:
            self.scheduler.prefilled(seq, goes_on)
        return goes_on

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shipyard-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        else:
            self._fail_all("the server is shutting down", "shutdown")

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self.scheduler.busy):
                    self._cv.wait()
                if self._stop:
                    break
            self.step()
        self._fail_all("the server is shutting down", "shutdown")

    def _gauges(self) -> None:
        """Waiting and running requests and the cache they hold, as they are now (an idle
        engine reads 0, not what its last step held)."""
        m, s = self.metrics, self.scheduler
        if m is None:
            return
        m.queue.set(len(s.waiting))
        m.waiting.set(len(s.waiting))
        m.running.set(len(s.running) + len(s.prefilling))
        held = self.runner.held if s.running else 0
        m.kv.set(held / self.settings.kv_budget_tokens)

    def _fail_all(self, why: str, kind: ErrorKind) -> None:
        with self._cv:
            for seq in self.scheduler.clear():
                self.output.ended(seq, Event(error=why, kind=kind), "error")
            self.runner.clear()
