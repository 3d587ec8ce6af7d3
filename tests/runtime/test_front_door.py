"""The shipped launcher's guards, at the ASGI boundary (a real app behind them stands in for
MLServer's; the served tests in test_mlserver_requests.py go through a real MLServer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from shipyard_runtime import front_door as fd

TOKEN = "t0ken-that-is-long-enough"
CAP = 1000


def call(
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    chunks: list[bytes] | None = None,
    delay: float = 0.0,
    admin: bool = False,
    token: str | None = TOKEN,
    app: Any = None,
) -> tuple[int, bytes, bool]:
    """(status, body, whether the app ran) for one request through the door."""
    ran = []

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        ran.append(True)
        got = b""
        while True:
            m = await receive()
            got += m.get("body", b"")
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": got})

    sent: list[dict[str, Any]] = []
    parts = list(chunks if chunks is not None else [body])

    async def receive() -> dict[str, Any]:
        if delay:
            await asyncio.sleep(delay)
        if not parts:
            await asyncio.sleep(3600)
        chunk = parts.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    heads = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if chunks is None and not any(k == b"content-length" for k, _ in heads):
        heads.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "path": path, "headers": heads}
    door = fd.FrontDoor(app or echo, token, CAP, 0.3, admin)
    asyncio.run(door(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], out, bool(ran)


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": "Bearer "},
        {"X-Api-Key": TOKEN},
    ],
)
def test_a_request_without_the_right_bearer_token_gets_401_and_never_reaches_the_model(
    headers: dict[str, str],
) -> None:
    status, body, ran = call("/v2/models/m/infer", b"{}", headers)
    assert (status, ran) == (401, False)
    assert b"Authorization: Bearer" in body


def test_the_token_is_let_in_and_health_probes_need_none() -> None:
    assert call("/v2/models/m/infer", b"{}", AUTH)[:1] == (200,)
    assert call("/v2/models/m/infer", b"{}", {"Authorization": f"bearer {TOKEN}"})[0] == 200
    for probe in ("/v2/health/live", "/v2/health/ready"):
        assert call(probe)[0] == 200
    # a probe's prefix is not a probe
    assert call("/v2/health/live/../../models/m/infer")[0] == 401
    assert call("/v2/health/readyz")[0] == 401


def test_the_repository_api_is_404_unless_the_admin_switch_is_on() -> None:
    for path in ("/v2/repository/index", "/v2/repository/models/m/unload"):
        status, body, ran = call(path, b"", AUTH)
        assert (status, ran) == (404, False) and b"--admin-api" in body
        assert call(path, b"", AUTH, admin=True)[0] == 200
        assert call(path, b"", {}, admin=True)[0] == 401  # admin still needs the token


def test_a_body_at_the_cap_is_read_and_one_byte_more_is_413_unread() -> None:
    status, body, ran = call("/v2/models/m/infer", b"x" * CAP, AUTH)
    assert (status, len(body), ran) == (200, CAP, True)
    status, body, ran = call("/v2/models/m/infer", b"x" * (CAP + 1), AUTH)
    assert (status, ran) == (413, False) and b"max_request_bytes" in body


def test_a_chunked_body_past_the_cap_is_413_however_it_is_split() -> None:
    at = [b"x" * 400, b"x" * 400, b"x" * 200]
    assert call("/v2/models/m/infer", headers=AUTH, chunks=at)[:1] == (200,)
    over = [b"x" * 400, b"x" * 400, b"x" * 201]
    status, _, ran = call("/v2/models/m/infer", headers=AUTH, chunks=over)
    assert (status, ran) == (413, False)


@pytest.mark.parametrize("length", ["-1", "1e9", "abc", str(CAP + 1), "99999999999999999999"])
def test_a_content_length_past_the_cap_or_not_a_number_is_413(length: str) -> None:
    status, _, ran = call("/v2/models/m/infer", b"", {**AUTH, "Content-Length": length})
    assert (status, ran) == (413, False)


def test_a_body_that_drips_past_the_read_timeout_gets_408() -> None:
    status, body, ran = call("/v2/models/m/infer", headers=AUTH, chunks=[b"{"], delay=0.5)
    assert (status, ran) == (408, False) and b"read_timeout_s" in body
    # a body that never finishes (more_body and then nothing) is the same
    status, _, ran = call("/v2/models/m/infer", headers=AUTH, chunks=[b"{", b"}"], delay=0.2)
    assert (status, ran) == (408, False)


def stream_app(first: dict[str, Any], status: int = 200) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send(
            {
                "type": "http.response.body",
                "body": b"data: " + json.dumps(first).encode() + b"\n\n",
                "more_body": True,
            }
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


REFUSED = {"outputs": [], "parameters": {"error": "queue full: retry", "status_code": 503}}


def test_a_stream_refused_by_the_engine_answers_with_its_status_not_a_200_stream() -> None:
    status, body, _ = call("/v2/models/m/infer_stream", b"{}", AUTH, app=stream_app(REFUSED))
    assert status == 503 and json.loads(body) == {"error": "queue full: retry"}
    path = "/v2/models/m/versions/1/generate_stream"
    assert call(path, b"{}", AUTH, app=stream_app(REFUSED))[0] == 503


@pytest.mark.parametrize(
    "first",
    [
        # a token event is a stream, whatever its parameters say
        {"outputs": [{"name": "output_ids"}], "parameters": {"error": "x", "status_code": 503}},
        {"outputs": [], "parameters": {"status_code": 503}},  # no error text: not a refusal
        {"outputs": [], "parameters": {"error": "x", "status_code": 200}},
        {"outputs": [], "parameters": {"error": "x", "status_code": "503"}},
        {"outputs": []},
    ],
)
def test_a_stream_whose_first_event_is_not_a_refusal_streams_on(first: dict[str, Any]) -> None:
    status, body, _ = call("/v2/models/m/infer_stream", b"{}", AUTH, app=stream_app(first))
    assert status == 200 and body.startswith(b"data: ")


def test_stream_events_lose_their_headers_and_the_first_ones_go_in_the_head() -> None:
    """Each event's `parameters.headers` is taken out (an emptied `parameters` too); the
    first event's become response headers, lower-cased, unless a value could split a
    header; a chunk of several events, a non-JSON event and a keep-alive pass intact."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    def event(params: dict[str, Any], token: int) -> bytes:
        body = {"id": "r1", "parameters": params, "outputs": [{"data": [token], "x": "é"}]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    heads = {"Ce-Id": "r1", "Ce-Type": "t", "Bad": "a\r\nSet-Cookie: x"}
    chunks = [
        event({"headers": heads}, 1),
        event({"headers": heads}, 2) + event({"headers": heads, "finish_reason": "stop"}, 3),
        b"data: not json\n\n",
        b": keep-alive\n\n",
    ]

    async def run() -> None:
        door = fd._StreamStatus(send)
        await door.send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]})
        for chunk in chunks:
            await door.send({"type": "http.response.body", "body": chunk, "more_body": True})

    asyncio.run(run())
    assert sent[0]["headers"] == [(b"a", b"b"), (b"ce-id", b"r1"), (b"ce-type", b"t")]
    bodies = [m["body"] for m in sent[1:]]
    events = [json.loads(e[6:]) for b in bodies[:2] for e in b.split(b"\n\n") if e]
    assert [e.get("parameters") for e in events] == [None, None, {"finish_reason": "stop"}]
    assert [e["outputs"][0] for e in events] == [{"data": [t], "x": "é"} for t in (1, 2, 3)]
    assert bodies[2:] == chunks[2:]


def test_only_stream_paths_are_held() -> None:
    status, body, _ = call("/v2/models/m/infer", b"{}", AUTH, app=stream_app(REFUSED))
    assert status == 200 and body.startswith(b"data: ")


def test_the_token_comes_from_the_environment_or_a_file_and_bad_ones_refuse_to_start(
    tmp_path: Path,
) -> None:
    assert fd.read_token({}) is None
    assert fd.read_token({fd.TOKEN_ENV: f"  {TOKEN}\n"}) == TOKEN
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    assert fd.read_token({fd.TOKEN_FILE_ENV: str(file)}) == TOKEN
    bad = {
        "both": {fd.TOKEN_ENV: TOKEN, fd.TOKEN_FILE_ENV: str(file)},
        "short": {fd.TOKEN_ENV: "short"},
        "empty": {fd.TOKEN_ENV: ""},
        "space": {fd.TOKEN_ENV: "a" * 10 + " " + "b" * 10},
        "missing file": {fd.TOKEN_FILE_ENV: str(tmp_path / "nope")},
        "a folder": {fd.TOKEN_FILE_ENV: str(tmp_path)},
    }
    huge = tmp_path / "huge"
    huge.write_bytes(b"a" * (fd.MAX_TOKEN_BYTES + 1))
    bad["huge file"] = {fd.TOKEN_FILE_ENV: str(huge)}
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" * 20)
    bad["binary file"] = {fd.TOKEN_FILE_ENV: str(binary)}
    for case, env in bad.items():
        with pytest.raises(fd.Refused) as exc:
            fd.read_token(env)
        assert str(exc.value.code).startswith("shipyard_serve: "), case


def test_no_auth_binds_loopback_only_and_a_missing_token_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / fd.CONFIG).write_text(
        json.dumps(
            {
                "max_request_bytes": 1,
                "read_timeout_s": 1,
                "idle_timeout_s": 1,
                "max_connections": 1,
                "metrics_auth": True,
            }
        )
    )
    (tmp_path / "settings.json").write_text(json.dumps({"host": "127.0.0.1"}))
    cases = {
        "no token": ([], "no API token"),
        "no auth on all interfaces": (["--no-auth", "--host", "0.0.0.0"], "loopback only"),
        "no auth on a LAN address": (["--no-auth", "--host", "10.1.2.3"], "loopback only"),
        "no auth on a name": (["--no-auth", "--host", "example.com"], "loopback only"),
        "bad port": (["--no-auth", "--http-port", "70000"], "1-65535"),
    }
    for case, (argv, why) in cases.items():
        with pytest.raises(fd.Refused) as exc:
            fd.main(argv, tmp_path)
        assert why in str(exc.value.code), case
    good = json.loads((tmp_path / fd.CONFIG).read_text())
    broken = {
        "empty": ({}, "max_request_bytes: Field required"),
        "unknown key": ({**good, "max_body": 5}, "max_body: Extra inputs are not permitted"),
        "zero cap": ({**good, "max_connections": 0}, "max_connections: Input should be greater"),
        "a string": ({**good, "read_timeout_s": "soon"}, "read_timeout_s: Input should be"),
        "not an object": ([], "(file): Input should be an object"),
    }
    for case, (data, why) in broken.items():
        (tmp_path / fd.CONFIG).write_text(json.dumps(data))
        with pytest.raises(fd.Refused) as exc:
            fd.main(["--no-auth"], tmp_path)
        message = str(exc.value.code)
        assert why in message and message.endswith("rebuild the bundle"), (case, message)


# ------------------------------------------------------------ binary tensor data extension
def triton_body(binary: bool, outputs: list[Any] | None = None) -> tuple[bytes, int | None]:
    """What tritonclient.http sends, built by tritonclient itself."""
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request

    ids = httpclient.InferInput("input_ids", [2, 3], "INT64")
    ids.set_data_from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3), binary_data=binary)
    text = httpclient.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array(["héllo", ""], dtype=object), binary_data=binary)
    scale = httpclient.InferInput("scale", [1], "FP16")
    scale.set_data_from_numpy(np.array([0.5], dtype=np.float16), binary_data=binary)
    return _get_inference_request(
        [ids, text, scale], "", outputs, 0, False, False, 0, None, {"max_new_tokens": 2}
    )


@pytest.mark.parametrize("binary", [True, False])
def test_a_tritonclient_request_becomes_the_json_mlserver_parses(binary: bool) -> None:
    body, length = triton_body(binary)
    plain, wants = fd.from_binary(body, None if length is None else str(length).encode())
    request = json.loads(plain)
    data = {t["name"]: t["data"] for t in request["inputs"]}
    assert data == {"input_ids": [0, 1, 2, 3, 4, 5], "text": ["héllo", ""], "scale": [0.5]} or (
        not binary and data["input_ids"] == [[0, 1, 2], [3, 4, 5]]
    )
    assert request["parameters"] == {"max_new_tokens": 2}  # binary_data_output taken out
    assert wants.every and not any("parameters" in t for t in request["inputs"])


def test_a_tritonclient_response_in_binary_is_read_back_by_tritonclient() -> None:
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.http import InferResult

    response = {
        "model_name": "m",
        "outputs": [
            {"name": "output_ids", "datatype": "INT64", "shape": [1, 3], "data": [7, 8, 9]},
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["ünï"]},
            {"name": "score", "datatype": "FP32", "shape": [1], "data": [0.25]},
        ],
    }
    body, header = fd.to_binary(json.dumps(response).encode(), fd.Binary(True, set()))
    result = InferResult.from_response_body(body, False, header)
    assert result.as_numpy("output_ids").tolist() == [[7, 8, 9]]
    assert result.as_numpy("text").tolist() == ["ünï".encode()]
    assert result.as_numpy("score").dtype == np.float32
    # only the named ones move to binary; the rest stay JSON
    wanted = [httpclient.InferRequestedOutput("text", binary_data=True)]
    _, wants = fd.from_binary(triton_body(False, wanted)[0], None)
    assert wants.names == {"text"} and not wants.every
    body, header = fd.to_binary(json.dumps(response).encode(), wants)
    head = json.loads(body[:header])
    assert "data" in head["outputs"][0] and "data" not in head["outputs"][1]


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda b, n: (b[:-3], n), "overruns"),
        (lambda b, n: (b + b"xx", n), "bytes after the last binary input"),
        (lambda b, n: (b, b"99999999"), "not a length within the body"),
        (lambda b, n: (b"[" + b[1:], n), "does not parse"),
        (lambda b, n: (b, b"-1"), "not a length within the body"),
    ],
)
def test_a_malformed_binary_request_is_a_400_naming_what_is_wrong(mutate: Any, why: str) -> None:
    body, length = triton_body(True)
    body, header = mutate(body, str(length).encode())
    with pytest.raises(ValueError, match=why):
        fd.from_binary(body, header)
    status, text, ran = call(
        "/v2/models/m/infer", body, {**AUTH, "Inference-Header-Content-Length": header.decode()}
    )
    assert (status, ran) == (400, False) and why.encode() in text


def test_the_classification_extension_is_refused_not_ignored() -> None:
    import tritonclient.http as httpclient

    wanted = [httpclient.InferRequestedOutput("logits", class_count=3)]
    with pytest.raises(ValueError, match="classification extension"):
        fd.from_binary(triton_body(False, wanted)[0], None)


def test_the_metrics_port_lets_a_loopback_scraper_in_only_when_the_spec_opts_out() -> None:
    """bundle.serving.metrics_auth false: a scraper on loopback needs no token, a client
    from elsewhere still does; true (the default): everyone needs it."""

    async def metrics(client: str, loopback_free: bool, header: bytes | None = None) -> int:
        sent: list[Any] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def send(message: Any) -> None:
            sent.append(message)

        async def receive() -> Any:
            return {"type": "http.request", "body": b"", "more_body": False}

        door = fd.FrontDoor(app, "t" * 20, 1024, 1.0, False, loopback_free=loopback_free)
        headers = [(b"authorization", header)] if header else []
        scope = {"type": "http", "path": "/metrics", "headers": headers, "client": (client, 1)}
        await door(scope, receive, send)
        return int(sent[0]["status"])

    assert asyncio.run(metrics("127.0.0.1", loopback_free=True)) == 200
    assert asyncio.run(metrics("::1", loopback_free=True)) == 200
    assert asyncio.run(metrics("10.0.0.7", loopback_free=True)) == 401
    assert asyncio.run(metrics("127.0.0.1", loopback_free=False)) == 401
    assert asyncio.run(metrics("10.0.0.7", False, b"Bearer " + b"t" * 20)) == 200
