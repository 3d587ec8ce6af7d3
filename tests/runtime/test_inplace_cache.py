"""Issue 41 item 4: no per-step copy of the whole KV cache. On a fused graph (stages/onnx/
fused.py) the engine's cache is kv.Slots: one buffer per past input, bound as the layer's
past and its present, written in place at each row's length. These tests try to catch a
copy (the buffers replaced or moved by a step), a write out of place (another row's or
another position's slots touched), a capacity that grows past its cap, and rows that lose
their tokens when the buffers are remade (growth, compaction, free slots dropped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shipyard_runtime.generation.kv import Slots
from shipyard_runtime.generation.runner import Graph, Runner


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Graph:
    import onnxruntime as ort

    from tests.fixtures.fused import fused_graph

    path = fused_graph(tmp_path_factory.mktemp("inplace"))
    return Graph(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))


def _prefilled(runner: Runner, prompt: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return runner.prefill_chunk(prompt, 0, len(prompt), None)


def _logits_alone(graph: Graph, tokens: list[int]) -> np.ndarray:
    """The next-token logits of `tokens` by a prefill then one decode step, in a runner of
    its own (a row decoded once after its prefill must equal it)."""
    runner = Runner(graph, 256)
    _, past = _prefilled(runner, tokens[:-1])
    runner.join([(0, past)])
    return dict(runner.decode({0: tokens[-1]}))[0]


def test_a_decode_step_writes_in_place_and_copies_nothing(graph: Graph) -> None:
    assert graph.in_place
    runner = Runner(graph, 256)
    prompts = {1: list(range(10, 27)), 2: list(range(40, 45)), 3: list(range(60, 100))}
    joined = [(k, _prefilled(runner, p)[1]) for k, p in prompts.items()]
    runner.join(joined)
    slots = runner.batch
    assert isinstance(slots, Slots)
    before = {n: (a, a.ctypes.data, a.copy()) for n, a in slots.past.items()}
    lengths = slots.lengths.copy()
    runner.decode({1: 5, 2: 6, 3: 7})
    for name, (array, pointer, old) in before.items():
        now = slots.past[name]
        assert now is array and now.ctypes.data == pointer  # the same buffer, not a copy
        for row, n in enumerate(lengths):
            assert np.array_equal(now[row, :, :n], old[row, :, :n])  # the past untouched
            assert not np.array_equal(now[row, :, n], old[row, :, n])  # the new token, at n
            assert np.array_equal(now[row, :, n + 1 :], old[row, :, n + 1 :])  # nothing after
    assert list(slots.lengths) == [n + 1 for n in lengths]


def test_each_row_equals_itself_alone_through_growth_and_compaction(graph: Graph) -> None:
    """Rows joining and leaving, the capacity growing past a STEP and shrinking: each row's
    logits at each step equal the same sequence's, decoded the same way (the same prefill,
    the same steps) in a runner of its own, to the bit."""
    runner = Runner(graph, 256)
    rng = np.random.default_rng(2)
    seqs: dict[int, list[int]] = {}
    alone: dict[int, Runner] = {}
    for key, n in enumerate((3, 50, 61, 7)):
        seqs[key] = rng.integers(5, 500, n).tolist()
        alone[key] = Runner(graph, 256)
        for r in (runner, alone[key]):
            r.join([(key, _prefilled(r, seqs[key][:-1])[1])])
    grew = False
    for step in range(12):
        out = dict(runner.decode({k: s[-1] for k, s in seqs.items()}))
        grew |= runner.batch.length > 64
        for key, logits in out.items():
            want = dict(alone[key].decode({key: seqs[key][-1]}))[key]
            assert np.array_equal(logits, want), (step, key)
            seqs[key].append(int(logits.argmax()))
        if step == 8:  # the longest leaves (its growth took the capacity past 64)
            runner.leave(2)
            del seqs[2]
        if step == 9:
            runner.leave(0)
            del seqs[0]
            runner.batch.drop_free(0)
    assert grew and runner.batch.length == 64  # shrunk back once the longest left


def test_the_capacity_never_rounds_past_the_most_a_row_holds(graph: Graph) -> None:
    slots = Slots(graph.spec, graph.dtype, most=70)
    assert slots.rounded(10) == 64
    assert slots.rounded(63) == 64  # 63 cached and the next token
    assert slots.rounded(64) == 70 and slots.rounded(69) == 70  # capped, not 128
    assert slots.rounded(75) == 76  # a need past the cap is met, never cut
    uncapped = Slots(graph.spec, graph.dtype)
    assert uncapped.rounded(63) == 64 and uncapped.rounded(64) == 128


@pytest.mark.parametrize(
    ("prompt", "tokens", "most"), [(5, 2, 70), (40, 30, 70), (60, 5, 70), (60, 6, 70)]
)
def test_the_budget_counts_the_capacity_a_sequence_reaches_and_no_more(
    graph: Graph, prompt: int, tokens: int, most: int
) -> None:
    """The scheduler admits a sequence of prompt + max_tokens = total by `columns(total)`
    a row. A sequence decoded to its end takes exactly that capacity (less, and a row would
    outgrow what was counted; more, and the budget admits fewer rows than fit), and one at
    the engine's longest (total = most, the plan's cached tokens) counts `most`: rows at the
    plan's extreme fit a budget of rows x most (counted as most + 1, the plan's last row
    waited for the first to leave)."""
    runner = Runner(graph, most)
    total = prompt + tokens
    ids = list(range(3, 3 + total))
    first, past = _prefilled(runner, ids[:prompt])
    runner.join([(0, past)])
    reached = runner.batch.length
    for i in range(tokens - 1):  # the last token is generated, never fed
        runner.decode({0: ids[prompt + i]})
        reached = max(reached, runner.batch.length)
    assert isinstance(runner.batch, Slots)
    assert reached == runner.batch.columns(total), (reached, runner.batch.columns(total))
    assert runner.batch.columns(most) == most  # the longest the engine admits
    assert runner.batch.columns(total) <= most


def test_a_free_slot_decodes_beside_rows_without_moving_them(graph: Graph) -> None:
    runner = Runner(graph, 256)
    a, b = list(range(20, 40)), list(range(70, 75))
    runner.join([(1, _prefilled(runner, a[:-1])[1]), (2, _prefilled(runner, b[:-1])[1])])
    runner.batch.wanted = 1  # keep the free slot (a sequence on its way in)
    runner.leave(1)
    assert runner.batch.free == 1
    out: dict[int, Any] = dict(runner.decode({2: b[-1]}))
    assert list(out) == [2]
    assert np.array_equal(out[2], _logits_alone(graph, b))


def test_the_graph_file_is_the_fused_one(graph: Graph) -> None:
    """Sanity: what these tests hold is the kernel that updates in place."""
    path = Path(graph.session._model_path)
    import onnx

    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in ops
