"""The running batch's KV cache: one array per past input, [rows, heads, length, dim], rows
left-padded to a common length (zeros in the mask, positions from the mask: kvcheck's padded
probe holds the graph to that).

A decode step feeds these arrays and takes the presents back as the next step's pasts. The
cache is not rebuilt when membership changes: a row that leaves stays as a free slot (its
mask zeroed; it rides along in the decode steps, a small cost at these batch sizes, since a
decode step reads the weights once for every row), and a sequence that joins is written
into a free slot, one row's copy. Only growing the batch (new slots, or a prompt longer
than every row) copies it whole, once for all the sequences prefilled together, and so
does compacting it, once free slots outnumber the sequences or a quarter of the columns
are padding nobody needs. Measured on gpt2-small at
16 streams, rebuilding on every join and leave spent 3.6 s of a 9.6 s run copying caches;
with free slots, 0.5 s (benchmarks/bench_continuous_batching.py).
"""

from __future__ import annotations

from typing import cast

import numpy as np


def empty_past(
    spec: list[tuple[str, int, int]], rows: int, dtype: np.dtype
) -> dict[str, np.ndarray]:
    return {name: np.zeros((rows, heads, 0, dim), dtype) for name, heads, dim in spec}


def positions_from_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """Position ids of the last `width` tokens of a [rows, total] mask, as transformers'
    generate derives them: a row left-padded by 3 numbers its first real token 0, not 3."""
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0) * (mask != 0)
    return cast(np.ndarray, positions[:, positions.shape[-1] - width :].astype(np.int64))


def _drop_free(cache: Batch | Slots, keep: int, per_row: str) -> bool:
    """Free slots beyond `keep` leave `cache`: the last row moves into a free one (its
    pasts and its `per_row` array's row: the mask or the lengths) and every array ends a
    row earlier (a view). Whether any row left."""
    cache.wanted = keep
    dropped = False
    while cache.free > keep:
        last = len(cache.keys) - 1
        rows = getattr(cache, per_row)
        if cache.keys[last] is not None:
            row = cache.keys.index(None)
            for array in cache.past.values():
                array[row] = array[last]
            rows[row] = rows[last]
            cache.keys[row] = cache.keys[last]
        cache.keys.pop()
        cache.past = {n: v[:last] for n, v in cache.past.items()}
        setattr(cache, per_row, rows[:last])
        dropped = True
    return dropped


class Batch:
    """Rows of running sequences (None: a free slot): their pasts and their mask."""

    def __init__(self, spec: list[tuple[str, int, int]], dtype: np.dtype) -> None:
        self.spec, self.dtype = spec, dtype
        self.past = empty_past(spec, 0, dtype)
        self.mask = np.zeros((0, 0), np.int64)
        self.keys: list[int | None] = []  # the sequence id of each row; None: free
        # free rows wanted by sequences on their way in (the scheduler's count, kept by
        # drop_free): a row that leaves does not compact them away
        self.wanted = 0

    def clear(self) -> None:
        """No rows (the engine dropped every sequence)."""
        self.past = empty_past(self.spec, 0, self.dtype)
        self.mask = np.zeros((0, 0), np.int64)
        self.keys = []
        self.wanted = 0

    def __len__(self) -> int:
        """Sequences in the batch (free slots not counted)."""
        return sum(k is not None for k in self.keys)

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    @property
    def free(self) -> int:
        return len(self.keys) - len(self)

    @classmethod
    def columns(cls, total: int) -> int:
        """The most columns a sequence of `total` tokens (prompt + max_tokens) takes: its
        row is padded to the longest (Slots round up to their capacity)."""
        return total

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` more sequences of up to `length` cached tokens, made in one copy
        of the cache (sequences prefilled together join together)."""
        more = max(0, rows - self.free)
        grow = max(0, length - self.length)
        if not (more or grow):
            return
        old = len(self.keys)
        shape = (old + more, self.length + grow)
        past = {}
        for name, array in self.past.items():
            fresh = np.zeros((shape[0], array.shape[1], shape[1], array.shape[3]), self.dtype)
            fresh[:old, :, grow:] = array
            past[name] = fresh
        mask = np.zeros(shape, np.int64)
        mask[:old, grow:] = self.mask
        self.past, self.mask = past, mask
        self.keys.extend([None] * more)

    def join(self, key: int, past: dict[str, np.ndarray]) -> None:
        """A prefilled sequence (its own past, one row, no padding) takes a free slot, or a
        new last row."""
        held = next(iter(past.values())).shape[2]
        self.reserve(1, held)
        row = self.keys.index(None)
        start = self.length - held
        for name, array in self.past.items():
            array[row] = 0
            array[row, :, start:] = past[name][0]
        self.mask[row] = 0
        self.mask[row, start:] = 1
        self.keys[row] = key

    def leave(self, key: int) -> None:
        """The sequence's row becomes a free slot; compacted once free slots (but those
        `wanted` by sequences on their way in) outnumber the sequences, or a quarter of
        every row is padding no sequence needs any more (each decode step pays for both)."""
        row = self.keys.index(key)
        self.keys[row] = None
        self.mask[row] = 0
        used = np.nonzero(self.mask.any(axis=0))[0]
        unused = int(used[0]) if used.size else self.length
        if self.free - self.wanted > len(self) or unused >= max(16, self.length // 4):
            self.compact(self.wanted)

    def drop_free(self, keep: int) -> None:
        """Free slots beyond `keep` leave the batch without a copy of the cache: the last
        row moves into a free one (one row's copy) and the arrays end a row earlier (a
        view). Rows are independent (stages/onnx/invariant.py), so order changes nothing."""
        _drop_free(self, keep, "mask")

    def compact(self, keep: int = 0) -> None:
        """Drop the columns no row uses any more and the free slots but `keep` of them."""
        live = [i for i, k in enumerate(self.keys) if k is not None]
        rows = sorted(live + [i for i, k in enumerate(self.keys) if k is None][:keep])
        used = np.nonzero(self.mask[live].any(axis=0))[0]
        start = int(used[0]) if used.size else self.length
        self.mask = np.ascontiguousarray(self.mask[rows, start:])
        self.past = {n: np.ascontiguousarray(v[rows, :, start:]) for n, v in self.past.items()}
        self.keys = [self.keys[i] for i in rows]

    def feeds(self, tokens: np.ndarray, positions: bool) -> dict[str, np.ndarray]:
        """One decode step: each row's next token [rows, 1] on the cache (free slots: 0)."""
        mask = np.concatenate([self.mask, np.ones((len(self.keys), 1), np.int64)], axis=1)
        feeds = {"input_ids": tokens.reshape(-1, 1).astype(np.int64), "attention_mask": mask}
        if positions:
            feeds["position_ids"] = positions_from_mask(mask, 1)
        return feeds | self.past

    def advance(self, presents: dict[str, np.ndarray]) -> None:
        """The step's presents (keyed by past name) are the cache now; the mask grows (a free
        slot's stays zero)."""
        self.past = presents
        live = np.array([[k is not None] for k in self.keys], np.int64).reshape(-1, 1)
        self.mask = np.concatenate([self.mask, live], axis=1)


class Slots:
    """The running batch's cache for a graph that updates it in place (a fused graph,
    stages/onnx/fused.py: GroupQueryAttention bound to one buffer as its past and its
    present): per past input one [rows, heads, capacity, dim] buffer, each row's tokens at
    its start (right-padded: the kernel reads a row's length from its mask), and each row's
    length. A decode step writes each row's new keys at the row's length and copies nothing;
    the same interface as Batch otherwise (free slots, joins, compaction).

    The capacity grows in steps of STEP tokens (a growth copies the buffers, once in STEP
    decode steps at worst, where the traced graph's presents copy the whole cache every
    step), and shrinks when compacted. A free slot decodes token 0 at position 0 of its own
    row, which no other row reads."""

    STEP = 64

    def __init__(
        self, spec: list[tuple[str, int, int]], dtype: np.dtype, most: int | None = None
    ) -> None:
        """`most`: the most tokens a row ever holds (the served past + 2: a sequence's prompt
        and tokens but its last); the capacity never rounds past it, so the engine's budget
        (rows x the longest sequence, the plan's) holds whole rows at the extreme."""
        self.spec, self.dtype, self.most = spec, dtype, most
        self.clear()

    def clear(self) -> None:
        self.past = {n: np.zeros((0, h, 0, d), self.dtype) for n, h, d in self.spec}
        self.lengths = np.zeros(0, np.int64)
        self.keys: list[int | None] = []
        self.wanted = 0
        self.version = 0  # bumped whenever a buffer is replaced or resized (bindings)

    def __len__(self) -> int:
        return sum(k is not None for k in self.keys)

    @property
    def length(self) -> int:
        """The capacity: cache slots a row holds."""
        return int(next(iter(self.past.values())).shape[2]) if self.past else 0

    @property
    def free(self) -> int:
        return len(self.keys) - len(self)

    def rounded(self, tokens: int) -> int:
        """The capacity that holds `tokens` cached tokens and the next one."""
        up = -(-(tokens + 1) // self.STEP) * self.STEP
        return max(tokens + 1, min(up, self.most)) if self.most else up

    def columns(self, total: int) -> int:
        """The most capacity a sequence of `total` tokens (prompt + max_tokens) needs: it
        caches total - 1 at most (its last token is never fed), written by a step that
        read total - 2, so the capacity that holds total - 2 and the next one (never past
        `most`: a sequence the engine admits has total <= most)."""
        return self.rounded(max(total - 2, 0))

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` more sequences of up to `length` cached tokens (and each one's
        next token), in one copy of the cache."""
        more = max(0, rows - self.free)
        capacity = max(self.length, self.rounded(length))
        if not more and capacity == self.length:
            return
        self._remake(list(range(len(self.keys))), more, capacity)

    def _remake(self, rows: list[int], more: int, capacity: int) -> None:
        old = self.length
        keep = min(old, capacity)
        past = {}
        for name, array in self.past.items():
            fresh = np.zeros(
                (len(rows) + more, array.shape[1], capacity, array.shape[3]), self.dtype
            )
            for i, row in enumerate(rows):  # a view a row: array[rows] would copy the layer
                fresh[i, :, :keep] = array[row, :, :keep]
            past[name] = fresh
        self.past = past
        self.lengths = np.concatenate([self.lengths[rows], np.zeros(more, np.int64)])
        self.keys = [self.keys[i] for i in rows] + [None] * more
        self.version += 1

    def join(self, key: int, past: dict[str, np.ndarray]) -> None:
        """A prefilled sequence (its own past, one row) takes a free slot or a new row."""
        held = next(iter(past.values())).shape[2]
        self.reserve(1, held)
        row = self.keys.index(None)
        for name, array in self.past.items():
            array[row, :, :held] = past[name][0]
            array[row, :, held:] = 0
        self.lengths[row] = held
        self.keys[row] = key

    def leave(self, key: int) -> None:
        """The row becomes a free slot; compacted once free slots (but those `wanted`)
        outnumber the sequences, or the rows left need under half the capacity."""
        row = self.keys.index(key)
        self.keys[row] = None
        self.lengths[row] = 0
        live = max(
            (int(n) for n, k in zip(self.lengths, self.keys, strict=True) if k is not None),
            default=0,
        )
        if self.free - self.wanted > len(self) or self.rounded(live) <= self.length // 2:
            self.compact(self.wanted)

    def drop_free(self, keep: int) -> None:
        """Free slots beyond `keep` leave: the last row moves into a free one (one row's
        copy) and the buffers end a row earlier (a view, still contiguous)."""
        if _drop_free(self, keep, "lengths"):
            self.version += 1

    def compact(self, keep: int = 0) -> None:
        """The live rows and `keep` free ones, in a capacity fitted to the longest row."""
        live = [i for i, k in enumerate(self.keys) if k is not None]
        rows = sorted(live + [i for i, k in enumerate(self.keys) if k is None][:keep])
        longest = max((int(self.lengths[i]) for i in live), default=0)
        self._remake(rows, 0, self.rounded(longest) if rows else 0)

    def ready(self) -> None:
        """Room for every row's next token (a decode step writes it at the row's length)."""
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        if longest + 1 > self.length:
            self._remake(list(range(len(self.keys))), 0, self.rounded(longest))

    def mask(self) -> np.ndarray:
        """A decode step's mask: each row's cached tokens and its new one, right-padded."""
        width = int(self.lengths.max()) + 1
        return (np.arange(width)[None, :] <= self.lengths[:, None]).astype(np.int64)

    def advance(self) -> None:
        """The step wrote each live row's token: its length grows (a free slot's stays 0)."""
        self.lengths += np.array([k is not None for k in self.keys], np.int64)
