"""Writing an ONNX model without its weights in memory (issue 14: peak memory).

The export stage's raw graph keeps every weight in an external data file. From there the
shipped graph is written one tensor at a time: to its own external data file, or inline,
by writing the protobuf encoding of the model around the weights' bytes. Protobuf encodes
a message as its fields in field-number order, so the bytes equal `onnx.save_model` of the
same model (the tests compare them), and no step holds more than one weight.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

COPY_BYTES = 16 << 20  # copied in 16 MiB steps, whatever the tensor's size


@dataclass(frozen=True)
class Source:
    """Where a tensor's bytes are: `length` bytes at `offset` of the file `path`."""

    path: Path
    offset: int
    length: int


def source(tensor: Any, base: Path) -> Source | None:
    """The external bytes of an initializer (None when it is held inline). A location that
    leaves `base` is refused: the raw graph is ours, but the rule costs nothing."""
    from onnx import TensorProto

    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    path = (base / info["location"]).resolve()
    if not path.is_relative_to(base.resolve()):
        raise ValueError(f"tensor {tensor.name}: external data outside {base}")
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else path.stat().st_size - offset
    return Source(path, offset, length)


def array(tensor: Any, base: Path) -> np.ndarray:
    """An initializer as an array; external data is memory-mapped, not read."""
    from onnx import helper, numpy_helper

    where = source(tensor, base)
    if where is None:
        return numpy_helper.to_array(tensor)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(tensor.dims)
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return np.memmap(where.path, dtype=dtype, mode="r", offset=where.offset, shape=shape)


def nbytes(tensor: Any) -> int:
    """The bytes of an initializer's raw data, inline or external (0: typed fields)."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return int({e.key: e.value for e in tensor.external_data}.get("length", 0))


def save(model: Any, base: Path, path: Path, external: set[str], location: str) -> None:
    """Write `model` to `path`. Its external initializers (bytes under `base`) named in
    `external` go to `location` beside `path`, one after another as `onnx.save_model` lays
    them out; every other initializer is written inline. The model is changed in place to
    describe the written graph (without the inline bytes of the big weights)."""
    deferred: dict[int, Source] = {}
    data_path = path.parent / location
    data = open(data_path, "wb") if external else None  # noqa: SIM115 (closed below)
    try:
        for i, tensor in enumerate(model.graph.initializer):
            where = source(tensor, base)
            if tensor.name in external:
                if data is None:
                    raise ValueError("no external data file")
                offset = data.tell()
                if where is None:  # an inline tensor the output stores externally
                    data.write(_raw(tensor))
                    tensor.ClearField("raw_data")
                else:
                    _copy(where, data)
                point(tensor, location, offset, data.tell() - offset)
            elif where is not None:
                deferred[i] = where
                del tensor.external_data[:]
                tensor.ClearField("data_location")
    finally:
        if data is not None:
            data.close()
    if external and data_path.stat().st_size == 0:
        data_path.unlink()
    with open(path, "wb") as out:
        _write_model(model, deferred, out)


def _raw(tensor: Any) -> bytes:
    """A tensor's bytes, converting typed fields (float_data, ...) to raw little-endian."""
    from onnx import numpy_helper

    if tensor.HasField("raw_data"):
        return bytes(tensor.raw_data)
    converted = numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name)
    tensor.CopyFrom(converted)
    return bytes(tensor.raw_data)


def point(tensor: Any, location: str, offset: int, length: int) -> None:
    """What onnx's set_external_data writes: location, offset, length, in that order."""
    from onnx import TensorProto

    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _copy(where: Source, into: BinaryIO) -> None:
    """`where`'s bytes appended to `into`: in the kernel (copy_file_range) when `into` is a
    file on disk, else through Python in COPY_BYTES steps. On this machine's disk the kernel
    copy of a 0.66 GB weights file took 0.24 s against 0.92 s read and written back, and
    every stage writing a model copies its weights this way (export's graph, each quantized
    variant)."""
    if _kernel_copy(where, into):
        return
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        left = where.length
        while left:
            chunk = f.read(min(left, COPY_BYTES))
            if not chunk:
                raise ValueError(f"{where.path} ends before offset {where.offset + where.length}")
            into.write(chunk)
            left -= len(chunk)


def _kernel_copy(where: Source, into: BinaryIO) -> bool:
    """`_copy` by os.copy_file_range at `into`'s position; False (nothing written) where
    `into` is not a file or the kernel will not copy between these files."""
    import errno
    import io

    try:
        out = into.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    if not hasattr(os, "copy_file_range") or not where.length:
        return False
    into.flush()
    offset, left = where.offset, where.length
    with open(where.path, "rb") as f:
        try:
            while left:
                n = os.copy_file_range(f.fileno(), out, left, offset)
                if n == 0:
                    raise ValueError(
                        f"{where.path} ends before offset {where.offset + where.length}"
                    )
                offset, left = offset + n, left - n
        except OSError as exc:
            if offset != where.offset or exc.errno not in (
                errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF
            ):  # fmt: skip
                raise
            return False  # nothing copied (the file's position has not moved): Python's copy
    into.seek(os.lseek(out, 0, os.SEEK_CUR))  # the buffered writer follows the file
    return True


# ---- the protobuf wire format, for the fields written around the weights' bytes ----


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(number: int) -> bytes:
    return _varint(number << 3 | 2)  # wire type 2: length-delimited


def _split(message: Any, number: int) -> tuple[bytes, bytes]:
    """The encoding of `message`'s fields below and above field `number`."""
    low, high = type(message)(), type(message)()
    low.CopyFrom(message)
    high.CopyFrom(message)
    for field, _ in message.ListFields():
        (high if field.number < number else low).ClearField(field.name)
    low.ClearField(_name(message, number))
    high.ClearField(_name(message, number))
    return low.SerializeToString(), high.SerializeToString()


def _name(message: Any, number: int) -> str:
    return str(message.DESCRIPTOR.fields_by_number[number].name)


GRAPH = 7  # ModelProto.graph
INITIALIZER = 5  # GraphProto.initializer
RAW_DATA = 9  # TensorProto.raw_data


def _write_model(model: Any, deferred: dict[int, Source], out: BinaryIO) -> None:
    """The model's encoding, with each deferred initializer's raw_data copied from its
    source into the stream. Field numbers are checked against onnx's own descriptors."""
    from onnx import GraphProto, ModelProto, TensorProto

    for cls, field, number in (
        (ModelProto, "graph", GRAPH),
        (GraphProto, "initializer", INITIALIZER),
        (TensorProto, "raw_data", RAW_DATA),
    ):
        assert cls.DESCRIPTOR.fields_by_name[field].number == number
    graph = model.graph
    model_low, model_high = _split(model, GRAPH)
    graph_low, graph_high = _split(graph, INITIALIZER)
    parts = list(_initializers(graph, deferred))
    size = len(graph_low) + len(graph_high)
    size += sum(len(_key(INITIALIZER)) + len(_varint(n)) + n for n, _ in parts)
    out.write(model_low)
    if model.HasField("graph"):
        out.write(_key(GRAPH) + _varint(size) + graph_low)
        for n, pieces in parts:
            out.write(_key(INITIALIZER) + _varint(n))
            for piece in pieces:
                if isinstance(piece, Source):
                    _copy(piece, out)
                else:
                    out.write(piece)
        out.write(graph_high)
    out.write(model_high)


def _initializers(graph: Any, deferred: dict[int, Source]) -> Iterator[tuple[int, list[Any]]]:
    """(encoded size, pieces) per initializer; a deferred one's bytes stay in its file."""
    for i, tensor in enumerate(graph.initializer):
        where = deferred.get(i)
        if where is None:
            encoded = tensor.SerializeToString()
            yield len(encoded), [encoded]
            continue
        low, high = _split(tensor, RAW_DATA)
        head = _key(RAW_DATA) + _varint(where.length)
        yield len(low) + len(head) + where.length + len(high), [low, head, where, high]


# ---- reading: an inline model as a view whose weights are byte ranges of its own file ----


def goes_external(data_type: int, nbytes: int) -> bool:
    """Whether a weight of this type and size is stored outside the graph. Integer and bool
    tensors under 1 MiB and scalars stay inline: ONNX Runtime's shape inference reads the
    constant inputs of Reshape/Unsqueeze/Slice and cannot from external data (dynamo's
    graphs hold them as initializers), and the eval-mode check reads flags such as
    Dropout's training_mode. A plain size threshold would instead leave a small model's
    weights inline under `always`."""
    return nbytes > SCALAR_BYTES and not (data_type in INLINE_DTYPES and nbytes < INLINE_BYTES)


INLINE_DTYPES = (6, 7, 9)  # INT32, INT64, BOOL: shape constants, indices, mode flags
INLINE_BYTES = 1 << 20
SCALAR_BYTES = 8


def _read_varint(f: BinaryIO) -> int:
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise ValueError("truncated protobuf")
        result |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return result
        shift += 7


def _fields(f: BinaryIO, end: int) -> Iterator[tuple[int, int, int, bytes]]:
    """(field number, payload length, payload end or start, encoded head) of each field up
    to `end`. A length-delimited field's head is its key and length, its payload left
    unread at the given start for the caller to read or skip; a scalar field (length -1)
    is all head, and the position given is its end."""
    while f.tell() < end:
        start = f.tell()
        key = _read_varint(f)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length = _read_varint(f)
            head_end = f.tell()
            f.seek(start)
            head = f.read(head_end - start)
            yield number, length, head_end, head
            f.seek(head_end + length)
        else:  # a scalar field: its whole encoding is the "head"
            if wire == 0:
                _read_varint(f)
            elif wire in (1, 5):
                f.seek(8 if wire == 1 else 4, 1)
            else:
                raise ValueError(f"unsupported protobuf wire type {wire}")
            stop = f.tell()
            f.seek(start)
            yield number, -1, stop, f.read(stop - start)
            f.seek(stop)


def skeleton(path: Path) -> Any:
    """The model at `path` with its big inline weights turned into external data at their
    byte ranges in `path` itself (location: the file's name). It reads the structure and
    seeks past the weights, so a 0.5 GB graph costs what its nodes cost; next to `path`, the
    result is the same model for onnx and ONNX Runtime. Small weights stay inline (see
    `goes_external`), so graph checks still read constant flags and shapes."""
    from onnx import GraphProto, ModelProto, TensorProto

    top, graph_bytes = bytearray(), bytearray()
    tensors: list[Any] = []
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        for number, length, at, head in _fields(f, size):
            if number != GRAPH or length < 0:
                top += head + (f.read(length) if length >= 0 else b"")
                continue
            for g_number, g_length, g_at, g_head in _fields(f, at + length):
                if g_number != INITIALIZER or g_length < 0:
                    graph_bytes += g_head + (f.read(g_length) if g_length >= 0 else b"")
                    continue
                kept, raw = bytearray(), None
                for t_number, t_length, t_at, t_head in _fields(f, g_at + g_length):
                    if t_number == RAW_DATA and t_length >= 0:
                        raw = (t_at, t_length)
                    else:
                        kept += t_head + (f.read(t_length) if t_length >= 0 else b"")
                tensor = TensorProto.FromString(bytes(kept))
                if raw is not None and goes_external(tensor.data_type, raw[1]):
                    point(tensor, path.name, *raw)
                elif raw is not None:
                    f.seek(raw[0])
                    tensor.raw_data = f.read(raw[1])
                tensors.append(tensor)
    model = ModelProto.FromString(bytes(top))
    graph = GraphProto.FromString(bytes(graph_bytes))
    graph.initializer.extend(tensors)
    if tensors or graph_bytes:
        model.graph.CopyFrom(graph)
    return model


VIEW = "view.onnx"


def data_files(model: Any, path: Path) -> set[str]:
    """The names of the files the model at `path` (its skeleton: `model`) reads: its own and
    every external data location its initializers name."""
    from onnx import TensorProto

    return {path.name} | {
        entry.value
        for t in model.graph.initializer
        if t.data_location == TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }


@contextlib.contextmanager
def external_view(path: Path, edit: Any = None) -> Iterator[Path]:
    """A graph ONNX Runtime loads `path` from without a second copy of its weights: its
    `skeleton` (edited by `edit(model)` when given) in a scratch folder beside hard links to
    `path` and to the external data files it names (copies where links fail). ONNX Runtime
    then reads the weights from the file instead of parsing them into a protobuf and
    copying them out of it (gpt2-small: 0.25 GB less at its peak)."""
    model = skeleton(path)
    files = data_files(model, path)
    if edit is not None:
        edit(model)
    # beside the model's folder (same file system, so the files are linked, not copied)
    with tempfile.TemporaryDirectory(prefix=".view-", dir=path.parent.parent) as tmp:
        for name in sorted(files):
            target = (Path(tmp) / name).resolve()
            if not target.is_relative_to(Path(tmp).resolve()) or name == VIEW:
                raise ValueError(f"{path}: external data location {name!r} is not a file name")
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path.parent / name, target)
            except OSError:
                shutil.copyfile(path.parent / name, target)
        view = Path(tmp) / VIEW
        view.write_bytes(model.SerializeToString())
        del model
        yield view
