"""MLServer runtime for a Shipyard bundle: ONNX Runtime behind the Open Inference Protocol.

The bundle ships this file next to `model-settings.json`; MLServer imports it from there
(`implementation: shipyard_runtime.ShipyardOnnxRuntime`). It needs only mlserver,
onnxruntime and numpy.

- every task: `infer` feeds the request's tensors by name and returns every graph output;
  a label task (sequence/token classification, `serving: labels`) adds `label` (BYTES, the
  top class's name from the model's id2label) and `score` (FP32, its softmax probability).
- Concurrent `infer` requests are batched by the runtime itself (see Batcher), not by
  MLServer's adaptive batching, which would merge incompatible requests.
- a generating task (causal-lm, `serving: generate`): `infer` takes `input_ids` INT64
  [batch, prompt] and the request parameter `max_new_tokens` (default 1) and returns
  `output_ids` INT64 [batch, max_new_tokens] by greedy decoding with the KV-cache graph
  (prefill runs on the same graph with an empty past). `infer_stream` / `generate_stream`
  yield one response per decoded token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, Parameters, ResponseOutput
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


class QueueFull(MLServerError):
    """Triton's REJECT policy: a full queue answers at once instead of growing."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=503)


class TimedOut(MLServerError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=504)


# Open Inference Protocol datatypes of the ONNX tensor types a graph may take.
V2_TYPES = {
    "tensor(float)": "FP32",
    "tensor(float16)": "FP16",
    "tensor(double)": "FP64",
    "tensor(int64)": "INT64",
    "tensor(int32)": "INT32",
    "tensor(int16)": "INT16",
    "tensor(int8)": "INT8",
    "tensor(uint8)": "UINT8",
    "tensor(bool)": "BOOL",
}
INTEGER_TYPES = {"INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32", "UINT64"}
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
    return array


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


def positions_from_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """Position ids of the last `width` tokens of a [batch, total] mask, as transformers'
    generate derives them (cumsum of the mask - 1; padding at 0, masked out): a row
    left-padded by 3 numbers its first real token 0, not 3."""
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0) * (mask != 0)
    return positions[:, positions.shape[-1] - width :].astype(np.int64)


class Decoder:
    """Greedy decoding with a KV-cache graph: inputs input_ids, attention_mask, past_*."""

    def __init__(self, session: ort.InferenceSession, max_context: int) -> None:
        self.session = session
        self.max_context = max_context
        self.past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.present = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
        self.float = np.float16 if "float16" in (self.past[0].type if self.past else "") else None
        self.positions = any(i.name == "position_ids" for i in session.get_inputs())
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
            mask = np.ones((batch, total), dtype=np.int64)
            feeds["attention_mask"] = mask
            if self.positions:
                feeds["position_ids"] = positions_from_mask(mask, feeds["input_ids"].shape[1])
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

    Limits, as Triton's queue policy: at most `max_queue` requests wait (more are refused at
    once with 503 "queue full"), and a request not answered within `timeout` seconds gets
    504 and leaves the queue. Streams take an instance too (`instance()`).
    """

    def __init__(
        self,
        run: Any,
        max_rows: int,
        delay: float,
        instances: int = 1,
        max_queue: int = 0,
        timeout: float = 0.0,
    ) -> None:
        self.run, self.max_rows, self.delay = run, max_rows, delay
        self.pending: dict[Any, list[tuple[dict[str, np.ndarray], asyncio.Future[Any]]]] = {}
        self.due: set[Any] = set()
        self.instances = instances
        self.max_queue, self.timeout = max_queue, timeout
        self.waiting = 0  # requests queued, not yet running (streams included)
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
        self._admit()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        future.add_done_callback(_consume)
        queue = self.pending.setdefault(key, [])
        queue.append((arrays, future))
        self.waiting += 1
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
            raise TimedOut(
                f"request timed out after {self.timeout:g} s (request_timeout_seconds)"
            ) from None
        return result

    @contextlib.asynccontextmanager
    async def instance(self) -> AsyncIterator[None]:
        """One model instance for a stream: counted in the queue while it waits."""
        self._admit()
        self.waiting += 1
        try:
            await asyncio.wait_for(self._semaphore().acquire(), self.timeout or None)
        except TimeoutError:
            raise TimedOut(
                f"no model instance free within {self.timeout:g} s (request_timeout_seconds)"
            ) from None
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._semaphore().release()

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
            if rest:  # the next batch of this key, on the next free instance
                self.pending[key] = rest
                self._make_due(key)
            if queue:
                await self._execute(key, queue)

    async def _execute(self, key: Any, queue: list[Any]) -> None:
        """Merge, run, split: any failure (the merge included) answers every request of the
        batch at once, instead of leaving them to their timeout."""
        try:
            rows = [_rows([item]) for item in queue]
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


class ShipyardOnnxRuntime(MLModel):
    """Loads the bundle's ONNX model; parameters.extra carries task and session config."""

    async def load(self) -> bool:
        extra = dict(self.settings.parameters.extra or {}) if self.settings.parameters else {}
        model_path = Path(await get_model_uri(self.settings))
        folder = Path(self.settings._source or ".").parent
        config_file = extra.get("ort_session")
        config = json.loads((folder / config_file).read_text()) if config_file else {}
        self.task = extra.get("task", "generic")
        self.serving = extra.get("serving", "tensors")  # generate | labels | tensors
        self.labels = [str(x) for x in extra.get("labels") or []]
        self.bounds = {
            str(k): (int(v[0]), int(v[1])) for k, v in (extra.get("input_bounds") or {}).items()
        }
        self.session = session_from(model_path, config)
        if self.serving == "generate":
            self.decoder = Decoder(self.session, int(extra.get("max_context_length", 1 << 30)))
        self.max_request_rows = int(extra.get("max_batch_rows", 1))  # the served batch
        self.limits = {k: int(extra.get(k, 0)) for k in ("max_prompt_tokens", "max_past_tokens")}
        rows = self.max_request_rows if extra.get("dynamic_batching") else 1
        delay = float(extra.get("max_batch_delay_s", 0))
        instances = int(extra.get("instance_count", 1))
        self.batcher = Batcher(
            self._run_batch,
            rows,
            delay,
            instances,
            max_queue=int(extra.get("max_queue_depth", 0)),
            timeout=float(extra.get("request_timeout_seconds", 0)),
        )
        self.ready = True
        return self.ready

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if self.serving != "generate":
            feeds = self._graph_inputs(payload)
            key = tuple(sorted((n, v.shape[1:], str(v.dtype)) for n, v in feeds.items()))
            return self._response(await self.batcher.submit(key, feeds))
        input_ids, new_tokens = self._generation_args(payload)
        generation = (input_ids.shape[1], new_tokens)
        return self._response(await self.batcher.submit(generation, {"input_ids": input_ids}))

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
        batch = batches.pop()
        if not 1 <= batch <= self.max_request_rows:
            raise BadRequest(
                f"batch {batch} is outside [1, {self.max_request_rows}] (the served max_batch_size)"
            )
        return feeds

    def _run_batch(self, key: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch in a worker thread: greedy generation, or one pass of the graph."""
        if self.serving == "generate":
            steps = self.decoder.steps(feeds["input_ids"], key[1])
            return {"output_ids": np.concatenate(list(steps), axis=1)}
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feeds), strict=True))
        if self.serving == "labels":
            out.update(label_scores(out[names[0]], self.labels))
        return out

    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        if self.serving != "generate":
            raise BadRequest(f"streaming is only served for generating tasks, not {self.task}")
        payload = await payloads.__anext__()
        try:
            input_ids, new_tokens = self._generation_args(payload)
        except BadRequest as exc:
            # MLServer 1.7.1 has committed the stream's response before this generator
            # runs, so a raised error can only become a bare 500: say why in-band instead,
            # as one event carrying the error and its status, and no tokens.
            yield InferenceResponse(
                model_name=self.name,
                model_version=self.version,
                outputs=[],
                parameters=Parameters(error=exc.args[0] if exc.args else str(exc), status_code=400),
            )
            return
        async with self.batcher.instance():  # a stream holds a model instance throughout
            steps = self.decoder.steps(input_ids, new_tokens)
            while (token := await asyncio.to_thread(next, steps, None)) is not None:
                yield self._response({"output_ids": token})

    def _generation_args(self, payload: InferenceRequest) -> tuple[np.ndarray, int]:
        names = [i.name for i in payload.inputs]
        if names != ["input_ids"]:
            raise BadRequest(f"{self.task} expects exactly one input 'input_ids'; got {names}")
        inp = payload.inputs[0]
        if inp.datatype not in ("INT64", "INT32"):
            raise BadRequest(f"input_ids must be INT64 (or INT32); got {inp.datatype}")
        input_ids = decode(inp).astype(np.int64)
        if input_ids.ndim != 2:
            raise BadRequest(
                f"input_ids must be [batch, prompt]; got shape {list(input_ids.shape)}"
            )
        extra = (payload.parameters.model_extra if payload.parameters else None) or {}
        new_tokens = extra.get("max_new_tokens", 1)
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int):
            raise BadRequest(f"max_new_tokens must be an integer; got {new_tokens!r:.40}")
        if new_tokens < 1:
            raise BadRequest("max_new_tokens must be at least 1")
        batch, prompt = input_ids.shape
        if batch < 1 or prompt < 1:
            raise BadRequest(
                f"input_ids shape {[batch, prompt]}: send at least one row of one token"
            )
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
