"""The scheduler: iteration-level (continuous) batching policy over plain state, the way
LLM servers split it (vLLM's `Scheduler.schedule()` -> `SchedulerOutput`, TGI's
`next_batch(budget)`). It holds the waiting, prefilling and running sequences and the
prefix cache, and each `schedule()` returns a `StepPlan`; it runs no graph and samples
nothing (shipyard_runtime/generation/runner.py runs a plan, output.py turns logits into tokens,
core.py's `Engine.step()` ties them together). Each step:
1. cancelled and timed-out requests leave; waiting ones are admitted while a row is free and
   the padded cache (rows x longest total) stays within the KV budget, first come first
   served; a request that does not fit may be overtaken by later ones that do, until it has
   waited `max_wait_s`, after which nobody overtakes it (so neither a long request nor the
   short ones behind it starve);
2. at most `chunk` prompt tokens are prefilled: prompts with as many tokens already cached
   and lengths close enough that the padding costs less than the passes it saves go
   together in one pass (left-padded), the rest one chunk at a time on their own cache,
   starting from the longest cached prefix when prefix caching is on; a prompt whose
   prefill ends samples its first token and joins the running batch;
3. one decode step for every running sequence together; rows leave at EOS, a stop token
   or string, or their token limit.

The `request` policy is the request-level baseline: a batch is admitted only when the
previous one has finished, and nobody joins it midway.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from shipyard_runtime.generation.kv import Batch, Slots
from shipyard_runtime.generation.params import GenerationParams
from shipyard_runtime.generation.text import Detokenizer


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


# why a request ended without an answer: the front doors map a kind to their own status
# (HTTP 504 / 503 / 500, Triton's codes), so the engine knows nothing of HTTP
ErrorKind = Literal["timeout", "shutdown", "internal"]


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
    kind: ErrorKind | None = None  # what went wrong; each front door maps it to its status
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


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
                # a copy, never a view: a view of one block (one KV head: contiguous)
                # would keep the whole prefill's presents alive, uncounted
                kv = {k: np.array(v[:, :, start : start + self.block]) for k, v in past.items()}
                block = self.blocks[key] = _Block(key, parent, kv)
                if parent is not None:
                    self.blocks[parent].children += 1
                self.held += self.block
            block.used = now
            parent = key


@dataclass(eq=False)  # one request: compared by identity
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
    admitted: float = 0.0  # when the scheduler admitted it (queue and prefill time)
    looked_up: bool = False  # its prompt was looked up in the prefix cache

    @property
    def total(self) -> int:
        return len(self.prompt) + self.params.max_tokens


@dataclass
class StepPlan:
    """What one step runs: sequences that ended before it (to be told why), the prompts
    prefilled together in one pass, each other prompt's chunk (its tokens this step), and
    whether the running batch decodes after them."""

    ended: list[tuple[Sequence, Event, str]] = field(default_factory=list)  # + metric reason
    group: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.ended or self.group or self.chunks)


# Padding tokens a row may bring into a grouped prefill pass, on average. A padded token
# costs what a real one does, and a pass saved is worth about one weight read: on a 30-layer
# decoder (llama-30's INT8 graph) a prefill pass costs about 15 ms plus 1 ms a token, and 16
# prompts of 17-125 tokens took 2.0-2.4 s grouped as they arrived (1,883 tokens with the
# padding, 1,158 without) against 1.2 s one prompt a pass.
GROUP_PADDING = 16


class Scheduler:
    """Waiting, prefilling and running sequences and the prefix cache; the policy that
    plans each step. `batch` is the running batch's cache layout (rows, free slots,
    length), read to price admissions and compacted when free slots are not wanted."""

    def __init__(
        self,
        settings: EngineSettings,
        positions: bool,
        batch: Batch | Slots,
        in_place: bool = False,
    ) -> None:
        self.settings, self.positions, self.batch = settings, positions, batch
        # a graph whose rows are right-padded and whose cache is updated in place: rows
        # batch (each row's positions come from its own length), prompts prefill one a pass
        # (the kernel takes one query a row in a batch with a past)
        self.in_place = in_place
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.running: dict[int, Sequence] = {}
        self.prefix = (
            PrefixCache(settings.prefix_cache_tokens, settings.prefix_block)
            if settings.prefix_cache_tokens
            else None
        )

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a request, or QueueFull at max_queue (answered at once, never queued)."""
        if self.settings.max_queue and len(self.waiting) >= self.settings.max_queue:
            raise QueueFull(
                f"queue full: {len(self.waiting)} requests waiting (max_queue_depth "
                f"{self.settings.max_queue}); retry later"
            )
        self.waiting.append(seq)

    def schedule(self, now: float) -> StepPlan:
        """This step's plan: who leaves, who is admitted, what is prefilled."""
        plan = StepPlan()
        self._drop(now, plan)
        self._admit(now)
        budget = self.settings.chunk
        group = self._group(budget)
        if len(group) > 1:
            budget -= len(group) * max(len(q.prompt) - q.done for q in group)
            plan.group = group
        for seq in self.prefilling:
            if budget <= 0:
                break
            if seq in plan.group:
                continue
            n = min(budget, len(seq.prompt) - seq.done)
            plan.chunks.append((seq, n))
            budget -= n
        return plan

    def prefilled(self, seq: Sequence, goes_on: bool) -> None:
        """Its prompt is in the cache; it has sampled its first token and runs on, or
        ended there (a row is taken only if it goes on)."""
        self.prefilling.remove(seq)
        seq.past = None
        if goes_on:
            self.running[seq.key] = seq

    def keep_prefix(self, seq: Sequence, past: dict[str, np.ndarray]) -> None:
        """Its prompt's blocks into the prefix cache (`past`: the row's own tokens), within
        what the batch leaves of the budget once the rows of this step's prefills have
        joined (counted before they had, a group's rows were missed: the cache overran)."""
        if self.prefix is not None:
            self.prefix.store(seq.prompt, past, self.settings.kv_budget_tokens - self._need(seq))

    def finished(self, key: int) -> None:
        del self.running[key]

    def compact_free_slots(self) -> None:
        """A free slot rides along in every decode step (its row's attention over the
        padded length): kept only while a sequence on its way in may take it (issue 41:
        after a burst of one-token requests a lone request decoded 2.1-2.7x slower, beside
        1,515 cached slots nobody used), and dropped without copying the cache (a full
        compaction here was a second copy of it at the plan's extreme)."""
        self.batch.drop_free(len(self.prefilling) + len(self.waiting))

    def clear(self) -> list[Sequence]:
        """Every sequence, forgotten (the graph failed, or the engine stops)."""
        out = [*self.running.values(), *self.prefilling, *self.waiting]
        self.running.clear()
        self.prefilling.clear()
        self.waiting.clear()
        return out

    # ------------------------------------------------------------------ policy
    def _drop(self, now: float, plan: StepPlan) -> None:
        s = self.settings
        keep: collections.deque[Sequence] = collections.deque()
        for seq in self.waiting:
            if seq.cancelled:
                continue
            if s.timeout_s and now - seq.arrival > s.timeout_s:
                why = f"not admitted within {s.timeout_s:g} s (request_timeout_seconds)"
                plan.ended.append((seq, Event(error=why, kind="timeout"), "timeout"))
                continue
            keep.append(seq)
        self.waiting = keep
        self.prefilling = [q for q in self.prefilling if not q.cancelled]
        for key in [k for k, q in self.running.items() if q.cancelled]:
            plan.ended.append((self.running.pop(key), Event(finish="abort"), "abort"))
            self.batch.leave(key)

    def _admit(self, now: float) -> None:
        s = self.settings
        if s.policy == "request" and (self.running or self.prefilling):
            return
        skipped = 0
        # without position_ids a left-padded row would be misplaced: one sequence at a time
        rows = s.max_rows if self.positions or self.in_place else 1
        while skipped < len(self.waiting):
            seq = self.waiting[skipped]
            if len(self.running) + len(self.prefilling) >= rows:
                return
            if self._fits(seq):
                del self.waiting[skipped]
                seq.admitted = now
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
        active = {q.key: q for q in [*self.running.values(), *self.prefilling, seq]}.values()
        joining = len(active) - len(self.running)
        rows = len(self.batch.keys) + max(0, joining - self.batch.free)
        return rows * self.batch.columns(max(q.total for q in active))

    def _start(self, seq: Sequence) -> None:
        if self.prefix is not None:
            seq.cached, seq.past = self.prefix.lookup(seq.prompt)
            seq.done, seq.looked_up = seq.cached, True
        self.prefilling.append(seq)

    def _group(self, budget: int) -> list[Sequence]:
        """Prompts that can be prefilled in one pass, in arrival order: the same number of
        tokens already in their caches as the first (0, or a cached prefix of that length),
        the rest of every prompt within the budget, padded to the longest, and at most
        GROUP_PADDING padding tokens a row (a prompt that would bring more, or force more on
        the others, is prefilled on its own). None without position_ids (a padded row would
        be misplaced)."""
        group: list[Sequence] = []
        if not self.positions or self.in_place:
            return group
        for seq in self.prefilling:
            if group and seq.done != group[0].done:
                continue
            rests = [len(q.prompt) - q.done for q in (*group, seq)]
            width = max(rests)
            if len(rests) * width > budget:
                break
            if len(rests) > 1 and len(rests) * width - sum(rests) > GROUP_PADDING * len(rests):
                continue
            group.append(seq)
        return group
