"""What one generation request may ask: checked, never ignored (an unknown name is a 400)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOPS = 16
MAX_STOP_CHARS = 256  # a stop string's tail is held back from the stream: keep it short
MAX_LOGPROBS = 20


class BadParameter(ValueError):
    """A request parameter the engine refuses; the front ends answer 400 with the message."""


class GenerationParams(BaseModel):
    """Sampling and stopping for one sequence. Temperature 0 is greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0, le=100, description="0: greedy.")
    top_k: int = Field(default=0, ge=0, description="Keep the k most likely tokens; 0: all.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus mass to keep.")
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=10, description="> 1 discourages tokens already in the text."
    )
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Same seed, same tokens.")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOPS)
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOPS
    )
    ignore_eos: bool = Field(default=False, description="Generate past the model's EOS.")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Top alternatives to return per token."
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("a stop string must not be empty")
        return value


def check_rows(rows: int, limit: int) -> None:
    """The one check of a request's rows (prompts, inputs, a tensor's batch) against the
    served max_batch_size, whichever door it came in by."""
    if not 1 <= rows <= limit:
        raise BadParameter(f"batch {rows} is outside [1, {limit}] (the served max_batch_size)")


def parse(given: dict[str, Any], defaults: dict[str, Any] | None = None) -> GenerationParams:
    """`given` over `defaults` (the model's generation config), or BadParameter naming the
    parameter and what it must be."""
    try:
        return GenerationParams.model_validate({**(defaults or {}), **given})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        if first["type"] == "extra_forbidden":
            known = ", ".join(GenerationParams.model_fields)
            raise BadParameter(f"unknown parameter {where!r}; known: {known}") from None
        raise BadParameter(f"parameter {where!r}: {first['msg']}") from None


GREEDY = {"temperature": 0.0}  # a tensor-protocol request decodes greedily unless it asks


def parse_tensor_request(
    given: dict[str, Any], sampling_defaults: dict[str, Any] | None = None
) -> GenerationParams:
    """The parameters of a tensor-protocol request (V2 `infer` parameters, Triton's
    `sampling_parameters`): `max_new_tokens` is an alias of `max_tokens` (default 1), one
    `stop` string may be given bare, and decoding is greedy unless `temperature` is set,
    whatever the model's generation config samples with."""
    given = dict(given)
    if "max_new_tokens" in given:
        if "max_tokens" in given:
            raise BadParameter("give max_new_tokens or max_tokens, not both")
        new_tokens = given.pop("max_new_tokens")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int):
            raise BadParameter(f"max_new_tokens must be an integer; got {new_tokens!r:.40}")
        if new_tokens < 1:
            raise BadParameter("max_new_tokens must be at least 1")
        given["max_tokens"] = new_tokens
    given.setdefault("max_tokens", 1)
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    return parse(given, {**(sampling_defaults or {}), **GREEDY})
