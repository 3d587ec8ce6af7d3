"""The endpoints users' clients speak (issue 25), through the real `openai` Python client
against a real MLServer serving a bundle built by the stages: completions and chat (whole
and streamed, with usage and finish reasons), the same tokens as V2 `infer`, every
unsupported or malformed field refused with a 400 (never ignored), and `/v1/embeddings` on
a text-embedding bundle equal to the graph's own output."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from stages.loadtesting.server import LocalServer, assemble
from tests.conftest import TINY, Workspace, gpt2_spec
from tests.fixtures import architectures as matrix

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    # a hostile template's loop, on one message only (tests/runtime/test_front_door_input.py)
    "{% if messages[0].content == '__loop__' %}"
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
)


def serve(ws: Workspace, name: str, spec: dict[str, Any]) -> Path:
    for stage in ("pin", "export", "quantize", "plan", "serve"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    tree = ws.root / f"tree-{name}"
    assemble(tree, sorted(ws.out(name, "quantize").glob("model.onnx*")), ws.out(name, "serve"))
    return tree


@pytest.fixture(scope="module")
def gpt2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ws = Workspace(tmp_path_factory.mktemp("openai"))
    (ws.root / "models" / "tiny-gpt2" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    spec = gpt2_spec()
    spec["export"]["dims"]["past_sequence"]["max"] = 120  # room for a rendered chat
    tree = serve(ws, "tiny-gpt2", spec)
    assert (tree / "serving" / "text" / "chat_template.jinja").is_file()
    with LocalServer(tree, "tiny-gpt2", ws.root / "log", 60) as srv:
        METRICS[srv.url] = f"http://127.0.0.1:{srv.ports[2]}/metrics"
        yield srv.url


METRICS: dict[str, str] = {}  # a served URL -> its Prometheus endpoint


@pytest.fixture
def client(gpt2_server: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{gpt2_server}/v1", api_key="unused", max_retries=0)


def v2(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{url}/v2/models/tiny-gpt2/infer", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())

    return asyncio.run(go())


VARIED = {"repetition_penalty": 5.0}  # the random-weight model repeats one token otherwise


def test_models_lists_the_served_model(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-gpt2"]


def test_a_completion_returns_text_usage_and_the_tokens_v2_returns(
    client: Any, gpt2_server: str
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    done = client.completions.create(
        model="tiny-gpt2", prompt="def add(a, b):", max_tokens=8, temperature=0, extra_body=VARIED
    )
    (choice,) = done.choices
    ids = tok.encode("def add(a, b):").ids
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 8
    assert choice.finish_reason == "length" and done.object == "text_completion"
    body = {
        "inputs": [{"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}],
        "parameters": {"max_new_tokens": 8, **VARIED},
    }
    out = {o["name"]: o for o in v2(gpt2_server, body)["outputs"]}
    assert choice.text == tok.decode(out["output_ids"]["data"]) == out["text"]["data"][0]


def test_a_streamed_completion_adds_up_to_the_whole_one(client: Any) -> None:
    ask = {"model": "tiny-gpt2", "prompt": "x = ", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**ask, extra_body=VARIED)
    chunks = list(
        client.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}, extra_body=VARIED
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_a_chat_is_rendered_with_the_shipped_template_and_streams(client: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model="tiny-gpt2", messages=messages, max_tokens=6, temperature=0, extra_body=VARIED
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.object == "chat.completion" and whole.usage.completion_tokens == 6
    # the template's text, not the raw messages, was the prompt
    from tokenizers import Tokenizer

    prompt = "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert whole.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False).ids)
    stream = client.chat.completions.create(
        model="tiny-gpt2",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body=VARIED,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )


def test_a_seeded_sampled_completion_repeats_and_a_stop_string_ends_it(client: Any) -> None:
    ask = {"model": "tiny-gpt2", "prompt": "hello", "max_tokens": 12, "temperature": 1.0}
    a = client.completions.create(**ask, seed=5)
    b = client.completions.create(**ask, seed=5)
    assert a.choices[0].text == b.choices[0].text
    greedy = client.completions.create(
        model="tiny-gpt2", prompt="hello", max_tokens=12, temperature=0, extra_body=VARIED
    ).choices[0]
    stop = greedy.text[4:7]
    cut = client.completions.create(
        model="tiny-gpt2",
        prompt="hello",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body=VARIED,
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.index(stop)]


def test_logprobs_come_back_per_token(client: Any) -> None:
    done = client.completions.create(
        model="tiny-gpt2", prompt="a", max_tokens=3, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(x < 0 for x in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_every_top_logprob_asked_for_comes_back_even_when_tokens_decode_alike(
    client: Any,
) -> None:
    """Issue 41: keyed by text, alternatives that decode alike (byte fragments, a bundle
    without a tokenizer) collapsed into one entry: 5 asked, 1-3 returned."""
    done = client.completions.create(
        model="tiny-gpt2", prompt="\u00e9\u00e8", max_tokens=8, temperature=0, logprobs=20,
        extra_body=VARIED,
    )  # fmt: skip
    tops = done.choices[0].logprobs.top_logprobs
    assert len(tops) == 8 and all(len(top) == 20 for top in tops), [len(t) for t in tops]


def test_alternatives_keyed_by_text_fall_back_to_token_ids_where_texts_clash() -> None:
    from shipyard_runtime.openai_api import _top_by_text

    texts = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "", 5: "b", 6: "b", 7: "c"}
    top = [(t, -float(t)) for t in texts]
    out = _top_by_text(top, lambda ids: texts[ids[0]])
    # and the chosen token is named as its alternatives name it
    from shipyard_runtime.generation.scheduler import Event
    from shipyard_runtime.openai_api import _logprobs_block

    events = [Event(token=t, logprob=-1.0, top=top) for t in (1, 3, 6)]
    block = _logprobs_block("completion", events, lambda ids: texts[ids[0]])
    assert block["tokens"] == ["a", "token_id:3", "token_id:6"]
    assert all(t in top_i for t, top_i in zip(block["tokens"], block["top_logprobs"], strict=True))
    assert out == {
        "a": -1.0, "token_id:2": -2.0, "token_id:3": -3.0, "token_id:4": -4.0,
        "token_id:5": -5.0, "token_id:6": -6.0, "c": -7.0,
    }  # fmt: skip


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(
    client: Any, gpt2_server: str
) -> None:
    """OpenAI's default for chat is the rest of the context, not 16 tokens."""
    messages = [{"role": "user", "content": "hi"}]
    done = client.chat.completions.create(
        model="tiny-gpt2", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    used = done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens > 16
    # exactly what the served limits allow: one token more is refused
    status, answer = post(
        gpt2_server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": done.usage.completion_tokens + 1},
    )
    assert status == 400, answer
    assert used == 122  # past_sequence.max 120, the token fed last, the one never fed


def test_a_greedy_request_is_the_same_alone_and_among_concurrent_ones(client: Any) -> None:
    """Issue 41, through the openai client: the same greedy completion, alone and while
    eight others of other lengths run beside it, returns the same tokens and logprobs."""
    from concurrent.futures import ThreadPoolExecutor

    ask = {"model": "tiny-gpt2", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0,
           "logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
    alone = client.completions.create(**ask).choices[0].logprobs
    others = [
        {**ask, "prompt": "x" * (3 + 7 * i), "max_tokens": 4 + 3 * i, "logprobs": None}
        for i in range(8)
    ]
    with ThreadPoolExecutor(9) as pool:
        crowd = [pool.submit(client.completions.create, **o) for o in others[:4]]
        busy = pool.submit(client.completions.create, **ask)
        crowd += [pool.submit(client.completions.create, **o) for o in others[4:]]
        beside = busy.result().choices[0].logprobs
        for f in crowd:
            f.result()
    assert beside.tokens == alone.tokens
    assert beside.token_logprobs == alone.token_logprobs  # to the bit
    assert beside.top_logprobs == alone.top_logprobs


def test_a_shared_system_prompt_hits_the_prefix_cache(client: Any) -> None:
    """Issue 41: B shares only its system prompt with A and reported cached_tokens 0."""
    system = list(range(100, 148))  # 48 tokens: three blocks of 16
    ask = {"model": "tiny-gpt2", "max_tokens": 2, "temperature": 0}
    a = client.completions.create(prompt=system + list(range(300, 320)), **ask)
    b = client.completions.create(prompt=system + list(range(400, 437)), **ask)
    details = b.usage.prompt_tokens_details
    assert b.usage.prompt_tokens == 85 and details is not None and details.cached_tokens == 48
    assert a.usage.prompt_tokens == 68


REFUSED = [
    ({"prompt": "a", "n": 2}, "n must be 1"),
    ({"prompt": "a", "best_of": 2}, "unknown or unsupported field 'best_of'"),
    ({"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty is not supported"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias is not supported"),
    ({"prompt": "a", "echo": True}, "echo and suffix are not supported"),
    ({"prompt": "a", "top_p": 0}, "parameter 'top_p'"),
    ({"prompt": "a", "temperature": -1}, "parameter 'temperature'"),
    ({"prompt": "a", "max_tokens": 0}, "parameter 'max_tokens'"),
    ({"prompt": "a", "max_tokens": 500}, "exceeds the served context"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": [1, 512]}, "token ids must lie in [0, 512)"),
    ({"prompt": "a", "logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt": ["a", "b"], "stream": True}, "a streamed completion takes one prompt"),
    ({"prompt": "a", "stream_options": {"x": 1}}, "stream_options takes only include_usage"),
]


@pytest.mark.parametrize(("body", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_each_unsupported_or_malformed_completion_field_is_a_400(
    gpt2_server: str, body: dict[str, Any], message: str
) -> None:
    status, answer = post(gpt2_server, "/v1/completions", {"model": "tiny-gpt2", **body})
    assert status == 400, answer
    assert message in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_chat_refusals_and_an_unknown_model_is_a_404(gpt2_server: str) -> None:
    ok = [{"role": "user", "content": "hi"}]
    for body, message in (
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
        ({"messages": ok, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"messages": ok, "max_tokens": 2, "max_completion_tokens": 2}, "not both"),
        ({"messages": ok, "tools": []}, "unknown or unsupported field 'tools'"),
    ):
        status, answer = post(gpt2_server, "/v1/chat/completions", body)
        assert status == 400 and message in answer["error"]["message"], (body, answer)
    status, answer = post(gpt2_server, "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert status == 404 and "does not exist" in answer["error"]["message"]
    status, answer = post(gpt2_server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = post(gpt2_server, "/v1/embeddings", {"input": "a"})
    assert status == 404 and "serves no embeddings" in answer["error"]["message"]


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body)
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{url}{path}", data=data, headers={"content-type": "application/json"}) as r,
        ):
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


# ------------------------------------------------------------------- embeddings
@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = matrix.workspace(tmp_path_factory.mktemp("embed") / "repo")
    arch = next(a for a in matrix.ARCHITECTURES if a.name == "BERT" and a.task == "text-embedding")
    slug = matrix.slug_of(arch)
    matrix.build_model(arch, root / "models" / slug)
    shutil.copy(TINY / "tokenizer.json", root / "models" / slug / "tokenizer.json")
    ws = Workspace.__new__(Workspace)
    ws.root = root
    tree = serve(ws, slug, matrix.spec_for(arch, slug))
    with LocalServer(tree, slug, root / "log", 60) as srv:
        METRICS[srv.url] = f"http://127.0.0.1:{srv.ports[2]}/metrics"
        yield srv.url, ws.out(slug, "quantize") / "model.onnx"


def test_an_embedding_server_announces_its_model(bert: Any) -> None:
    """Issue 43: an embedding bundle exported no series of its own, so its release's alerts
    had nothing to scope to and no target-down rule could see it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url, model = bert
    with urllib.request.urlopen(METRICS[url], timeout=10) as r:
        text = r.read().decode()
    info = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "shipyard_model_info"
    ]
    assert [(s.labels, s.value) for s in info] == [({"model_name": model.parents[1].name}, 1.0)]


def test_an_embedding_server_counts_its_requests_tokens_and_latency(bert: Any) -> None:
    """Issue 43 item 4: a one-pass bundle exported no engine series: no request counts,
    latency, queue or batch sizes (its dashboard and alerts had nothing but memory)."""
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    url, model = bert
    name = model.parents[1].name

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(METRICS[url], timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("model_name") == name
        }

    own = (("model_name", name),)
    before = scrape()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.embeddings.create(model=name, input=["one two three", "four"])
    client.embeddings.create(model=name, input="five six")
    with pytest.raises(openai.BadRequestError):  # refused before it is queued: not counted
        client.embeddings.create(model=name, input=[[1] * 100_000])
    after = scrape()

    def grew(series: str, labels: tuple[tuple[str, str], ...] = own) -> float:
        return after.get((series, labels), 0.0) - before.get((series, labels), 0.0)

    stop = (("model_name", name), ("reason", "stop"))
    assert grew("shipyard_requests_finished_total", stop) == 2
    assert grew("shipyard_e2e_request_latency_seconds_count") == 2
    assert grew("shipyard_request_queue_time_seconds_count") == 2
    assert grew("shipyard_prompt_tokens_total") >= done.usage.prompt_tokens + 2
    assert grew("shipyard_running_batch_size_count") >= 1
    assert grew("shipyard_running_batch_size_sum") == 3  # three texts, in batches
    for gauge in ("shipyard_requests_running", "shipyard_requests_waiting"):
        assert after[(gauge, own)] == 0  # idle again


def test_embeddings_through_the_openai_client_equal_the_graphs_output(bert: Any) -> None:
    import onnxruntime as ort
    import openai
    from tokenizers import Tokenizer

    url, model = bert
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    texts = ["a short one", "and a somewhat longer sentence to embed"]
    done = client.embeddings.create(model="bert-text-embedding", input=texts)
    assert [d.index for d in done.data] == [0, 1]
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}

    def run(rows: list[list[int]]) -> np.ndarray:
        width = max(len(r) for r in rows)
        ids = np.array([r + [0] * (width - len(r)) for r in rows], np.int64)
        mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        return np.asarray(session.run(["sentence_embedding"], feeds)[0])

    rows = [tok.encode(t).ids for t in texts]
    got = np.array([d.embedding for d in done.data])
    assert np.allclose(got, run(rows), atol=1e-6)  # the graph on the same right-padded batch
    for row, vector in zip(rows, got, strict=True):
        alone = run([row])[0]  # INT8's per-call scales move it a little, padding does not
        cosine = float(vector @ alone / np.linalg.norm(vector) / np.linalg.norm(alone))
        assert cosine > 0.999, cosine
    assert done.usage.prompt_tokens == sum(len(tok.encode(t).ids) for t in texts)
    import base64

    b64 = client.embeddings.create(model="bert-text-embedding", input="x", encoding_format="base64")
    floats = client.embeddings.create(model="bert-text-embedding", input="x").data[0].embedding
    raw = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")  # type: ignore[arg-type]
    assert np.array_equal(raw, np.array(floats, np.float32))


def test_embedding_refusals(bert: Any) -> None:
    url, _ = bert
    for body, message in (
        ({"input": ""}, "an input string must not be empty"),
        ({"input": "a", "dimensions": 8}, "dimensions is not supported"),
        ({"input": ["a"] * 4}, "batch 4 is outside [1, 3] (the served max_batch_size)"),
        ({"input": [1] * 65}, "an input of 65 tokens exceeds the exported maximum 64"),
        ({"input": [[1, 600]]}, "values must lie in [0, 512)"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format must be float or base64"),
    ):
        status, answer = post(url, "/v1/embeddings", body)
        assert status == 400 and message in answer["error"]["message"], (body, answer)
    status, answer = post(url, "/v1/completions", {"prompt": "a"})
    assert status == 404 and "does not generate" in answer["error"]["message"]


def test_sixteen_streams_run_at_once_on_the_rows_the_plan_sized(gpt2_server: str) -> None:
    """Issue 41 item 5: the served rows come from the KV budget (16 here), not the export's
    probe batch (3): 16 concurrent streams through the openai client are decoded together,
    so the engine's own histogram of rows a decode step counts steps of more than 8 (with
    3 rows there are none), and every stream gets all its tokens."""
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    def wide_steps() -> float:
        """Decode steps so far with more than 8 rows."""
        with urllib.request.urlopen(METRICS[gpt2_server], timeout=10) as r:
            text = r.read().decode()
        counts = {
            s.labels["le"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "shipyard_running_batch_size_bucket"
        }
        return counts["+Inf"] - counts["8.0"]

    async def one(client: Any, i: int) -> int:
        stream = await client.completions.create(
            model="tiny-gpt2",
            prompt=[1 + i, 2, 3],
            max_tokens=100,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, **VARIED},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                tokens += 1
        return tokens

    async def all16() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{gpt2_server}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    before = wide_steps()
    done = asyncio.run(all16())
    assert done == [100] * 16, done
    assert wide_steps() - before >= 10, (before, wide_steps())
