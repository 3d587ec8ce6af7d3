"""Iteration-level (continuous) batching over a KV-cache graph, the way LLM servers do it.

One thread owns the graph. Each iteration it
1. drops cancelled and timed-out requests, and admits waiting ones while a row is free and
   the padded cache (rows x longest total) stays within the KV budget, first come first
   served; a request that does not fit may be overtaken by later ones that do, until it has
   waited `max_wait_s`, after which nobody overtakes it (so neither a long request nor the
   short ones behind it starve);
2. prefills admitted prompts, at most `chunk` tokens per iteration across them (a long
   prompt is prefilled in chunks between decode steps, so it does not stall running ones),
   starting from the longest cached prefix when prefix caching is on; a prompt whose
   prefill ends samples its first token and joins the running batch;
3. runs one decode step for every running sequence together, samples each row, and lets
   rows leave at EOS, a stop token or string, or their token limit.

The `request` policy is the request-level baseline: a batch is admitted only when the
previous one has finished, and nobody joins it midway.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from . import sampler
from .kv import Batch, empty_past, positions_from_mask
from .params import BadParameter, GenerationParams
from .text import Detokenizer, Text

PAST, PRESENT = "past_key_values.", "present."


class EngineSettings(BaseModel):
    """The engine's limits, rendered by the serve stage from the spec and the plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: int = Field(ge=1, description="Sequences decoded together (max_batch_size).")
    max_context: int = Field(ge=1, description="Prompt + generated tokens of one sequence.")
    chunk: int = Field(ge=1, description="Prefill tokens per iteration (export sequence.max).")
    max_past: int = Field(ge=0, description="The export's past_sequence.max.")
    kv_budget_tokens: int = Field(ge=1, description="Padded cache size the batch may hold.")
    max_queue: int = Field(default=0, ge=0, description="Waiting requests; 0: unbounded.")
    timeout_s: float = Field(default=0.0, ge=0, description="Wait for admission; 0: forever.")
    max_wait_s: float = Field(default=1.0, ge=0, description="Ageing: overtaken this long.")
    policy: Literal["continuous", "request"] = "continuous"
    prefix_cache_tokens: int = Field(default=0, ge=0, description="0: no prefix caching.")
    prefix_block: int = Field(default=16, ge=1, description="Prefixes cached in blocks.")
    eos_token_ids: list[int] = Field(default_factory=list, description="generation_config's.")


class QueueFull(RuntimeError):
    """The waiting queue is at max_queue: answered at once (503), never queued."""


@dataclass
class Event:
    """One step of a sequence's output, in order; the last has `finish` (or `error`)."""

    token: int | None = None
    text: str = ""
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Graph:
    """The KV-cache graph: its past inputs, presents, whether it takes position_ids."""

    def __init__(self, session: Any) -> None:
        self.session = session
        inputs = session.get_inputs()
        self.spec = [
            (i.name, int(i.shape[1]), int(i.shape[3])) for i in inputs if i.name.startswith(PAST)
        ]
        self.presents = [n.replace("past_key_values.", PRESENT) for n, _, _ in self.spec]
        self.positions = any(i.name == "position_ids" for i in inputs)
        first = next(i for i in inputs if i.name.startswith(PAST))
        self.dtype = np.dtype(np.float16 if "float16" in first.type else np.float32)
        logits = next(o for o in session.get_outputs() if o.name == "logits")
        self.vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else 0
        self.bytes_per_token = sum(h * d for _, h, d in self.spec) * self.dtype.itemsize

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits, *present = self.session.run(["logits", *self.presents], feeds)
        return logits, dict(zip((n for n, _, _ in self.spec), present, strict=True))


@dataclass
class _Block:
    """One full block of a cached prompt: its KV, keyed by the hash of every token up to
    its end (its parent's key and its own tokens), so any prompt sharing that prefix finds
    it, whatever follows."""

    key: bytes
    parent: bytes | None
    kv: dict[str, np.ndarray]  # [1, heads, block, dim] per past input
    children: int = 0  # cached blocks that extend it
    used: int = 0  # when it was last looked up or stored (LRU)


class PrefixCache:
    """KV of prompt prefixes, block by block, as vLLM's automatic prefix caching keeps them:
    every full block of every stored prompt is kept under a hash chain (sha256 over the
    parent block's hash and its own token ids), so a request sharing only a system prompt
    with an earlier one, or a chat that grows turn by turn, reuses the blocks they share.
    Least recently used blocks are evicted first, and only leaves (a block whose extension
    is cached stays while it is), so every cached block is reachable from the start."""

    def __init__(self, capacity: int, block: int) -> None:
        self.capacity, self.block = capacity, block
        self.blocks: dict[bytes, _Block] = {}
        self.held = 0  # tokens held (blocks x block size)
        self.hits = self.misses = self.hit_tokens = 0
        self._clock = itertools.count(1)

    def _keys(self, prompt: list[int]) -> list[bytes]:
        """The chain of block keys of the prompt's full blocks, leaving at least one token
        to prefill (its logits give the first generated token)."""
        import hashlib

        keys: list[bytes] = []
        parent = b""
        for end in range(self.block, len(prompt), self.block):
            ids = np.asarray(prompt[end - self.block : end], np.int64).tobytes()
            parent = hashlib.sha256(parent + ids).digest()
            keys.append(parent)
        return keys

    def lookup(self, prompt: list[int]) -> tuple[int, dict[str, np.ndarray] | None]:
        """The longest run of cached blocks the prompt starts with, as one past, and its
        length in tokens (0, None: none cached)."""
        found: list[_Block] = []
        for key in self._keys(prompt):
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        if not found:
            self.misses += 1
            return 0, None
        now = next(self._clock)
        for block in found:
            block.used = now
        n = len(found) * self.block
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + n
        names = found[0].kv.keys()
        return n, {k: np.concatenate([b.kv[k] for b in found], axis=2) for k in names}

    def evict(self, keep: frozenset[bytes] = frozenset()) -> bool:
        """Drop the least recently used leaf block (not one in `keep`); False if none."""
        leaves = [b for b in self.blocks.values() if not b.children and b.key not in keep]
        if not leaves:
            return False
        old = min(leaves, key=lambda b: b.used)
        del self.blocks[old.key]
        if old.parent is not None and old.parent in self.blocks:
            self.blocks[old.parent].children -= 1
        self.held -= self.block
        return True

    def store(self, prompt: list[int], past: dict[str, np.ndarray], room: int) -> None:
        """Keep every full block of the prompt not cached yet, within `room` tokens (what
        the running batch leaves of the KV budget) and the cache's own capacity, evicting
        least recently used blocks of other prompts; a block that does not fit ends it
        (the ones after it would be unreachable)."""
        limit = min(self.capacity, room)
        if limit < self.block:
            return
        keys = self._keys(prompt)
        chain = frozenset(keys)
        now = next(self._clock)
        parent: bytes | None = None
        for i, key in enumerate(keys):
            block = self.blocks.get(key)
            if block is None:
                while self.held + self.block > limit:
                    if not self.evict(keep=chain):
                        return
                start = i * self.block
                kv = {
                    k: np.ascontiguousarray(v[:, :, start : start + self.block])
                    for k, v in past.items()
                }
                block = self.blocks[key] = _Block(key, parent, kv)
                if parent is not None:
                    self.blocks[parent].children += 1
                self.held += self.block
            block.used = now
            parent = key


@dataclass
class Sequence:
    key: int
    prompt: list[int]
    params: GenerationParams
    emit: Callable[[Event], None]
    arrival: float
    rng: np.random.Generator
    detok: Detokenizer | None
    stops: frozenset[int]
    generated: list[int] = field(default_factory=list)
    done: int = 0  # prompt tokens prefilled
    past: dict[str, np.ndarray] | None = None  # its own cache while it prefills
    cached: int = 0
    cancelled: bool = False
    last: float = 0.0  # when its latest token was emitted (inter-token latency)

    @property
    def total(self) -> int:
        return len(self.prompt) + self.params.max_tokens


class Handle:
    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self._engine, self._seq = engine, seq

    def cancel(self) -> None:
        """The client went away: the sequence leaves at the next iteration."""
        self._seq.cancelled = True
        self._engine._wake()


class Engine:
    def __init__(
        self,
        graph: Graph,
        settings: EngineSettings,
        text: Text | None = None,
        metrics: Any = None,
    ) -> None:
        self.graph, self.settings, self.text = graph, settings, text
        self.metrics = metrics  # engine.metrics.Metrics, or None: nothing measured
        self.eos = frozenset(settings.eos_token_ids)
        self.batch = Batch(graph.spec, graph.dtype)
        self.rows: dict[int, Sequence] = {}  # running, by key
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.prefix = (
            PrefixCache(settings.prefix_cache_tokens, settings.prefix_block)
            if settings.prefix_cache_tokens
            else None
        )
        self.steps = 0
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="shipyard-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests in
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
            if self.settings.max_queue and len(self.waiting) >= self.settings.max_queue:
                if self.metrics is not None:
                    self.metrics.finished("rejected", 0, False)
                raise QueueFull(
                    f"queue full: {len(self.waiting)} requests waiting (max_queue_depth "
                    f"{self.settings.max_queue}); retry later"
                )
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
            self.waiting.append(seq)
            if self.metrics is not None:
                self.metrics.queue.set(len(self.waiting))
            self._cv.notify()
        return Handle(self, seq)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self.waiting or self.prefilling or self.rows):
                    self._cv.wait()
                if self._stop:
                    break
                self._drop()
                self._admit()
                self._gauges()
            try:
                if self.prefilling:
                    self._prefill()
                if self.rows:
                    self._decode()
            except Exception as exc:  # the graph failed: every running request learns why
                self._fail_all(f"{type(exc).__name__}: {exc}")
            with self._cv:
                self._gauges()  # what the iteration left (all zero once idle)
        self._fail_all("the server is shutting down", 503)

    def _gauges(self) -> None:
        """Waiting and running requests and the cache they hold, as they are now (an idle
        engine reads 0, not what its last step held)."""
        m = self.metrics
        if m is None:
            return
        m.queue.set(len(self.waiting))
        m.waiting.set(len(self.waiting))
        m.running.set(len(self.rows) + len(self.prefilling))
        held = len(self.batch.keys) * self.batch.length if self.rows else 0
        m.kv.set(held / self.settings.kv_budget_tokens)

    def _drop(self) -> None:
        now, s = time.monotonic(), self.settings
        keep: collections.deque[Sequence] = collections.deque()
        for seq in self.waiting:
            if seq.cancelled:
                continue
            if s.timeout_s and now - seq.arrival > s.timeout_s:
                if self.metrics is not None:
                    self.metrics.finished("timeout", 0, False)
                seq.emit(
                    Event(
                        error=f"not admitted within {s.timeout_s:g} s (request_timeout_seconds)",
                        status=504,
                    )
                )
                continue
            keep.append(seq)
        self.waiting = keep
        self.prefilling = [q for q in self.prefilling if not q.cancelled]
        gone = [k for k, q in self.rows.items() if q.cancelled]
        for k in gone:
            self.rows.pop(k).emit(Event(finish="abort"))
            self.batch.leave(k)
            if self.metrics is not None:
                self.metrics.finished("abort", 0, False)

    def _admit(self) -> None:
        s = self.settings
        if s.policy == "request" and (self.rows or self.prefilling):
            return
        now, skipped = time.monotonic(), 0
        # without position_ids a left-padded row would be misplaced: one sequence at a time
        rows = s.max_rows if self.graph.positions else 1
        while skipped < len(self.waiting):
            seq = self.waiting[skipped]
            if len(self.rows) + len(self.prefilling) >= rows:
                return
            if self._fits(seq):
                del self.waiting[skipped]
                self._start(seq)
                continue
            if s.policy == "request" or now - seq.arrival >= s.max_wait_s:
                return  # it has waited long enough: nobody overtakes it
            skipped += 1

    def _fits(self, seq: Sequence) -> bool:
        """The padded cache with `seq` in it, plus the cached prefixes, within the budget;
        free slots are compacted away, and cached prefixes give way (least recently used
        first), for a request that needs the room."""
        need, budget = self._need(seq), self.settings.kv_budget_tokens
        if need > budget and self.batch.free:
            self.batch.compact()
            need = self._need(seq)
        if need > budget:
            return False
        while self.prefix is not None and self.prefix.held and need + self.prefix.held > budget:
            self.prefix.evict()
        return True

    def _need(self, seq: Sequence) -> int:
        """Tokens the padded cache may hold with `seq` among the running and prefilling:
        its rows (free slots included, less those the newcomers take) x the longest total."""
        active = {q.key: q for q in [*self.rows.values(), *self.prefilling, seq]}.values()
        joining = len(active) - len(self.rows)
        rows = len(self.batch.keys) + max(0, joining - self.batch.free)
        return rows * max(q.total for q in active)

    def _start(self, seq: Sequence) -> None:
        if self.prefix is not None:
            seq.cached, seq.past = self.prefix.lookup(seq.prompt)
            seq.done = seq.cached
        self.prefilling.append(seq)

    def _prefill(self) -> None:
        """At most `chunk` prompt tokens this iteration: prompts that fit together are
        prefilled in one pass (the same number of tokens already cached: none, or a cached
        prefix; the rest left-padded to the longest, as the decode batch pads them); the
        rest one chunk at a time, each on its own cache."""
        budget = self.settings.chunk
        group = self._group(budget)
        if len(group) > 1:
            budget -= len(group) * max(len(q.prompt) - q.done for q in group)
            self._prefill_together(group)
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            n = min(budget, len(seq.prompt) - seq.done)
            ids = np.array([seq.prompt[seq.done : seq.done + n]], np.int64)
            past = (
                seq.past
                if seq.past is not None
                else empty_past(self.graph.spec, 1, self.graph.dtype)
            )
            mask = np.ones((1, seq.done + n), np.int64)
            feeds = {"input_ids": ids, "attention_mask": mask, **past}
            if self.graph.positions:
                feeds["position_ids"] = positions_from_mask(mask, n)
            logits, seq.past = self.graph.run(feeds)
            seq.done, budget = seq.done + n, budget - n
            if seq.done == len(seq.prompt):
                real = self._prefilled(seq, logits[0, -1], seq.past, mask[0])
                if real is not None:
                    self._join(seq, real)

    def _group(self, budget: int) -> list[Sequence]:
        """Prompts that can be prefilled in one pass, in arrival order: the same number of
        tokens already in their caches as the first (0, or a cached prefix of that length),
        and the rest of every prompt within the budget, padded to the longest. None without
        position_ids (a padded row would be misplaced)."""
        group: list[Sequence] = []
        if not self.graph.positions:
            return group
        for seq in self.prefilling:
            if group and seq.done != group[0].done:
                continue
            width = max([len(seq.prompt) - seq.done, *(len(q.prompt) - q.done for q in group)])
            if (len(group) + 1) * width > budget:
                break
            group.append(seq)
        return group

    def _prefill_together(self, group: list[Sequence]) -> None:
        """One pass for the group: each row's cached tokens, padding, then the rest of its
        prompt (the padding between is masked; positions count only real tokens)."""
        done = group[0].done
        width = max(len(q.prompt) - done for q in group)
        ids = np.zeros((len(group), width), np.int64)
        mask = np.zeros((len(group), done + width), np.int64)
        mask[:, :done] = 1
        for row, seq in enumerate(group):
            rest = seq.prompt[done:]
            ids[row, width - len(rest) :] = rest
            mask[row, done + width - len(rest) :] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if done:
            feeds |= {
                name: np.concatenate([q.past[name] for q in group if q.past is not None])
                for name, _, _ in self.graph.spec
            }
        else:
            feeds |= empty_past(self.graph.spec, len(group), self.graph.dtype)
        feeds["position_ids"] = positions_from_mask(mask, width)
        logits, presents = self.graph.run(feeds)
        going = []
        for row, seq in enumerate(group):
            seq.done = len(seq.prompt)
            past = {k: v[row : row + 1] for k, v in presents.items()}
            real = self._prefilled(seq, logits[row, -1], past, mask[row])
            if real is not None:
                going.append((seq, real))
        # rows only for the sequences that go on (one that stopped at its first token, a
        # max_tokens 1, EOS or a stop, takes none), made in one copy of the cache
        self.batch.reserve(len(going), max((len(q.prompt) for q, _ in going), default=0))
        for seq, real in going:
            self._join(seq, real)

    def _prefilled(
        self, seq: Sequence, logits: np.ndarray, past: dict[str, np.ndarray], mask: np.ndarray
    ) -> dict[str, np.ndarray] | None:
        """Its prompt is in the cache: sample the first token. Its cache (the row's own
        tokens) when it goes on, to join the running batch; None when it ended."""
        self.prefilling.remove(seq)
        seq.past = None
        keep = mask.astype(bool)  # the row's own tokens: padding left of or inside it goes
        real = past if keep.all() else {k: v[:, :, keep] for k, v in past.items()}
        if self.prefix is not None:
            self.prefix.store(seq.prompt, real, self.settings.kv_budget_tokens - self._need(seq))
        return real if self._take(seq, logits) else None

    def _join(self, seq: Sequence, past: dict[str, np.ndarray]) -> None:
        self.batch.join(seq.key, past)
        self.rows[seq.key] = seq

    def _decode(self) -> None:
        # a free slot rides along in every step (its row's attention over the padded
        # length): kept only while a sequence on its way in may take it, dropped otherwise
        # without copying the cache (a full compaction here was a second copy of it at
        # the plan's extreme: +56 MiB over the plan on an 8 x 1k-token batch)
        # (issue 41: after a burst of one-token requests a lone request decoded 2.1-2.7x
        # slower, beside 1,515 cached slots nobody used)
        self.batch.drop_free(len(self.prefilling) + len(self.waiting))
        order = list(self.batch.keys)
        tokens = np.array(
            [self.rows[k].generated[-1] if k is not None else 0 for k in order], np.int64
        )
        logits, presents = self.graph.run(self.batch.feeds(tokens, self.graph.positions))
        self.batch.advance(presents)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.rows.observe(len(self.rows))
        for row, key in enumerate(order):
            if key is not None and not self._take(self.rows[key], logits[row, -1]):
                del self.rows[key]
                self.batch.leave(key)

    def _take(self, seq: Sequence, logits: np.ndarray) -> bool:
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

    def _measure(self, seq: Sequence, event: Event, stopped: bool) -> None:
        now, m = time.monotonic(), self.metrics
        if len(seq.generated) == 1:
            m.ttft.observe(now - seq.arrival)
            m.prompt.inc(len(seq.prompt))
        else:
            m.itl.observe(now - seq.last)
        seq.last = now
        m.generated.inc()
        if event.finish:
            # empty: the first token was already a stop (nothing a user would read)
            m.finished(event.finish, len(seq.generated), stopped and len(seq.generated) == 1)

    def _fail_all(self, why: str, status: int = 500) -> None:
        with self._cv:
            for seq in [*self.rows.values(), *self.prefilling, *self.waiting]:
                seq.emit(Event(error=why, status=status))
                if self.metrics is not None:
                    self.metrics.finished("error", len(seq.generated), False)
            self.rows.clear()
            self.prefilling.clear()
            self.waiting.clear()
            self.batch = Batch(self.graph.spec, self.graph.dtype)


_NONE = np.zeros(0, np.int64)
