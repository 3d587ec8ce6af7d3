"""MLServer runtime for a Shipyard bundle: ONNX Runtime behind the Open Inference Protocol
and, for generating and embedding tasks, the OpenAI API.

The bundle ships the runtime package next to `model-settings.json` (`implementation:
shipyard_runtime.mlserver.ShipyardOnnxRuntime`), this adapter with the generation engine
(`shipyard_runtime.generation`); `parameters.extra` is the typed `RuntimeSettings`. It
needs mlserver, onnxruntime, numpy, and for text the `tokenizers` library (jinja2 for chat
templates).

- every task: `infer` feeds the request's tensors by name and returns every graph output;
  a label task (sequence/token classification, `serving: labels`) adds `label` (BYTES, the
  top class's name from the model's id2label) and `score` (FP32, its softmax probability).
  Concurrent requests are batched by the runtime itself (Batcher), not by MLServer's
  adaptive batching, which would merge incompatible requests.
- a generating task (causal-lm, `serving: generate`): every request goes to one engine
  (shipyard_runtime.generation) that batches decode steps, so requests join and leave between
  steps. `infer` takes `input_ids` INT64 [batch, prompt] or `text` BYTES [batch] and the
  generation parameters (`max_new_tokens` or `max_tokens`, `temperature` (default 0:
  greedy), `top_k`, `top_p`, `repetition_penalty`, `seed`, `stop`, `stop_token_ids`,
  `ignore_eos`); it returns `output_ids` INT64 [batch, longest] (-1 after a row's end),
  `finish_reason` and, with a tokenizer, `text`. `infer_stream` yields one response per token.
  `/v1/completions`, `/v1/chat/completions` (SSE when streamed) and `/v1/models` speak the
  OpenAI API; a text-embedding bundle answers `/v1/embeddings`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import numpy as np
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.errors import MLServerError
from mlserver.handlers import custom_handler
from mlserver.types import (
    InferenceRequest,
    InferenceResponse,
    MetadataModelResponse,
    MetadataTensor,
    Parameters,
    ResponseOutput,
)
from mlserver.utils import get_model_uri

from shipyard_runtime import openai_api
from shipyard_runtime.dtypes import INTEGER_V2, V2_OF_ONNX
from shipyard_runtime.generation.core import Engine
from shipyard_runtime.generation.params import BadParameter, check_rows, parse_tensor_request
from shipyard_runtime.generation.runner import Graph
from shipyard_runtime.generation.scheduler import QueueFull as EngineQueueFull
from shipyard_runtime.generation.text import Text
from shipyard_runtime.metrics import announce, for_model
from shipyard_runtime.origin import foreign_runtime
from shipyard_runtime.session import session_from
from shipyard_runtime.settings import RuntimeSettings


class BadRequest(MLServerError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=400)


class QueueFull(MLServerError):
    """Triton's REJECT policy: a full queue answers at once instead of growing."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=503)


class TimedOut(MLServerError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=504)


MAX_ELEMENTS = 1 << 24  # per input; far beyond any shape the export allows


def decode(inp: Any) -> np.ndarray:
    """One request tensor, checked before numpy sees it: a shape of non-negative ints,
    data that fills it exactly, numbers of the declared datatype (no silent truncation of
    1.7 to 1), no BYTES where numbers are expected."""
    name, shape, datatype = inp.name, list(inp.shape or []), str(inp.datatype)
    if not shape:
        raise BadRequest(f"input {name!r}: a 0-d tensor; send shape [batch, ...]")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise BadRequest(f"input {name!r}: shape {shape} must be non-negative integers")
    count = int(np.prod(shape))
    if count > MAX_ELEMENTS:
        raise BadRequest(f"input {name!r}: {count} elements is beyond {MAX_ELEMENTS}")
    if datatype == "BYTES":
        raise BadRequest(f"input {name!r}: BYTES is not accepted here; send numbers")
    values = _flat(getattr(inp.data, "root", inp.data))
    if len(values) != count:
        raise BadRequest(
            f"input {name!r}: {len(values)} values do not fill shape {shape} ({count} needed)"
        )
    if datatype in INTEGER_TYPES and any(
        isinstance(v, bool) or not isinstance(v, int) for v in values
    ):
        raise BadRequest(f"input {name!r}: {datatype} needs integers; found a non-integer value")
    if datatype == "BOOL" and any(not isinstance(v, bool | int) for v in values):
        raise BadRequest(f"input {name!r}: BOOL needs true/false values")
    if datatype.startswith("FP") and any(
        isinstance(v, bool) or not isinstance(v, int | float) for v in values
    ):
        raise BadRequest(f"input {name!r}: {datatype} needs numbers")
    try:
        array = NumpyCodec.decode_input(inp)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"input {name!r}: cannot decode as {datatype} {shape}: {exc}") from None
    if list(array.shape) != shape:
        raise BadRequest(f"input {name!r}: data decodes to {list(array.shape)}, not {shape}")
    return cast(np.ndarray, array)


def check_bounds(name: str, array: np.ndarray, bounds: tuple[int, int] | None) -> None:
    """An integer input's values lie in its [low, high) from model_info (token ids below
    the vocabulary, segment ids below type_vocab_size, masks 0/1): an id past its
    embedding table would be an ONNX Runtime error, that is a 500, not the client's 400."""
    if bounds is None or not array.size or array.dtype.kind not in "iu":
        return
    low, high = bounds
    smallest, largest = int(array.min()), int(array.max())
    if smallest < low or largest >= high:
        found = smallest if smallest < low else largest
        raise BadRequest(f"input {name!r}: values must lie in [{low}, {high}); found {found}")


def _flat(data: Any) -> list[Any]:
    out: list[Any] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(reversed(item))
        else:
            out.append(item)
        if len(out) > MAX_ELEMENTS:
            break
    return out


class Batcher:
    """Dynamic batching that only merges compatible requests, Triton-style.

    MLServer's own adaptive batching concatenates any requests that arrive together and
    keeps one request's parameters, so two prompts of different lengths, or two different
    `max_new_tokens`, would break or silently change each other. Here a request joins the
    queue of its key (the shapes after the batch axis and the generation parameters). A
    queue is due when it holds `max_rows` rows or its first request has waited `delay`
    seconds; it then runs on the next free model instance (`instances` at once), taking
    every compatible request that arrived meanwhile, up to `max_rows` rows.

    Limits, as Triton's queue policy: at most `max_queue` requests wait (more are refused at
    once with 503 "queue full"), and a request not answered within `timeout` seconds gets
    504 and leaves the queue.
    """

    def __init__(
        self,
        run: Any,
        max_rows: int,
        delay: float,
        instances: int = 1,
        max_queue: int = 0,
        timeout: float = 0.0,
        metrics: Any = None,
    ) -> None:
        self.run, self.max_rows, self.delay = run, max_rows, delay
        # the engine's series (shipyard_runtime/metrics.py) for a one-pass task: requests
        # waiting and running, queue time and end-to-end latency, rows a batch, prompt
        # tokens, and how each request ended (stop: answered; rejected, timeout, error)
        self.metrics = metrics
        self.arrived: dict[int, float] = {}  # id(future) -> arrival, while it waits
        self.pending: dict[Any, list[tuple[dict[str, np.ndarray], asyncio.Future[Any]]]] = {}
        self.due: set[Any] = set()
        self.instances = instances
        self.max_queue, self.timeout = max_queue, timeout
        self.waiting = 0  # requests queued, not yet running
        self.running = 0  # requests in a batch that runs now
        self._slots: asyncio.Semaphore | None = None

    def _admit(self) -> None:
        if self.max_queue and self.waiting >= self.max_queue:
            raise QueueFull(
                f"queue full: {self.waiting} requests waiting (max_queue_depth "
                f"{self.max_queue}); retry later"
            )

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:  # created on the server's event loop
            self._slots = asyncio.Semaphore(self.instances)
        return self._slots

    async def submit(self, key: Any, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.monotonic()
        try:
            self._admit()
        except QueueFull:
            self._ended("rejected", start)
            raise
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        future.add_done_callback(_consume)
        queue = self.pending.setdefault(key, [])
        queue.append((arrays, future))
        self.arrived[id(future)] = start
        self.waiting += 1
        self._gauges()
        if self.metrics is not None:
            mask = arrays.get("attention_mask")
            ids = arrays.get("input_ids")
            tokens = mask.sum() if mask is not None else ids.size if ids is not None else 0
            self.metrics.prompt.inc(int(tokens))
        if len(queue) == 1:
            loop.call_later(self.delay, self._make_due, key)
        if _rows(queue) >= self.max_rows:
            self._make_due(key)
        try:
            result: dict[str, np.ndarray] = await asyncio.wait_for(
                asyncio.shield(future), self.timeout or None
            )
        except TimeoutError:
            still = self.pending.get(key, [])
            if any(f is future for _, f in still):  # never started: it leaves the queue
                self.pending[key] = [item for item in still if item[1] is not future]
                self.waiting -= 1
                self.arrived.pop(id(future), None)
                self._gauges()
            self._ended("timeout", start)
            raise TimedOut(
                f"request timed out after {self.timeout:g} s (request_timeout_seconds)"
            ) from None
        except asyncio.CancelledError:  # the client went away
            self._ended("abort", start)
            raise
        except Exception:
            self._ended("error", start)
            raise
        self._ended("stop", start)
        return result

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(self.waiting)
            self.metrics.queue.set(self.waiting)
            self.metrics.running.set(self.running)

    def _ended(self, reason: str, start: float) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - start)
            self.metrics.finished(reason, 0, False)

    def _make_due(self, key: Any) -> None:
        if self.pending.get(key) and key not in self.due:
            self.due.add(key)
            asyncio.ensure_future(self._run(key))

    async def _run(self, key: Any) -> None:
        async with self._semaphore():
            self.due.discard(key)
            queue = self.pending.pop(key, [])
            take = 1
            while take < len(queue) and _rows(queue[: take + 1]) <= self.max_rows:
                take += 1
            queue, rest = queue[:take], queue[take:]
            self.waiting -= len(queue)
            now = time.monotonic()
            for _, f in queue:
                arrived = self.arrived.pop(id(f), None)
                if self.metrics is not None and arrived is not None:
                    self.metrics.queue_time.observe(now - arrived)
            if rest:  # the next batch of this key, on the next free instance
                self.pending[key] = rest
                self._make_due(key)
            if queue:
                await self._execute(key, queue)

    async def _execute(self, key: Any, queue: list[Any]) -> None:
        """Merge, run, split: any failure (the merge included) answers every request of the
        batch at once, instead of leaving them to their timeout."""
        rows = [_rows([item]) for item in queue]
        self.running += len(queue)
        self._gauges()
        if self.metrics is not None:
            self.metrics.rows.observe(sum(rows))
        try:
            merged = {n: np.concatenate([a[n] for a, _ in queue]) for n in queue[0][0]}
            out = await asyncio.to_thread(self.run, key, merged)
            bounds = np.cumsum([0, *rows])
            parts = [
                {n: v[a:b] for n, v in out.items()}
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        except Exception as exc:  # every request of the batch gets the error
            for _, f in queue:
                if not f.done():
                    f.set_exception(exc)
            return
        finally:
            self.running -= len(queue)
            self._gauges()
        for (_, f), part in zip(queue, parts, strict=True):
            if not f.done():
                f.set_result(part)


def label_scores(logits: np.ndarray, labels: list[str]) -> dict[str, np.ndarray]:
    """The top class per row (sequence classification) or per token (token classification):
    its name and its softmax probability, computed stably in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    top = probs.argmax(axis=-1)
    names = np.array(labels or [f"LABEL_{i}" for i in range(logits.shape[-1])], dtype=object)
    if len(names) != logits.shape[-1]:
        raise RuntimeError(f"{len(names)} labels for {logits.shape[-1]} scores")
    return {
        "label": names[top],
        "score": np.take_along_axis(probs, top[..., None], axis=-1)[..., 0].astype(np.float32),
    }


def _consume(future: asyncio.Future[Any]) -> None:
    """Nobody may be waiting any more (a timed-out client): read the outcome anyway."""
    if not future.cancelled():
        future.exception()


def _rows(queue: list[tuple[dict[str, np.ndarray], Any]]) -> int:
    return sum(len(next(iter(arrays.values()))) for arrays, _ in queue)


# Open Inference Protocol datatypes of the ONNX tensor types a graph may take (dtypes.py)
V2_TYPES: dict[str, str] = V2_OF_ONNX
INTEGER_TYPES: frozenset[str] = INTEGER_V2


class ShipyardOnnxRuntime(MLModel):
    """Loads the bundle's ONNX model; parameters.extra is the typed RuntimeSettings."""

    async def load(self) -> bool:
        if os.environ.get("SHIPYARD_FRONT_DOOR") != "1":
            raise RuntimeError(
                "start this bundle with `python serving/mlserver/shipyard_serve.py` (see its "
                "--help): `mlserver start` alone serves it with no API token, body cap or "
                "read timeouts"
            )
        extra = dict(self.settings.parameters.extra or {}) if self.settings.parameters else {}
        try:
            self.config = RuntimeSettings.model_validate(extra)
        except ValueError as exc:
            raise RuntimeError(f"model-settings.json parameters.extra: {exc}") from None
        c = self.config
        model_path = Path(await get_model_uri(self.settings))
        folder = Path(self.settings._source or ".").parent
        problem = foreign_runtime(folder)
        if problem:
            raise RuntimeError(problem)
        session_config = json.loads((folder / c.ort_session).read_text())
        self.task, self.serving, self.labels = c.task, c.serving, list(c.labels)
        self.bounds = {k: (int(v[0]), int(v[1])) for k, v in c.input_bounds.items()}
        self.session = session_from(model_path, session_config)
        self.text = Text(folder / c.text) if c.text else None
        self.max_request_rows = c.batching.max_rows
        self.engine = None
        announce(self.name)  # every task: the alerts' scope and target-down
        if self.serving == "generate":
            assert c.engine is not None, "a generating task needs engine settings"
            graph = Graph(self.session)
            self.engine = Engine(graph, c.engine, self.text, metrics=for_model(self.name))
        b = c.batching
        self.batcher = Batcher(
            self._run_batch,
            b.max_rows if b.enabled else 1,
            b.delay_s,
            b.instances,
            max_queue=b.max_queue,
            timeout=b.timeout_s,
            # a generating task's requests go to the engine, which has its own series
            metrics=None if self.serving == "generate" else for_model(self.name),
        )
        self.ready = True
        return self.ready

    async def unload(self) -> bool:
        if self.engine is not None:
            self.engine.close()
        if self.text is not None:
            self.text.close()
        return True

    # ------------------------------------------------------------ V2 metadata
    async def metadata(self) -> MetadataModelResponse:
        """What a V2 client sends and gets back (REST `GET /v2/models/<m>`, gRPC
        ModelMetadata): the served signature, not MLServer's empty default."""
        inputs, outputs = self.signature()
        return MetadataModelResponse(
            name=self.name,
            versions=[self.version] if self.version else None,
            platform="onnxruntime_onnx",
            inputs=inputs,
            outputs=outputs,
        )

    def signature(self) -> tuple[list[MetadataTensor], list[MetadataTensor]]:
        """Inputs and outputs as requests meet them: the graph's for one-pass tasks (with
        label and score for label tasks), the generation tensors for a generating one. -1 is
        a dimension the request chooses; a bounded integer input carries its [low, high)."""

        def tensor(name: str, datatype: str, shape: list[Any]) -> MetadataTensor:
            bounds = self.bounds.get(name)
            return MetadataTensor(
                name=name,
                datatype=datatype,
                shape=[d if isinstance(d, int) and d > 0 else -1 for d in shape],
                parameters=Parameters(low=bounds[0], high=bounds[1]) if bounds else None,
            )

        # text goes out as MLServer's StringCodec writes it: one row of one element each
        if self.serving == "generate":
            ins = [tensor("input_ids", "INT64", [-1, -1])]
            outs = [
                tensor("output_ids", "INT64", [-1, -1]),
                tensor("finish_reason", "BYTES", [-1, 1]),
            ]
            if self.text is not None:
                ins.append(tensor("text", "BYTES", [-1]))
                outs.append(tensor("text", "BYTES", [-1, 1]))
            return ins, outs
        ins = [
            tensor(i.name, V2_TYPES.get(i.type, "BYTES"), i.shape)
            for i in self.session.get_inputs()
        ]
        graph = self.session.get_outputs()
        outs = [tensor(o.name, V2_TYPES.get(o.type, "BYTES"), o.shape) for o in graph]
        if self.serving == "labels":
            rows = [-1] * (len(graph[0].shape) - 1)
            outs += [tensor("label", "BYTES", [*rows, 1]), tensor("score", "FP32", rows)]
        return ins, outs

    # ------------------------------------------------------------ V2: one pass per request
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        return self._selected(await self._predict(payload), payload)

    def _selected(
        self, response: InferenceResponse, payload: InferenceRequest
    ) -> InferenceResponse:
        """Only the outputs the request names (V2 `outputs`), in its order; all without."""
        if not payload.outputs:
            return response
        by_name = {o.name: o for o in response.outputs}
        wanted = [o.name for o in payload.outputs]
        unknown = [n for n in wanted if n not in by_name]
        if unknown or len(set(wanted)) != len(wanted):
            raise BadRequest(
                f"outputs must name each of {sorted(by_name)} at most once; got {wanted}"
            )
        response.outputs = [by_name[n] for n in wanted]
        return response

    async def _predict(self, payload: InferenceRequest) -> InferenceResponse:
        if self.serving != "generate":
            feeds = self._graph_inputs(payload)
            key = tuple(sorted((n, v.shape[1:], str(v.dtype)) for n, v in feeds.items()))
            return self._response(await self.batcher.submit(key, feeds))
        prompts, params = await self._generation_args(payload)
        results = await self._generate_all(prompts, params)
        width = max(len(r) for r in results)
        ids = np.full((len(results), width), -1, dtype=np.int64)
        for row, events in enumerate(results):
            ids[row, : len(events)] = [e.token for e in events]
        outputs: dict[str, np.ndarray] = {
            "output_ids": ids,
            "finish_reason": np.array([r[-1].finish or "" for r in results], dtype=object),
        }
        if self.text is not None:
            outputs["text"] = np.array(["".join(e.text for e in r) for r in results], object)
        return self._response(outputs)

    def _graph_inputs(self, payload: InferenceRequest) -> dict[str, np.ndarray]:
        """Exactly the graph's inputs: names, datatypes, ranks, static sizes, one batch."""
        expected = {i.name: i for i in self.session.get_inputs()}
        given = [i.name for i in payload.inputs]
        if sorted(given) != sorted(expected) or len(set(given)) != len(given):
            raise BadRequest(f"inputs must be exactly {sorted(expected)}; got {given}")
        feeds = {}
        for inp in payload.inputs:
            want = expected[inp.name]
            datatype = V2_TYPES.get(want.type)
            if datatype and inp.datatype != datatype:
                raise BadRequest(f"input {inp.name!r} must be {datatype}; got {inp.datatype}")
            array = decode(inp)
            if array.ndim != len(want.shape):
                raise BadRequest(
                    f"input {inp.name!r} must have {len(want.shape)} axes {want.shape}; "
                    f"got shape {list(array.shape)}"
                )
            for axis, (size, dim) in enumerate(zip(array.shape, want.shape, strict=True)):
                if isinstance(dim, int) and size != dim:
                    raise BadRequest(f"input {inp.name!r} axis {axis} must be {dim}; got {size}")
            check_bounds(inp.name, array, self.bounds.get(inp.name))
            feeds[inp.name] = array
        batches = {v.shape[0] for v in feeds.values()}
        if len(batches) != 1:
            raise BadRequest(f"inputs disagree on the batch size: {sorted(batches)}")
        try:
            check_rows(batches.pop(), self.max_request_rows)
        except BadParameter as exc:
            raise BadRequest(str(exc)) from None
        return feeds

    def _run_batch(self, key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch of a one-pass task in a worker thread."""
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feeds), strict=True))
        if self.serving == "labels":
            out.update(label_scores(out[names[0]], self.labels))
        return out

    # ------------------------------------------------------------ generation
    async def _events(self, prompt: list[int], params: Any) -> AsyncGenerator[Any, None]:
        """The engine's events for one sequence, in order; leaving early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(event: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, event)

        assert self.engine is not None
        try:
            handle = self.engine.submit(prompt, params, emit)
        except BadParameter as exc:
            raise BadRequest(str(exc)) from None
        except EngineQueueFull as exc:
            raise QueueFull(str(exc)) from None
        try:
            while True:
                event = await queue.get()
                if event.error:
                    raise MLServerError(
                        event.error, status_code=HTTP_STATUS[event.kind or "internal"]
                    )
                yield event
                if event.finish:
                    return
        finally:
            handle.cancel()

    async def _generate(self, prompt: list[int], params: Any) -> list[Any]:
        return [event async for event in self._events(prompt, params)]

    async def _generate_all(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        """Every prompt of a request; the first failure cancels the rest and is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._generate(p, params)) for p in prompts]
        except* MLServerError as failed:
            raise failed.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _generation_args(self, payload: InferenceRequest) -> tuple[list[list[int]], Any]:
        names = [i.name for i in payload.inputs]
        if names not in (["input_ids"], ["text"]):
            raise BadRequest(
                f"{self.task} expects exactly one input 'input_ids' (or 'text'); got {names}"
            )
        inp = payload.inputs[0]
        if names == ["text"]:
            prompts = await self._text_prompts(inp)
        else:
            if inp.datatype not in ("INT64", "INT32"):
                raise BadRequest(f"input_ids must be INT64 (or INT32); got {inp.datatype}")
            input_ids = decode(inp).astype(np.int64)
            if input_ids.ndim != 2:
                raise BadRequest(
                    f"input_ids must be [batch, prompt]; got shape {list(input_ids.shape)}"
                )
            if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
                raise BadRequest(
                    f"input_ids shape {list(input_ids.shape)}: send at least one row of one token"
                )
            prompts = input_ids.tolist()
        params = self._v2_params(payload)
        assert self.engine is not None
        try:
            self.engine.admit(prompts, params, self.max_request_rows)
        except BadParameter as exc:
            raise BadRequest(str(exc)) from None
        return prompts, params

    async def _text_prompts(self, inp: Any) -> list[list[int]]:
        if self.text is None:
            raise BadRequest("this bundle ships no tokenizer.json: send input_ids")
        if inp.datatype != "BYTES":
            raise BadRequest(f"text must be BYTES; got {inp.datatype}")
        shape = list(inp.shape or [])
        values = _flat(getattr(inp.data, "root", inp.data))
        if len(shape) != 1 or shape[0] != len(values) or not values:
            raise BadRequest(f"text must be [batch] strings; got shape {shape}")
        out = []
        for value in values:
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise BadRequest("text must be UTF-8") from None
            if not isinstance(value, str) or not value:
                raise BadRequest("text must be non-empty strings")
            try:
                self.text.fits(value, self._context_tokens, "text")
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            out.append(await asyncio.to_thread(self.text.encode, value))
        return out

    @property
    def _context_tokens(self) -> int:
        """The most tokens one input may have: the served context (a generation engine's),
        the export's sequence (a one-pass model's), else no bound of ours."""
        if self.engine is not None:
            return int(self.engine.settings.max_context)
        return int(self.config.max_sequence or 1 << 20)

    def _v2_params(self, payload: InferenceRequest) -> Any:
        given = dict((payload.parameters.model_extra if payload.parameters else None) or {})
        try:
            return parse_tensor_request(given, dict(self.config.sampling_defaults))
        except BadParameter as exc:
            raise BadRequest(str(exc)) from None

    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        if self.serving != "generate":
            raise BadRequest(f"streaming is only served for generating tasks, not {self.task}")
        payload = await payloads.__anext__()
        try:
            prompts, params = await self._generation_args(payload)
            if len(prompts) != 1:
                raise BadRequest(f"a stream generates one sequence; got a batch of {len(prompts)}")
            async for event in self._events(prompts[0], params):
                outputs: dict[str, np.ndarray] = {
                    "output_ids": np.array([[event.token]], dtype=np.int64)
                }
                if self.text is not None:
                    outputs["text"] = np.array([event.text], dtype=object)
                response = self._response(outputs)
                if event.finish:
                    response.parameters = Parameters(finish_reason=event.finish)
                yield response
        except MLServerError as exc:
            # MLServer 1.7.1 has committed the stream's response before this generator
            # runs, so a raised error can only become a bare 500: say why in-band instead,
            # as one event carrying the error and its status.
            yield InferenceResponse(
                model_name=self.name,
                model_version=self.version,
                outputs=[],
                parameters=Parameters(
                    error=exc.args[0] if exc.args else str(exc),
                    status_code=getattr(exc, "status_code", 500),
                ),
            )

    def _response(self, outputs: dict[str, np.ndarray]) -> InferenceResponse:
        encoded: list[ResponseOutput] = []
        for name, value in outputs.items():
            if value.dtype == object:
                encoded.append(StringCodec.encode_output(name, [str(v) for v in value]))
            else:
                encoded.append(NumpyCodec.encode_output(name, value))
        return InferenceResponse(model_name=self.name, model_version=self.version, outputs=encoded)

    # ------------------------------------------------------------ the OpenAI API
    @custom_handler(rest_path="/v1/models", rest_method="GET")
    async def openai_models(self, request: Request) -> Response:
        data = [{"id": self.name, "object": "model", "created": 0, "owned_by": "shipyard"}]
        return JSONResponse({"object": "list", "data": data})

    @custom_handler(rest_path="/v1/completions")
    async def openai_completions(self, request: Request) -> Response:
        return await self._openai(request, "completion")

    @custom_handler(rest_path="/v1/chat/completions")
    async def openai_chat(self, request: Request) -> Response:
        return await self._openai(request, "chat")

    @custom_handler(rest_path="/v1/embeddings")
    async def openai_embeddings(self, request: Request) -> Response:
        try:
            if self.config.embedding_output is None:
                raise openai_api.ApiError(404, f"{self.task} serves no embeddings")
            inputs, b64 = openai_api.embeddings(await _json_body(request), self.name)
            vectors, tokens = await self._embed(inputs)
        except openai_api.ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                if b64
                else v.astype(np.float32).tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": self.name, "usage": usage})

    async def _embed(self, inputs: list[Any]) -> tuple[np.ndarray, int]:
        rows = []
        for item in inputs:
            if isinstance(item, str):
                if self.text is None:
                    raise openai_api.ApiError(
                        400, "this bundle ships no tokenizer.json: send token ids"
                    )
                item = await self._encode(item, "input")
            rows.append(item)
        try:
            check_rows(len(rows), self.max_request_rows)
        except BadParameter as exc:
            raise openai_api.ApiError(400, str(exc), "input") from None
        longest = max(len(r) for r in rows)
        limit = self.config.max_sequence
        if limit and longest > limit:
            raise openai_api.ApiError(
                400, f"an input of {longest} tokens exceeds the exported maximum {limit}", "input"
            )
        ids = np.zeros((len(rows), longest), np.int64)
        mask = np.zeros((len(rows), longest), np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        names = {i.name for i in self.session.get_inputs()}
        if "token_type_ids" in names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        try:
            for name, array in feeds.items():
                check_bounds(name, array, self.bounds.get(name))
        except BadRequest as exc:
            raise openai_api.ApiError(400, str(exc), "input") from None
        key = tuple(sorted((n, v.shape[1:], str(v.dtype)) for n, v in feeds.items()))
        output = self.config.embedding_output
        assert output is not None, "openai_embeddings serves embedding tasks only"
        out = await self.batcher.submit(key, feeds)
        return out[output], int(mask.sum())

    async def _openai(self, request: Request, kind: str) -> Response:
        try:
            if self.serving != "generate":
                raise openai_api.ApiError(
                    404, f"{self.task} does not generate; see /v2 or /v1/embeddings"
                )
            body = await _json_body(request)
            defaults = dict(self.config.sampling_defaults)
            if kind == "chat":
                call, messages = openai_api.chat(body, self.name, defaults)
                if self.text is None:
                    raise openai_api.ApiError(
                        400, "this bundle ships no tokenizer: chat needs text"
                    )
                try:  # off the event loop, limited in size, time and memory (text.py)
                    rendered = await asyncio.to_thread(
                        self.text.chat, messages, self._context_tokens
                    )
                except ValueError as exc:
                    raise openai_api.ApiError(400, str(exc), "messages") from None
                call.prompts = [await self._encode(rendered, "messages", special=False)]
            else:
                call = openai_api.completion(body, self.name, defaults)
            prompts = [await self._prompt_ids(p) for p in call.prompts]
            assert self.engine is not None
            if call.rest_of_context:  # a chat without max_tokens: the rest of the context
                room = max(1, self.engine.room(len(prompts[0])))
                call.params = call.params.model_copy(update={"max_tokens": room})
            try:
                self.engine.admit(prompts, call.params, self.max_request_rows)
            except BadParameter as exc:
                raise openai_api.ApiError(400, str(exc)) from None
        except openai_api.ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        decode = self.text.decode if self.text is not None else (lambda ids: "")
        if call.stream:
            return await self._openai_stream(call, rid, prompts[0], decode)
        try:
            results = await openai_api.unless_dropped(
                request.is_disconnected, self._generate_all(prompts, call.params)
            )
        except MLServerError as exc:
            error = openai_api.ApiError(getattr(exc, "status_code", 500), str(exc.args[0]))
            return JSONResponse(error.body(), status_code=error.status)
        if results is None:  # the client went away: its sequences were cancelled
            return Response(status_code=499)
        return JSONResponse(openai_api.response(call, rid, self.name, results, decode))

    async def _openai_stream(self, call: Any, rid: str, prompt: list[int], decode: Any) -> Response:
        events = self._events(prompt, call.params)
        try:  # admission errors (queue full, ...) are still an HTTP status, not an event
            first = await events.__anext__()
        except MLServerError as exc:
            error = openai_api.ApiError(getattr(exc, "status_code", 500), str(exc.args[0]))
            return JSONResponse(error.body(), status_code=error.status)

        async def body() -> AsyncIterator[str]:
            last = first
            try:
                yield openai_api.chunk(call, rid, self.name, first, decode, first=True)
                if not first.finish:
                    async for event in events:
                        last = event
                        yield openai_api.chunk(call, rid, self.name, event, decode)
                if call.include_usage:
                    yield openai_api.usage_chunk(call, rid, self.name, last)
                yield openai_api.DONE
            except MLServerError as exc:
                yield openai_api.sse(
                    openai_api.ApiError(getattr(exc, "status_code", 500), str(exc)).body()
                )
            finally:
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.text is None:
                raise openai_api.ApiError(
                    400, "this bundle ships no tokenizer: send token ids as the prompt", "prompt"
                )
            return await self._encode(prompt, "prompt")
        return list(prompt)

    async def _encode(self, text: str, field: str, special: bool = True) -> list[int]:
        """Token ids of a request's text: refused (400) before tokenizing when the context
        could not hold it, then tokenized off the event loop (Text.encode lets it run)."""
        assert self.text is not None
        try:
            self.text.fits(text, self._context_tokens, field)
        except ValueError as exc:
            raise openai_api.ApiError(400, str(exc), field) from None
        return cast(list[int], await asyncio.to_thread(self.text.encode, text, special))


# the engine's error kinds, as HTTP answers them
HTTP_STATUS = {"timeout": 504, "shutdown": 503, "internal": 500}


async def _json_body(request: Request) -> Any:
    """The body as JSON, or a 400: not JSON, nested deeper than the parser recurses, or
    holding a string that is not Unicode text (a lone surrogate, in a key or a value)."""
    try:
        body = json.loads(await request.body())
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer of 4,300+ digits
        raise openai_api.ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise openai_api.ApiError(400, "the request body is nested too deeply") from None
    where = _not_text(body)
    if where is not None:
        raise openai_api.ApiError(
            400, f"the request body's {where} holds a lone surrogate: not Unicode text"
        )
    return body


def _not_text(body: Any) -> str | None:
    """Where the first string that cannot be UTF-8 (a lone surrogate) is: `field 'x'`, a
    key, or None. Walked without recursion (a body may be nested deeply)."""
    todo: list[tuple[str, Any]] = [("body", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            strings = [value]
        elif isinstance(value, dict):
            strings = list(value)
            todo.extend((f"field {k!r}"[:80], v) for k, v in value.items())
        elif isinstance(value, list):
            strings = []
            todo.extend((where, v) for v in value)
        else:
            continue
        for text in strings:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return where if isinstance(value, str) else "a field name"
    return None
