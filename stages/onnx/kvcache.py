"""Cached decoding against the truth: a full recompute (issue 24).

Every other check compares the export with the model, so a bug in the model's own cache path
(positions that restart at 0, a dropped or clipped past, a mask ignored over the past) sits
on both sides and passes. Here the reference is always one pass over the whole sequence
with an empty past, never another cached decoder:

- `walk` decodes a seeded sequence through the cache: a short prompt, then one token a step
  for the first `steps`, then, at each past length of the plan (spread out to
  past_sequence.max, the max included, odd ones among them), a single-token step after the
  past was filled by chunked prefills of at most sequence.max tokens. Each step's last
  logits and its presents are compared with one full pass at that length: the cost is a few
  full passes, not one per step.
- `padded` decodes a batch whose second row is left-padded (zeros in the mask, positions
  from the mask) and compares each row, at the prefill and at every step, with a full pass
  of that row alone.

A backend is a `Run`: feeds by name -> outputs by name (PyTorch or ONNX Runtime). The past a
step is fed is always the one the backend itself produced from real tokens, never noise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.details import KvComparison
from stages.onnx import shapes as sh
from stages.onnx.compare import atol_scale, compare, normalized, placed

if TYPE_CHECKING:
    from schemas.spec.export import DimRange
    from schemas.spec.parity import KVCheck, ParityConfig, Tolerance

Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
# the KV-cache graph's input and output name prefixes (the export's), for every build-side
# module; the shipped runtime keeps its own copy (it imports nothing of the repository), held
# equal by a test
PAST, PRESENT = "past_key_values.", "present."


def greedy(
    run: Run,
    empty: dict[str, np.ndarray],
    positions: bool,
    prompts: list[np.ndarray],
    tokens: int,
    prefill_rows: int | None = None,
    right: bool = False,
    first: dict[str, np.ndarray] | None = None,
) -> np.ndarray:
    """Greedy decoding through a KV-cache graph, the one decoder of the checks (evaluate's
    decode metrics, quantize's reference text): `prompts` prefilled in one run, left-padded
    to the longest (zeros in the mask, positions from it: kvcheck holds such a row to the
    same row alone), then one token a step for every row. Returns the [rows, tokens] ids
    chosen. `empty`: each past input's empty cache for one row ([1, heads, 0, dim]);
    `positions`: whether the graph takes position_ids. A batch is for a backend whose rows
    do not depend on each other (FP32, per-token INT8); per-call dynamic INT8 decodes one
    prompt a call. `prefill_rows`: the prefill in runs of at most that many rows (its
    logits are rows x prompt x vocabulary; a step's are rows x vocabulary), each run as
    wide as its longest prompt (`_prefill_in_runs`), for such a backend only. `right`: a
    graph whose rows are right-padded (stages/onnx/fused.py): each prompt at the start of
    its row, its first token read at its own last position, and each step's new token at
    its row's length (the mask ones up to it: the graph writes it over the padding).
    `first`: the prefill's outputs, already computed (left-padded rows: each row's last
    logits [rows, 1, vocab] and its presents with zeros on the left, as `_prefill_in_runs`
    returns them): evaluate takes FP32's from its pass over the evaluation set."""
    if first is not None and right:
        raise ValueError("a given prefill is left-padded: not for a right-padded graph")
    rows, width = len(prompts), max(p.size for p in prompts)
    lengths = np.array([p.size for p in prompts])
    ids = np.zeros((rows, width), np.int64)
    mask = np.zeros((rows, width), np.int64)
    for row, prompt in enumerate(prompts):
        at = slice(0, prompt.size) if right else slice(width - prompt.size, width)
        ids[row, at] = prompt
        mask[row, at] = 1
    feeds = {name: np.repeat(cache, rows, 0) for name, cache in empty.items()}
    made = np.zeros((rows, tokens), np.int64)
    step = ids
    for k in range(tokens):
        feeds |= {"input_ids": step, "attention_mask": mask}
        if positions:
            feeds[sh.POSITIONS] = sh.positions_from_mask(mask, step.shape[1])
        if k == 0 and first is not None and not right:
            out = first
        elif k == 0 and prefill_rows is not None and not right:
            out = _prefill_in_runs(run, feeds, [p.size for p in prompts], prefill_rows, empty)
        else:
            out = run(feeds)
        logits = out["logits"]
        last = logits[np.arange(rows), lengths - 1] if right and k == 0 else logits[:, -1]
        made[:, k] = last.argmax(-1)
        step = made[:, k : k + 1]
        if right:  # each row's cached tokens and the new one, then its padding
            cached = lengths + k + 1
            mask = (np.arange(width + k + 1)[None, :] < cached[:, None]).astype(np.int64)
        else:
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
        feeds = {name: out[name.replace(PAST, PRESENT)] for name in empty}
    return made


def _prefill_in_runs(
    run: Run,
    feeds: dict[str, np.ndarray],
    lengths: list[int],
    size: int,
    empty: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """One left-padded prefill (`feeds`: every row at the longest prompt's width) as runs of
    at most `size` rows, the rows sorted by length and each run only as wide as its longest
    prompt: each row's last logits, and its presents with the columns its run left out put
    back as zeros on the left (padding, masked like the rest of it). For a backend whose
    rows do not depend on their batch or their padding: the same result as one run."""
    rows, width = len(lengths), feeds["input_ids"].shape[1]
    order = sorted(range(rows), key=lambda r: lengths[r])
    padded = {"input_ids", "attention_mask", sh.POSITIONS}
    out: dict[str, np.ndarray] = {}
    for start in range(0, rows, size):
        chosen = order[start : start + size]
        cut = width - max(lengths[r] for r in chosen)
        part = run({n: v[chosen][:, cut:] if n in padded else v[chosen] for n, v in feeds.items()})
        got = {"logits": part["logits"][:, -1:]}
        for name, cache in empty.items():
            present = part[name.replace(PAST, PRESENT)]
            axis = cache.shape.index(0)  # the cache's sequence axis: empty in `empty`
            zeros = list(present.shape)
            zeros[axis] = cut
            got[name.replace(PAST, PRESENT)] = np.concatenate(
                [np.zeros(zeros, present.dtype), present], axis=axis
            )
        for name, value in got.items():
            if name not in out:
                out[name] = np.empty((rows, *value.shape[1:]), value.dtype)
            out[name][chosen] = value
    return out


@dataclass(frozen=True)
class Plan:
    prompt: int  # tokens prefilled before the first step
    steps: int  # single-token steps after the prompt
    pasts: tuple[int, ...]  # past lengths of the later steps, ascending
    chunk: int  # the longest prefill one pass takes (sequence.max)
    batch: int  # rows per pass of the walk (batch.min, at least 1)
    padded: tuple[int, int, int] | None  # (row length, pad, steps); None: batch.max < 2

    def lengths(self) -> list[int]:
        """Full-pass lengths the walk compares with: one per step (past + 1 tokens)."""
        steps = [self.prompt + k + 1 for k in range(self.steps)]
        return sorted({*steps, *(p + 1 for p in self.pasts)})

    def padded_lengths(self) -> list[tuple[int, int]]:
        """(row, length) of the full passes the padded check compares each row with."""
        if self.padded is None:
            return []
        length, pad, steps = self.padded
        return [
            (row, n + k) for row, n in ((0, length), (1, length - pad)) for k in range(steps + 1)
        ]


def make_plan(dims: dict[str, DimRange], cfg: KVCheck) -> Plan:
    """The probes for export.dims and parity.kv (spec rules: past_sequence.min 0, sequence.min
    1; past_lengths within past_sequence)."""
    seq, past, batch = dims["sequence"], dims["past_sequence"], dims.get("batch")
    prompt = max(1, min(3, seq.max))
    steps = max(0, min(cfg.steps, past.max - prompt + 1))
    if cfg.past_lengths is not None:
        pasts = sorted(set(cfg.past_lengths))
    else:
        top = past.max
        pasts = sorted({min(top, (top * k // 4) | 1) for k in (1, 2, 3)} | {top})
        pasts = [p for p in pasts if p >= prompt + steps]
    padded = None
    if cfg.padded and batch is not None and batch.min <= 2 <= batch.max and seq.max >= 2:
        length = min(seq.max, 6)
        pad = max(1, length // 2)
        padded = (length, pad, max(0, min(cfg.steps, past.max - length + 1)))
    rows = max(1, batch.min if batch is not None else 1)
    return Plan(prompt, steps, tuple(pasts), seq.max, rows, padded)


def sequences(vocab: int, length: int, seed: int) -> np.ndarray:
    """Two seeded token sequences [2, length]: the walk's and the padded row's."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, max(vocab, 1), size=(2, length)).astype(np.int64)


def feeds(
    lay: sh.Layout, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The graph's inputs for one pass: ids [batch, n], mask [batch, past + n], positions
    from the mask, the past (empty when None)."""
    out = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for t in lay.inputs:
        if t.name == sh.POSITIONS:
            out[t.name] = sh.positions_from_mask(mask, ids.shape[1])
        elif t.name.startswith(PAST):
            if past is not None:
                out[t.name] = past[t.name]
            else:
                shape = [
                    ids.shape[0] if a == "batch" else 0 if isinstance(a, str) else a for a in t.axes
                ]
                out[t.name] = np.zeros(shape, dtype=np.float32)
    return out


def presents(lay: sh.Layout, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs that feed the next step, keyed by the past input they become."""
    return {
        t.name: outputs[t.name.replace("past_key_values", "present")]
        for t in lay.inputs
        if t.name.startswith(PAST)
    }


def with_produced_past(
    run: Run, lay: sh.Layout, given: dict[str, np.ndarray], chunk: int, seed: int
) -> dict[str, np.ndarray]:
    """`given` feeds with the past the model itself produces from seeded tokens (prefilled through
    its cache in chunks of at most `chunk`) instead of noise: random-normal keys and values
    are nothing a model produces, and 30 layers amplify float differences on them into
    false parity failures (a real 135M Llama at past 1536). Unchanged without a past."""
    names = [t.name for t in lay.inputs if t.name.startswith(PAST)]
    if not names or given[names[0]].shape[2] == 0:
        return given
    batch, length = given["input_ids"].shape[0], given[names[0]].shape[2]
    tokens = np.random.default_rng(seed).integers(0, vocab_of(lay), size=(batch, length))
    cache: dict[str, np.ndarray] | None = None
    for start in range(0, length, chunk):
        ids = tokens[:, start : start + chunk]
        cache = presents(lay, run(feeds(lay, ids, np.ones((batch, start + ids.shape[1])), cache)))
    assert cache is not None
    return {**given, **cache}


def vocab_of(lay: sh.Layout) -> int:
    ids = next(t for t in lay.inputs if t.name == "input_ids")
    return max(int(ids.high), 1)


def full_pass(run: Run, lay: sh.Layout, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The reference at one length: ids [1, n] in one pass, an empty past. Kept: the last
    position's logits and the presents (every layer's keys and values at every position)."""
    out = run(feeds(lay, ids, np.ones_like(ids), None))
    # a copy: a view of the last position kept every position's logits alive ([n, vocab],
    # 0.2 GB at 1024 tokens of a 49k vocabulary) under the next pass's peak
    kept = {"logits": np.array(np.asarray(out["logits"])[:, -1])}
    kept |= {name: np.asarray(v) for name, v in presents(lay, out).items()}
    return kept


@dataclass(frozen=True)
class Probe:
    label: str  # "step 2", "past 127", "padded row 1 step 0"
    past: int  # the past length the compared pass was fed
    position: int  # the token position whose next-token logits are compared
    outputs: dict[str, np.ndarray]
    rows: tuple[int, ...] | None = None  # padded: which batch row; None: every row
    index: int = -1  # where along the outputs' sequence the compared logits sit


def walk(run: Run, lay: sh.Layout, tokens: np.ndarray, plan: Plan) -> Iterator[Probe]:
    """The cached decode of `tokens` [n]: prompt, single steps, then a step at each past
    length (a shorter one than the cache already holds starts a fresh cache)."""
    rows = plan.batch
    cache: dict[str, np.ndarray] | None = None
    held = 0

    def advance(upto: int) -> dict[str, np.ndarray]:
        nonlocal cache, held
        out: dict[str, np.ndarray] = {}
        while held < upto:
            n = min(plan.chunk, upto - held)
            ids = np.tile(tokens[None, held : held + n], (rows, 1))
            out = run(feeds(lay, ids, np.ones((rows, held + n)), cache))
            cache, held = presents(lay, out), held + n
        return out

    advance(plan.prompt)
    for k in range(plan.steps):
        yield Probe(f"step {k}", held, held, advance(held + 1))
    for past in plan.pasts:
        if past < held:
            cache, held = None, 0
        advance(past)
        yield Probe(f"past {past}", past, past, advance(past + 1))


def padded(
    run: Run, lay: sh.Layout, tokens: np.ndarray, plan: Plan, right: bool = False
) -> Iterator[Probe]:
    """A batch of two rows, the second padded: prefill, then single steps; each probe
    names the row it is compared on. Left-padded (zeros in the mask before the row's
    tokens), or with `right` (a graph whose rows are right-padded, stages/onnx/fused.py)
    after them: the row's prefill logits sit at its last token, and each step's new token
    is written at the row's own length, over its padding."""
    assert plan.padded is not None
    length, pad, steps = plan.padded
    short = tokens[1, : length - pad]
    ids = np.stack(
        [tokens[0, :length], np.r_[short, np.zeros(pad)] if right else np.r_[np.zeros(pad), short]]
    )
    out = run(feeds(lay, ids, _two_rows(length, pad, 0, right), None))
    for k in range(steps + 1):
        for row in (0, 1):
            real = length - pad * row + k  # the row's real tokens so far
            label = f"padded row {row} ({pad * row} pads{' after' if right else ''}) step {k}"
            index = real - 1 if right and k == 0 else -1
            yield Probe(label, real - 1, real - 1, out, (row,), index)
        if k == steps:
            break
        step = np.array([[tokens[0, length + k]], [tokens[1, length - pad + k]]])
        out = run(feeds(lay, step, _two_rows(length, pad, k + 1, right), presents(lay, out)))


def _two_rows(length: int, pad: int, k: int, right: bool) -> np.ndarray:
    """The padded batch's mask after `k` steps: row 0 all real; row 1 `pad` short, its
    padding before its tokens, or after them (`right`: its tokens so far, then zeros)."""
    mask = np.ones((2, length + k))
    if right:
        mask[1, length - pad + k :] = 0
    else:
        mask[1, :pad] = 0
    return mask


def judge(
    probe: Probe,
    ref: dict[str, np.ndarray],
    tol: Tolerance,
    cfg: ParityConfig,
    fp32: dict[str, np.ndarray] | None = None,
) -> list[KvComparison]:
    """Compare a probe's last logits (and, unpadded, its presents) with the full pass. A
    failed row names the first diverging position along the sequence. With `fp32` (the
    FP32 full pass of a quantized graph's tokens) a present out of tolerance is accepted
    as quantization rounding when its error is a small share of quantizing's own
    (`rounding_share`); the logits are always held to the tolerance."""
    rows = list(probe.rows) if probe.rows is not None else None
    names = ["logits"] + ([] if rows is not None else sorted(k for k in ref if k != "logits"))
    out = []
    for name in names:
        key = name.replace("past_key_values", "present")
        got = np.asarray(probe.outputs["logits" if name == "logits" else key])
        got = got[:, probe.index] if name == "logits" else got
        got = got[rows] if rows is not None else got
        want = ref[name]
        if rows is None and got.shape[0] != want.shape[0]:  # the walk's rows are one sequence
            want = np.repeat(want, got.shape[0], axis=0)
        result = compare(want, got, tol, cfg)
        position = probe.position
        excused: dict[str, Any] = {}  # a present off by quantization rounding only
        if not result.ok and name != "logits" and want.shape == got.shape:
            position = first_position(want, got, tol)
            base = fp32.get(name) if fp32 is not None else None
            if base is not None and base.shape[1:] == want.shape[1:]:
                share = rounding_share(got, want, np.broadcast_to(base, want.shape))
                if share <= ROUNDING_SHARE:
                    excused = {"ok": True, "rounding": share}
        where = {"probe": probe.label, "past": probe.past, "output": key, "position": position}
        out.append(placed(KvComparison, result, **where, **excused))
    return out


# A quantized graph's cached decode and its full pass differ where float-level differences
# (attention over one row or over n, the same sums in another order) move a quantizer's
# input across a rounding boundary: one quantization step at one position, which the later
# layers' attention mixes into every position after it, small everywhere. On a 30-layer
# INT8 decoder this put every layer's presents out of an FP32 tolerance (normalized error
# up to 35, at 0.003 of keys of RMS ~1) while the logits matched; its rms stayed <= 4.2 % of
# the quantization's own rms error (issue 40, benchmarks/bench_memory.py llama-30). A cache
# bug moves the values themselves: many times the quantization's error, not a tenth of it.
ROUNDING_SHARE = 0.1


def rounding_share(got: np.ndarray, want: np.ndarray, fp32: np.ndarray) -> float:
    """rms(cached - full) / rms(full - FP32 full): the cache path's error as a share of
    quantizing's own on this tensor (inf when quantizing changed nothing)."""
    cache = float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2)))
    quant = float(np.sqrt(np.mean((want.astype(np.float64) - fp32) ** 2)))
    if cache == 0:
        return 0.0
    return cache / quant if quant > 0 else float("inf")


def first_position(want: np.ndarray, got: np.ndarray, tol: Tolerance) -> int:
    """The first position (axis 2 of [batch, heads, positions, dim]) out of tolerance."""
    diff = np.abs(want.astype(np.float64) - got)
    norm = normalized(diff, want, tol, atol_scale(want, tol))
    bad = np.nonzero((~np.isfinite(norm) | (norm > 1)).any(axis=(0, 1, 3)))[0]
    return int(bad[0]) if bad.size else -1


def check(
    run: Run,
    lay: sh.Layout,
    tokens: np.ndarray,
    plan: Plan,
    refs: Callable[[str, int, int], dict[str, np.ndarray]],
    tol: Tolerance,
    cfg: ParityConfig,
    fp32: Callable[[str, int, int], dict[str, np.ndarray]] | None = None,
    right: bool = False,
) -> list[KvComparison]:
    """Every probe of the walk and of the padded batch, judged against its full pass.
    `refs(kind, row, length)`: the reference of `kind` ("walk" | "padded") at that length;
    `fp32`: the FP32 model's, for a quantized `run` (see `judge`); `right`: the graph's
    rows are right-padded (`padded`)."""
    rows: list[KvComparison] = []
    for probe in walk(run, lay, tokens[0], plan):
        n = probe.past + 1
        base = fp32("walk", 0, n) if fp32 is not None else None
        rows += judge(probe, refs("walk", 0, n), tol, cfg, base)
    if plan.padded is not None:
        for probe in padded(run, lay, tokens, plan, right):
            row = probe.rows[0] if probe.rows else 0
            rows += judge(probe, refs("padded", row, probe.position + 1), tol, cfg)
    return rows


def references(
    run: Run, lay: sh.Layout, tokens: np.ndarray, plan: Plan
) -> Iterator[tuple[str, int, int, dict[str, np.ndarray]]]:
    """(kind, row, length, full pass) for every probe of `check`: the walk's sequence at each
    length, and each padded row alone at each of its lengths."""
    for n in plan.lengths():
        yield "walk", 0, n, full_pass(run, lay, tokens[:1, :n])
    for row, n in plan.padded_lengths():
        yield "padded", row, n, full_pass(run, lay, tokens[row : row + 1, :n])


def exercise(run: Run, lay: sh.Layout, tokens: np.ndarray, plan: Plan, right: bool = False) -> None:
    """Every pass `references` and `check` make, outputs dropped: for a run that records
    something as it goes (the ranges of a dynamically quantized graph)."""
    for _ in references(run, lay, tokens, plan):
        pass
    for _ in walk(run, lay, tokens[0], plan):
        pass
    if plan.padded is not None:
        for _ in padded(run, lay, tokens, plan, right):
            pass


def reasons(who: str, rows: list[KvComparison]) -> list[str]:
    """The first diverging probe per output kind, in decode order, named for the user."""
    failed = [r for r in rows if not r.ok]
    if not failed:
        return []
    first = failed[0]
    what = first.note or (
        f"normalized error {first.error:.3g} > 1 (max |diff| {first.max_abs:.3g})"
    )
    more = f"; {len(failed) - 1} more comparison(s) out of tolerance" if len(failed) > 1 else ""
    past = "" if first.probe.startswith("past ") else f" (past {first.past})"
    return [
        f"{who}: cached decode at {first.probe}{past}: {first.output} "
        f"at position {first.position} differs from a full recompute: {what}{more}"
    ]
