"""The model runner: executes a step plan on the KV-cache graph (vLLM's model runner, TGI's
`Model.generate_token`). It owns the running batch's cache (kv.Batch) and returns logits;
what to run is the scheduler's decision, what the logits mean is the output processor's.

Where a decode step's time goes is counted by part (`Runner.times`, read through
`Engine.step_profile()`). The whole-cache copy a step makes is the graph's own: its presents
are the pasts concatenated with the new token's keys and values. `session.run` adds none
(onnxruntime 1.2x hands its output buffers to numpy without a copy; binding preallocated
outputs measured the same, 23.0 vs 23.4 ms for a 295 MB cache).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from shipyard_runtime.generation.kv import Batch, Slots, empty_past, positions_from_mask

PAST, PRESENT = "past_key_values.", "present."
# the mark of a graph whose rows are right-padded and whose cache is updated in place
# (stages/onnx/fused.py keeps the same key, held equal by a test)
PADDING_KEY = "shipyard.padding"


class Graph:
    """The KV-cache graph: its past inputs, presents, whether it takes position_ids."""

    def __init__(self, session: Any) -> None:
        self.session = session
        inputs = session.get_inputs()
        self.spec = [
            (i.name, int(i.shape[1]), int(i.shape[3])) for i in inputs if i.name.startswith(PAST)
        ]
        self.presents = [n.replace(PAST, PRESENT) for n, _, _ in self.spec]
        self.positions = any(i.name == "position_ids" for i in inputs)
        first = next(i for i in inputs if i.name.startswith(PAST))
        self.dtype = np.dtype(np.float16 if "float16" in first.type else np.float32)
        logits = next(o for o in session.get_outputs() if o.name == "logits")
        self.vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else 0
        self.bytes_per_token = sum(h * d for _, h, d in self.spec) * self.dtype.itemsize
        meta = session.get_modelmeta().custom_metadata_map
        # right-padded rows, the cache updated in place (a fused graph): never left-padded
        self.in_place = meta.get(PADDING_KEY) == "right"

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits, *present = self.session.run(["logits", *self.presents], feeds)
        return logits, dict(zip((n for n, _, _ in self.spec), present, strict=True))

    def run_into(
        self, feeds: dict[str, np.ndarray], length: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """As `run`, each present written into an array of `length` tokens made here (the
        past fed and the new tokens), not one from ONNX Runtime's arena: the arena keeps the
        largest blocks it ever gave, so a prompt's presents, chunk after chunk, stayed held
        beside the engine's budget (8 rows of 882-token prompts on the plan test's fused
        decoder: 22 MiB, 1.5 sequences, more at the peak; docs/benchmarks.md)."""
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")
        rows = len(feeds["input_ids"])
        out = {}
        for (name, heads, dim), present in zip(self.spec, self.presents, strict=True):
            array = out[name] = np.empty((rows, heads, length, dim), self.dtype)
            shape = list(array.shape)
            binding.bind_output(present, "cpu", 0, array.dtype, shape, array.ctypes.data)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy(), out


Past = dict[str, np.ndarray]


class Runner:
    """Prefill passes and decode steps on `graph`; the running batch's cache."""

    def __init__(self, graph: Graph, most: int | None = None) -> None:
        """`most`: the most tokens a sequence caches (an in-place cache's capacity cap)."""
        self.graph = graph
        self.batch: Batch | Slots = (
            Slots(graph.spec, graph.dtype, most)
            if graph.in_place
            else Batch(graph.spec, graph.dtype)
        )
        self._binding: tuple[int, Any] | None = None  # (the cache's version, its binding)
        # seconds spent in decode steps, by part: the graph, its inputs, the cache's own
        # copies (rows leaving, compaction); rows joining after their prefill (between
        # steps); the engine adds the rest
        self.times: collections.defaultdict[str, float] = collections.defaultdict(float)

    def prefill_together(
        self, prompts: list[list[int]], done: int, cached: list[Past | None]
    ) -> list[tuple[np.ndarray, Past]]:
        """One pass for prompts with `done` tokens already cached each (`cached`, one row
        each, or None when done is 0): the cached tokens, padding, then the rest of each
        prompt (the padding between is masked; positions count only real tokens). Each
        prompt's last logits and its own cache (its real tokens only)."""
        width = max(len(p) - done for p in prompts)
        rows = len(prompts)
        ids = np.zeros((rows, width), np.int64)
        mask = np.zeros((rows, done + width), np.int64)
        mask[:, :done] = 1
        for row, prompt in enumerate(prompts):
            rest = prompt[done:]
            ids[row, width - len(rest) :] = rest
            mask[row, done + width - len(rest) :] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if done:
            feeds |= {
                name: np.concatenate([c[name] for c in cached if c is not None])
                for name, _, _ in self.graph.spec
            }
        else:
            feeds |= empty_past(self.graph.spec, rows, self.graph.dtype)
        feeds["position_ids"] = positions_from_mask(mask, width)
        logits, presents = self.graph.run(feeds)
        out = []
        for row in range(rows):
            keep = mask[row].astype(bool)  # the row's own tokens: padding inside it goes
            past = {k: v[row : row + 1] for k, v in presents.items()}
            if not keep.all():
                past = {k: v[:, :, keep] for k, v in past.items()}
            out.append((logits[row, -1], past))
        return out

    def prefill_chunk(
        self, prompt: list[int], done: int, n: int, past: Past | None
    ) -> tuple[np.ndarray, Past]:
        """The next `n` tokens of one prompt on its own cache (`done` tokens in `past`):
        the last logits and the cache grown by them."""
        ids = np.array([prompt[done : done + n]], np.int64)
        mask = np.ones((1, done + n), np.int64)
        feeds = {
            "input_ids": ids,
            "attention_mask": mask,
            **(past if past is not None else empty_past(self.graph.spec, 1, self.graph.dtype)),
        }
        if self.graph.positions:
            feeds["position_ids"] = positions_from_mask(mask, n)
        if self.graph.in_place:  # presents of the past and the chunk, in arrays of ours
            logits, presents = self.graph.run_into(feeds, done + n)
        else:
            logits, presents = self.graph.run(feeds)
        return logits[0, -1], presents

    def join(self, pasts: list[tuple[int, Past]], coming: tuple[int, int] = (0, 0)) -> None:
        """Sequences whose prefill ended take rows, made in one copy of the cache. `coming`:
        (rows, longest prompt) of the sequences that join within a step or so (admitted,
        their prompt's last chunk fits the next step); when the batch must grow now it
        grows for them too, so they join without another copy of the whole cache (on a
        30-layer decoder at 16 streams, a row at a time cost 40-130 ms a join)."""
        if not pasts:
            return
        start = time.perf_counter()
        longest = max(next(iter(p.values())).shape[2] for _, p in pasts)
        if len(pasts) > self.batch.free or longest > self.batch.length:
            self.batch.reserve(len(pasts) + coming[0], max(longest, coming[1]))
        for key, past in pasts:
            self.batch.join(key, past)
        self.times["join"] += time.perf_counter() - start

    def decode(self, last_tokens: dict[int, int]) -> list[tuple[int, np.ndarray]]:
        """One step for every running row (`last_tokens`: key -> its latest token); each
        row's next-token logits, in row order."""
        t0 = time.perf_counter()
        order = list(self.batch.keys)
        tokens = np.array([last_tokens[k] if k is not None else 0 for k in order], np.int64)
        if isinstance(self.batch, Slots):
            return self._decode_in_place(order, tokens, t0)
        feeds = self.batch.feeds(tokens, self.graph.positions)
        t1 = time.perf_counter()
        logits, presents = self.graph.run(feeds)
        t2 = time.perf_counter()
        self.batch.advance(presents)
        self.times["inputs"] += t1 - t0 + time.perf_counter() - t2
        self.times["graph"] += t2 - t1
        self.times["slots"] += len(order) * (self.batch.length - 1)  # the past it read
        return [(k, logits[row, -1]) for row, k in enumerate(order) if k is not None]

    def _decode_in_place(
        self, order: list[int | None], tokens: np.ndarray, t0: float
    ) -> list[tuple[int, np.ndarray]]:
        """One step on the Slots' buffers, each bound as its layer's past and present: the
        graph writes each row's new keys and values at the row's length, nothing else."""
        slots = self.batch
        assert isinstance(slots, Slots)
        slots.ready()
        binding = self._bind(slots)
        binding.bind_cpu_input("input_ids", tokens.reshape(-1, 1))
        binding.bind_cpu_input("attention_mask", slots.mask())
        t1 = time.perf_counter()
        self.graph.session.run_with_iobinding(binding)
        t2 = time.perf_counter()
        logits = binding.get_outputs()[0].numpy()
        slots.advance()
        self.times["inputs"] += t1 - t0 + time.perf_counter() - t2
        self.times["graph"] += t2 - t1
        self.times["slots"] += len(order) * (slots.length - 1)
        return [(k, logits[row, -1]) for row, k in enumerate(order) if k is not None]

    def _bind(self, slots: Slots) -> Any:
        """The buffers bound as pasts and presents, kept until the Slots remake them."""
        if self._binding is None or self._binding[0] != slots.version:
            binding = self.graph.session.io_binding()
            binding.bind_output("logits", "cpu")  # the first output: allocated each run
            for (name, _, _), present in zip(self.graph.spec, self.graph.presents, strict=True):
                array = slots.past[name]
                assert array.flags.c_contiguous
                for bind, key in ((binding.bind_input, name), (binding.bind_output, present)):
                    bind(key, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            self._binding = (slots.version, binding)
        return self._binding[1]

    def leave(self, key: int) -> None:
        start = time.perf_counter()
        self.batch.leave(key)
        self.times["cache"] += time.perf_counter() - start

    def clear(self) -> None:
        self.batch.clear()
        self._binding = None

    @property
    def held(self) -> int:
        """Cache slots the running batch holds (rows x length, padding included)."""
        return len(self.batch.keys) * self.batch.length
