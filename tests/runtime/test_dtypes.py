"""One table of tensor datatypes (shipyard_runtime/dtypes.py): each row's spellings name
the same type, and the copy the front door ships with (it ships alone) is the table's."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from shipyard_runtime import dtypes, front_door
from shipyard_runtime.dtypes import TYPES
from stages.serving import configs


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.v2)
def test_each_row_spells_one_type(t: dtypes.DType) -> None:
    if t.wire is None:  # bfloat16: no numpy type, ONNX has its own
        proto = TensorProto.BFLOAT16
    else:
        assert np.dtype(t.wire).name == t.numpy
        assert np.dtype(t.wire).itemsize == 1 or np.dtype(t.wire).byteorder in "<="
        proto = helper.np_dtype_to_tensor_dtype(np.dtype(t.numpy))
    assert t.onnx == f"tensor({TensorProto.DataType.Name(proto).lower()})"  # ORT's spelling
    assert t.triton == f"TYPE_{t.v2}"
    assert t.integer == (t.wire is not None and np.issubdtype(np.dtype(t.wire), np.integer))


def test_the_front_doors_copy_is_the_table() -> None:
    assert front_door.NUMPY == dtypes.WIRE_OF_V2


def test_every_type_a_graph_may_declare_has_a_triton_type() -> None:
    """A ModelInfo dtype with no Triton spelling used to be a KeyError at render time (the
    config's table lacked float64 and int16, which the runtime accepted)."""
    assert set(dtypes.TRITON_OF_NUMPY) == {t.numpy for t in TYPES}
    assert {"float64", "int16"} <= set(dtypes.TRITON_OF_NUMPY)
    assert configs.TRITON_OF_NUMPY is dtypes.TRITON_OF_NUMPY
