"""Issue 42 items 4 and 10: what a request holds can neither stall the server nor make it
answer 500. JSON nested 100k deep, lone surrogates in values and field names, a 3.9 MB
prompt, a chat template that loops or asks for range(10**9), and random JSON (hypothesis)
through the real server and the openai client; the template worker's limits on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shipyard_runtime.generation.text import Text
from tests.conftest import TINY

pytest_plugins = ["tests.runtime.test_openai_api"]  # its module-scoped gpt2_server


def raw(url: str, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, Any]:
        headers = {"content-type": "application/json"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + path, data=data, headers=headers) as r,
        ):
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def test_json_nested_100k_deep_is_a_400(gpt2_server: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, answer = raw(gpt2_server, path, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "nested too deeply" in answer["error"]["message"], answer
    # a causal LM serves no embeddings: said before the body is read
    assert raw(gpt2_server, "/v1/embeddings", b"[" * 100_000)[0] == 404
    status, answer = raw(
        gpt2_server, "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    )
    assert status == 400


def test_an_integer_of_5000_digits_is_a_400(gpt2_server: str) -> None:
    """Python refuses to parse integers of more than 4,300 digits with a ValueError that
    is not a JSONDecodeError: it was a 500."""
    body = b'{"prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}"
    status, answer = raw(gpt2_server, "/v1/completions", body)
    assert status == 400 and "not valid JSON" in answer["error"]["message"], answer


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}',
        b'{"prompt": "a", "max_tokens": 2, "\\ud800x": 1}',  # an unknown field's name
        b'{"prompt": "a", "max_tokens": 2, "stop": ["\\ud83d"]}',
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_it(gpt2_server: str, body: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = raw(gpt2_server, path, body)
    assert status == 400, answer
    assert "lone surrogate" in answer["error"]["message"]


def test_huge_prompts_are_refused_before_tokenizing_and_stall_no_one(gpt2_server: str) -> None:
    """Three 3.9 MB prompts at once (each took 5.9 s to tokenize on the event loop, and
    stalled every client 9.9 s): refused by their length, while a small request beside them
    is answered."""
    huge = json.dumps({"prompt": "hello world. " * 300_000, "max_tokens": 1}).encode()
    small = json.dumps({"prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()

    async def go() -> tuple[list[tuple[int, str]], float]:
        headers = {"content-type": "application/json"}
        limits = aiohttp.TCPConnector(limit=8)
        async with aiohttp.ClientSession(connector=limits) as s:

            async def one(data: bytes) -> tuple[int, str]:
                async with s.post(gpt2_server + "/v1/completions", data=data, headers=headers) as r:
                    return r.status, await r.text()

            start = time.perf_counter()
            big = [asyncio.create_task(one(huge)) for _ in range(3)]
            status, _ = await one(small)
            took = time.perf_counter() - start
            assert status == 200
            return list(await asyncio.gather(*big)), took

    answers, took = asyncio.run(go())
    assert all(status == 400 and "characters, more than" in text for status, text in answers)
    assert took < 5.0, took  # 9.9 s before; the 4 MB bodies themselves take a while to send


def test_a_chat_template_that_loops_is_stopped_and_the_server_goes_on(gpt2_server: str) -> None:
    """The template loops 99,999 x 99,999 on one message (40 s+ before, every client
    stalled): refused after its 2 s, a completion beside it answered at once, and the next
    chat rendered by a fresh worker."""
    import openai

    client = openai.OpenAI(base_url=f"{gpt2_server}/v1", api_key="unused", max_retries=0)

    async def beside() -> float:
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [1, 2], "max_tokens": 2}
            async with s.post(gpt2_server + "/v1/completions", json=body) as r:
                assert r.status == 200
        return time.perf_counter() - start

    async def both() -> tuple[Any, float]:
        looping = asyncio.to_thread(
            lambda: _refused(client, [{"role": "user", "content": "__loop__"}])
        )
        return tuple(await asyncio.gather(looping, beside()))  # type: ignore[return-value]

    refusal, other = asyncio.run(both())
    assert "took more than 2 s of CPU time to render the messages and was stopped" in refusal
    assert other < 1.5, other
    done = client.chat.completions.create(
        model="tiny-gpt2", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert done.choices[0].finish_reason == "length"


def _refused(client: Any, messages: list[dict[str, str]]) -> str:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-gpt2", messages=messages, max_tokens=2)
    return str(caught.value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "prompt": _json,
        "messages": _json,
        "max_tokens": _json,
        "temperature": _json,
        "stop": _json,
        "logprobs": _json,
        "top_logprobs": _json,
        "n": _json,
        "seed": _json,
        "stream": st.just(False),
        "model": st.sampled_from(["tiny-gpt2", "other"]),
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_fields | _json, chat=st.booleans())
def test_random_json_never_gets_a_500(gpt2_server: str, body: Any, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(abs(body["max_tokens"]), 4)
    status, answer = raw(gpt2_server, path, json.dumps(body).encode())
    assert status < 500, (body, answer)
    assert status in (200, 400, 404, 422), (status, answer)


# ------------------------------------------------------------------ the template worker
@pytest.fixture
def text(tmp_path: Path) -> Iterator[Any]:
    (tmp_path / "tokenizer.json").write_bytes((TINY / "tokenizer.json").read_bytes())

    def make(template: str) -> Text:
        (tmp_path / "chat_template.jinja").write_text(template)
        made.append(Text(tmp_path))
        return made[-1]

    made: list[Text] = []
    yield make
    for t in made:
        t.close()


HI = [{"role": "user", "content": "hi there"}]


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        ("{% for i in range(10**9) %}{% endfor %}", "OverflowError: Range too big"),
        (
            "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "ran out of its memory",
        ),
        (
            "{% for i in range(99999) %}{{ messages[0].content }}{% endfor %}",
            "the rendered chat has",
        ),
        ("{% for %}", "does not compile"),
        ("{{ raise_exception('no system role') }}", "refused the messages: no system role"),
        ("{{ ''.__class__.__mro__ }}", "chat template"),
    ],
)
def test_a_hostile_template_is_a_refusal_not_a_crash(
    text: Any, template: str, refusal: str
) -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="chat template|rendered chat") as caught:
        text(template).chat(HI, 2048)
    assert refusal in str(caught.value)
    # the memory went in the worker, not here (1.5-4.6 GB before)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024


def test_a_looping_template_is_killed_and_the_next_render_gets_a_fresh_worker(text: Any) -> None:
    t = text(
        "{% if messages[0].content == 'loop' %}{% for i in range(99999) %}"
        "{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
        "<|{{ messages[0].content }}|>"
    )
    start = time.perf_counter()
    with pytest.raises(ValueError, match="took more than 2 s"):
        t.chat([{"role": "user", "content": "loop"}], 2048)
    assert time.perf_counter() - start < 10
    assert t.chat(HI, 2048) == "<|hi there|>"


def test_a_render_starved_of_the_cpu_is_not_stopped_by_the_wall_clock(text: Any) -> None:
    """The render limit counts the worker's CPU time: a worker that waits 3 s for a CPU (a
    busy machine, here a SIGSTOP) still renders a template that needs little of it, and a
    template that needs more than 2 s is stopped however long it had to wait. (On wall time,
    CI's busy runner turned the memory-growing template above into a timeout.)"""
    import signal
    import threading

    t = text(
        "{% if messages[0].content == 'loop' %}{% for i in range(99999) %}"
        "{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
        "{% for i in range(20000) %}{% endfor %}<|{{ messages[0].content }}|>"
    )
    assert t.chat(HI, 2048) == "<|hi there|>"  # the worker is up
    assert t._template is not None and t._template._proc is not None
    pid = t._template._proc.pid
    for content, want in (("hi there", "<|hi there|>"), ("loop", "took more than 2 s of CPU")):
        out: list[Any] = []

        def render(content: str = content, out: list[Any] = out) -> None:
            try:
                out.append(t.chat([{"role": "user", "content": content}], 2048))
            except ValueError as exc:
                out.append(exc)

        os.kill(pid, signal.SIGSTOP)
        worker = threading.Thread(target=render)
        start = time.perf_counter()
        worker.start()
        time.sleep(3.0)
        with contextlib.suppress(ProcessLookupError):  # killed on the wall clock
            os.kill(pid, signal.SIGCONT)
        worker.join(60)
        assert out and want in str(out[0]), out
        assert time.perf_counter() - start > 3.0
        if content == "loop":  # stopped: the next render gets a fresh worker
            assert t._template._proc is None
            assert t.chat(HI, 2048) == "<|hi there|>"
            pid = t._template._proc.pid


def test_a_chat_too_big_for_the_context_is_refused_before_rendering(text: Any) -> None:
    t = text("{% for m in messages %}{{ m.content }}{% endfor %}")
    many = [{"role": "user", "content": "a"}] * 100_001
    with pytest.raises(ValueError, match="100001 messages are more than the 2048-token context"):
        t.chat(many, 2048)
    with pytest.raises(ValueError, match="characters, more than 2048 tokens"):
        t.chat([{"role": "user", "content": "x" * 3_500_000}], 2048)
    assert t._template is not None and t._template._proc is None  # no worker started
    assert t.chat(HI, 2048) == "hi there"


def test_fits_bounds_a_text_by_the_longest_token(text: Any) -> None:
    t = text("")
    t.fits("a" * (10 * t.longest), 10, "prompt")
    with pytest.raises(ValueError, match=f"prompt has {10 * t.longest + 1} characters"):
        t.fits("a" * (10 * t.longest + 1), 10, "prompt")
    assert t.encode("hello world") == list(t.tokenizer.encode("hello world").ids)
