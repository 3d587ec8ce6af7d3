"""Triton python-backend entry of a generating bundle: a decoupled model that generates with
the same engine as the MLServer runtime (`shipyard_runtime.generation`, shipped beside this
file as `shipyard_runtime/`).

The bundle ships it as `serving/triton/<release>-generate/1/model.py`; `config.pbtxt`
carries the typed RuntimeSettings (`parameters.runtime`, JSON, paths relative to the version
folder) and the ONNX model's path (`parameters.model`: the onnxruntime entry's copy, so the
model is stored once). Triton runs this file in its python-backend stub, which uses the
system Python and ignores PYTHONPATH: `SHIPYARD_SITE_PACKAGES` (os.pathsep-separated, first
wins) names the folders holding numpy, onnxruntime, pydantic, tokenizers and jinja2.

One request is one sequence. Inputs (all optional but one prompt):
- `text_input` BYTES [1] (needs the shipped tokenizer) or `input_ids` INT64 [n];
- `sampling_parameters` BYTES [1]: a JSON object of the engine's parameters (`max_tokens`
  or `max_new_tokens`, `temperature` (default 0: greedy), `top_k`, `top_p`,
  `repetition_penalty`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`); unknown ones are
  refused;
- `stream` BOOL [1] (default true): one response per token; false: one response at the end.
Outputs: `output_ids` INT64 [n], `text_output` BYTES [1] (with a tokenizer),
`finish_reason` BYTES [1] (on the last response: stop, length, abort).
A bad request gets an INVALID_ARG error, a full queue UNAVAILABLE; a cancelled request
leaves the running batch at the next step.

Every request needs `authorization: Bearer <token>` (HTTP header or gRPC metadata), which
the server forwards as a request parameter (`stages/loadtesting/triton_server.py` starts it
so); the token is read at load from the file `SHIPYARD_API_TOKEN_FILE` names. Without one
(and without the launcher's --no-auth) the model does not load: it never answers unchecked.
A request without the right token gets INVALID_ARG "a valid API token is required" (the
python backend has no UNAUTHENTICATED) before anything of it is read.
"""

from __future__ import annotations

import hmac
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any


def _environment() -> None:
    sys.dont_write_bytecode = True  # a bundle stays as signed: no __pycache__ beside this
    # Triton's stub appends this folder to sys.path: moved first, so the entry's own copy of
    # shipyard_runtime wins over any other on the path (initialize() checks it did)
    here = str(Path(__file__).absolute().parent)
    extra = [p for p in os.environ.get("SHIPYARD_SITE_PACKAGES", "").split(os.pathsep) if p]
    first = [here, *(p for p in extra if p != here)]
    sys.path[:] = [*first, *(p for p in sys.path if p not in first)]


_environment()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # noqa: E402

from shipyard_runtime.generation.core import Engine  # noqa: E402
from shipyard_runtime.generation.params import BadParameter, parse_tensor_request  # noqa: E402
from shipyard_runtime.generation.runner import Graph  # noqa: E402
from shipyard_runtime.generation.scheduler import QueueFull as EngineQueueFull  # noqa: E402
from shipyard_runtime.generation.text import Text  # noqa: E402
from shipyard_runtime.metrics import for_triton  # noqa: E402
from shipyard_runtime.origin import foreign_runtime  # noqa: E402
from shipyard_runtime.session import session_from  # noqa: E402
from shipyard_runtime.settings import RuntimeSettings  # noqa: E402

INPUTS = ("text_input", "input_ids", "sampling_parameters", "stream")


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "this model streams one response per token: config.pbtxt needs "
                "model_transaction_policy { decoupled: true }"
            )
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        try:
            settings = RuntimeSettings.model_validate_json(parameters["runtime"])
        except (KeyError, ValueError) as exc:
            raise pb_utils.TritonModelException(
                f"config.pbtxt parameters.runtime is not the engine's settings: {exc}"
            ) from None
        if settings.engine is None:
            raise pb_utils.TritonModelException("parameters.runtime has no engine settings")
        here = Path(args["model_repository"]) / args["model_version"]
        problem = foreign_runtime(here)
        if problem:
            raise pb_utils.TritonModelException(problem)
        session_config = json.loads((here / settings.ort_session).read_text(encoding="utf-8"))
        session = session_from(here / parameters["model"], session_config)
        self.token = _token()
        self.settings = settings
        self.text = Text(here / settings.text) if settings.text else None
        # the engine's series on Triton's metrics port, with the names and labels an
        # MLServer bundle exports (the dashboard and the alerts read either)
        metrics = for_triton(args["model_name"], pb_utils)
        self.engine = Engine(Graph(session), settings.engine, self.text, metrics=metrics)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._start(request)
        return None  # decoupled: every response goes through the request's sender

    def finalize(self) -> None:
        self.engine.close()
        if self.text is not None:
            self.text.close()

    # ------------------------------------------------------------------ one request
    def _start(self, request: Any) -> None:
        sender = request.get_response_sender()
        if self.token is not None and not _authorized(request, self.token):
            _fail(
                sender,
                "a valid API token is required: send 'authorization: Bearer <token>'",
                pb_utils.TritonError.INVALID_ARG,
            )
            return
        try:
            prompt, params, stream = self._arguments(request)
            call = _Call(sender, stream, self.text is not None)
            call.handle = self.engine.submit(prompt, params, call.emit)
        except BadParameter as exc:
            _fail(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
        except EngineQueueFull as exc:
            _fail(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
        except Exception as exc:  # never leave a request without its final response
            _fail(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
        else:
            call.started.set()

    def _arguments(self, request: Any) -> tuple[list[int], Any, bool]:
        tensors = {
            name: t.as_numpy()
            for name in INPUTS
            if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None
        }
        if ("text_input" in tensors) == ("input_ids" in tensors):
            raise BadParameter("send exactly one of text_input (BYTES) or input_ids")
        if "input_ids" in tensors:
            ids = tensors["input_ids"]
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                raise BadParameter(
                    f"input_ids must be INT64 [n]; got {ids.dtype} {list(ids.shape)}"
                )
            prompt = [int(i) for i in ids]
        else:
            if self.text is None:
                raise BadParameter("this bundle ships no tokenizer.json: send input_ids")
            text = _one_string(tensors["text_input"], "text_input")
            try:  # refused before tokenizing when the served context could not hold it
                self.text.fits(text, self.engine.settings.max_context, "text_input")
            except ValueError as exc:
                raise BadParameter(str(exc)) from None
            prompt = self.text.encode(text)
        given: Any = {}
        if "sampling_parameters" in tensors:
            raw = _one_string(tensors["sampling_parameters"], "sampling_parameters")
            try:
                given = json.loads(raw)
            except ValueError as exc:  # not JSON, or an integer of 4,300+ digits
                raise BadParameter(f"sampling_parameters is not JSON: {exc}") from None
            except RecursionError:
                raise BadParameter("sampling_parameters is nested too deeply") from None
            if not isinstance(given, dict):
                raise BadParameter("sampling_parameters must be a JSON object")
        params = parse_tensor_request(given, dict(self.settings.sampling_defaults))
        self.engine.admit([prompt], params, 1)  # one sequence a Triton request
        stream = True
        if "stream" in tensors:
            flag = tensors["stream"]
            if flag.dtype != np.bool_ or flag.size != 1:
                raise BadParameter("stream must be BOOL [1]")
            stream = bool(flag.reshape(-1)[0])
        return prompt, params, stream


class _Call:
    """One sequence's responses: sent from the engine's thread as its events come."""

    def __init__(self, sender: Any, stream: bool, with_text: bool) -> None:
        self.sender, self.stream, self.with_text = sender, stream, with_text
        self.handle: Any = None
        self.started = threading.Event()  # submit() returned: the handle is set
        self.ids: list[int] = []
        self.text: list[str] = []

    def emit(self, event: Any) -> None:
        if event.error:
            _fail(self.sender, event.error, _kind_code(event.kind))
            return
        if self.sender.is_cancelled() and not event.finish:
            self.started.wait()
            self.handle.cancel()  # the engine answers with finish "abort", sent as final
            pb_utils.Logger.log_info("a request was cancelled: it leaves the batch")
            return
        if event.token is not None:
            self.ids.append(event.token)
        self.text.append(event.text)
        if self.stream:
            tokens = [event.token] if event.token is not None else []
            self._send(tokens, event.text, event.finish)
        elif event.finish:
            self._send(self.ids, "".join(self.text), event.finish)

    def _send(self, ids: list[int], text: str, finish: str | None) -> None:
        outputs = [pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int64))]
        if self.with_text:
            outputs.append(pb_utils.Tensor("text_output", np.array([text.encode()], object)))
        if finish:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([finish.encode()], object)))
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if finish else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)


def _token() -> bytes | None:
    """The API token from the file the launcher wrote, or None under its --no-auth; a model
    started any other way refuses to load rather than answer anyone."""
    if os.environ.get("SHIPYARD_TRITON_NO_AUTH") == "1":
        return None
    file = os.environ.get("SHIPYARD_API_TOKEN_FILE")
    token = b""
    if file:
        try:
            token = Path(file).read_bytes().strip()
        except OSError as exc:
            raise pb_utils.TritonModelException(f"SHIPYARD_API_TOKEN_FILE={file}: {exc}") from None
    if len(token) < 16:
        raise pb_utils.TritonModelException(
            "no API token for this model: start the server with `python -m "
            "stages.loadtesting.triton_server` and SHIPYARD_API_TOKEN set (or --no-auth)"
        )
    return token


def _authorized(request: Any, token: bytes) -> bool:
    """The forwarded `authorization` parameter (any case) is `Bearer <token>`."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError:
        return False
    given = [v for k, v in parameters.items() if k.lower() == "authorization"]
    if len(given) != 1 or not isinstance(given[0], str):
        return False
    scheme, _, value = given[0].partition(" ")
    try:
        raw = value.strip().encode("ascii")
    except UnicodeEncodeError:
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(raw, token)


def _one_string(array: Any, name: str) -> str:
    if array.dtype != np.object_ or array.size != 1:
        raise BadParameter(f"{name} must be BYTES [1]")
    value = array.reshape(-1)[0]
    try:
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise BadParameter(f"{name} must be UTF-8") from None
    if not text:
        raise BadParameter(f"{name} is empty")
    return text


def _kind_code(kind: str | None) -> Any:
    """The engine's error kind as Triton reports it."""
    return _code({"timeout": 504, "shutdown": 503}.get(kind or "", 500))


def _code(status: int) -> Any:
    return {
        400: pb_utils.TritonError.INVALID_ARG,
        503: pb_utils.TritonError.UNAVAILABLE,
        504: pb_utils.TritonError.UNAVAILABLE,
    }.get(status, pb_utils.TritonError.INTERNAL)


def _fail(sender: Any, message: str, code: Any) -> None:
    sender.send(
        pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
