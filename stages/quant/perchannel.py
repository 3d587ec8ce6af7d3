"""Per-channel weight quantization for onnxruntime's dynamic quantizer, in whole-array numpy.

onnxruntime 1.32's `quantize_weight_per_channel_impl` quantizes a weight one output channel
at a time in Python (`quantize_data` per channel, ~50 us of overhead each): 411,554 calls
and 25 s of a 141 s recipe search on a 30-layer decoder with a 50k vocabulary, most of it
on the LM head's 50,257 columns, for two recipes. `vectorized()` computes the same scales,
zero points and integers for every channel at once and writes the same initializers. The
arithmetic follows onnxruntime's own steps and dtypes (range widened to include zero,
symmetric absmax, the scale's float64 quotient stored as float32, the tiny-scale fallback,
division in float32, round half to even, clip to the type's full range), and
tests/stages/test_quant_perchannel.py holds it bit for bit against onnxruntime's loop on
weights built to hit every branch. What it does not cover (per-channel overrides, a
minimum real range, other integer widths) goes to onnxruntime's own loop unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

FAST_TYPES = ("INT8", "UINT8")  # onnx.TensorProto names this path computes


@contextlib.contextmanager
def vectorized() -> Iterator[None]:
    """onnxruntime's ONNXQuantizer quantizes per-channel weights with `_per_channel` while
    the block runs (the class attribute is restored after, even on an error)."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer

    original = ONNXQuantizer.quantize_weight_per_channel_impl

    def impl(
        self: Any,
        weight_name: str,
        weight_qType: int,  # noqa: N803 (onnxruntime's argument name)
        channel_axis: int,
        reduce_range: bool = True,
        keep_float_weight: bool = False,
    ) -> tuple[str, str, str]:
        done = _per_channel(self, weight_name, weight_qType, channel_axis, reduce_range)
        if done is None or keep_float_weight:
            return original(  # type: ignore[no-any-return]
                self, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight
            )
        return done

    ONNXQuantizer.quantize_weight_per_channel_impl = impl
    try:
        yield
    finally:
        ONNXQuantizer.quantize_weight_per_channel_impl = original


def _per_channel(
    quantizer: Any, weight_name: str, qtype: int, axis: int, reduce_range: bool
) -> tuple[str, str, str] | None:
    """The weight's per-channel quantization added to the quantizer's model as onnxruntime
    adds it; None where this path does not apply (onnxruntime's loop then runs)."""
    import onnx
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import (
        TENSOR_NAME_QUANT_SUFFIX,
        find_by_name,
        get_qmin_qmax_for_qType,
        tensor_proto_to_array,
    )

    if qtype not in tuple(getattr(TensorProto, t) for t in FAST_TYPES):
        return None
    if quantizer.min_real_range is not None or quantizer.tensor_quant_overrides.get(weight_name):
        return None
    initializer = find_by_name(weight_name, quantizer.model.initializer())
    if initializer is None:
        return None
    weights = tensor_proto_to_array(initializer)
    if weights.dtype != np.float32 or not weights.size or not -weights.ndim <= axis < weights.ndim:
        return None
    axis %= weights.ndim
    symmetric = bool(quantizer.is_weight_symmetric(qtype))
    qmin, qmax = get_qmin_qmax_for_qType(qtype, quantizer.reduce_range and reduce_range, symmetric)
    scale, zero = scales(weights, axis, qmin, qmax, symmetric)
    # quantize_nparray: clipped to the type's full range, whatever the scale's range was
    low, high = get_qmin_qmax_for_qType(qtype, reduce_range=False, symmetric=False)
    shape = [1] * weights.ndim
    shape[axis] = weights.shape[axis]
    q = (weights / scale.reshape(shape)).round() + zero.reshape(shape)
    np.clip(q, low, high, out=q)
    quantized = q.astype(onnx.helper.tensor_dtype_to_np_dtype(qtype))

    q_name = weight_name + TENSOR_NAME_QUANT_SUFFIX
    zp_name, scale_name = weight_name + "_zero_point", weight_name + "_scale"
    dims = [initializer.dims[axis]]
    quantizer.model.initializer_extend(
        [
            onnx.helper.make_tensor(scale_name, initializer.data_type, dims, scale.tolist()),
            onnx.helper.make_tensor(zp_name, qtype, dims, zero.tolist()),
            onnx.numpy_helper.from_array(quantized.reshape(tuple(initializer.dims)), q_name),
        ]
    )
    return q_name, zp_name, scale_name


def scales(
    weights: np.ndarray, axis: int, qmin: np.ndarray, qmax: np.ndarray, symmetric: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each channel's (scale as float32, zero point in qmin's dtype), as onnxruntime's
    compute_scale_zp computes them for that channel alone."""
    others = tuple(i for i in range(weights.ndim) if i != axis)
    rmin = np.minimum(weights.min(axis=others), np.float32(0))
    rmax = np.maximum(weights.max(axis=others), np.float32(0))
    if symmetric:
        rmax = np.maximum(np.abs(rmin), np.abs(rmax))
        rmin = -rmax
    wide = (rmax.astype(np.float64) - rmin.astype(np.float64)) / (
        np.float64(qmax) - np.float64(qmin)
    )
    tiny = wide < np.finfo(np.float32).tiny  # onnxruntime's fallback: scale 1, zero point 0
    if symmetric:
        zero = np.full(rmin.shape, np.round((qmin + qmax) / np.float64(2.0)))
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.round(qmin - rmin / np.where(tiny, 1.0, wide))
    zero = np.where(tiny, 0, zero).astype(qmin.dtype)
    scale = np.where(tiny, np.float32(1.0), wide.astype(np.float32)).astype(np.float32)
    return scale, zero
