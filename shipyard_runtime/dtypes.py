"""The tensor datatypes a served graph may take, one row per type in every spelling the
serving path meets: ONNX Runtime's (`tensor(float)`), numpy's (`float32`, the spelling of
`ModelInfo`), the Open Inference Protocol's (`FP32`), Triton's model config (`TYPE_FP32`) and
the little-endian wire layout of the V2 binary extension (`<f4`).

Every table the runtime, the configs and the load generator use is derived from `TYPES`;
the front door (`front_door.py`, shipped alone as `shipyard_serve.py`) keeps a copy that a
test holds equal to it. bfloat16 has no numpy type: Triton's config can name it, but the
paths that decode request data into numpy cannot.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    onnx: str
    numpy: str
    v2: str
    triton: str
    wire: str | None  # None: numpy has no such type
    integer: bool = False


TYPES: tuple[DType, ...] = (
    DType("tensor(bool)", "bool", "BOOL", "TYPE_BOOL", "?"),
    DType("tensor(uint8)", "uint8", "UINT8", "TYPE_UINT8", "u1", integer=True),
    DType("tensor(uint16)", "uint16", "UINT16", "TYPE_UINT16", "<u2", integer=True),
    DType("tensor(uint32)", "uint32", "UINT32", "TYPE_UINT32", "<u4", integer=True),
    DType("tensor(uint64)", "uint64", "UINT64", "TYPE_UINT64", "<u8", integer=True),
    DType("tensor(int8)", "int8", "INT8", "TYPE_INT8", "i1", integer=True),
    DType("tensor(int16)", "int16", "INT16", "TYPE_INT16", "<i2", integer=True),
    DType("tensor(int32)", "int32", "INT32", "TYPE_INT32", "<i4", integer=True),
    DType("tensor(int64)", "int64", "INT64", "TYPE_INT64", "<i8", integer=True),
    DType("tensor(float16)", "float16", "FP16", "TYPE_FP16", "<f2"),
    DType("tensor(float)", "float32", "FP32", "TYPE_FP32", "<f4"),
    DType("tensor(double)", "float64", "FP64", "TYPE_FP64", "<f8"),
    DType("tensor(bfloat16)", "bfloat16", "BF16", "TYPE_BF16", None),
)
_DECODABLE = tuple(t for t in TYPES if t.wire is not None)

# V2 datatype of an ONNX Runtime tensor type, for the types a request can carry as numbers
V2_OF_ONNX: dict[str, str] = {t.onnx: t.v2 for t in _DECODABLE}
# V2 datatype of a numpy dtype name (what a client sends for an array)
V2_OF_NUMPY: dict[str, str] = {t.numpy: t.v2 for t in _DECODABLE}
# Triton model-config data_type of a ModelInfo dtype
TRITON_OF_NUMPY: dict[str, str] = {t.numpy: t.triton for t in TYPES}
# numpy dtype of a V2 datatype's binary data (little-endian, as the extension sends it)
WIRE_OF_V2: dict[str, str] = {t.v2: t.wire for t in _DECODABLE if t.wire is not None}
INTEGER_V2: frozenset[str] = frozenset(t.v2 for t in TYPES if t.integer)
