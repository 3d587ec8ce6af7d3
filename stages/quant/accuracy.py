"""Precision-appropriate comparison of a quantized model with its FP32 reference."""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.tasks import TASKS


def outputs(session: Any, samples: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """The first graph output (logits / embedding / scores) for every sample."""
    name = session.get_outputs()[0].name
    return [session.run([name], feeds)[0] for feeds in samples]


def agreement(
    task: str, ref: list[np.ndarray], got: list[np.ndarray], samples: list[dict[str, np.ndarray]]
) -> dict[str, float]:
    """top-1 agreement, mean cosine, SNR (dB) and, for a language model, perplexity change."""
    vec_r = np.concatenate([r.reshape(-1, r.shape[-1]) for r in ref]).astype(np.float64)
    vec_g = np.concatenate([g.reshape(-1, g.shape[-1]) for g in got]).astype(np.float64)
    norms = np.linalg.norm(vec_r, axis=1) * np.linalg.norm(vec_g, axis=1)
    cosine = np.sum(vec_r * vec_g, axis=1) / np.where(norms == 0, 1, norms)
    out = {
        "top1_agreement": float(np.mean(vec_r.argmax(1) == vec_g.argmax(1))),
        "logit_cosine": float(np.mean(cosine)),
        "snr_db": snr_db(vec_r, vec_g),
    }
    if TASKS[task].language_model:
        ppl_r, ppl_g = perplexity(ref, samples), perplexity(got, samples)
        out |= {
            "perplexity_fp32": ppl_r,
            "perplexity": ppl_g,
            "perplexity_increase": ppl_g / ppl_r - 1,
        }
    return out


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """10 log10(signal / noise) in dB; 200 when identical."""
    ref64 = ref.astype(np.float64)
    noise = float(np.sum((ref64 - got) ** 2))
    return 10 * float(np.log10(np.sum(ref64**2) / noise)) if noise else 200.0


def worst_channel_snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """The lowest per-channel (last axis) SNR among channels that carry signal."""
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    g = got.reshape(-1, got.shape[-1]).astype(np.float64)
    signal, noise = np.sum(r**2, axis=0), np.sum((r - g) ** 2, axis=0)
    live = signal > 0
    if not live.any():
        return 200.0
    with np.errstate(divide="ignore"):
        per = 10 * np.log10(signal[live] / noise[live])
    return float(min(np.min(per), 200.0))


def perplexity(logits: list[np.ndarray], samples: list[dict[str, np.ndarray]]) -> float:
    """exp(mean next-token NLL) over every sample, targets = the sample's own next tokens."""
    nll, count = 0.0, 0
    for lg, feeds in zip(logits, samples, strict=True):
        ids = feeds["input_ids"][0]
        if ids.size < 2:
            continue
        x = lg[0, :-1].astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(ids.size - 1), ids[1:]].sum())
        count += ids.size - 1
    return float(np.exp(nll / max(count, 1)))


BOUNDS = {  # budget field -> (metric, "min" or "max")
    "top1_agreement_min": ("top1_agreement", "min"),
    "logit_cosine_min": ("logit_cosine", "min"),
    "snr_db_min": ("snr_db", "min"),
    "perplexity_increase_max": ("perplexity_increase", "max"),
}


def violations(budget: Any, metrics: dict[str, float]) -> list[str]:
    """Each budget bound that the metrics break, as `metric 0.97 < 0.99`."""
    broken = []
    for field, (metric, kind) in BOUNDS.items():
        bound = getattr(budget, field)
        if bound is None:
            continue
        value = metrics[metric]
        if (kind == "min" and value < bound) or (kind == "max" and value > bound):
            broken.append(f"{metric} {value:.4g} {'<' if kind == 'min' else '>'} {bound:g}")
    return broken


def score(metrics: dict[str, float]) -> float:
    """Sensitivity ranking key: lower SNR = more damage (continuous, unlike top-1)."""
    return metrics["snr_db"]
