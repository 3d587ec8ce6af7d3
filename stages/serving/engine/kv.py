"""The running batch's KV cache: one array per past input, [rows, heads, length, dim], rows
left-padded to a common length (zeros in the mask, positions from the mask: kvcheck's padded
probe holds the graph to that).

A decode step feeds these arrays and takes the presents back as the next step's pasts: no
copy of the cache is made outside the graph's own concatenation. The cache is copied only
when membership changes: a sequence that joins is padded to the batch's length (and the
batch to its), rows that leave are filtered out, and columns no row uses any more are cut."""

from __future__ import annotations

import numpy as np


def empty_past(
    spec: list[tuple[str, int, int]], rows: int, dtype: np.dtype
) -> dict[str, np.ndarray]:
    return {name: np.zeros((rows, heads, 0, dim), dtype) for name, heads, dim in spec}


def positions_from_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """Position ids of the last `width` tokens of a [rows, total] mask, as transformers'
    generate derives them: a row left-padded by 3 numbers its first real token 0, not 3."""
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0) * (mask != 0)
    return positions[:, positions.shape[-1] - width :].astype(np.int64)


class Batch:
    """Rows of running sequences: their pasts, their mask, and the row order."""

    def __init__(self, spec: list[tuple[str, int, int]], dtype: np.dtype) -> None:
        self.spec, self.dtype = spec, dtype
        self.past = empty_past(spec, 0, dtype)
        self.mask = np.zeros((0, 0), np.int64)
        self.keys: list[int] = []  # the sequence id of each row

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def tokens(self) -> int:
        """Padded size of the cache in tokens (rows x length): what it holds in memory."""
        return len(self) * self.length

    def join(self, key: int, past: dict[str, np.ndarray]) -> None:
        """A prefilled sequence (its own past, one row) becomes the last row."""
        held = next(iter(past.values())).shape[2]
        length = max(self.length, held)
        grow, pad = length - self.length, length - held
        for name in self.past:
            left = np.pad(self.past[name], ((0, 0), (0, 0), (grow, 0), (0, 0)))
            right = np.pad(past[name], ((0, 0), (0, 0), (pad, 0), (0, 0)))
            self.past[name] = np.concatenate([left, right.astype(self.dtype, copy=False)])
        row = np.r_[np.zeros(pad, np.int64), np.ones(held, np.int64)][None]
        self.mask = np.concatenate([np.pad(self.mask, ((0, 0), (grow, 0))), row])
        self.keys.append(key)

    def keep(self, keys: list[int]) -> None:
        """Only these rows stay (in their order); columns no remaining row uses are cut."""
        if keys == self.keys:
            return
        rows = [self.keys.index(k) for k in keys]
        self.mask = self.mask[rows]
        used = np.nonzero(self.mask.any(axis=0))[0]
        start = int(used[0]) if used.size else self.length
        self.mask = self.mask[:, start:]
        self.past = {n: np.ascontiguousarray(v[rows, :, start:]) for n, v in self.past.items()}
        self.keys = list(keys)

    def feeds(self, tokens: np.ndarray, positions: bool) -> dict[str, np.ndarray]:
        """One decode step: each row's next token [rows, 1] on the cache."""
        mask = np.concatenate([self.mask, np.ones((len(self), 1), np.int64)], axis=1)
        feeds = {"input_ids": tokens.reshape(-1, 1).astype(np.int64), "attention_mask": mask}
        if positions:
            feeds["position_ids"] = positions_from_mask(mask, 1)
        return feeds | self.past

    def advance(self, presents: dict[str, np.ndarray]) -> None:
        """The step's presents (keyed by past name) are the cache now; the mask grows."""
        self.past = presents
        self.mask = np.concatenate([self.mask, np.ones((len(self), 1), np.int64)], axis=1)
