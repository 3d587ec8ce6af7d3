"""The next token of one sequence from its logits: penalty, temperature, top-k, top-p.

Exact, and cheap at a 50k vocabulary: top-p looks at the few hundred most likely tokens
first (argpartition) and sorts the whole vocabulary only when they hold less than top_p."""

from __future__ import annotations

from typing import cast

import numpy as np

from shipyard_runtime.generation.params import GenerationParams

CANDIDATES = 256


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's repetition penalty (as transformers applies it): a seen token's logit is
    divided by the penalty when positive, multiplied when negative."""
    if penalty == 1.0 or not seen.size:
        return logits
    out = logits.copy()
    picked = out[seen]
    out[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - float(logits.max())
    return cast(np.ndarray, z - np.log(np.exp(z).sum()))


def choose(
    logits: np.ndarray, params: GenerationParams, rng: np.random.Generator, seen: np.ndarray
) -> int:
    """One token id from logits [vocab]."""
    logits = penalize(np.asarray(logits, dtype=np.float32), seen, params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    ids = np.arange(scaled.size)
    if params.top_k and params.top_k < scaled.size:
        ids = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    probs = np.exp(scaled[ids] - scaled[ids].max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        ids, probs = _nucleus(ids, probs, params.top_p)
    return int(ids[_draw(probs, rng)])


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest most-likely set whose mass reaches top_p, renormalized."""
    if probs.size > CANDIDATES:
        head = np.argpartition(-probs, CANDIDATES - 1)[:CANDIDATES]
        if probs[head].sum() >= top_p:  # the nucleus lies within the head: exact
            ids, probs = ids[head], probs[head]
    order = np.argsort(-probs, kind="stable")
    ids, probs = ids[order], probs[order]
    keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(index, probs.size - 1)


def top_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model and the n most likely tokens'."""
    lp = log_softmax(np.asarray(logits, dtype=np.float32))
    top: list[tuple[int, float]] = []
    if n:
        best = np.argpartition(-lp, min(n, lp.size) - 1)[:n]
        best = best[np.argsort(-lp[best], kind="stable")]
        top = [(int(i), float(lp[i])) for i in best]
    return float(lp[token]), top
