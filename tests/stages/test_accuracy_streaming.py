"""The quantize/evaluate comparison, accumulated one sample at a time, equals the same
metrics computed over every sample's outputs at once (the formulas written out here)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.quant import accuracy as acc


def whole(task: str, ref: list[np.ndarray], got: list[np.ndarray], ids: list[np.ndarray]) -> dict:
    r = np.concatenate([x.reshape(-1, x.shape[-1]) for x in ref]).astype(np.float64)
    g = np.concatenate([x.reshape(-1, x.shape[-1]) for x in got]).astype(np.float64)
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1)
    out = {
        "top1_agreement": np.mean(r.argmax(1) == g.argmax(1)),
        "logit_cosine": np.mean(np.sum(r * g, axis=1) / np.where(norms == 0, 1, norms)),
        "snr_db": 10 * np.log10(np.sum(r**2) / np.sum((r - g) ** 2)),
    }
    if task == "causal-lm":

        def ppl(logits: list[np.ndarray]) -> float:
            nll = []
            for lg, t in zip(logits, ids, strict=True):
                x = lg[0, :-1].astype(np.float64)
                x = x - x.max(1, keepdims=True)
                logp = x - np.log(np.exp(x).sum(1, keepdims=True))
                nll.append(-logp[np.arange(t.size - 1), t[1:]])
            return float(np.exp(np.concatenate(nll).mean()))

        out |= {"perplexity_fp32": ppl(ref), "perplexity": ppl(got)}
        out["perplexity_increase"] = out["perplexity"] / out["perplexity_fp32"] - 1
    return out


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 150), min_size=1, max_size=5),
    vocab=st.integers(2, 300),
    noise=st.floats(1e-4, 1.0),
    seed=st.integers(0, 2**16),
    task=st.sampled_from(["causal-lm", "sequence-classification"]),
)
def test_streamed_agreement_equals_the_whole_computation(
    lengths: list[int], vocab: int, noise: float, seed: int, task: str
) -> None:
    rng = np.random.default_rng(seed)
    ref = [rng.standard_normal((1, n, vocab)).astype(np.float32) * 4 for n in lengths]
    got = [r + noise * rng.standard_normal(r.shape).astype(np.float32) for r in ref]
    ids = [rng.integers(0, vocab, n) for n in lengths]
    samples = [{"input_ids": t[None]} for t in ids]
    streamed = acc.Agreement(task)
    for r, g, s in zip(ref, got, samples, strict=True):  # rows cross ROWS chunks
        streamed.add(r, g, s)
    want = whole(task, ref, got, ids)
    have = streamed.result()
    assert have.keys() == want.keys()
    for key, value in want.items():
        assert have[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
