"""Text in and out with the shipped tokenizer (the `tokenizers` library), stop strings and
chat templates (rendered from the shipped template in a sandbox, as transformers does).

Nothing here may stall the server or take its memory, whatever a request holds:
- a text is refused before it is tokenized when it has more characters than the context
  could hold (`Text.longest`: the most characters one token stands for, x the tokens), and
  it is tokenized through `encode_batch`, which releases the GIL (`encode` holds it: a
  3.9 MB prompt stalled every other request 2.7 s from a thread; `encode_batch` 12 ms);
- a chat is refused before it is rendered when it has more messages or characters than
  the context could hold, and it is rendered in a worker process of its own
  (`GuardedTemplate`), which is killed past `timeout_s` of its own CPU time (not wall time:
  a busy machine must not turn a render that fits into a refusal, nor decide which limit a
  template meets first), has `memory` bytes of address space and returns at most the
  characters asked for: a template that loops (99,999 x 99,999),
  grows a string without end or asks for range(10**9) is a refused request, not a stalled
  or swollen server.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
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
        # the most characters one token stands for (a byte-level token's bytes; at least 1)
        ids = [[i] for i in self.tokenizer.get_vocab(with_added_tokens=True).values()]
        texts = self.tokenizer.decode_batch(ids, skip_special_tokens=False)  # one call
        self.longest = max(1, *map(len, texts)) if texts else 1
        # made here (it starts no process until its first render): two first chats at once
        # share one worker
        self._template = (
            GuardedTemplate(self.chat_template, self.special) if self.chat_template else None
        )

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids; `special`: with the tokenizer's own additions (BOS, [CLS]/[SEP]), as a
        completion prompt or an embedding input is encoded (a rendered chat has them).
        Through `encode_batch`, which lets other threads run while it works."""
        return list(self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)

    def fits(self, text: str, tokens: int, what: str) -> None:
        """ValueError when `text` has more characters than `tokens` tokens could stand for
        (it could not fit however it tokenizes): checked before tokenizing it."""
        most = tokens * self.longest
        if len(text) > most:
            raise ValueError(
                f"{what} has {len(text)} characters, more than {tokens} tokens (the served "
                f"context) can hold at {self.longest} characters a token at most"
            )

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]], tokens: int = 1 << 20) -> str:
        """The prompt of a conversation, ending where the assistant's turn begins; refused
        (ValueError) beyond what `tokens` tokens of context could hold, before rendering."""
        if not self.chat_template:
            raise ValueError(
                "this model ships no chat template (chat_template.jinja or tokenizer_config."
                "json's chat_template); use /v1/completions with a prompt"
            )
        if len(messages) > tokens:
            raise ValueError(
                f"{len(messages)} messages are more than the {tokens}-token context can hold"
            )
        chars = sum(len(str(v)) for m in messages for v in m.values())
        if chars > tokens * self.longest:
            raise ValueError(
                f"the messages have {chars} characters, more than {tokens} tokens (the served "
                f"context) can hold at {self.longest} characters a token at most"
            )
        assert self._template is not None
        return self._template.render(messages, tokens * self.longest)

    def close(self) -> None:
        if self._template is not None:
            self._template.close()


# The chat template's worker: one JSON request a line on stdin ({"messages", "max_chars"}),
# one JSON answer a line on stdout ({"text"} or {"error"}). Its address space is capped
# before jinja2 is imported, so a string grown without end is a MemoryError it reports.
_WORKER = """
import json, resource, sys
memory = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
setup = json.loads(sys.stdin.readline())
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
def raise_exception(message):
    raise TemplateError(message)
env.globals["raise_exception"] = raise_exception
try:
    template = env.from_string(setup["template"])
    broken = None
except Exception as exc:
    broken = f"the chat template does not compile: {type(exc).__name__}: {exc}"
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    try:
        if broken:
            raise ValueError(broken)
        ask = json.loads(line)
        text = template.render(
            messages=ask["messages"], add_generation_prompt=True, **setup["special"]
        )
        if len(text) > ask["max_chars"]:
            out = {"error": f"the rendered chat has {len(text)} characters, more than the "
                            f"{ask['max_chars']} the served context can hold"}
        else:
            out = {"text": text}
    except TemplateError as exc:
        out = {"error": f"the chat template refused the messages: {exc}"}
    except MemoryError:
        out = {"error": "the chat template ran out of its memory rendering the messages"}
    except (OverflowError, RecursionError, ValueError, TypeError) as exc:
        out = {"error": f"the chat template failed: {type(exc).__name__}: {exc}"}
    except Exception as exc:
        out = {"error": f"the chat template failed: {type(exc).__name__}: {exc}"}
    try:
        print(json.dumps(out), flush=True)
    except MemoryError:
        print(json.dumps({"error": "the chat template ran out of its memory"}), flush=True)
"""


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time (user + system) so far from /proc, or None where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class GuardedTemplate:
    """A chat template rendered in a worker process (sandboxed Jinja, as transformers
    renders it), one render at a time: killed and refused past `timeout_s` of the worker's
    CPU time (wall time where /proc is missing; a render also stops at `WALL_FACTOR` times
    that much wall time, whatever the machine's load), with `memory` bytes of address
    space, and at most the characters asked for. A killed or dead worker is replaced at the
    next render."""

    WALL_FACTOR = 15.0

    def __init__(
        self,
        template: str,
        special: dict[str, str],
        timeout_s: float = 2.0,
        memory: int = 256 << 20,
    ) -> None:
        self.template, self.special = template, special
        self.timeout_s, self.memory = timeout_s, memory
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def render(self, messages: list[dict[str, Any]], max_chars: int) -> str:
        try:
            ask = json.dumps({"messages": messages, "max_chars": max_chars}) + "\n"
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the messages cannot be rendered: {exc}") from None
        with self._lock:
            proc = self._worker()
            try:
                assert proc.stdin is not None
                proc.stdin.write(ask.encode("utf-8", "surrogatepass"))
                proc.stdin.flush()
                answer = self._read(proc, self.timeout_s, cpu=True)
            except (OSError, TimeoutError) as exc:
                self._kill()
                if isinstance(exc, TimeoutError):
                    raise ValueError(
                        f"the chat template took more than {self.timeout_s:g} s of CPU time to "
                        "render the messages and was stopped"
                    ) from None
                raise ValueError("the chat template's worker failed; try again") from None
        if "error" in answer:
            raise ValueError(str(answer["error"]))
        return str(answer["text"])

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(self.memory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("SHIPYARD_API_TOKEN")},
        )
        assert proc.stdin is not None
        setup = {"template": self.template, "special": self.special}
        proc.stdin.write((json.dumps(setup) + "\n").encode())
        proc.stdin.flush()
        self._proc = proc
        try:
            self._read(proc, 30.0)  # its imports
        except (OSError, TimeoutError):
            self._kill()
            raise ValueError("the chat template's worker did not start") from None
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], timeout_s: float, cpu: bool = False) -> dict[str, Any]:
        """One answer line, or OSError when the worker died, or TimeoutError: past
        `timeout_s` of wall time, or with `cpu` past `timeout_s` of the worker's CPU time
        (checked every 50 ms) or `WALL_FACTOR` times that of wall time."""
        assert proc.stdout is not None
        spent = cpu_seconds(proc.pid) if cpu else None
        wall = timeout_s * GuardedTemplate.WALL_FACTOR if spent is not None else timeout_s
        deadline = time.monotonic() + wall
        buffer = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not buffer.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if not sel.select(min(left, 0.05) if spent is not None else left):
                    if spent is None:
                        raise TimeoutError
                    now = cpu_seconds(proc.pid)
                    if now is None or now - spent > timeout_s:
                        raise TimeoutError
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise OSError("the worker exited")
                buffer += chunk
        answer = json.loads(buffer)
        return answer if isinstance(answer, dict) else {"error": "the worker answered nonsense"}

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


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
