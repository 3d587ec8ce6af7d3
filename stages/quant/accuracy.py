"""Precision-appropriate comparison of a quantized model with its FP32 reference."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from schemas.contract import BUDGET_METRICS
from schemas.tasks import TASKS
from stages.onnx.kvcache import PAST, PRESENT

if TYPE_CHECKING:
    from schemas.spec.quantization import AccuracyBudget


def outputs(session: Any, samples: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """The first graph output (logits / embedding / scores) for every sample."""
    name = session.get_outputs()[0].name
    return [session.run([name], feeds)[0] for feeds in samples]


class Agreement:
    """top-1 agreement, mean cosine, SNR (dB) and, for a language model, perplexity change,
    accumulated one sample at a time: no logits are kept, and float64 copies exist only for
    ROWS rows at once (a vocabulary-wide model's logits over a dataset are gigabytes).

    Samples may arrive in any order (`index`: the sample's place in the dataset, default
    the next one): each keeps its own terms, and `result` adds every sample's terms in the
    dataset's order, so the metrics are the same bits whatever order the samples ran in."""

    ROWS = 64
    SUMS = ("cosine", "signal", "nll_r", "nll_g", "noise")

    def __init__(self, task: str) -> None:
        self.language_model = TASKS[task].language_model
        # each sample's terms, in the order the old running sums added them
        self._terms: dict[int, tuple[list[tuple[str, float]], int, int, int]] = {}
        # float64 room for a chunk's two copies and the perplexity's scratch, kept between
        # samples (fresh ones cost their page faults every chunk): one a thread (add_many)
        self._local = threading.local()
        self._pool: Any = None

    def add(
        self,
        ref: np.ndarray,
        got: np.ndarray,
        feeds: dict[str, np.ndarray],
        index: int | None = None,
    ) -> None:
        if index is None:
            index = max(self._terms, default=-1) + 1
        if index in self._terms:
            raise ValueError(f"sample {index} was added twice")
        r_all, g_all = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
        terms: list[tuple[str, float]] = []
        rows = same_count = tokens = 0
        # a language model's next-token targets, row by row (one sequence a sample, as
        # `_nll` reads it): each chunk's float64 copies serve its perplexity too
        ids = feeds["input_ids"][0] if self.language_model else None
        targets = ids[1:] if ids is not None and ref.shape[0] == 1 else None
        kept = getattr(self._local, "room", None)
        if kept is None or kept.shape[2] != r_all.shape[-1]:
            kept = self._local.room = np.empty((3, self.ROWS, r_all.shape[-1]))  # paged in use
        for start in range(0, len(r_all), self.ROWS):
            r32, g32 = r_all[start : start + self.ROWS], g_all[start : start + self.ROWS]
            same = r32.argmax(1) == g32.argmax(1)  # float32: float64 holds the same values
            r, g, scratch = (room[: len(r32)] for room in kept)
            np.copyto(r, r32)  # float64 copies: the values of astype, in kept room
            np.copyto(g, g32)
            rr, gg = np.einsum("ij,ij->i", r, r), np.einsum("ij,ij->i", g, g)
            norms = np.sqrt(rr) * np.sqrt(gg)
            terms.append(
                (
                    "cosine",
                    float(np.sum(np.einsum("ij,ij->i", r, g) / np.where(norms == 0, 1, norms))),
                )
            )
            same_count += int(np.sum(same))
            terms.append(("signal", float(np.sum(rr))))
            if targets is not None and start < targets.size:
                scored = slice(0, min(len(r), targets.size - start))
                wanted = targets[start : start + len(r)]
                terms.append(("nll_r", _chunk_nll(r[scored], wanted, scratch)))
                terms.append(("nll_g", _chunk_nll(g[scored], wanted, scratch)))
            r -= g  # the noise, in place: r is not read again
            terms.append(("noise", float(np.einsum("ij,ij->", r, r))))
            rows += len(r)
        if self.language_model:
            if targets is None:  # several sequences in one sample: its first, as before
                nll, tokens = _nll(ref, feeds)
                terms.append(("nll_r", nll))
                terms.append(("nll_g", _nll(got, feeds)[0]))
            else:
                tokens = targets.size
        self._terms[index] = (terms, rows, same_count, tokens)

    THREADS = 2  # numpy lets go of the GIL in these loops: 0.75 -> 0.45 s on llama-30

    def add_many(
        self, pairs: Iterable[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], int]]
    ) -> None:
        """`add` for each (reference, shipped, feeds, index), on THREADS threads kept until
        `result` (each with its own room: THREADS x 3 x ROWS x vocabulary float64). A
        sample's terms are computed alone and kept by its index, so the result is the same
        bits as adding the samples one by one, in any order."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="agreement")
        list(self._pool.map(lambda pair: self.add(*pair), pairs))  # raises what add raised

    @property
    def per_sample(self) -> list[dict[str, float]]:
        """Each sample's own top-1 agreement and mean cosine, in the dataset's order: which
        inputs a failure is about."""
        out = []
        for index in sorted(self._terms):
            terms, rows, same, _ = self._terms[index]
            cosine = 0.0
            for name, value in terms:
                if name == "cosine":
                    cosine += value
            out.append(
                {"top1_agreement": same / max(rows, 1), "logit_cosine": cosine / max(rows, 1)}
            )
        return out

    def _totals(self) -> tuple[dict[str, float], int, int, int]:
        sums = dict.fromkeys(self.SUMS, 0.0)
        rows = same = tokens = 0
        for index in sorted(self._terms):
            terms, n, agreed, counted = self._terms[index]
            for name, value in terms:
                sums[name] += value
            rows, same, tokens = rows + n, same + agreed, tokens + counted
        return sums, rows, same, tokens

    def result(self) -> dict[str, float]:
        if self._pool is not None:  # add_many's threads and their rooms
            self._pool.shutdown()
            self._pool = None
        sums, rows, same, tokens = self._totals()
        signal, noise = sums["signal"], sums["noise"]
        snr = 10 * float(np.log10(signal / noise)) if noise else 200.0
        out = {
            "top1_agreement": same / max(rows, 1),
            "logit_cosine": sums["cosine"] / max(rows, 1),
            "snr_db": snr,
        }
        if self.language_model:
            ppl_r = float(np.exp(sums["nll_r"] / max(tokens, 1)))
            ppl_g = float(np.exp(sums["nll_g"] / max(tokens, 1)))
            out |= {
                "perplexity_fp32": ppl_r,
                "perplexity": ppl_g,
                "perplexity_increase": ppl_g / ppl_r - 1,
            }
        return out


def agreement(
    task: str, ref: list[np.ndarray], got: list[np.ndarray], samples: list[dict[str, np.ndarray]]
) -> dict[str, float]:
    """Agreement over lists of outputs held in memory (small models, benchmarks)."""
    acc = Agreement(task)
    for r, g, feeds in zip(ref, got, samples, strict=True):
        acc.add(r, g, feeds)
    return acc.result()


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """10 log10(signal / noise) in dB; 200 when identical."""
    ref64 = ref.astype(np.float64)
    noise = float(np.sum((ref64 - got) ** 2))
    return 10 * float(np.log10(np.sum(ref64**2) / noise)) if noise else 200.0


def _channel_snrs(ref: np.ndarray, got: np.ndarray) -> np.ndarray | None:
    """Per-channel (last axis) SNR in dB of the channels that carry signal (None: none do)."""
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    g = got.reshape(-1, got.shape[-1]).astype(np.float64)
    signal, noise = np.sum(r**2, axis=0), np.sum((r - g) ** 2, axis=0)
    live = signal > 0
    if not live.any():
        return None
    with np.errstate(divide="ignore"):
        return cast(np.ndarray, np.minimum(10 * np.log10(signal[live] / noise[live]), 200.0))


def worst_channel_snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """The lowest per-channel (last axis) SNR among channels that carry signal."""
    per = _channel_snrs(ref, got)
    return 200.0 if per is None else float(np.min(per))


def mean_channel_snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """The mean over last-axis channels of each channel's SNR (dB, capped at 200).

    Unlike one SNR over the tensor, a few huge channels cannot hide the others: a weight
    scale set by outlier rows keeps those rows exact and crushes the rest, which the next
    layer (that divides the outliers back down) then sees."""
    per = _channel_snrs(ref, got)
    return 200.0 if per is None else float(np.mean(per))


def _nll(logits: np.ndarray, feeds: dict[str, np.ndarray]) -> tuple[float, int]:
    """One sample's summed next-token NLL and the number of tokens it predicts."""
    ids = feeds["input_ids"][0]
    if ids.size < 2:
        return 0.0, 0
    x = logits[0, :-1].astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return -float(logp[np.arange(ids.size - 1), ids[1:]].sum()), ids.size - 1


def _chunk_nll(x: np.ndarray, targets: np.ndarray, scratch: np.ndarray | None = None) -> float:
    """The summed NLL of `targets` under float64 logit rows `x` (one target a row);
    `scratch`: room for at least x's rows (else a new array)."""
    top = x.max(axis=1)
    shifted = np.empty_like(x) if scratch is None else scratch[: len(x)]
    np.subtract(x, top[:, None], out=shifted)
    lse = top + np.log(np.exp(shifted, out=shifted).sum(axis=1))
    return float(np.sum(lse - x[np.arange(len(x)), targets]))


GREEDY_PROMPTS, GREEDY_PROMPT_TOKENS, GREEDY_TOKENS = 16, 32, 16


LOGITS_BYTES = 64 << 20  # logits one batched greedy run may hold (rows x tokens x vocab)


def with_ids(sample: dict[str, np.ndarray], ids: np.ndarray) -> dict[str, np.ndarray]:
    """The sample's feeds (its empty KV cache kept) for another token sequence; `sample`
    may be several samples stacked (`stacked`), one row of `ids` each."""
    feeds = {**sample, "input_ids": ids}
    if "attention_mask" in sample:
        feeds["attention_mask"] = np.ones_like(ids)
    if "position_ids" in sample:
        feeds["position_ids"] = np.repeat(
            np.arange(ids.shape[1], dtype=np.int64)[None, :], ids.shape[0], 0
        )
    return feeds


def stacked(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch of samples whose every input has the same shape past the batch axis."""
    return {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}


def pass_groups(
    session: Any, samples: list[dict[str, np.ndarray]], pad: bool = True
) -> tuple[list[list[int]], bool]:
    """Groups of samples a caller runs through one session, outputs kept, before the other
    session's turn (alternating two sessions a sample at a time cost 1.5x on both,
    docs/benchmarks.md: onnxruntime's workers spin on the cores for a while after a run),
    and whether each group runs as one right-padded batch (`right_padded`).

    Batched: a causal model's KV-cache graph (`cacheable`), one sequence a sample, a known
    vocabulary; the samples sorted by length (little padding), at most LOGITS_BYTES of
    padded logits a group. Else consecutive samples whose outputs together hold at most
    LOGITS_BYTES, one sample a run (`pad` False: always). Either way a sample alone may
    hold more."""
    shape = session.get_outputs()[0].shape
    vocab = shape[-1] if shape and isinstance(shape[-1], int) else None
    lengths = [s["input_ids"].shape[-1] if "input_ids" in s else 0 for s in samples]
    padded = pad and bool(samples) and vocab is not None and cacheable(session, samples[0])
    if padded:
        pasts = {k: v.shape[1:] for k, v in samples[0].items() if k.startswith(PAST)}
        padded = all(
            s["input_ids"].ndim == 2
            and s["input_ids"].shape[0] == 1
            and set(s) == set(samples[0])
            and {k: v.shape[1:] for k, v in s.items() if k in pasts} == pasts
            for s in samples
        )
    order = sorted(range(len(samples)), key=lambda i: lengths[i]) if padded else range(len(samples))
    groups: list[list[int]] = []
    held = width = 0
    for i in order:
        if padded:
            width = max(width, lengths[i]) if groups else lengths[i]
            fits = bool(groups) and (len(groups[-1]) + 1) * width * (vocab or 0) * 4 <= LOGITS_BYTES
        else:
            # a sample without token ids (a generic graph's): its outputs' size is unknown
            size = lengths[i] * vocab * 4 if vocab and lengths[i] else LOGITS_BYTES
            fits = bool(groups) and held + size <= LOGITS_BYTES
            held = held + size if fits else size
        if fits:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = lengths[i]
    return groups, padded


def run_group(
    session: Any, name: str, samples: list[dict[str, np.ndarray]], group: list[int], padded: bool
) -> list[np.ndarray]:
    """Output `name` of each sample of `group` (acc.pass_groups), one [1, its tokens, ...]
    array a sample: one right-padded run when `padded` (each row sliced to its own length),
    else one run a sample."""
    return [out[name] for out in run_group_outputs(session, {name: 1}, samples, group, padded)]


def run_group_outputs(
    session: Any,
    axes: dict[str, int],
    samples: list[dict[str, np.ndarray]],
    group: list[int],
    padded: bool,
) -> list[dict[str, np.ndarray]]:
    """run_group for several outputs: each of `axes`' outputs of each sample of `group`, a
    right-padded run's rows each sliced to its own length on the output's token axis
    (`axes[name]`: 1 for logits, the cache's sequence axis for a present)."""
    names = list(axes)
    if not padded or len(group) == 1:
        return [dict(zip(names, session.run(names, samples[i]), strict=True)) for i in group]
    many = dict(
        zip(names, session.run(names, right_padded([samples[i] for i in group])), strict=True)
    )
    out = []
    for r, i in enumerate(group):
        length = samples[i]["input_ids"].shape[-1]
        row = {}
        for name, value in many.items():
            cut: list[slice] = [slice(r, r + 1)] + [slice(None)] * (value.ndim - 1)
            cut[axes[name]] = slice(0, length)
            row[name] = value[tuple(cut)]
        out.append(row)
    return out


def padding_is_inert(session: Any, samples: list[dict[str, np.ndarray]]) -> bool:
    """Whether right padding leaves a row's logits its own in this graph: the shortest
    sample padded to the longest's length beside it, and alone, within float noise (more
    padding than any group of acc.pass_groups has). A graph whose positions see later
    tokens (not causal) fails kvcheck; this keeps evaluate right without relying on that."""
    lengths = [s["input_ids"].shape[-1] for s in samples]
    short, long = int(np.argmin(lengths)), int(np.argmax(lengths))
    if lengths[short] == lengths[long]:
        return True  # nothing is padded
    name = session.get_outputs()[0].name
    padded = session.run([name], right_padded([samples[short], samples[long]]))[0]
    alone = session.run([name], samples[short])[0]
    return bool(np.allclose(padded[:1, : lengths[short]], alone, rtol=1e-4, atol=1e-4))


def right_padded(group: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch of single-sequence samples of a causal model (`pass_groups`), each row
    padded on the right: a position's logits do not depend on the tokens after it, so each
    row's first positions are its own sample's (bit for bit on the graphs measured,
    tests/stages/test_evaluate_batched.py), and the padding is only future text that
    nothing before it attends to."""
    first = group[0]
    width = max(s["input_ids"].shape[1] for s in group)
    ids = np.zeros((len(group), width), first["input_ids"].dtype)
    for row, s in enumerate(group):
        ids[row, : s["input_ids"].shape[1]] = s["input_ids"][0]
    feeds = {k: np.concatenate([s[k] for s in group]) for k in first if k.startswith(PAST)}
    feeds["input_ids"] = ids
    feeds["attention_mask"] = np.ones_like(ids, dtype=first["attention_mask"].dtype)
    if "position_ids" in first:
        feeds["position_ids"] = np.repeat(
            np.arange(width, dtype=first["position_ids"].dtype)[None, :], len(group), 0
        )
    return feeds


def batches(session: Any, shapes: list[Any], tokens: int) -> list[list[int]]:
    """Indices of the samples that can run as one batch: the same `shapes` key, a graph whose
    every input has a free batch axis, and at most LOGITS_BYTES of logits for `tokens`
    positions each (a 150k vocabulary at 48 tokens is 29 MB a row). A fixed batch axis or
    an unknown vocabulary: one sample a batch."""
    free = all(i.shape and not isinstance(i.shape[0], int) for i in session.get_inputs())
    vocab = session.get_outputs()[0].shape[-1] if session.get_outputs()[0].shape else None
    rows = max(1, LOGITS_BYTES // (tokens * vocab * 4)) if free and isinstance(vocab, int) else 1
    groups: dict[Any, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return [g[j : j + rows] for g in groups.values() for j in range(0, len(g), rows)]


def greedy_continuations(
    session: Any, samples: list[dict[str, np.ndarray]]
) -> list[tuple[dict[str, np.ndarray], int]]:
    """FP32's own greedy text: each sample's first GREEDY_PROMPT_TOKENS tokens as a prompt,
    GREEDY_TOKENS tokens generated (through the KV cache when the graph has one, else by
    full recompute); with the prompt's length.

    Prompts are generated together (`batches`): one run per token, not per token and
    prompt, which on a small model was most of what the reference costs. Shorter rows are
    padded on the right: a causal model's logits at a position do not depend on the
    tokens after it, so each row reads its next token at its own end, and the padding is
    only future text that nothing attends to. For FP32 only: an FP32 row does not depend
    on its batch-mates (a dynamically quantized one does)."""
    name = session.get_outputs()[0].name
    prompts = [s["input_ids"][0, :GREEDY_PROMPT_TOKENS] for s in samples[:GREEDY_PROMPTS]]
    if prompts and cacheable(session, samples[0]):
        return _cached_continuations(session, samples, prompts)
    out: list[Any] = [None] * len(prompts)
    width = max((p.size for p in prompts), default=0) + GREEDY_TOKENS
    for group in batches(session, [0] * len(prompts), width):
        ids = np.zeros((len(group), width), np.int64)  # 0: any id serves as padding
        ends = np.array([prompts[i].size for i in group])
        for row, i in enumerate(group):
            ids[row, : ends[row]] = prompts[i]
        base = stacked([with_ids(samples[i], ids[row : row + 1]) for row, i in enumerate(group)])
        rows = np.arange(len(group))
        for _ in range(GREEDY_TOKENS):
            now = int(ends.max())
            logits = session.run([name], with_ids(base, ids[:, :now]))[0]
            ids[rows, ends] = logits[rows, ends - 1].argmax(-1)
            ends += 1
        for row, i in enumerate(group):
            text = ids[row : row + 1, : ends[row]]
            out[i] = (with_ids(samples[i], text), prompts[i].size)
    return out


def cacheable(session: Any, sample: dict[str, np.ndarray]) -> bool:
    """A KV-cache graph fed ids, a mask, maybe positions and its empty cache, every input
    with a free batch axis: it can decode through its own cache."""
    inputs = session.get_inputs()
    known = {"input_ids", "attention_mask", "position_ids"}
    return (
        any(i.name.startswith(PAST) for i in inputs)
        and "logits" in {o.name for o in session.get_outputs()}
        and {"input_ids", "attention_mask"} <= set(sample)
        and all(i.name in known or i.name.startswith(PAST) for i in inputs)
        and all(i.shape and not isinstance(i.shape[0], int) for i in inputs)
    )


def _cached_continuations(
    session: Any, samples: list[dict[str, np.ndarray]], prompts: list[np.ndarray]
) -> list[tuple[dict[str, np.ndarray], int]]:
    """greedy_continuations through the graph's KV cache (kvcache.greedy: the prompts
    prefilled together, left-padded, then one token a step for every row): a sixth of the
    full recomputes' work at 32 + 16 tokens. One decode for every prompt: FP32's rows do
    not move each other (the export's attention is row-independent, evaluate's
    `rows_independent`), so the same tokens as any grouping."""
    from stages.onnx import kvcache as kv

    names = [i.name for i in session.get_inputs()]
    pasts = [n for n in names if n.startswith(PAST)]
    wanted = ["logits", *(n.replace(PAST, PRESENT) for n in pasts)]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(wanted, session.run(wanted, feeds), strict=True))

    empty = {n: samples[0][n][:1, :, :0] for n in pasts}
    width = max(p.size for p in prompts)
    # every prompt in one decode (a step over every row reads the weights once), the
    # prefill in runs whose logits fit LOGITS_BYTES (`batches`' rows)
    rows = len(batches(session, [0] * len(prompts), width)[0])
    made = kv.greedy(run, empty, "position_ids" in names, prompts, GREEDY_TOKENS, rows)
    return [
        (with_ids(samples[i], np.concatenate([prompt, made[i]])[None, :]), prompt.size)
        for i, prompt in enumerate(prompts)
    ]


def greedy_agreement(session: Any, generated: list[tuple[dict[str, np.ndarray], int]]) -> float:
    """Share of FP32's greedily generated tokens that the other model also picks, fed the
    same text (teacher-forced, so one early difference does not hide every later one).

    One text a run, unlike the FP32 generation: dynamic INT8 quantizes each activation
    tensor with one scale over the whole batch, so a batched run would score each text
    against its batch-mates' ranges (measured: 0.9 % agreement batched, 2.7 % alone).

    Text a model generates is where it is confident: this is the agreement a user meets in
    generation, unlike top-1 agreement on calibration text, where a model's own predictions
    are often near-ties that any noise flips."""
    name = session.get_outputs()[0].name
    return teacher_forced(lambda feeds: session.run([name], feeds)[0], generated)


def teacher_forced(logits_of: Any, generated: list[tuple[dict[str, np.ndarray], int]]) -> float:
    """greedy_agreement for any model: `logits_of(feeds)` gives its logits [1, tokens, vocab]
    (an ONNX Runtime session in quantize, the shipped graph in evaluate)."""
    same = total = 0
    for feeds, prompt in generated:
        agreed, counted = _picked_alike(logits_of(feeds), feeds, prompt)
        same, total = same + agreed, total + counted
    return same / max(total, 1)


def teacher_forced_together(
    session: Any, generated: list[tuple[dict[str, np.ndarray], int]]
) -> float:
    """teacher_forced for a session whose rows cannot move each other (evaluate's
    `rows_independent`): the texts run as right-padded batches (`pass_groups`), the same
    logits as one text a run, in a few runs instead of one a text."""
    name = session.get_outputs()[0].name
    texts = [feeds for feeds, _ in generated]
    groups, padded = pass_groups(session, texts)
    same = total = 0
    for group in groups:
        for logits, i in zip(run_group(session, name, texts, group, padded), group, strict=True):
            agreed, counted = _picked_alike(logits, texts[i], generated[i][1])
            same, total = same + agreed, total + counted
    return same / max(total, 1)


def _picked_alike(logits: np.ndarray, feeds: dict[str, np.ndarray], prompt: int) -> tuple[int, int]:
    """How many of a text's tokens after its prompt the logits pick, of how many."""
    ids = feeds["input_ids"][0]
    picked = logits[0, prompt - 1 : -1].argmax(-1)
    return int(np.sum(picked == ids[prompt:])), ids.size - prompt


BOUNDS = BUDGET_METRICS  # budget field -> (metric, "min" or "max"): schemas/contract.py


def violations(budget: AccuracyBudget, metrics: dict[str, float]) -> list[str]:
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
