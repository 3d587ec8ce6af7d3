"""What an attention that updates the KV cache in place would give a decode step, and whether
onnxruntime's kernel for it keeps the guarantees the served graph has (issue 41: no per-step
copy of the whole KV cache).

The served graph's attention (one layer, as export traces a grouped-query model and
stages/onnx/invariant.py rewrites it) reads the past as an input and returns the presents,
the past and the new keys concatenated: every step copies the whole cache, and the
row-independent rewrite pads the keys and values to whole blocks, a second copy of V.
onnxruntime's CPU `com.microsoft.GroupQueryAttention` takes a preallocated buffer per
layer ([rows, kv_heads, capacity, head_dim]) bound as both its past input and its present
output (IO binding), each row's own length (`seqlens_k`, right-padded rows: no left
padding), and writes the new keys into the buffer where they belong.

Printed, on one layer of llama-30's shapes (9 query heads on 3 key/value heads of 64):
1. the kernel's guarantees, bit for bit: a row's result alone against beside 15 rows of
   other lengths, against a buffer of another capacity, on 1 and 2 threads; a cached
   decode against a full recompute of the same sequence (a one-row product takes another
   path: fed its query twice, a lone row's decode is the full recompute's; the kernel
   refuses two queries a row in a batch with a past); a prefill in two chunks, cut at
   several places, against one pass (where a query sits in its chunk's product can move
   its last bit);
2. a decode step's time at ROWS rows on a PAST-token past, the served form (with and
   without the row-independent rewrite) against the in-place kernel, interleaved rounds,
   medians, x 30 layers.

Usage: python benchmarks/bench_inplace_kv.py [--rows 16] [--past 256] [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H, KV, D, LAYERS = 9, 3, 64, 30


def gqa_model(layers: int = 1) -> bytes:
    """`layers` GroupQueryAttention nodes on the same query, key and value, each with its own
    cache (past_key.i / present_key.i, ...)."""
    from onnx import TensorProto as T
    from onnx import helper

    vi = helper.make_tensor_value_info
    nodes, caches, presents = [], [], []
    for i in range(layers):
        tag = "" if layers == 1 else f".{i}"
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", f"past_key{tag}", f"past_value{tag}", "seqlens_k", "total_len"],
            [f"out{tag}", f"present_key{tag}", f"present_value{tag}"],
            domain="com.microsoft", num_heads=H, kv_num_heads=KV,
        ))  # fmt: skip
        caches += [vi(f"past_{s}{tag}", T.FLOAT, ["B", KV, "P", D]) for s in ("key", "value")]
        presents += [vi(f"out{tag}", T.FLOAT, ["B", "S", H * D])]
        presents += [vi(f"present_{s}{tag}", T.FLOAT, ["B", KV, "P", D]) for s in ("key", "value")]
    graph = helper.make_graph(
        nodes,
        "gqa",
        [vi("q", T.FLOAT, ["B", "S", H * D]), vi("k", T.FLOAT, ["B", "S", KV * D]),
         vi("v", T.FLOAT, ["B", "S", KV * D]), *caches, vi("seqlens_k", T.INT32, ["B"]),
         vi("total_len", T.INT32, [])],
        presents,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return bytes(helper.make_model(graph, opset_imports=opsets).SerializeToString())


def served_model(invariant: bool, layers: int = 1) -> bytes:
    """One layer's attention as the served graph has it: the presents concatenated, the
    group's query heads as rows (stages/onnx/grouped.py), the mask as a bias; with
    `invariant`, rewritten by stages/onnx/invariant.py."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    from stages.onnx import invariant as inv

    vi = helper.make_tensor_value_info
    g = H // KV
    consts = [
        numpy_helper.from_array(np.array([0, KV, -1, D], np.int64), "grouped"),
        numpy_helper.from_array(np.array([0, H, -1, D], np.int64), "heads"),
        numpy_helper.from_array(np.array(1 / np.sqrt(D), np.float32), "scale"),
        numpy_helper.from_array(np.array(-1e9, np.float32), "masked"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "axes12"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = [
        helper.make_node("Concat", ["past_key", "k"], ["present_key"], axis=2),
        helper.make_node("Concat", ["past_value", "v"], ["present_value"], axis=2),
        helper.make_node("Reshape", ["q", "grouped"], ["qg"]),  # [B, KV, g*S, D]
        helper.make_node("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qg", "kt"], ["raw"]),
        helper.make_node("Mul", ["raw", "scale"], ["scaled"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=T.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["unmasked"]),
        helper.make_node("Mul", ["unmasked", "masked"], ["bias2"]),
        helper.make_node("Unsqueeze", ["bias2", "axes12"], ["bias"]),  # [B, 1, 1, T]
        helper.make_node("Add", ["scaled", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_value"], ["og"]),
        helper.make_node("Reshape", ["og", "heads"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "served",
        [vi("q", T.FLOAT, ["B", H, "S", D]), vi("k", T.FLOAT, ["B", KV, "S", D]),
         vi("v", T.FLOAT, ["B", KV, "S", D]), vi("past_key", T.FLOAT, ["B", KV, "P", D]),
         vi("past_value", T.FLOAT, ["B", KV, "P", D]), vi("mask", T.INT64, ["B", "T"])],
        [vi("out", T.FLOAT, ["B", H, "S", D]), vi("present_key", T.FLOAT, ["B", KV, "T", D]),
         vi("present_value", T.FLOAT, ["B", KV, "T", D])],
        consts,
    )  # fmt: skip
    if layers > 1:  # the layer's nodes again per layer, on its own cache
        shared = {"q", "k", "v", "mask", *(c.name for c in consts)}
        one = list(graph.node)
        del graph.node[:]
        for i in range(layers):
            for n in one:
                node = helper.make_node(
                    n.op_type,
                    [x if x in shared else f"{x}.{i}" for x in n.input],
                    [f"{x}.{i}" for x in n.output],
                )
                node.attribute.extend(n.attribute)
                graph.node.append(node)
        inputs = [x for x in graph.input if x.name in shared]
        caches = [x for x in graph.input if x.name not in shared]
        outs = list(graph.output)
        del graph.input[:], graph.output[:]
        graph.input.extend(inputs)
        for i in range(layers):
            for x in caches:
                graph.input.append(vi(f"{x.name}.{i}", T.FLOAT, ["B", KV, "P", D]))
            for x in outs:
                y = graph.output.add()
                y.CopyFrom(x)
                y.name = f"{x.name}.{i}"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    if invariant:
        done = inv.rewrite(model)
        assert done.softmaxes == layers and done.products == layers, done
    _ = g
    return bytes(model.SerializeToString())


def session(model: bytes, threads: int = 0) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


class InPlace:
    """One layer's cache in place: a [rows, KV, capacity, D] buffer per side, bound as the
    kernel's past and present."""

    def __init__(self, sess: Any, rows: int, capacity: int) -> None:
        import onnxruntime as ort

        self.sess = sess
        self.k = np.zeros((rows, KV, capacity, D), np.float32)
        self.v = np.zeros_like(self.k)
        self.kv = tuple(ort.OrtValue.ortvalue_from_numpy(a) for a in (self.k, self.v))

    def run(self, q: Any, k: Any, v: Any, lengths: list[int]) -> np.ndarray:
        """q [rows, S, H*D], k/v [rows, S, KV*D] for rows holding `lengths` cached tokens."""
        io = self.sess.io_binding()
        for name, a in (("q", q), ("k", k), ("v", v)):
            io.bind_cpu_input(name, np.ascontiguousarray(a, np.float32))
        io.bind_ortvalue_input("past_key", self.kv[0])
        io.bind_ortvalue_input("past_value", self.kv[1])
        s = q.shape[1]
        io.bind_cpu_input("seqlens_k", np.array([n + s - 1 for n in lengths], np.int32))
        io.bind_cpu_input("total_len", np.array(max(lengths) + s, np.int32))
        io.bind_ortvalue_output("present_key", self.kv[0])
        io.bind_ortvalue_output("present_value", self.kv[1])
        io.bind_output("out")
        self.sess.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[-1])


def guarantees(rng: np.random.Generator) -> dict[str, bool]:
    """The kernel's guarantees, bit for bit, on one sequence of 200 tokens."""
    n = 200
    seq_q = rng.standard_normal((n + 1, H * D)).astype(np.float32)
    seq_k = rng.standard_normal((n + 1, KV * D)).astype(np.float32)
    seq_v = rng.standard_normal((n + 1, KV * D)).astype(np.float32)

    def cached(sess: Any, capacity: int, others: list[int], twice: bool = False) -> np.ndarray:
        rows = 1 + len(others)
        layer = InPlace(sess, rows, capacity)
        layer.run(seq_q[None, :n], seq_k[None, :n], seq_v[None, :n], [0]) if rows == 1 else None
        if rows > 1:  # the others first hold their own pasts (their own prefills)
            for r, m in enumerate([n, *others]):
                one = InPlace(sess, 1, capacity)
                src = (seq_q[None, :n], seq_k[None, :n], seq_v[None, :n]) if r == 0 else (
                    rng.standard_normal((1, m, H * D)), rng.standard_normal((1, m, KV * D)),
                    rng.standard_normal((1, m, KV * D)))  # fmt: skip
                one.run(*src, [0])
                layer.k[r], layer.v[r] = one.k[0], one.v[0]
        s = 2 if twice else 1
        new = [np.repeat(a[n : n + 1][None], s, 1) for a in (seq_q, seq_k, seq_v)]
        pick = [np.concatenate([x, rng.standard_normal((rows - 1, s, x.shape[2]))]) for x in new]
        out = layer.run(*pick, [n, *others])
        return out[0, 0]

    def full(sess: Any, cut: int | None = None) -> np.ndarray:
        layer = InPlace(sess, 1, 256)
        if cut:
            layer.run(seq_q[None, :cut], seq_k[None, :cut], seq_v[None, :cut], [0])
            return layer.run(seq_q[None, cut:], seq_k[None, cut:], seq_v[None, cut:], [cut])[0, -1]
        return layer.run(seq_q[None], seq_k[None], seq_v[None], [0])[0, -1]

    one, two = session(gqa_model(), 1), session(gqa_model(), 2)
    alone = cached(two, 256, [])
    reference = full(two)
    found = {
        "row alone == row beside 15 of other lengths": bool(
            np.array_equal(alone, cached(two, 256, [int(x) for x in rng.integers(1, 250, 15)]))
        ),
        "row in a 256-slot buffer == in a 512-slot one": bool(
            np.array_equal(alone, cached(two, 512, []))
        ),
        "1 thread == 2 threads": bool(np.array_equal(alone, cached(one, 256, []))),
        "cached decode == full recompute": bool(np.array_equal(alone, reference)),
        "cached decode, one row, its query twice == full recompute": bool(
            np.array_equal(cached(two, 256, [], twice=True), reference)
        ),
    }
    for cut in (1, 17, 100, 150, 199):
        found[f"prefill in two chunks ({cut} + {n + 1 - cut}) == one pass"] = bool(
            np.array_equal(full(two, cut), reference)
        )
    try:  # the query twice beside other rows: refused by the kernel
        cached(two, 256, [5], twice=True)
        found["two queries a row beside another row with a past: accepted"] = True
    except Exception as exc:  # onnxruntime's own error type
        found[f"two queries a row beside another row with a past: refused ({exc})"[:150]] = False
    return found


def timings(rows: int, past: int, rounds: int, rng: np.random.Generator) -> dict[str, float]:
    """ms per decode step of LAYERS layers' attention (one graph each), interleaved rounds,
    medians."""
    import onnxruntime as ort

    served = {name: session(served_model(inv, LAYERS)) for name, inv in
              (("served, row-independent", True), ("served, plain", False))}  # fmt: skip
    gqa = session(gqa_model(LAYERS))
    q = rng.standard_normal((rows, H, 1, D)).astype(np.float32)
    k = rng.standard_normal((rows, KV, 1, D)).astype(np.float32)
    v = rng.standard_normal((rows, KV, 1, D)).astype(np.float32)
    feeds = {"q": q, "k": k, "v": v, "mask": np.ones((rows, past + 1), np.int64)}
    buffers = []
    for i in range(LAYERS):
        for side in ("key", "value"):
            cache = rng.standard_normal((rows, KV, past, D)).astype(np.float32)
            feeds[f"past_{side}.{i}"] = cache
            buffer = np.zeros((rows, KV, past + 64, D), np.float32)
            buffer[:, :, :past] = cache
            buffers.append((f"{side}.{i}", ort.OrtValue.ortvalue_from_numpy(buffer), buffer))
    io = gqa.io_binding()
    io.bind_cpu_input("q", q.reshape(rows, 1, H * D))
    io.bind_cpu_input("k", k.reshape(rows, 1, KV * D))
    io.bind_cpu_input("v", v.reshape(rows, 1, KV * D))
    io.bind_cpu_input("seqlens_k", np.full(rows, past, np.int32))
    io.bind_cpu_input("total_len", np.array(past + 1, np.int32))
    for name, value, _ in buffers:
        io.bind_ortvalue_input(f"past_{name}", value)
        io.bind_ortvalue_output(f"present_{name}", value)
    for i in range(LAYERS):
        io.bind_output(f"out.{i}")

    runs = {name: (lambda s=sess: s.run(None, feeds)) for name, sess in served.items()}
    # the same token each step: the lengths stay (a steady state)
    runs["in place"] = lambda: gqa.run_with_iobinding(io)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()  # warm-up
    for r in range(rounds):
        order = list(runs.items()) if r % 2 == 0 else list(reversed(runs.items()))
        for name, run in order:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {k: 1000 * float(np.median(v)) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}: GroupQueryAttention, one layer ({H}/{KV} heads of {D})")
    for what, ok in guarantees(rng).items():
        print(f"  {'yes' if ok else 'NO '}  {what}")
    print(f"decode step, {LAYERS} layers' attention, {args.rows} rows on a {args.past}-token "
          f"past, {args.rounds} interleaved rounds, median ms:")  # fmt: skip
    got = timings(args.rows, args.past, args.rounds, rng)
    base = got["served, row-independent"]
    for name, ms in got.items():
        print(f"  {name:<28} {ms:8.2f} ms  ({base / ms:.2f}x the served form)")


if __name__ == "__main__":
    main()
