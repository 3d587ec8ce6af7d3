"""The OpenAI-compatible API over the engine, framework-free: requests checked into engine
parameters (an unknown or unsupported field is a 400, never ignored), responses and
server-sent-event chunks built as OpenAI's clients read them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

from .params import BadParameter, GenerationParams, parse
from .scheduler import Event

# fields OpenAI defines that the engine maps onto its own parameters
_SAMPLING = {"max_tokens", "temperature", "top_p", "seed", "stop"}
# engine extensions, named as vLLM names them
_EXTENSIONS = {"top_k", "repetition_penalty", "stop_token_ids", "ignore_eos"}
_COMMON = {
    "model",
    "n",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
COMPLETION_FIELDS = _SAMPLING | _EXTENSIONS | _COMMON | {"prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = (
    _SAMPLING
    | _EXTENSIONS
    | _COMMON
    | {
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
    }
)
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user", "dimensions"}


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


def _fields(body: Any, fields: set[str], served: str) -> dict[str, Any]:
    """A JSON object of known fields only, for the served model (or no model named)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"unknown or unsupported field {unknown[0]!r}", unknown[0])
    if body.get("model") not in (None, served):
        raise ApiError(
            404,
            f"the model {body.get('model')!r} does not exist; this server serves {served!r}",
            "model",
        )
    return cast(dict[str, Any], body)


def _check_common(body: Any, fields: set[str], served: str) -> dict[str, Any]:
    body = _fields(body, fields, served)
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1 (one choice per request)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) not in (0, 0.0, None):
            raise ApiError(400, f"{name} is not supported; use repetition_penalty", name)
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    return cast(dict[str, Any], body)


def _params(
    body: dict[str, Any], defaults: dict[str, Any], logprobs: int | None
) -> GenerationParams:
    given = {k: body[k] for k in (_SAMPLING | _EXTENSIONS) if k in body and body[k] is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if logprobs is not None:
        given["logprobs"] = logprobs
    try:
        return parse(given, defaults)
    except BadParameter as exc:
        raise ApiError(400, str(exc)) from None


def _usage_option(body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options takes only include_usage", "stream_options")
    return bool(options.get("include_usage", False))


def completion(body: Any, served: str, defaults: dict[str, Any]) -> Call:
    body = _check_common(body, COMPLETION_FIELDS, served)
    if body.get("echo") or body.get("suffix"):
        raise ApiError(400, "echo and suffix are not supported", "echo")
    prompt = body.get("prompt")
    prompts: list[list[int] | str]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(
            400,
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of such lists (none empty)",
            "prompt",
        )
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 20):
        raise ApiError(400, "logprobs must be an integer in [0, 20]", "logprobs")
    if body.get("stream") and len(prompts) > 1:
        raise ApiError(400, "a streamed completion takes one prompt", "prompt")
    return Call(
        "completion",
        prompts,
        _params(body, defaults, logprobs),
        bool(body.get("stream")),
        _usage_option(body),
    )


def chat(body: Any, served: str, defaults: dict[str, Any]) -> tuple[Call, list[dict[str, Any]]]:
    body = _check_common(body, CHAT_FIELDS, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", "messages")
        if not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
        body.pop("max_completion_tokens")
    logprobs: int | None = None
    if body.get("logprobs"):
        top = body.get("top_logprobs", 0)
        if not _is_int(top) or not 0 <= top <= 20:
            raise ApiError(400, "top_logprobs must be an integer in [0, 20]", "top_logprobs")
        logprobs = top
    elif body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    call = Call(
        "chat", [], _params(body, defaults, logprobs), bool(body.get("stream")), _usage_option(body)
    )
    call.rest_of_context = body.get("max_tokens") is None
    return call, [{"role": m["role"], "content": m["content"]} for m in messages]


def embeddings(body: Any, served: str) -> tuple[list[list[int] | str], bool]:
    """(inputs, base64?)."""
    body = _fields(body, EMBEDDING_FIELDS, served)
    if body.get("dimensions") is not None:
        raise ApiError(
            400, "dimensions is not supported: the model's size is returned", "dimensions"
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", "encoding_format")
    given = body.get("input")
    if isinstance(given, str):
        inputs: list[list[int] | str] = [given]
    elif isinstance(given, list) and given and all(_is_int(t) for t in given):
        inputs = [list(given)]
    elif (
        isinstance(given, list)
        and given
        and all(
            isinstance(x, str) or (isinstance(x, list) and x and all(_is_int(t) for t in x))
            for x in given
        )
    ):
        inputs = list(given)
    else:
        raise ApiError(400, "input must be a string, a list of strings, or token ids", "input")
    if any(isinstance(x, str) and not x for x in inputs):
        raise ApiError(400, "an input string must not be empty", "input")
    return inputs, fmt == "base64"


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
    return {
        "tokens": [decode([e.token]) for e in events if e.token is not None],
        "token_logprobs": [e.logprob for e in events if e.token is not None],
        "top_logprobs": [_top_by_text(e.top, decode) for e in events if e.token is not None],
        "text_offset": [],
    }


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
