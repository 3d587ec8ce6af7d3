"""Start this bundle's MLServer behind the front door a service needs.

Shipped as `serving/mlserver/shipyard_serve.py`; run it from anywhere:

    SHIPYARD_API_TOKEN=... python serving/mlserver/shipyard_serve.py [--host 0.0.0.0]
        [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--admin-api]

What `mlserver start` alone does not give (the limits come from the release spec, rendered
into `shipyard_server.json` beside this file; nothing hashed is edited to change host or
ports):
- authentication: every request but the two health probes (`/v2/health/live`, `/ready`)
  needs `Authorization: Bearer <token>` (REST) or `authorization` metadata (gRPC); the
  token comes from `SHIPYARD_API_TOKEN` or the file named by `SHIPYARD_API_TOKEN_FILE`,
  never from the bundle. Without one the server does not start, unless `--no-auth` is
  given, and `--no-auth` only binds a loopback host;
- the model repository API (load, unload, index) is off unless `--admin-api`;
- a request body larger than `max_request_bytes` gets 413 before it is parsed (gRPC: the
  same cap as its message limit), and a request's headers and body must arrive within
  `read_timeout_s` (slow-drip connections are closed, 408 for a slow body); an idle
  kept-alive connection closes after `idle_timeout_s`; past `max_connections` a request
  gets 503;
- the same limits on every port: REST and the Prometheus port close a connection past
  `max_connections` open ones at once, and one that sends no request head within
  `read_timeout_s`; gRPC allows `max_connections` connections and concurrent calls, closes
  a connection idle for 5 minutes (gRPC channels are long-lived) and a handshake slower
  than `read_timeout_s`; the
  process's open-file limit is raised to its hard limit, so three ports at their caps
  cannot exhaust it;
- `/metrics` needs the token as well (Prometheus: `authorization: {credentials_file: ...}`),
  unless the spec sets `bundle.serving.metrics_auth: false`, and then only for a scraper
  on loopback (a client from elsewhere still needs the token);
- the token is read, then the process re-executes itself with the token on an inherited
  pipe instead of in its environment, so `/proc/<pid>/environ` never holds it;
- a V2 stream the engine refuses (a full queue: 503, a bad parameter: 400) answers with
  that status and a JSON error: MLServer commits a stream's 200 before the model runs, so
  the first event is held until it is known;
- nothing is written into the bundle: no `__pycache__` beside the modules it imports, in
  this process or in the workers it starts;
- the V2 binary tensor data extension (what `tritonclient.http` sends by default): binary
  inputs (`Inference-Header-Content-Length`, `binary_data_size`) become JSON data before
  MLServer parses the request, and outputs asked for as binary (`binary_data`,
  `binary_data_output`) come back binary; MLServer has no such extension (it answered 422).

The runtime refuses to load when started any other way (`SHIPYARD_FRONT_DOOR` unset).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

HERE = Path(__file__).resolve().parent
CONFIG = "shipyard_server.json"
TOKEN_ENV, TOKEN_FILE_ENV = "SHIPYARD_API_TOKEN", "SHIPYARD_API_TOKEN_FILE"
TOKEN_FD_ENV = "SHIPYARD_API_TOKEN_FD"  # set by the re-exec: the pipe the token is on
DEVICE_ENV = "SHIPYARD_DEVICE"  # read by the runtime's sessions (shipyard_runtime/session.py)
GUARD_ENV = "SHIPYARD_FRONT_DOOR"  # the runtime's proof that it runs behind this door
HEALTH = frozenset({"/v2/health/live", "/v2/health/ready"})
HEALTH_GRPC = frozenset(
    {"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"}
)
ADMIN_PREFIX = "/v2/repository"
# the repository service, and the same calls inside the inference service (Triton's layout)
ADMIN_GRPC_PREFIXES = (
    "/inference.model_repository.ModelRepositoryService/",
    "/inference.GRPCInferenceService/Repository",
)
STREAM_SUFFIXES = ("/infer_stream", "/generate_stream")
MAX_TOKEN_BYTES = 4096

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class Refused(SystemExit):
    """The server does not start: the message says why and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"shipyard_serve: {message}")


class Limits(BaseModel):
    """`shipyard_server.json`: the limits this launcher enforces, written by the serve stage
    from `bundle.serving` (stages/serving/configs.py builds this model) and read back here;
    a missing, unknown or out-of-range key refuses to start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_bytes: int = Field(gt=0, description="413 above it; gRPC's message cap")
    read_timeout_s: float = Field(gt=0, description="a request head or body slower: 408")
    idle_timeout_s: float = Field(gt=0, description="a kept-alive connection idle longer")
    max_connections: int = Field(gt=0, description="open at once (503 beyond); gRPC calls")
    metrics_auth: bool = Field(description="the metrics port asks for the token too")

    def dump(self) -> str:
        return json.dumps(self.model_dump(), indent=2) + "\n"


def limits(folder: Path) -> Limits:
    path = folder / CONFIG
    try:
        return Limits.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise Refused(f"cannot read {path}: {exc}; rebuild the bundle") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in exc.errors()
        )
        raise Refused(f"{path}: {problems}; rebuild the bundle") from None


def read_token(env: MutableMapping[str, str]) -> str | None:
    """The bearer token from the environment, a file, or the pipe the re-exec left it on;
    never empty, never the bundle's."""
    fd = env.pop(TOKEN_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "rb") as pipe:
            return pipe.read(MAX_TOKEN_BYTES + 1).decode("ascii")
    token, file = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if token is not None and file is not None:
        raise Refused(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if file is not None:
        try:
            with open(file, "rb") as f:
                raw = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as exc:
            raise Refused(f"{TOKEN_FILE_ENV}={file}: {exc.strerror or exc}") from None
        if len(raw) > MAX_TOKEN_BYTES:
            raise Refused(f"{TOKEN_FILE_ENV}={file}: longer than {MAX_TOKEN_BYTES} bytes")
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise Refused(f"{TOKEN_FILE_ENV}={file}: the token must be ASCII") from None
    if token is None:
        return None
    token = token.strip()
    if len(token) < 16 or any(c.isspace() or not c.isprintable() for c in token):
        raise Refused(
            "the API token must be at least 16 printable characters without spaces "
            '(e.g. python -c "import secrets; print(secrets.token_urlsafe(32))")'
        )
    return token


def check_auth(token: str | None, no_auth: bool, host: str) -> None:
    """A token, or --no-auth on a loopback host: never both, never neither (this launcher's
    rule, and the Triton entry's)."""
    if token is None and not no_auth:
        raise Refused(
            f"no API token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (clients then send "
            "'Authorization: Bearer <token>'), or pass --no-auth on a loopback host"
        )
    if token is not None and no_auth:
        raise Refused("--no-auth with a token set: drop one of them")
    if no_auth and not _loopback(host):
        raise Refused(f"--no-auth binds loopback only; {host} is not (set a token instead)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_ok(header: bytes | str | None, token: str) -> bool:
    if header is None:
        return False
    raw = header.encode("latin-1") if isinstance(header, str) else header
    scheme, _, given = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())


async def _answer(send: Send, status: int, message: str, extra: list[Any] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


class FrontDoor:
    """ASGI middleware: authentication, the admin switch, the body cap and read deadline,
    and a stream's refusal as its HTTP status. `loopback_free`: a client on loopback needs
    no token (the metrics port, when the spec opts out for a local scraper)."""

    def __init__(
        self,
        app: App,
        token: str | None,
        max_body: int,
        read_timeout: float,
        admin: bool,
        loopback_free: bool = False,
    ) -> None:
        self.app, self.token, self.max_body = app, token, max_body
        self.read_timeout, self.admin = read_timeout, admin
        self.loopback_free = loopback_free

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        headers = dict(scope["headers"])
        let_in = bearer_ok(headers.get(b"authorization"), self.token) if self.token else True
        if not let_in and self.loopback_free:
            client = scope.get("client") or ("", 0)
            let_in = _loopback(str(client[0]))
        if not let_in and path not in HEALTH:
            return await _answer(
                send,
                401,
                "missing or wrong API token: send 'Authorization: Bearer <token>'",
                [(b"www-authenticate", b'Bearer realm="shipyard"')],
            )
        if path.startswith(ADMIN_PREFIX) and not self.admin:
            return await _answer(
                send, 404, "the model repository API is off; start the server with --admin-api"
            )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _answer(send, 413, self._too_big())
        try:
            body = await asyncio.wait_for(self._body(receive), self.read_timeout)
        except TimeoutError:
            return await _answer(
                send,
                408,
                f"the request did not arrive within {self.read_timeout:g} s (read_timeout_s)",
            )
        if body is None:
            return await _answer(send, 413, self._too_big())
        binary: Binary | None = None
        if path.endswith(INFER_SUFFIXES) and (b"binary_data" in body or HEADER_LENGTH in headers):
            try:
                body, binary = from_binary(body, headers.get(HEADER_LENGTH))
            except ValueError as exc:
                return await _answer(send, 400, f"binary tensor data: {exc}")
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k not in (HEADER_LENGTH, b"content-length")
            ] + [(b"content-length", b"%d" % len(body))]
        replay = _Replay(body, receive)
        if path.endswith(STREAM_SUFFIXES):
            send = _StreamStatus(send).send
        elif binary is not None and binary.wanted:
            send = _BinaryResponse(send, binary).send
        await self.app(scope, replay, send)

    def _too_big(self) -> str:
        return (
            f"the request body exceeds {self.max_body} bytes (bundle.serving.max_request_bytes); "
            "send smaller batches"
        )

    async def _body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the cap (nothing more is read)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)


# ------------------------------------------------------------------ binary tensor data
HEADER_LENGTH = b"inference-header-content-length"
INFER_SUFFIXES = ("/infer",)
# shipyard_runtime/dtypes.py's WIRE_OF_V2 (this file ships alone; a test holds them equal)
NUMPY = {
    "BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}  # fmt: skip


class Binary:
    """Which outputs a binary-extension request wants back as binary (all: `every`)."""

    def __init__(self, every: bool, names: set[str]) -> None:
        self.every, self.names = every, names

    @property
    def wanted(self) -> bool:
        return self.every or bool(self.names)


def from_binary(body: bytes, header_length: bytes | None) -> tuple[bytes, Binary]:
    """A request of the binary tensor data extension as the plain JSON MLServer parses,
    and what it wants back; ValueError says what is wrong with it."""
    import numpy as np

    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise ValueError("Inference-Header-Content-Length is not a length within the body")
        split = int(header_length)
    else:
        split = len(body)
    try:
        head = json.loads(body[:split])
    except ValueError:
        raise ValueError("the JSON header does not parse") from None
    if not isinstance(head, dict):
        raise ValueError("the JSON header is not an object")
    blob, offset = body[split:], 0
    for tensor in head.get("inputs") or []:
        params = tensor.get("parameters") if isinstance(tensor, dict) else None
        if not isinstance(params, dict) or "binary_data_size" not in params:
            continue
        size = params.pop("binary_data_size")
        if not isinstance(size, int) or size < 0 or offset + size > len(blob):
            raise ValueError(f"input {tensor.get('name')!r}: binary_data_size overruns the body")
        chunk, offset = blob[offset : offset + size], offset + size
        datatype = tensor.get("datatype")
        if datatype == "BYTES":
            tensor["data"] = _split_bytes(chunk, tensor.get("name"))
        elif datatype in NUMPY:
            dtype = np.dtype(NUMPY[datatype])
            if size % dtype.itemsize:
                raise ValueError(f"input {tensor.get('name')!r}: {size} bytes is not {datatype}s")
            tensor["data"] = np.frombuffer(chunk, dtype).tolist()
        else:
            raise ValueError(f"input {tensor.get('name')!r}: datatype {datatype!r} is not served")
        if not params:
            tensor.pop("parameters")
    if offset != len(blob):
        raise ValueError(f"{len(blob) - offset} bytes after the last binary input")
    request_params = head.get("parameters")
    every = False
    if isinstance(request_params, dict):
        every = bool(request_params.pop("binary_data_output", False))
        if not request_params:
            head.pop("parameters")
    names = set()
    for out in head.get("outputs") or []:
        params = out.get("parameters") if isinstance(out, dict) else None
        if not isinstance(params, dict):
            continue
        if "classification" in params:
            raise ValueError("the classification extension is not served; ask for the tensors")
        if params.pop("binary_data", False):
            names.add(str(out.get("name")))
        if not params:
            out.pop("parameters")
    return json.dumps(head).encode(), Binary(every, names)


def _split_bytes(chunk: bytes, name: Any) -> list[str]:
    """BYTES elements: each a 4-byte little-endian length, then that many bytes (UTF-8)."""
    out, at = [], 0
    while at < len(chunk):
        if at + 4 > len(chunk):
            raise ValueError(f"input {name!r}: a BYTES element's length is cut off")
        n = int.from_bytes(chunk[at : at + 4], "little")
        if at + 4 + n > len(chunk):
            raise ValueError(f"input {name!r}: a BYTES element overruns its data")
        try:
            out.append(chunk[at + 4 : at + 4 + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"input {name!r}: a BYTES element is not UTF-8 text") from None
        at += 4 + n
    return out


def to_binary(body: bytes, binary: Binary) -> tuple[bytes, int] | None:
    """A JSON inference response with the wanted outputs moved into binary data, and the
    JSON header's length; None when it is not one (an error: sent as it is)."""
    import numpy as np

    try:
        head = json.loads(body)
    except ValueError:
        return None
    if not isinstance(head, dict) or not isinstance(head.get("outputs"), list):
        return None
    blobs = []
    for out in head["outputs"]:
        if not (binary.every or out.get("name") in binary.names) or "data" not in out:
            continue
        data, datatype = out.pop("data"), out.get("datatype")
        if datatype == "BYTES":
            raw = b"".join(
                len(e).to_bytes(4, "little") + e
                for e in (str(v).encode("utf-8") for v in np.asarray(data, object).ravel())
            )
        else:
            raw = np.asarray(data, NUMPY[str(datatype)]).tobytes()
        out.setdefault("parameters", {})["binary_data_size"] = len(raw)
        blobs.append(raw)
    header = json.dumps(head).encode()
    return header + b"".join(blobs), len(header)


class _BinaryResponse:
    """Collects a JSON inference response and sends it in the binary extension's layout."""

    def __init__(self, send: Send, binary: Binary) -> None:
        self._send, self._binary = send, binary
        self._start: Message | None = None
        self._parts: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body" or self._start is None:
            return await self._send(message)
        self._parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        start, body = self._start, b"".join(self._parts)
        converted = to_binary(body, self._binary) if start["status"] == 200 else None
        headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
        if converted is not None:
            body, header = converted
            headers = [(k, v) for k, v in headers if k != b"content-type"] + [
                (b"content-type", b"application/octet-stream"),
                (b"inference-header-content-length", b"%d" % header),
            ]
        headers.append((b"content-length", b"%d" % len(body)))
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


class _Replay:
    """The buffered body to the app, then the connection's own messages (disconnects)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()


class _StreamStatus:
    """Holds a stream's response start until its first event: when that event is the
    runtime's in-band refusal (`parameters.status_code`), the client gets that status and
    a JSON error instead of a 200 stream. Every event loses `parameters.headers`: MLServer
    sends its CloudEvents headers as headers of a unary response, but repeated them in the
    body of every event of a stream (eight of them, 400 bytes a token; issue 43); the first
    event's go in the stream's response head instead, as a unary response has them."""

    def __init__(self, send: Send) -> None:
        self._send, self._first = send, True
        self._start: Message | None = None
        self._refused = False  # the refusal is answered: the stream's rest goes nowhere

    async def send(self, message: Message) -> None:
        if self._refused:
            return
        if message["type"] == "http.response.start" and self._first:
            self._start = message
            return
        if message["type"] == "http.response.body":
            body, headers = _without_headers(message.get("body", b""))
            message = {**message, "body": body}
        if message["type"] == "http.response.body" and self._first:
            self._first = False
            start, self._start = self._start, None
            refusal = _refusal(message.get("body", b""))
            if refusal is not None and start is not None and start["status"] == 200:
                status, error = refusal
                self._refused = True
                await _answer(self._send, status, error)
                return
            if start is not None:
                extra = [
                    (k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in headers.items()
                    if _header_safe(k) and _header_safe(v)
                ]
                await self._send({**start, "headers": [*start.get("headers", []), *extra]})
        await self._send(message)


def _header_safe(text: Any) -> bool:
    return (
        isinstance(text, str)
        and text.isascii()
        and text.isprintable()
        and not any(c in text for c in "\r\n")
    )


def _without_headers(chunk: bytes) -> tuple[bytes, dict[str, Any]]:
    """The SSE chunk with each event's `parameters.headers` taken out (an emptied
    `parameters` goes too), and the first event's headers; a chunk that is not JSON events
    passes as it came."""
    if not chunk.startswith(b"data: "):
        return chunk, {}
    events, first = [], None
    for raw in chunk.split(b"\n\n"):
        if not raw.startswith(b"data: "):
            events.append(raw)
            continue
        try:
            event = json.loads(raw[6:])
        except ValueError:
            events.append(raw)
            continue
        params = event.get("parameters") if isinstance(event, dict) else None
        if not isinstance(params, dict) or "headers" not in params:
            events.append(raw)
            continue
        headers = params.pop("headers")
        if first is None and isinstance(headers, dict):
            first = headers
        if not params:
            del event["parameters"]
        text = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        events.append(b"data: " + text.encode("utf-8"))
    return b"\n\n".join(events), first or {}


def _refusal(chunk: bytes) -> tuple[int, str] | None:
    if not chunk.startswith(b"data: "):
        return None
    try:
        event = json.loads(chunk[6:].split(b"\n\n", 1)[0])
        params = event.get("parameters") or {}
        status, error = params.get("status_code"), params.get("error")
    except (ValueError, AttributeError):
        return None
    if event.get("outputs") or not isinstance(status, int) or not isinstance(error, str):
        return None
    return (status, error) if 400 <= status < 600 else None


def grpc_guard(token: str | None, admin: bool) -> Any:
    """A grpc.aio interceptor: the same token and admin switch as REST."""
    import grpc
    from grpc import aio

    def denied(handler: Any, code: Any, why: str) -> Any:
        async def unary(request: Any, context: Any) -> Any:
            await context.abort(code, why)

        async def streaming(request: Any, context: Any) -> Any:
            await context.abort(code, why)
            yield  # pragma: no cover - abort raises

        kinds = {
            (False, False): (grpc.unary_unary_rpc_method_handler, unary),
            (False, True): (grpc.unary_stream_rpc_method_handler, streaming),
            (True, False): (grpc.stream_unary_rpc_method_handler, unary),
            (True, True): (grpc.stream_stream_rpc_method_handler, streaming),
        }
        make, behaviour = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    class Guard(aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            method = details.method
            if handler is None:
                return handler
            if token is not None and method not in HEALTH_GRPC:
                given = dict(details.invocation_metadata or ()).get("authorization")
                if not bearer_ok(given, token):
                    return denied(
                        handler,
                        grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong API token: send metadata authorization: Bearer <token>",
                    )
            if method.startswith(ADMIN_GRPC_PREFIXES) and not admin:
                return denied(
                    handler,
                    grpc.StatusCode.UNIMPLEMENTED,
                    "the model repository API is off; start the server with --admin-api",
                )
            if method == STREAM_GRPC and handler.stream_stream is not None:
                return triton_stream(handler)
            return handler

    return Guard()


STREAM_GRPC = "/inference.GRPCInferenceService/ModelStreamInfer"


def triton_stream(handler: Any) -> Any:
    """ModelStreamInfer as Triton (and `tritonclient`'s `start_stream`) has it: every
    request on the stream is an inference of its own, answered by one response or, for a
    generation, one per token, each wrapped as a ModelStreamInferResponse; a request that
    fails gets its `error_message` and the stream goes on. MLServer's own took the first
    request as the inference and the rest as its payloads, and answered with bare
    ModelInferResponses: tritonclient could not read them ("Exception deserializing
    response") and its stop_stream() waited forever (issue 43)."""
    import grpc

    original, serialize = handler.stream_stream, handler.response_serializer

    async def each(requests: Any, context: Any) -> Any:
        async for request in requests:

            async def alone(first: Any = request) -> Any:
                yield first

            try:
                async for response in original(alone(), _OneOfMany(context)):
                    yield stream_response(serialize(response), _in_band_error(response))
            except _Refused as refused:  # MLServer aborted this request: not the stream
                yield stream_response(b"", refused.reason)

    return grpc.stream_stream_rpc_method_handler(
        each,
        request_deserializer=handler.request_deserializer,
        response_serializer=lambda data: data,  # already Triton's message, serialized
    )


def _in_band_error(response: Any) -> str:
    """The error a streamed response carries in-band (the runtime's refusal once MLServer
    has committed the stream: no outputs, `parameters.error`), else ""."""
    if response.outputs or "error" not in response.parameters:
        return ""
    return str(response.parameters["error"].string_param) or "the request failed"


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _OneOfMany:
    """A stream's context as one of its inferences sees it. No trailing metadata: MLServer
    sets a response's headers as trailers and reads the trailers back as request headers
    (as plain tuples, which its reader cannot read: the second request on a stream failed
    "'tuple' object has no attribute 'value'"); trailers end a stream, not an inference.
    An abort refuses this inference only (`_Refused`), and the stream's own reads and
    writes are not this inference's to make."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def trailing_metadata(self) -> tuple[Any, ...]:
        return ()

    def set_trailing_metadata(self, metadata: Any) -> None:
        return None

    async def abort(self, code: Any = None, details: str = "", *args: Any, **kw: Any) -> None:
        raise _Refused(details or str(code))

    async def read(self) -> Any:
        raise RuntimeError("an inference of a stream does not read the stream")

    async def write(self, message: Any) -> None:
        raise RuntimeError("an inference of a stream does not write to the stream")


def stream_response(infer_response: bytes, error: str = "") -> bytes:
    """Triton's `ModelStreamInferResponse {string error_message = 1; ModelInferResponse
    infer_response = 2;}` on the wire (tritonclient's protobufs are not MLServer's: the
    two packages' generated modules clash in one process)."""

    def field(number: int, data: bytes) -> bytes:  # length-delimited (wire type 2)
        size, length = bytearray(), len(data)
        while True:  # the length as a varint
            low, length = length & 0x7F, length >> 7
            size.append(low | (0x80 if length else 0))
            if not length:
                break
        return bytes([number << 3 | 2]) + bytes(size) + data

    return (field(1, error.encode("utf-8")) if error else b"") + field(2, infer_response)


def guarded_h11(read_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with a deadline on each request's headers and a cap on open
    connections: a connection that has not sent a whole request head within `read_timeout`
    seconds (of opening, or of its last response) is closed, and one opened while
    `max_connections` are open gets a 503 at once and is closed (its socket freed). uvicorn
    has neither: connections that drip a byte at a time, or just stay open, hold their
    sockets until the process runs out of them (limit_concurrency answers 503 only to a
    request)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # a 503 now, the socket freed
                body = json.dumps({"error": f"more than {max_connections} connections are "
                                   "open (max_connections); try again"}).encode()  # fmt: skip
                head = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json"
                transport.write(
                    head + b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body
                )
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shipyard_serve.py", description="Serve this bundle with MLServer, guarded."
    )
    p.add_argument("--host", help="Interface to bind (default: the bundle's settings.json).")
    p.add_argument("--http-port", type=int, help="REST port (default: settings.json's).")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default: settings.json's).")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default: settings.json's).")
    p.add_argument(
        "--admin-api", action="store_true", help="Serve the model repository API (load/unload)."
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="Serve without a token (only on a loopback host).",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="Run the model on ONNX Runtime's CPU or CUDA execution provider (cuda needs "
        "onnxruntime-gpu: the gpu extra).",
    )
    return p


def main(argv: list[str] | None = None, folder: Path = HERE) -> None:
    args = parser().parse_args(argv)
    for name in ("http_port", "grpc_port", "metrics_port"):
        port = getattr(args, name)
        if port is not None and not 0 < port < 65536:
            raise Refused(f"--{name.replace('_', '-')} {port}: a port is 1-65535")
    cap = limits(folder)
    token = read_token(os.environ)
    if token is not None and os.environ.get(TOKEN_ENV) is not None and argv is None:
        _reexec(token)  # /proc/<pid>/environ is the block the process started with
    os.environ.pop(TOKEN_ENV, None)  # the model code never sees it
    _more_files()
    settings_file = json.loads((folder / "settings.json").read_text(encoding="utf-8"))
    host = args.host or settings_file.get("host", "127.0.0.1")
    check_auth(token, args.no_auth, host)
    if args.device == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Refused(
                f"--device cuda: this onnxruntime ({ort.__version__}) has no CUDA execution "
                "provider; install the gpu extra's onnxruntime-gpu in its place (bash "
                "scripts/gpu_check.sh does), or serve with --device cpu"
            )
    os.environ[DEVICE_ENV] = args.device  # the runtime's sessions (shipyard_runtime/session.py)
    import sys

    # a bundle stays as signed: served from build/ or a registry copy, nothing it imports
    # (the runtime, the engine) leaves a __pycache__ beside it; MLServer's workers and the
    # chat-template worker inherit the environment (issue 43: a later publish refused it)
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ[GUARD_ENV] = "1"
    asyncio.run(_serve(folder, args, host, token, cap))


def _reexec(token: str) -> None:
    """Start this script again without the token in its environment: the token on a pipe
    it inherits (read once by read_token, then closed). Popping it from os.environ alone
    leaves it in /proc/<pid>/environ, which the kernel keeps from the exec."""
    import sys

    read, write = os.pipe()
    os.write(write, token.encode("ascii"))  # at most 4 KiB: one pipe buffer holds it
    os.close(write)
    os.set_inheritable(read, True)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env[TOKEN_FD_ENV] = str(read)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _more_files() -> None:
    """The open-file limit up to its hard limit: three ports at their connection caps, the
    model and the worker pipes fit (1,024 did not)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _serve(folder: Path, args: Any, host: str, token: str | None, cap: Limits) -> None:
    import mlserver.grpc.server as grpc_server
    import mlserver.metrics.server as metrics_server
    import mlserver.rest.server as rest_server
    from grpc import aio
    from mlserver import MLServer
    from mlserver.cli.serve import load_settings

    settings, models = await load_settings(str(folder))
    settings.host = host
    for name in ("http_port", "grpc_port", "metrics_port"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    settings.grpc_max_message_length = cap.max_request_bytes
    guarded = {
        "http": guarded_h11(cap.read_timeout_s, cap.max_connections),
        "timeout_keep_alive": cap.idle_timeout_s,
        "limit_concurrency": cap.max_connections,
        "h11_max_incomplete_event_size": 64 * 1024,  # request line and headers
    }
    settings._custom_rest_server_settings = dict(guarded)
    settings._custom_metrics_server_settings = dict(guarded)  # the same limits there
    plain_app = rest_server.create_app

    def create_app(*a: Any, **kw: Any) -> Any:
        app = plain_app(*a, **kw)
        app.add_middleware(
            FrontDoor,
            token=token,
            max_body=cap.max_request_bytes,
            read_timeout=cap.read_timeout_s,
            admin=args.admin_api,
        )
        return app

    rest_server.create_app = create_app
    plain_metrics_app = metrics_server.MetricsServer._get_app

    def metrics_app(self: Any) -> Any:  # /metrics behind the same door
        app = plain_metrics_app(self)
        app.add_middleware(
            FrontDoor,
            token=token,
            max_body=64 * 1024,
            read_timeout=cap.read_timeout_s,
            admin=False,
            loopback_free=not cap.metrics_auth,
        )
        return app

    metrics_server.MetricsServer._get_app = metrics_app  # type: ignore[method-assign]
    guard = grpc_guard(token, args.admin_api)
    limited = [
        ("grpc.max_allowed_incoming_connections", cap.max_connections),
        ("grpc.max_concurrent_streams", 64),
        # gRPC channels are long-lived: an idle one is closed after minutes, not REST's
        # keep-alive seconds (a client's next call raced the GOAWAY and failed)
        ("grpc.max_connection_idle_ms", int(max(cap.idle_timeout_s, 300) * 1000)),
        ("grpc.server_handshake_timeout_ms", int(cap.read_timeout_s * 1000)),
    ]

    class _Aio:  # grpc.aio for MLServer's gRPC server, with the guard first and the limits
        def __getattr__(self, name: str) -> Any:
            return getattr(aio, name)

        def server(self, *a: Any, interceptors: Any = (), **kw: Any) -> Any:
            kw["options"] = [*(kw.get("options") or ()), *limited]
            kw.setdefault("maximum_concurrent_rpcs", cap.max_connections)
            return aio.server(*a, interceptors=[guard, *interceptors], **kw)

    grpc_server.aio = _Aio()  # type: ignore[assignment]
    _one_version_label({m.name: m.version for m in models})
    server = MLServer(settings)
    await server.start(models)


def _one_version_label(versions: dict[str, str | None]) -> None:
    """MLServer labels its inference series (`model_infer_request_success`, `_failure`,
    `_duration`) with the request's version as given: REST without one passes None (the
    label reads "None"), gRPC an empty string, so one model's requests split into two
    series by the door they came through. A request that names no version is served by the
    model's default one: it is labelled with that version (the bundle's, model-settings'
    `parameters.version`), whichever door."""
    from mlserver.handlers.dataplane import DataPlane

    plain = DataPlane._infer_contextmanager

    def labelled(self: Any, name: str, version: str | None = None) -> Any:
        return plain(self, name, version or versions.get(name) or None)

    DataPlane._infer_contextmanager = labelled  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
