"""The next token of one sequence from its logits: penalty, temperature, top-k, top-p.

Exact, and cheap at a 50k vocabulary: top-p sorts only the values of the tokens within a
factor of the most likely one (a comparison, no partition), widening that set while it
holds less than top_p; the whole vocabulary is sorted only for a distribution flat enough
to need it; top-k partitions only the tokens within a margin of the largest logit. At a 49k
vocabulary a draw with top-p 0.9 took 6.7 ms when the 256 most likely tokens held less than
0.9 (a stable sort of the whole vocabulary; 16 rows: 107 ms a step, twice the graph's), a
plain tempered draw 0.98 ms (float64 copies and a running sum over the vocabulary)."""

from __future__ import annotations

import math

import numpy as np

from shipyard_runtime.generation.params import GenerationParams

# each try keeps the tokens within this factor of the last try's cut (the first: of the most
# likely token's probability), down to every token
SPAN = 0.1


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's repetition penalty (as transformers applies it): a seen token's logit is
    divided by the penalty when positive, multiplied when negative."""
    if penalty == 1.0 or not seen.size:
        return logits
    out = logits.copy()
    picked = out[seen]
    out[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def choose(
    logits: np.ndarray, params: GenerationParams, rng: np.random.Generator, seen: np.ndarray
) -> int:
    """One token id from logits [vocab]."""
    logits = penalize(np.asarray(logits, dtype=np.float32), seen, params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits / np.float32(params.temperature)
    ids = None  # the vocabulary, in order (no copy of it)
    if params.top_k and params.top_k < scaled.size:
        ids = _top(scaled, params.top_k)
        scaled = scaled[ids]
    # probabilities in float32 (a 49k vocabulary's exp in float64, or a float64 copy of
    # it, was most of a draw), every sum over them in float64
    probs = np.exp(scaled - scaled.max())
    probs /= probs.dtype.type(probs.sum(dtype=np.float64))
    if params.top_p < 1.0:
        ids, probs = _nucleus(ids, probs, params.top_p)
    index = _draw(probs, rng)
    return index if ids is None else int(ids[index])


def _top(scaled: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest values (ties at the k-th: any of them, as argpartition
    takes them). Partitioned among the values within a margin of the largest, the margin
    growing by half until k are in: every value outside is below every value inside, so the k
    largest are among them (argpartition over a 49k vocabulary was 0.7 ms)."""
    top = float(scaled.max())
    margin = 1.0
    while True:
        near = np.flatnonzero(scaled >= top - margin) if margin < 1e30 else np.arange(scaled.size)
        if near.size >= k:
            break
        margin *= 1.5  # past 1e30 (or with NaN or inf logits): every value
        if not np.isfinite(top - margin):
            margin = 1e30
    return near[np.argpartition(-scaled[near], k - 1)[:k]]


def _nucleus(
    ids: np.ndarray | None, probs: np.ndarray, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The smallest most-likely set whose mass reaches top_p (its ids: positions in `probs`
    mapped through `ids`, None: the positions themselves), renormalized, in `ids` order
    (a draw from it is exact in any fixed order). Only the tokens at or above a cut are
    looked at: every token below it is less likely than every one above, so once those
    above hold top_p the nucleus lies among them. Their values are sorted (not their
    positions: 2.7x cheaper) to find the nucleus's smallest probability; ties at it are
    taken first come."""
    cut = float(probs.max()) * SPAN
    while True:
        # a cut of 0 (or NaN, from NaN logits) takes every token, and the loop ends there
        head = np.flatnonzero(probs >= cut) if cut > 0 else np.arange(probs.size)
        if not cut > 0 or probs[head].sum(dtype=np.float64) >= top_p:
            break
        cut = cut * SPAN if cut > 1e-200 else 0.0
    held = probs[head]
    ranked = np.sort(held)[::-1]
    need = min(int(np.searchsorted(np.cumsum(ranked, dtype=np.float64), top_p)) + 1, ranked.size)
    smallest = ranked[need - 1]
    keep = held > smallest
    ties = np.flatnonzero(held == smallest)[: need - int(keep.sum())]
    keep[ties] = True
    if not keep.any():  # NaN logits (a broken graph): nothing to rank, drawn as they are
        keep[:] = True
    kept = held[keep]
    chosen = head[keep]
    return chosen if ids is None else ids[chosen], kept / kept.dtype.type(
        kept.sum(dtype=np.float64)
    )


BLOCK = 256  # a draw finds its block of tokens first, then the token within it


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse CDF in two levels: the running sum of each block's mass, then of the one block
    the draw falls in (a running sum over a 49k vocabulary was 0.18 ms, most of a draw)."""
    full = probs.size // BLOCK * BLOCK
    sums = np.cumsum(probs[:full].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))
    tail = probs[full:]
    below = float(sums[-1]) if sums.size else 0.0
    target = rng.random() * (below + float(tail.sum(dtype=np.float64)))
    block = int(np.searchsorted(sums, target, side="right"))
    start = block * BLOCK
    if start >= full:  # in the tail after the last whole block
        start, base, part = full, below, tail
    else:
        base, part = float(sums[block - 1]) if block else 0.0, probs[start : start + BLOCK]
    running = base + np.cumsum(part, dtype=np.float64)
    index = start + int(np.searchsorted(running, target, side="right"))
    return min(index, start + part.size - 1, probs.size - 1)


def top_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model and the n most likely tokens',
    most likely first. Only the entries reported are computed: each logit less the
    vocabulary's log-sum-exp (exp in float32, summed in float64: within 1e-6 of float64
    throughout, at a tenth of its time over 49k logits)."""
    x = np.asarray(logits, dtype=np.float32)
    top = float(x.max())
    lse = top + math.log(float(np.exp(x - top).sum(dtype=np.float64)))
    best: list[tuple[int, float]] = []
    if n:
        ids = _top(x, min(n, x.size))
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = [(int(i), float(x[i]) - lse) for i in ids]
    return float(x[token]) - lse, best
