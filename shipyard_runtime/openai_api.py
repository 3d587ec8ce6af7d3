"""The OpenAI-compatible API over the engine, framework-free: request bodies read into
typed models (CompletionRequest, ChatRequest, EmbeddingRequest: an unknown or unsupported
field is a 400, never ignored) and turned into engine parameters (`to_params`); responses
and server-sent-event chunks built as OpenAI's clients read them."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shipyard_runtime.generation.params import BadParameter, GenerationParams, parse
from shipyard_runtime.generation.scheduler import Event


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class Call:
    """A checked request: what to generate, how, and how to answer."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int] | str]
    params: GenerationParams
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # no max_tokens given to a chat: OpenAI's default is the rest of the context, which
    # the server fills in once the prompt is rendered (Engine.room)
    rest_of_context: bool = False


# ---------------------------------------------------------------------------- requests
# Each endpoint's body is a pydantic model that forbids what it does not define: a field
# the engine cannot honour is a 400 naming it, never ignored. Sampling fields are typed
# loosely here and checked once, by GenerationParams (params.py), in `to_params`; the rest
# are checked by the models, each refusal with the message a client can act on.
Ids = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="The served model's name, or none.")
    user: str | None = Field(default=None, description="Accepted and ignored, as OpenAI does.")


class _Generation(_Body):
    """What completions and chat share: one choice, sampling, stopping, streaming."""

    n: Any = Field(default=1, description="Choices per request: 1 only.")
    stream: Any = Field(default=False, description="Server-sent events when true.")
    stream_options: Any = Field(default=None, description="{include_usage: bool} only.")
    presence_penalty: Any = Field(default=0, description="Not supported unless 0.")
    frequency_penalty: Any = Field(default=0, description="Not supported unless 0.")
    logit_bias: Any = Field(default=None, description="Not supported.")
    # sampling, as OpenAI names it; then the engine's extensions, as vLLM names them
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    repetition_penalty: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None

    @model_validator(mode="after")
    def _common(self) -> _Generation:
        if self.n not in (1, None) or isinstance(self.n, bool):
            raise _Refused("n must be 1 (one choice per request)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (0, 0.0, None):
                raise _Refused(f"{name} is not supported; use repetition_penalty", name)
        if self.logit_bias:
            raise _Refused("logit_bias is not supported", "logit_bias")
        if not isinstance(self.stream, bool):
            raise _Refused("stream must be true or false", "stream")
        options = self.stream_options or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _Refused("stream_options takes only include_usage", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))

    def to_params(
        self, defaults: dict[str, Any], logprobs: int | None, max_tokens: Any = None
    ) -> GenerationParams:
        """The engine's parameters: the model's defaults (generation_config.json) under
        what the request gives."""
        given = {
            k: getattr(self, k)
            for k in SAMPLING
            if getattr(self, k) is not None and not (k == "max_tokens" and max_tokens is not None)
        }
        if max_tokens is not None:
            given["max_tokens"] = max_tokens
        if isinstance(given.get("stop"), str):
            given["stop"] = [given["stop"]]
        if logprobs is not None:
            given["logprobs"] = logprobs
        try:
            return parse(given, defaults)
        except BadParameter as exc:
            raise ApiError(400, str(exc)) from None


SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
)


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: Any = Field(description="A string, strings, token ids, or lists of token ids.")
    logprobs: Any = Field(default=None, description="Alternatives per token, 0-20.")
    echo: Any = Field(default=None, description="Not supported.")
    suffix: Any = Field(default=None, description="Not supported.")

    @model_validator(mode="after")
    def _own(self) -> CompletionRequest:
        if self.echo or self.suffix:
            raise _Refused("echo and suffix are not supported", "echo")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
            raise _Refused("logprobs must be an integer in [0, 20]", "logprobs")
        if len(self.prompts()) > 1 and self.stream:
            raise _Refused("a streamed completion takes one prompt", "prompt")
        return self

    def prompts(self) -> list[Ids | str]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            return [list(p)]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return list(p)
        if isinstance(p, list) and p and all(_ids(x) for x in p):
            return [list(x) for x in p]
        raise _Refused(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of such lists (none empty)",
            "prompt",
        )

    def to_call(self, defaults: dict[str, Any]) -> Call:
        return Call(
            "completion",
            self.prompts(),
            self.to_params(defaults, self.logprobs),
            bool(self.stream),
            self.include_usage,
        )


class ChatRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: Any = Field(description="[{role, content: str}], rendered by the chat template.")
    logprobs: Any = Field(default=None, description="true: logprobs per token.")
    top_logprobs: Any = Field(default=None, description="Alternatives per token, 0-20.")
    max_completion_tokens: Any = Field(default=None, description="OpenAI's newer max_tokens.")

    @model_validator(mode="after")
    def _own(self) -> ChatRequest:
        m = self.messages
        if not isinstance(m, list) or not m:
            raise _Refused("messages must be a non-empty list", "messages")
        for i, item in enumerate(m):
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                raise _Refused(f"messages[{i}] must be an object with a role", "messages")
            if not isinstance(item.get("content"), str):
                raise _Refused(f"messages[{i}].content must be a string", "messages")
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise _Refused("give max_tokens or max_completion_tokens, not both", None)
        if self.logprobs:
            top = 0 if self.top_logprobs is None else self.top_logprobs
            if not _is_int(top) or not 0 <= top <= 20:
                raise _Refused("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        elif self.top_logprobs:
            raise _Refused("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def to_call(self, defaults: dict[str, Any]) -> tuple[Call, list[dict[str, Any]]]:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens
        call = Call(
            "chat",
            [],
            self.to_params(defaults, logprobs, limit),
            bool(self.stream),
            self.include_usage,
        )
        call.rest_of_context = self.max_tokens is None and limit is None
        return call, [{"role": m["role"], "content": m["content"]} for m in self.messages]


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    input: Any = Field(description="A string, strings, token ids, or lists of token ids.")
    encoding_format: Any = Field(default="float", description="float or base64.")
    dimensions: Any = Field(default=None, description="Not supported: the model's size.")

    @model_validator(mode="after")
    def _own(self) -> EmbeddingRequest:
        if self.dimensions is not None:
            raise _Refused(
                "dimensions is not supported: the model's size is returned", "dimensions"
            )
        if self.encoding_format not in ("float", "base64"):
            raise _Refused("encoding_format must be float or base64", "encoding_format")
        self.inputs()
        return self

    def inputs(self) -> list[Ids | str]:
        given = self.input
        out: list[Ids | str]
        if isinstance(given, str):
            out = [given]
        elif isinstance(given, list) and given and all(_is_int(t) for t in given):
            out = [list(given)]
        elif (
            isinstance(given, list) and given and all(isinstance(x, str) or _ids(x) for x in given)
        ):
            out = list(given)
        else:
            raise _Refused("input must be a string, a list of strings, or token ids", "input")
        if any(isinstance(x, str) and not x for x in out):
            raise _Refused("an input string must not be empty", "input")
        return out


class _Refused(ValueError):
    """A request a model refuses: its message and the parameter, as the 400 says them."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def read(model: type[_B], body: Any, served: str) -> _B:
    """The request body as `model`, or ApiError: 400 naming the first unknown field or
    the refused value, 404 for another model's name."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise ApiError(400, f"unknown or unsupported field {unknown[0]!r}", unknown[0])
    if body.get("model") not in (None, served):
        raise ApiError(
            404,
            f"the model {body.get('model')!r} does not exist; this server serves {served!r}",
            "model",
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        refused = (first.get("ctx") or {}).get("error")
        if isinstance(refused, _Refused):
            raise ApiError(400, refused.message, refused.param) from None
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", where or None) from None


_B = TypeVar("_B", bound=_Body)
T = TypeVar("T")


def completion(body: Any, served: str, defaults: dict[str, Any]) -> Call:
    return read(CompletionRequest, body, served).to_call(defaults)


def chat(body: Any, served: str, defaults: dict[str, Any]) -> tuple[Call, list[dict[str, Any]]]:
    return read(ChatRequest, body, served).to_call(defaults)


def embeddings(body: Any, served: str) -> tuple[list[Ids | str], bool]:
    """(inputs, base64?)."""
    request = read(EmbeddingRequest, body, served)
    return request.inputs(), request.encoding_format == "base64"


# ---------------------------------------------------------------------------- responses
def _logprobs_block(kind: str, events: list[Event], decode: Any) -> Any:
    if not events or events[0].logprob is None:
        return None
    if kind == "chat":
        return {
            "content": [
                {
                    "token": decode([e.token]),
                    "logprob": e.logprob,
                    "bytes": None,
                    "top_logprobs": [
                        {"token": decode([t]), "logprob": lp, "bytes": None} for t, lp in e.top
                    ],
                }
                for e in events
                if e.token is not None
            ]
        }
    shown = [e for e in events if e.token is not None]
    tops = [_top_by_text(e.top, decode) for e in shown]
    return {
        # the token as its alternatives name it, so top_logprobs[i][tokens[i]] is found
        "tokens": [_key_of(e, top, decode) for e, top in zip(shown, tops, strict=True)],
        "token_logprobs": [e.logprob for e in shown],
        "top_logprobs": tops,
        "text_offset": [],
    }


def _key_of(event: Event, top: dict[str, float], decode: Any) -> str:
    """The chosen token's name: its key among the alternatives when it is one of them
    (`token_id:<id>` there when its text clashes), else its text (or `token_id:<id>`
    when that text is empty or an incomplete character)."""
    assert event.token is not None
    by_id = f"token_id:{event.token}"
    if by_id in top:
        return by_id
    text = decode([event.token])
    return text if text and "\ufffd" not in text else by_id


def _top_by_text(top: list[tuple[int, float]], decode: Any) -> dict[str, float]:
    """The legacy completions API keys alternatives by their text, and tokens can share one
    (byte fragments of one character, a bundle with no tokenizer: every text ""). Every
    alternative asked for is returned: a text that is empty, incomplete (U+FFFD) or shared
    is keyed `token_id:<id>` instead, as vLLM's return_tokens_as_token_ids spells a token."""
    texts = [decode([t]) for t, _ in top]
    out: dict[str, float] = {}
    for (token, lp), text in zip(top, texts, strict=True):
        unique = text and "\ufffd" not in text and texts.count(text) == 1
        out[text if unique else f"token_id:{token}"] = lp
    return out


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def response(
    call: Call, rid: str, served: str, results: list[list[Event]], decode: Any
) -> dict[str, Any]:
    """The whole (non-streamed) answer: one choice per prompt."""
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for index, events in enumerate(results):
        last = events[-1]
        text = "".join(e.text for e in events)
        lp = _logprobs_block(call.kind, events, decode)
        if call.kind == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": last.finish,
                "logprobs": lp,
            }
        else:
            choice = {"index": index, "text": text, "finish_reason": last.finish, "logprobs": lp}
        choices.append(choice)
        prompt_tokens += last.prompt_tokens
        completion_tokens += last.completion_tokens
        cached += last.cached_tokens
    return {
        "id": rid,
        "object": "chat.completion" if call.kind == "chat" else "text_completion",
        "created": call.created,
        "model": served,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }


def chunk(call: Call, rid: str, served: str, event: Event, decode: Any, first: bool = False) -> str:
    """One server-sent event of a streamed answer."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
        "created": call.created,
        "model": served,
    }
    lp = _logprobs_block(call.kind, [event], decode) if event.token is not None else None
    if call.kind == "chat":
        delta: dict[str, Any] = {"content": event.text}
        if first:
            delta["role"] = "assistant"
        out["choices"] = [
            {"index": 0, "delta": delta, "finish_reason": event.finish, "logprobs": lp}
        ]
    else:
        out["choices"] = [
            {"index": 0, "text": event.text, "finish_reason": event.finish, "logprobs": lp}
        ]
    if call.include_usage:
        out["usage"] = None
    return sse(out)


def usage_chunk(call: Call, rid: str, served: str, last: Event) -> str:
    return sse(
        {
            "id": rid,
            "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
            "created": call.created,
            "model": served,
            "choices": [],
            "usage": usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens),
        }
    )


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(value: Any) -> bool:
    """A non-empty list of token ids."""
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


DROP_POLL_S = 0.25  # how often a waiting non-streamed request checks its client is there


async def unless_dropped(
    disconnected: Callable[[], Awaitable[bool]], work: Awaitable[T]
) -> T | None:
    """`work`'s result, or None once `disconnected()` (the HTTP request's) says the client
    went away: its task is cancelled then, and with it its sequences in the engine (issue
    41: a dropped non-streamed request generated to the end, holding its rows)."""
    import asyncio

    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DROP_POLL_S)
            if done:
                return task.result()
            if await disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
