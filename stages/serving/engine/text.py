"""Text in and out with the shipped tokenizer (the `tokenizers` library), stop strings and
chat templates (rendered from the shipped template in a sandbox, as transformers does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 sequence ends with


class Text:
    """The tokenizer, the generation config's EOS ids and the chat template of a model
    folder (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
    `chat_template.jinja`); each is optional but the tokenizer."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _json(folder / "tokenizer_config.json")
        self.generation = _json(folder / "generation_config.json")
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text(encoding="utf-8") if template.is_file() else None
        ) or _template_of(config)
        self.special = {k: _token(config.get(k)) for k in ("bos_token", "eos_token")}

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids; `special`: with the tokenizer's own additions (BOS, [CLS]/[SEP]), as a
        completion prompt or an embedding input is encoded (a rendered chat has them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt of a conversation, ending where the assistant's turn begins."""
        if not self.chat_template:
            raise ValueError(
                "this model ships no chat template (chat_template.jinja or tokenizer_config."
                "json's chat_template); use /v1/completions with a prompt"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, **self.special
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None


def eos_ids(generation: dict[str, Any]) -> list[int]:
    """The generation config's eos_token_id: one id or a list."""
    eos = generation.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The model's own sampling defaults (generation_config.json), as vLLM applies them; a
    request's values win. do_sample false (or absent with no temperature) means greedy."""
    out: dict[str, Any] = {}
    if generation.get("do_sample") is False:
        out["temperature"] = 0.0
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if key in generation and not (key == "temperature" and "temperature" in out):
            out[key] = generation[key]
    return out


class Detokenizer:
    """Text of the generated ids so far, one delta per token; a token that ends inside a
    UTF-8 character waits for the next. Stop strings end the text before them, and the tail
    that might still grow into a stop string is held back from the stream until it cannot."""

    def __init__(self, text: Text, stops: list[str]) -> None:
        self.text, self.stops = text, stops
        self.ids: list[int] = []
        self.full = ""  # decoded so far (complete characters)
        self.sent = 0  # characters of `full` already emitted
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False

    def add(self, token: int) -> tuple[str, bool]:
        """(new text to emit, hit a stop string?)."""
        self.ids.append(token)
        decoded = self.text.decode(self.ids)
        if decoded.endswith(REPLACEMENT):
            return "", False
        start = max(0, len(self.full) - self.hold)
        self.full = decoded
        # the earliest match wins, whichever stop string it is (one token can complete
        # several: with stops "e" and "w", " a wise" ends at " a ", not at " a wis")
        found = [at for stop in self.stops if (at := self.full.find(stop, start)) >= 0]
        if found:
            self.full, self.stopped = self.full[: min(found)], True
            return self.flush(), True
        ready = max(self.sent, len(self.full) - self.hold)
        out, self.sent = self.full[self.sent : ready], ready
        return out, False

    def flush(self) -> str:
        out, self.sent = self.full[self.sent :], len(self.full)
        return out

    def finish(self) -> str:
        """The rest of the text when the sequence ends: all of it, as one decode of every
        id gives it (a character cut off by the last token shows as U+FFFD), unless a stop
        string ended it."""
        if not self.stopped:
            decoded = self.text.decode(self.ids)
            if decoded.startswith(self.full[: self.sent]):
                self.full = decoded
            # the last token may have completed a character and a stop string with it
            start = max(0, self.sent - self.hold)
            found = [at for stop in self.stops if (at := self.full.find(stop, start)) >= 0]
            if found:
                self.full, self.stopped = self.full[: max(self.sent, min(found))], True
        return self.flush()


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _template_of(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)
