"""CUDA-graph capture and replay of a TensorRT engine (cuda-python), per batch size.

Each batch size: one plain `execute_async_v3` (which also finishes TensorRT's
shape-dependent setup, as capture requires), then capture of the same call into a graph.
The outputs are zeroed before the replays so a graph that did nothing cannot "match".
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from schemas import Refused
from schemas.artifacts import CudaGraphRow
from schemas.spec.parity import ParityConfig, Tolerance

REPLAYS = 50


def cuda_graph_check(
    plan: bytes, profiles: list[dict[str, Any]], batch_sizes: list[int]
) -> list[CudaGraphRow]:
    """One row per batch size: replay matches plain execution; latency of both in ms."""
    import tensorrt as trt

    engine = deserialize(trt, plan)
    rows = []
    for batch in batch_sizes:
        index = next(
            i
            for i, p in enumerate(profiles)
            if p["dims"]["batch"]["min"] <= batch <= p["dims"]["batch"]["max"]
        )
        shapes = {n: [batch, *s["opt"][1:]] for n, s in profiles[index]["shapes"].items()}
        with _Bindings(engine, index, shapes) as b:
            rows.append(_compare(batch, *b.plain_and_graph()))
    return rows


# A replay runs the very kernels of the plain execution: only float reassociation may differ.
# The comparator's settings as the spec's model (validated, and what compare_outputs takes).
REPLAY = ParityConfig(
    tolerance=Tolerance(atol=1e-6, rtol=1e-5, scale="none"),
    outputs={},
    statistic="max",
    quantile=0.99,
)


def deserialize(trt: Any, plan: bytes) -> Any:
    """The engine, with host code allowed (a version-compatible engine carries its own
    runtime code; without the flag TensorRT returns None); None is an error, not a crash."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    if hasattr(runtime, "engine_host_code_allowed"):
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise Refused(
            "TensorRT could not deserialize the engine it just built for the CUDA-graph check",
            "read the TensorRT log above (a version-compatible engine needs host code allowed)",
        )
    return engine


def _compare(
    batch: int, plain_ms: float, graph_ms: float, plain: dict[str, Any], replay: dict[str, Any]
) -> CudaGraphRow:
    from stages.onnx.compare import compare_outputs

    results = compare_outputs(plain, replay, REPLAY)
    ok = all(r.ok for r in results)
    worst = max((r.max_abs for r in results), default=0.0)
    speedup = plain_ms / graph_ms if graph_ms > 0 else float("inf")
    why = (
        f"batch {batch}: graph replay {'matches' if ok else 'DIFFERS from'} plain execution "
        f"(max |diff| {worst:.3g}); {plain_ms:.3f} ms plain, {graph_ms:.3f} ms graph, "
        f"{speedup:.2f}x"
    )
    return CudaGraphRow(
        batch=batch, ok=ok, plain_ms=plain_ms, graph_ms=graph_ms, speedup=speedup, why=why
    )


def _check(ok: Any, what: str) -> None:
    """TensorRT's context calls return False on failure instead of raising."""
    if ok is False:
        raise Refused(f"{what} returned False", "read the TensorRT log above")


class _Bindings:
    """Device buffers for every I/O tensor of one execution context; freed on exit."""

    def __init__(self, engine: Any, profile: int, shapes: dict[str, list[int]]) -> None:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart

        self.cudart = cudart
        self.stream = _ok(cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.context = engine.create_execution_context()
        if self.context is None:
            raise Refused("create_execution_context returned None", "check memory")
        _check(
            self.context.set_optimization_profile_async(profile, int(self.stream)),
            f"set_optimization_profile_async({profile})",
        )
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        for n in names:
            if is_input[n]:
                _check(self.context.set_input_shape(n, shapes[n]), f"set_input_shape({n})")
        self.outputs = [n for n in names if not is_input[n]]
        self.buffers: dict[str, tuple[int, np.ndarray]] = {}
        rng = np.random.default_rng(0)
        for n in names:
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(n)))
            host = np.zeros(tuple(self.context.get_tensor_shape(n)), dtype=dtype)
            if is_input[n]:
                host[...] = 1 if dtype.kind in "iub" else rng.standard_normal(host.shape)
            ptr = _ok(cudart.cudaMalloc(max(host.nbytes, 1)), "cudaMalloc")
            self.buffers[n] = (ptr, host)
            self.context.set_tensor_address(n, ptr)
            if is_input[n]:
                kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
                _ok(cudart.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, kind), "cudaMemcpy")

    def __enter__(self) -> _Bindings:
        return self

    def __exit__(self, *exc: object) -> None:
        for ptr, _ in self.buffers.values():
            self.cudart.cudaFree(ptr)
        self.cudart.cudaStreamDestroy(self.stream)

    def plain_and_graph(self) -> tuple[float, float, dict[str, Any], dict[str, Any]]:
        cudart, stream = self.cudart, self.stream
        plain_ms, plain = self._timed(
            lambda: _check(self.context.execute_async_v3(int(stream)), "execute_async_v3")
        )
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        _ok(cudart.cudaStreamBeginCapture(stream, mode), "cudaStreamBeginCapture")
        captured = self.context.execute_async_v3(int(stream))
        if captured is False:
            cudart.cudaStreamEndCapture(stream)  # leave the stream usable, then report
            _check(captured, "execute_async_v3 during graph capture")
        graph = _ok(cudart.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
        exec_graph = _ok(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        for n in self.outputs:
            ptr, host = self.buffers[n]
            _ok(cudart.cudaMemset(ptr, 0, host.nbytes), "cudaMemset")
        graph_ms, replay = self._timed(lambda: cudart.cudaGraphLaunch(exec_graph, stream))
        cudart.cudaGraphExecDestroy(exec_graph)
        cudart.cudaGraphDestroy(graph)
        return plain_ms, graph_ms, plain, replay

    def _timed(self, launch: Any) -> tuple[float, dict[str, np.ndarray]]:
        cudart = self.cudart
        launch()
        _ok(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        start = time.perf_counter()
        for _ in range(REPLAYS):
            launch()
        _ok(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        ms = (time.perf_counter() - start) * 1000 / REPLAYS
        outputs = {}
        for n in self.outputs:
            ptr, host = self.buffers[n]
            out = np.empty_like(host)
            kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
            _ok(cudart.cudaMemcpy(out.ctypes.data, ptr, out.nbytes, kind), "cudaMemcpy")
            outputs[n] = out.astype(np.float64)
        return ms, outputs


def _ok(result: tuple[Any, ...], what: str) -> Any:
    """cuda-python returns (err, *values): raise on an error, else the value(s)."""
    from cuda.bindings import runtime as cudart

    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        raise Refused(f"{what} failed: {err}", "check the CUDA driver and device")
    return values[0] if len(values) == 1 else (values or None)
