"""The engine stepped by hand (issue 41): `Engine(start=False)` runs no thread, each
`step(now)` is one iteration (the scheduler's plan, the runner's passes, the output
processor's events), so scheduling is checked exactly, with a fake clock and no sleeps or
queues to wait on. The graph is a counting stand-in (next token = last + 1) that records
every pass: (rows, new tokens, past)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shipyard_runtime.generation.core import Engine, EngineSettings, Event
from shipyard_runtime.generation.params import parse
from shipyard_runtime.generation.scheduler import Scheduler, StepPlan
from tests.fixtures.counting import Counting


def engine(**changes: Any) -> tuple[Engine, Counting]:
    base = {"max_rows": 4, "max_context": 200, "chunk": 64, "max_past": 200}
    settings = EngineSettings(**{"kv_budget_tokens": 800, **base, **changes})
    graph = Counting()
    return Engine(graph, settings, start=False), graph  # type: ignore[arg-type]


def submit(e: Engine, prompt: list[int], n: int, **params: Any) -> list[Event]:
    got: list[Event] = []
    e.submit(prompt, parse({"max_tokens": n, "temperature": 0, **params}), got.append)
    return got


def tokens(events: list[Event]) -> list[int]:
    return [ev.token for ev in events if ev.token is not None]


def test_one_step_prefills_the_arrivals_together_then_decodes_them() -> None:
    e, graph = engine()
    a, b = submit(e, [1, 2, 3], 3), submit(e, [10, 11], 3)
    assert graph.calls == [] and a == [] and b == []  # nothing runs until a step
    assert e.step()
    # one prefill pass of both (left-padded to 3), then one decode step of both rows
    assert graph.calls == [(2, 3, 0), (2, 1, 3)]
    assert tokens(a) == [4, 5] and tokens(b) == [12, 13]
    assert e.step()
    assert tokens(a) == [4, 5, 6] and a[-1].finish == "length"
    assert tokens(b) == [12, 13, 14] and b[-1].finish == "length"
    assert not e.step()  # idle
    assert len(e.batch.keys) == 0  # both rows gone at once


def test_a_long_prompt_is_prefilled_a_chunk_per_step_between_decode_steps() -> None:
    e, graph = engine(chunk=8)
    short = submit(e, [1, 2], 30)
    e.step()
    graph.calls.clear()
    long = submit(e, list(range(100, 140)), 2)  # 40 tokens: five chunks of 8
    for _ in range(5):
        e.step()
    # each step: one chunk of the long prompt, then the running batch's decode step; the
    # fifth chunk ends its prefill and it decodes with the short one in that same step
    assert [n for _, n, _ in graph.calls] == [8, 1] * 5
    assert [rows for rows, n, _ in graph.calls if n == 1] == [1, 1, 1, 1, 2]
    assert tokens(long) == [140, 141]  # its first token, and its first decode step
    assert len(tokens(short)) == 2 + 5  # and the short one decoded once a step meanwhile


def test_ageing_lets_short_requests_pass_a_blocked_long_one_for_max_wait_only() -> None:
    """A budget of 320 holds the running 4 + 150 and a short 2 + 6 (2 rows x 154), not the
    long 8 + 200 (2 x 208): the short ones overtake it until it has waited max_wait_s."""
    e, _ = engine(kv_budget_tokens=320, max_wait_s=1.0, max_context=300, max_past=300)
    submit(e, [1, 2, 3, 4], 150)
    t0 = 1000.0
    e.step(now=t0)
    long = submit(e, [7] * 8, 200)
    arrival = e.scheduler.waiting[-1].arrival
    early = submit(e, [5, 6], 6)
    e.step(now=arrival + 0.5)  # the long one has waited 0.5 s: the short one overtakes
    assert tokens(early) and not long
    late = submit(e, [8, 9], 6)
    e.step(now=arrival + 1.0)  # it has waited max_wait_s: nobody overtakes it any more
    assert not late and not long


def test_a_request_not_admitted_in_time_ends_with_the_kind_timeout() -> None:
    e, _ = engine(timeout_s=2.0, kv_budget_tokens=160, max_context=300, max_past=300)
    submit(e, [1] * 10, 150)  # takes the whole budget
    e.step()
    waiting = submit(e, [2] * 4, 4)
    arrival = e.scheduler.waiting[-1].arrival
    e.step(now=arrival + 1.9)
    assert waiting == []
    e.step(now=arrival + 2.1)
    assert [ev.kind for ev in waiting] == ["timeout"]
    assert "not admitted within 2 s" in (waiting[0].error or "")


def test_a_failing_graph_ends_every_sequence_with_the_kind_internal() -> None:
    e, graph = engine()
    running = submit(e, [1, 2], 10)
    e.step()
    waiting = submit(e, [3], 10)
    graph.fail = True
    e.step()
    assert running[-1].kind == "internal" and "the graph broke" in (running[-1].error or "")
    assert waiting[-1].kind == "internal"
    assert not e.step() and len(e.batch.keys) == 0
    later = submit(e, [4], 2)  # the engine goes on serving
    graph.fail = False
    e.step()
    e.step()
    assert tokens(later) == [5, 6]


def test_closing_an_engine_tells_what_is_left_the_kind_shutdown() -> None:
    e, _ = engine()
    left = submit(e, [1], 5)
    e.close()
    assert [ev.kind for ev in left] == ["shutdown"]


def test_a_cancelled_sequence_leaves_at_the_next_step_and_its_row_with_it() -> None:
    e, graph = engine()
    got: list[Event] = []
    handle = e.submit([1, 2], parse({"max_tokens": 50, "temperature": 0}), got.append)
    other = submit(e, [9], 50)
    e.step()
    handle.cancel()
    graph.calls.clear()
    e.step()
    assert got[-1].finish == "abort"
    assert graph.calls == [(1, 1, 3)]  # the next decode step runs the other row alone
    assert tokens(other)[-1] == 12


def test_the_scheduler_alone_plans_without_a_graph() -> None:
    """Policy over plain state: admission, groups and chunks come out as a plan."""
    from shipyard_runtime.generation.kv import Batch
    from shipyard_runtime.generation.scheduler import Sequence

    settings = EngineSettings(max_rows=2, max_context=100, chunk=16, max_past=100,
                              kv_budget_tokens=400)  # fmt: skip
    s = Scheduler(settings, True, Batch([("p", 1, 1)], np.dtype(np.float32)))

    def seq(key: int, n: int) -> Sequence:
        return Sequence(key, list(range(n)), parse({"max_tokens": 4}), lambda e: None, 0.0,
                        np.random.default_rng(0), None, frozenset())  # fmt: skip

    for key, n in ((0, 6), (1, 5), (2, 40)):
        s.add(seq(key, n))
    plan = s.schedule(now=0.0)
    assert isinstance(plan, StepPlan)
    assert [q.key for q in plan.group] == [0, 1]  # two rows: the third waits
    assert plan.chunks == [] and [q.key for q in s.waiting] == [2]


@pytest.mark.parametrize("n", [1, 3])
def test_max_tokens_one_ends_at_prefill_and_takes_no_row(n: int) -> None:
    e, graph = engine()
    burst = [submit(e, [i + 1, i + 2], 1) for i in range(n)]
    e.step()
    assert all(b[-1].finish == "length" for b in burst)
    assert len(e.batch.keys) == 0 and all(c[1] > 1 for c in graph.calls)  # no decode step


def test_prefixes_kept_by_a_prefill_together_stay_within_the_kv_budget() -> None:
    """Four prompts of 40 tokens (+ 60 to generate) prefilled in one pass fill a budget of
    400: their blocks may be cached only in what the joined rows leave (none here)."""
    e, _ = engine(
        kv_budget_tokens=400, prefix_cache_tokens=400, max_context=100, max_past=100, chunk=200
    )
    for i in range(4):
        submit(e, [i * 50 + j + 1 for j in range(40)], 60)
    e.step()
    assert e.prefix is not None and len(e.scheduler.running) == 4
    held = len(e.batch.keys) * max(q.total for q in e.scheduler.running.values())
    assert held + e.prefix.held <= 400, (held, e.prefix.held)


def test_the_step_profile_splits_a_decode_step_into_its_parts() -> None:
    """The benchmark prints where a decode step's time goes: the graph (here a counting
    graph that sleeps, so its share is known), the inputs, the output processor, the rest;
    the parts add up to the step, and the rows are counted per step."""
    import time

    e, graph = engine()
    slow = graph.run

    def sleepy(feeds: dict[str, np.ndarray]) -> Any:
        time.sleep(0.004)
        return slow(feeds)

    graph.run = sleepy  # type: ignore[method-assign]
    a, b = submit(e, [1, 2], 6), submit(e, [3], 6)
    while e.step():
        pass
    assert tokens(a) == [3, 4, 5, 6, 7, 8] and tokens(b) == [4, 5, 6, 7, 8, 9]
    p = e.step_profile()
    assert e.steps == 5 and p["rows"] == 2.0  # 5 decode steps of both rows
    assert p["slots"] == 2 * (2 + 3 + 4 + 5 + 6) / 5  # 2 rows, a past of 2 (padded) to 6
    assert 4.0 <= p["graph"] <= p["step"]
    parts = p["graph"] + p["inputs"] + p["cache"] + p["output"] + p["python"]
    assert abs(parts - p["step"]) < 1e-6 and min(p.values()) >= 0
    # measured, not the remainder: the sleeping graph is most of each step
    assert p["python"] + p["inputs"] + p["output"] < p["graph"]


def test_sequences_joining_a_step_apart_grow_the_batch_once() -> None:
    """Four prompts admitted together but prefilled on different steps (a chunk of 8 holds
    one and a bit): the first to join grows the batch for every one whose prompt's rest fits
    the next chunk, so the others take free rows without another copy of the whole cache,
    and the tokens are what a row at a time gives."""
    e, graph = engine(chunk=8)
    grown: list[tuple[int, int]] = []
    reserve = e.batch.reserve

    def counted(rows: int, length: int) -> None:
        before = (len(e.batch.keys), e.batch.length)
        reserve(rows, length)
        if (len(e.batch.keys), e.batch.length) != before:
            grown.append((len(e.batch.keys), e.batch.length))

    e.batch.reserve = counted  # type: ignore[method-assign]
    prompts = [[10 * i + j for j in range(1, 7)] for i in range(4)]
    got = [submit(e, p, 3) for p in prompts]
    while e.step():
        pass
    assert grown == [(4, 6)]  # one copy for all four (a row at a time was four)
    for p, events in zip(prompts, got, strict=True):
        assert tokens(events) == [p[-1] + 1, p[-1] + 2, p[-1] + 3]
        assert events[-1].finish == "length"
    # the rows rode along only while their sequences were on their way in
    assert max(rows for rows, n, _ in graph.calls if n == 1) == 4


def test_prompts_far_apart_in_length_are_prefilled_in_passes_of_their_own() -> None:
    """A 3-token and a 60-token prompt in one pass would be 57 padding tokens for the short
    one (a padded token costs what a real one does): each gets its own pass in the same
    step; two prompts close in length still share one, and both decode together."""
    from shipyard_runtime.generation.scheduler import GROUP_PADDING

    e, graph = engine(chunk=64)
    short, long = submit(e, [1, 2, 3], 2), submit(e, list(range(100, 160)), 2)
    e.step()
    assert graph.calls[:2] == [(1, 3, 0), (1, 60, 0)]  # no pass of 2 rows x 60
    assert graph.calls[2][:2] == (2, 1)  # then one decode step of both
    assert tokens(short) == [4, 5] and tokens(long) == [160, 161]
    graph.calls.clear()
    near = [list(range(10, 10 + n)) for n in (30, 30 - GROUP_PADDING)]
    got = [submit(e, p, 1) for p in near]
    e.step()
    assert graph.calls[0] == (2, 30, 0)  # padding of 16 for one of two rows: together
    assert [tokens(g) for g in got] == [[40], [24]]
