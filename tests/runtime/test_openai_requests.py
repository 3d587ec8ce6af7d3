"""The OpenAI request models (issue 41): typed bodies that forbid what they do not define,
refuse with the message and parameter a client can act on, and turn into the engine's
parameters (`to_params`) over the model's own defaults."""

from __future__ import annotations

from typing import Any

import pytest

from shipyard_runtime import openai_api as api

SERVED = "tiny"


def refused(model: type, body: dict[str, Any]) -> api.ApiError:
    with pytest.raises(api.ApiError) as caught:
        api.read(model, body, SERVED)
    return caught.value


def test_an_unknown_field_is_refused_by_name_in_every_endpoint() -> None:
    for model, body in (
        (api.CompletionRequest, {"prompt": "a"}),
        (api.ChatRequest, {"messages": [{"role": "user", "content": "a"}]}),
        (api.EmbeddingRequest, {"input": "a"}),
    ):
        error = refused(model, {**body, "best_of": 2})
        assert (error.status, error.param) == (400, "best_of")
        assert error.message == "unknown or unsupported field 'best_of'"


def test_a_wrong_type_names_the_field_and_another_model_is_a_404() -> None:
    error = refused(api.CompletionRequest, {"prompt": "a", "user": 5})
    assert error.status == 400 and error.param == "user" and "string" in error.message
    assert refused(api.CompletionRequest, {"prompt": "a", "model": "other"}).status == 404


def test_to_params_puts_the_request_over_the_models_defaults() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    call = api.completion({"prompt": [1, 2], "top_p": 0.5, "stop": "x"}, SERVED, defaults)
    p = call.params
    assert (p.temperature, p.top_p, p.repetition_penalty, p.stop) == (0.6, 0.5, 1.1, ["x"])
    assert call.prompts == [[1, 2]] and p.max_tokens == 16  # OpenAI's completion default


def test_a_chats_limit_may_be_given_either_way_or_left_to_the_context() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    call, messages = api.chat({**chat, "max_completion_tokens": 7}, SERVED, {})
    assert call.params.max_tokens == 7 and not call.rest_of_context
    assert messages == chat["messages"]
    call, _ = api.chat({**chat, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}, SERVED, {})
    assert (call.params.max_tokens, call.params.logprobs, call.rest_of_context) == (5, 3, False)
    call, _ = api.chat(chat, SERVED, {})
    assert call.rest_of_context  # the server fills in the rest of the context
    both = refused(api.ChatRequest, {**chat, "max_tokens": 5, "max_completion_tokens": 7})
    assert both.message == "give max_tokens or max_completion_tokens, not both"


def test_the_models_describe_every_field_they_accept() -> None:
    for model in (api.CompletionRequest, api.ChatRequest, api.EmbeddingRequest):
        schema = model.model_json_schema()
        assert schema["additionalProperties"] is False
        assert {"model", "user"} <= set(schema["properties"])
