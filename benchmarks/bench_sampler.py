"""What one draw of the engine's sampler costs at a real vocabulary (issue 41: where a decode
step's time goes), the sampler of the session of 2026-12-05 (fourth; kept below as
`before`) against the engine's (`shipyard_runtime/generation/sampler.py`), side by side.

Logits of a 49,152-token vocabulary with three spreads (standard deviation 1: flat, a
top-p 0.9 nucleus of most of the vocabulary; 3: hundreds to thousands of tokens; 6:
peaked, a few), and the request settings users send: plain temperature, top-p 0.9,
temperature 0.7 with top-p 0.95, top-k 50, greedy; and the log-probabilities of a token
and the top 5 (`logprobs: 5`). Interleaved rounds (each variant once a
round, in turn), the median ms of a draw and the ratio before / now. Both draw exactly from
the same distribution (tests/runtime/test_generation.py); the tokens a seed picks may
differ (float32 probabilities, the nucleus drawn in vocabulary order).

    python benchmarks/bench_sampler.py [--rounds 15] [--draws 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shipyard_runtime.generation import sampler  # noqa: E402
from shipyard_runtime.generation.params import GenerationParams, parse  # noqa: E402

VOCAB = 49_152
SETTINGS: dict[str, dict[str, float]] = {
    "temperature 1": {},
    "top-p 0.9": {"top_p": 0.9},
    "t 0.7, top-p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "top-k 50": {"top_k": 50},
    "greedy": {"temperature": 0},
}


def before(logits: np.ndarray, p: GenerationParams, rng: np.random.Generator) -> int:
    """The sampler as it was (no repetition penalty here): float64 throughout, the 256 most
    likely by argpartition, else a stable sort of the whole vocabulary."""
    logits = np.asarray(logits, dtype=np.float32)
    if p.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / p.temperature
    ids = np.arange(scaled.size)
    if p.top_k and p.top_k < scaled.size:
        ids = np.argpartition(-scaled, p.top_k - 1)[: p.top_k]
    probs = np.exp(scaled[ids] - scaled[ids].max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        if probs.size > 256:
            head = np.argpartition(-probs, 255)[:256]
            if probs[head].sum() >= p.top_p:
                ids, probs = ids[head], probs[head]
        order = np.argsort(-probs, kind="stable")
        ids, probs = ids[order], probs[order]
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(ids[min(index, probs.size - 1)])


def now(logits: np.ndarray, p: GenerationParams, rng: np.random.Generator) -> int:
    return sampler.choose(logits, p, rng, np.zeros(0, np.int64))


def logprobs_before(logits: np.ndarray, token: int, n: int) -> tuple[float, list[Any]]:
    """top_logprobs as it was: the whole log-softmax in float64, argpartition for the n."""
    z = np.asarray(logits, dtype=np.float32).astype(np.float64) - float(logits.max())
    lp = z - np.log(np.exp(z).sum())
    best = np.argpartition(-lp, n - 1)[:n]
    best = best[np.argsort(-lp[best], kind="stable")]
    return float(lp[token]), [(int(i), float(lp[i])) for i in best]


def timed(variants: dict[str, Any], rounds: int, draws: int) -> dict[str, float]:
    """Median ms of one call of each variant (a no-argument callable), interleaved rounds."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for r in range(rounds):
        for name in list(variants)[r % 2 :] + list(variants)[: r % 2]:
            start = time.perf_counter()
            for _ in range(draws):
                variants[name]()
            times[name].append((time.perf_counter() - start) * 1e3 / draws)
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--draws", type=int, default=200, help="draws a variant makes a round")
    args = parser.parse_args()
    print(f"one draw over {VOCAB:,} logits, ms (median of {args.rounds} interleaved rounds)")
    print(f"{'spread':>6}  {'settings':<20} {'before':>8} {'now':>8} {'before/now':>10}")
    for spread in (1.0, 3.0, 6.0):
        logits = (np.random.default_rng(0).standard_normal(VOCAB) * spread).astype(np.float32)
        for label, body in SETTINGS.items():
            params = parse({"max_tokens": 1, **body})
            rngs = {k: np.random.default_rng(0) for k in ("before", "now")}
            got = timed(
                {
                    "before": partial(before, logits, params, rngs["before"]),
                    "now": partial(now, logits, params, rngs["now"]),
                },
                args.rounds,
                args.draws,
            )
            b, n = got["before"], got["now"]
            print(f"{spread:>6g}  {label:<20} {b:>8.3f} {n:>8.3f} {b / n:>9.1f}x")
        got = timed(
            {
                "before": partial(logprobs_before, logits, 7, 5),
                "now": partial(sampler.top_logprobs, logits, 7, 5),
            },
            args.rounds,
            args.draws,
        )
        b, n = got["before"], got["now"]
        print(f"{spread:>6g}  {'logprobs, top 5':<20} {b:>8.3f} {n:>8.3f} {b / n:>9.1f}x")


if __name__ == "__main__":
    main()
