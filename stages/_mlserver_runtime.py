"""MLServer runtime for a Shipyard bundle: ONNX Runtime behind the Open Inference Protocol.

The bundle ships this file next to `model-settings.json`; MLServer imports it from there
(`implementation: shipyard_runtime.ShipyardOnnxRuntime`). It needs only mlserver,
onnxruntime and numpy.

- generic task: `infer` feeds the request's tensors by name and returns every graph output.
- Concurrent `infer` requests are batched by the runtime itself (see Batcher), not by
  MLServer's adaptive batching, which would merge incompatible requests.
- causal-lm: `infer` takes `input_ids` INT64 [batch, prompt] and the request parameter
  `max_new_tokens` (default 1) and returns `output_ids` INT64 [batch, max_new_tokens] by
  greedy decoding with the KV-cache graph (prefill runs on the same graph with an empty
  past). `infer_stream` / `generate_stream` yield one response per decoded token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput
from mlserver.utils import get_model_uri

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class BadRequest(MLServerError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=400)


def session_from(model_path: Path, config: dict[str, Any]) -> ort.InferenceSession:
    """An ORT session with the bundle's `ort_session.json` options."""
    options = ort.SessionOptions()
    opts = config.get("session_options", {})
    options.graph_optimization_level = _LEVELS[opts.get("graph_optimization_level", "all")]
    options.intra_op_num_threads = opts.get("intra_op_num_threads", 0)
    options.inter_op_num_threads = opts.get("inter_op_num_threads", 0)
    if opts.get("execution_mode") == "parallel":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    providers = config.get("providers", ["CPUExecutionProvider"])
    return ort.InferenceSession(str(model_path), options, providers=providers)


class Decoder:
    """Greedy decoding with a KV-cache graph: inputs input_ids, attention_mask, past_*."""

    def __init__(self, session: ort.InferenceSession, max_context: int) -> None:
        self.session = session
        self.max_context = max_context
        self.past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.present = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
        self.float = np.float16 if "float16" in (self.past[0].type if self.past else "") else None
        logits = next(o for o in session.get_outputs() if o.name == "logits")
        self.vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else 0

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        dtype = self.float or np.float32
        return {
            i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), dtype=dtype) for i in self.past
        }

    def steps(self, input_ids: np.ndarray, new_tokens: int) -> Iterator[np.ndarray]:
        """Yields the next token ids [batch, 1], new_tokens times."""
        batch, prompt = input_ids.shape
        feeds: dict[str, np.ndarray] = {"input_ids": input_ids, **self._empty_past(batch)}
        total = prompt
        for _ in range(new_tokens):
            feeds["attention_mask"] = np.ones((batch, total), dtype=np.int64)
            logits, *present = self.session.run(["logits", *self.present], feeds)
            token = logits[:, -1, :].argmax(axis=-1).astype(np.int64)[:, None]
            yield token
            feeds = {"input_ids": token}
            feeds.update(zip((i.name for i in self.past), present, strict=True))
            total += 1


class Batcher:
    """Dynamic batching that only merges compatible requests, Triton-style.

    MLServer's own adaptive batching concatenates any requests that arrive together and
    keeps one request's parameters, so two prompts of different lengths, or two different
    `max_new_tokens`, would break or silently change each other. Here a request joins the
    queue of its key (the shapes after the batch axis and the generation parameters). A
    queue is due when it holds `max_rows` rows or its first request has waited `delay`
    seconds; it then runs on the next free model instance (`instances` at once), taking
    every compatible request that arrived meanwhile, up to `max_rows` rows.
    """

    def __init__(self, run: Any, max_rows: int, delay: float, instances: int = 1) -> None:
        self.run, self.max_rows, self.delay = run, max_rows, delay
        self.pending: dict[Any, list[tuple[dict[str, np.ndarray], asyncio.Future[Any]]]] = {}
        self.due: set[Any] = set()
        self.instances = instances
        self._slots: asyncio.Semaphore | None = None

    async def submit(self, key: Any, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue = self.pending.setdefault(key, [])
        queue.append((arrays, future))
        if len(queue) == 1:
            loop.call_later(self.delay, self._make_due, key)
        if _rows(queue) >= self.max_rows:
            self._make_due(key)
        result: dict[str, np.ndarray] = await future
        return result

    def _make_due(self, key: Any) -> None:
        if self.pending.get(key) and key not in self.due:
            self.due.add(key)
            asyncio.ensure_future(self._run(key))

    async def _run(self, key: Any) -> None:
        if self._slots is None:  # created on the server's event loop
            self._slots = asyncio.Semaphore(self.instances)
        async with self._slots:
            self.due.discard(key)
            queue = self.pending.pop(key, [])
            take = 1
            while take < len(queue) and _rows(queue[: take + 1]) <= self.max_rows:
                take += 1
            queue, rest = queue[:take], queue[take:]
            if rest:  # the next batch of this key, on the next free instance
                self.pending[key] = rest
                self._make_due(key)
            if queue:
                await self._execute(key, queue)

    async def _execute(self, key: Any, queue: list[Any]) -> None:
        rows = [_rows([item]) for item in queue]
        merged = {n: np.concatenate([a[n] for a, _ in queue]) for n in queue[0][0]}
        try:
            out = await asyncio.to_thread(self.run, key, merged)
        except Exception as exc:  # every request of the batch gets the error
            for _, f in queue:
                f.set_exception(exc)
            return
        bounds = np.cumsum([0, *rows])
        for (_, f), a, b in zip(queue, bounds[:-1], bounds[1:], strict=True):
            f.set_result({n: v[a:b] for n, v in out.items()})


def _rows(queue: list[tuple[dict[str, np.ndarray], Any]]) -> int:
    return sum(len(next(iter(arrays.values()))) for arrays, _ in queue)


class ShipyardOnnxRuntime(MLModel):
    """Loads the bundle's ONNX model; parameters.extra carries task and session config."""

    async def load(self) -> bool:
        extra = dict(self.settings.parameters.extra or {}) if self.settings.parameters else {}
        model_path = Path(await get_model_uri(self.settings))
        folder = Path(self.settings._source or ".").parent
        config_file = extra.get("ort_session")
        config = json.loads((folder / config_file).read_text()) if config_file else {}
        self.task = extra.get("task", "generic")
        self.session = session_from(model_path, config)
        if self.task == "causal-lm":
            self.decoder = Decoder(self.session, int(extra.get("max_context_length", 1 << 30)))
        self.max_request_rows = int(extra.get("max_batch_rows", 1))  # the served batch
        self.limits = {k: int(extra.get(k, 0)) for k in ("max_prompt_tokens", "max_past_tokens")}
        rows = self.max_request_rows if extra.get("dynamic_batching") else 1
        delay = float(extra.get("max_batch_delay_s", 0))
        instances = int(extra.get("instance_count", 1))
        self.batcher = Batcher(self._run_batch, rows, delay, instances)
        self.ready = True
        return self.ready

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if self.task != "causal-lm":
            feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
            key = tuple(sorted((n, v.shape[1:], str(v.dtype)) for n, v in feeds.items()))
            return self._response(await self.batcher.submit(key, feeds))
        input_ids, new_tokens = self._generation_args(payload)
        key = (input_ids.shape[1], new_tokens)
        return self._response(await self.batcher.submit(key, {"input_ids": input_ids}))

    def _run_batch(self, key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch in a worker thread: greedy generation, or one pass of the graph."""
        if self.task == "causal-lm":
            steps = self.decoder.steps(feeds["input_ids"], key[1])
            return {"output_ids": np.concatenate(list(steps), axis=1)}
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feeds), strict=True))

    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        if self.task != "causal-lm":
            raise BadRequest("streaming is only served for causal-lm releases")
        payload = await payloads.__anext__()
        input_ids, new_tokens = self._generation_args(payload)
        steps = self.decoder.steps(input_ids, new_tokens)
        while (token := await asyncio.to_thread(next, steps, None)) is not None:
            yield self._response({"output_ids": token})

    def _generation_args(self, payload: InferenceRequest) -> tuple[np.ndarray, int]:
        inputs = {i.name: i for i in payload.inputs}
        if "input_ids" not in inputs:
            raise BadRequest(f"causal-lm expects input 'input_ids'; got {sorted(inputs)}")
        input_ids = NumpyCodec.decode_input(inputs["input_ids"]).astype(np.int64)
        if input_ids.ndim != 2:
            raise BadRequest(f"input_ids must be [batch, prompt]; got shape {input_ids.shape}")
        extra = payload.parameters.model_extra if payload.parameters else {}
        new_tokens = int((extra or {}).get("max_new_tokens", 1))
        if new_tokens < 1:
            raise BadRequest("max_new_tokens must be at least 1")
        batch, prompt = input_ids.shape
        if batch > self.max_request_rows:
            raise BadRequest(
                f"batch {batch} exceeds the served max_batch_size {self.max_request_rows}"
            )
        limits = self.limits
        if limits["max_prompt_tokens"] and prompt > limits["max_prompt_tokens"]:
            raise BadRequest(
                f"prompt of {prompt} tokens exceeds the exported maximum "
                f"{limits['max_prompt_tokens']}"
            )
        past = prompt + new_tokens - 2  # the longest past the last decode step feeds
        if limits["max_past_tokens"] and past > limits["max_past_tokens"]:
            raise BadRequest(
                f"prompt {prompt} + {new_tokens} new tokens needs a past of {past} tokens; "
                f"the export's past_sequence max is {limits['max_past_tokens']}"
            )
        if prompt + new_tokens - 1 > self.decoder.max_context:
            raise BadRequest(
                f"prompt {prompt} + {new_tokens} new tokens - 1 exceeds the served context "
                f"{self.decoder.max_context}"
            )
        vocab = self.decoder.vocab
        if (
            vocab
            and input_ids.size
            and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab
        ):
            raise BadRequest(f"input_ids must lie in [0, {vocab}) (the model's vocabulary)")
        return input_ids, new_tokens

    def _response(self, outputs: dict[str, np.ndarray]) -> InferenceResponse:
        encoded: list[ResponseOutput] = [
            NumpyCodec.encode_output(name, value) for name, value in outputs.items()
        ]
        return InferenceResponse(model_name=self.name, model_version=self.version, outputs=encoded)
