"""What an in-place KV cache would rest on (issue 41; benchmarks/bench_inplace_kv.py measures
it): onnxruntime's CPU `com.microsoft.GroupQueryAttention` with one preallocated buffer per
side bound as both its past input and its present output. These tests hold the kernel to
the guarantees such a cache needs, so an onnxruntime upgrade that breaks one is caught here:
- it writes each row's new keys and values into the buffer at that row's own length and
  leaves the rest of the buffer as it was (no copy of the cache: the same memory);
- a row's result does not depend on the other rows (their lengths, their contents), on the
  buffer's capacity, or on the number of threads, bit for bit;
- a prefill split into chunks, and a single-query decode, give the one pass's attention;
  not bit for bit: where a query sits in its chunk's product (a lone last row, a single
  query) moves the last bit, so a design on this kernel needs chunks cut where the tokens
  are, not where the batch's budget ends (benchmarks/bench_inplace_kv.py); and the kernel
  refuses two queries a row in a batch with a past."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

H, KV, D = 4, 2, 16


@pytest.fixture(scope="module")
def kernel() -> dict[int, Any]:
    vi = helper.make_tensor_value_info
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_len"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=KV,
    )
    graph = helper.make_graph(
        [node],
        "gqa",
        [vi("q", T.FLOAT, ["B", "S", H * D]), vi("k", T.FLOAT, ["B", "S", KV * D]),
         vi("v", T.FLOAT, ["B", "S", KV * D]), vi("past_key", T.FLOAT, ["B", KV, "P", D]),
         vi("past_value", T.FLOAT, ["B", KV, "P", D]), vi("seqlens_k", T.INT32, ["B"]),
         vi("total_len", T.INT32, [])],
        [vi("out", T.FLOAT, ["B", "S", H * D]), vi("present_key", T.FLOAT, ["B", KV, "P", D]),
         vi("present_value", T.FLOAT, ["B", KV, "P", D])],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    ).SerializeToString()
    sessions = {}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sessions[threads] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return sessions


class Cache:
    """[rows, KV, capacity, D] per side, bound as the kernel's past and present."""

    def __init__(self, session: Any, rows: int, capacity: int) -> None:
        self.session = session
        self.k = np.zeros((rows, KV, capacity, D), np.float32)
        self.v = np.zeros_like(self.k)
        self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self.k, self.v)]

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, held: list[int]) -> np.ndarray:
        io = self.session.io_binding()
        for name, a in (("q", q), ("k", k), ("v", v)):
            io.bind_cpu_input(name, np.ascontiguousarray(a, np.float32))
        s = q.shape[1]
        io.bind_cpu_input("seqlens_k", np.array([n + s - 1 for n in held], np.int32))
        io.bind_cpu_input("total_len", np.array(max(held) + s, np.int32))
        for side, value in zip(("key", "value"), self.values, strict=True):
            io.bind_ortvalue_input(f"past_{side}", value)
            io.bind_ortvalue_output(f"present_{side}", value)
        io.bind_output("out")
        self.session.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[-1])


def sequence(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        rng.standard_normal((n, H * D)).astype(np.float32),
        rng.standard_normal((n, KV * D)).astype(np.float32),
        rng.standard_normal((n, KV * D)).astype(np.float32),
    )


def prefilled(session: Any, capacity: int, rows: list[tuple[Any, int]]) -> Cache:
    """A batch whose row r holds the first n_r tokens of its sequence (each prefilled alone)."""
    cache = Cache(session, len(rows), capacity)
    for r, ((q, k, v), n) in enumerate(rows):
        alone = Cache(session, 1, capacity)
        alone.run(q[None, :n], k[None, :n], v[None, :n], [0])
        cache.k[r], cache.v[r] = alone.k[0], alone.v[0]
    return cache


def test_the_new_keys_are_written_in_place_at_each_rows_length(kernel: dict[int, Any]) -> None:
    rng = np.random.default_rng(0)
    seqs = [sequence(rng, 40) for _ in range(3)]
    held = [5, 30, 17]
    cache = prefilled(kernel[2], 48, list(zip(seqs, held, strict=True)))
    before = cache.k.copy(), cache.v.copy()
    new = [np.stack([s[i][n] for s, n in zip(seqs, held, strict=True)])[:, None] for i in range(3)]
    cache.run(*new, held)
    for r, n in enumerate(held):
        assert np.array_equal(cache.k[r, :, n], new[1][r, 0].reshape(KV, D))
        assert np.array_equal(cache.v[r, :, n], new[2][r, 0].reshape(KV, D))
        for side, old in zip((cache.k, cache.v), before, strict=True):
            assert np.array_equal(side[r, :, :n], old[r, :, :n])  # the past: untouched
            assert np.array_equal(side[r, :, n + 1 :], old[r, :, n + 1 :])  # beyond: too
    assert np.shares_memory(cache.k, cache.values[0].numpy())  # the same memory, no copy


def test_a_rows_decode_depends_on_nothing_but_its_own_tokens(kernel: dict[int, Any]) -> None:
    """Alone, beside rows of other lengths and contents, in a bigger buffer, on 1 thread:
    the same bits."""
    rng = np.random.default_rng(1)
    mine, n = sequence(rng, 61), 60

    def decode(session: Any, capacity: int, others: list[int]) -> np.ndarray:
        rows = [(mine, n), *[(sequence(rng, m + 1), m) for m in others]]
        cache = prefilled(session, capacity, rows)
        new = [np.stack([s[i][m] for s, m in rows])[:, None] for i in range(3)]
        return cache.run(*new, [m for _, m in rows])[0, 0]

    alone = decode(kernel[2], 64, [])
    assert np.array_equal(alone, decode(kernel[2], 64, [3, 63, 20, 1, 45]))
    assert np.array_equal(alone, decode(kernel[2], 128, [7]))
    assert np.array_equal(alone, decode(kernel[1], 64, [63, 2]))


def test_chunked_prefill_and_decode_are_the_one_pass_attention(kernel: dict[int, Any]) -> None:
    """Any split of a sequence into a prefill and the rest, a single-query decode among
    them, gives the one pass's attention (to float tolerance: where a query sits in the
    chunk's product moves its last bit, see the top); two queries a row are refused beside
    another row with a past."""
    rng = np.random.default_rng(2)
    q, k, v = sequence(rng, 50)
    one = Cache(kernel[2], 1, 64).run(q[None], k[None], v[None], [0])[0]
    for cut in (1, 17, 48, 49):
        cache = Cache(kernel[2], 1, 64)
        first = cache.run(q[None, :cut], k[None, :cut], v[None, :cut], [0])[0]
        rest = cache.run(q[None, cut:], k[None, cut:], v[None, cut:], [cut])[0]
        assert np.allclose(np.concatenate([first, rest]), one, rtol=1e-5, atol=1e-6), cut
    two_rows = prefilled(kernel[2], 64, [((q, k, v), 49), (sequence(rng, 9), 8)])
    with pytest.raises(Exception, match="batch_size must be 1"):
        two_rows.run(*[np.zeros((2, 2, a.shape[1]), np.float32) for a in (q, k, v)], [49, 8])
