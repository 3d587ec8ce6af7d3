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

3. with `--root DIR` (a workspace `bench_memory.py --synthetic llama-30 --keep DIR` left):
   the whole graphs instead, FP32 export and shipped, each layer's attention replaced by
   the kernel (`in_place_graph`): one decode step of each on the same cache, and how far
   the logits moved.

Usage: python benchmarks/bench_inplace_kv.py [--rows 16] [--past 256] [--rounds 15]
       python benchmarks/bench_inplace_kv.py --root DIR [--past 128] [--rows 16]
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
    return bytes(model.SerializeToString())


def session(model: bytes | str, threads: int = 0) -> Any:
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
        for r, m in enumerate([n, *others]):  # each row's past: its own prefill, alone
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


def in_place_graph(src: Path, out: Path) -> int:
    """`src` (a KV-cache graph as export traces a grouped-query Llama, row-independent
    attention and all, FP32 or quantized) with each layer's attention replaced by the
    kernel on in-place buffers (`kv_in.L.key` bound to `kv_out.L.key`, ..., `seqlens_k`,
    `total_len`; no attention_mask, no past inputs, no presents). A prototype for this
    benchmark: it finds the attention by the export's node names and fails loudly on a graph
    that does not have them. Returns the layers replaced."""
    import re

    import onnx
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    found = [re.fullmatch(r"present\.(\d+)\.key", o.name) for o in graph.output]
    layers = sorted(int(f.group(1)) for f in found if f)
    producer = {o: n for n in graph.node for o in n.output}
    named = {n.name: n for n in graph.node}
    shapes = {"flat": [0, 0, H * D], "kv": [0, 0, KV * D], "out5": [0, 0, KV, H // KV, D],
              "back": [0, KV, -1, D]}  # fmt: skip
    graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.int64), f"inplace_{k}") for k, v in shapes.items()
    )
    vi = helper.make_tensor_value_info
    rewired: dict[str, str] = {}
    inputs, outputs = [], []
    for i in layers:
        attn = f"/model/model/layers.{i}/self_attn"
        k_new = producer[f"present.{i}.key"].input[1]  # Concat(past, new): the new keys
        v_new = producer[f"present.{i}.value"].input[1]
        scores = named[f"{attn}/MatMul"]  # Q x K^T, its query rows one more (invariant.py)
        grouped = producer[scores.input[0]].input[0]  # Q as [B, KV, G x S, D]
        q_heads = producer[grouped].input[0]  # Q as [B, H, S, D]
        p = f"inplace.{i}"
        graph.node.extend([
            helper.make_node("Transpose", [q_heads], [f"{p}/qt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}/qt", "inplace_flat"], [f"{p}/q"]),
            helper.make_node("Transpose", [k_new], [f"{p}/kt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}/kt", "inplace_kv"], [f"{p}/k"]),
            helper.make_node("Transpose", [v_new], [f"{p}/vt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}/vt", "inplace_kv"], [f"{p}/v"]),
            helper.make_node(
                "GroupQueryAttention",
                [f"{p}/q", f"{p}/k", f"{p}/v", f"kv_in.{i}.key", f"kv_in.{i}.value",
                 "seqlens_k", "total_len"],
                [f"{p}/o", f"kv_out.{i}.key", f"kv_out.{i}.value"],
                domain="com.microsoft", num_heads=H, kv_num_heads=KV, name=f"{p}/attention",
            ),
            # back to the grouped layout the graph reads on: [B, KV, G x S, D]
            helper.make_node("Reshape", [f"{p}/o", "inplace_out5"], [f"{p}/o5"]),
            helper.make_node("Transpose", [f"{p}/o5"], [f"{p}/ot"], perm=[0, 2, 3, 1, 4]),
            helper.make_node("Reshape", [f"{p}/ot", "inplace_back"], [f"{p}/attention_out"]),
        ])  # fmt: skip
        rewired[f"{attn}/MatMul_1_output_0"] = f"{p}/attention_out"
        for side in ("key", "value"):
            inputs.append(vi(f"kv_in.{i}.{side}", T.FLOAT, ["batch", KV, "capacity", D]))
            outputs.append(vi(f"kv_out.{i}.{side}", T.FLOAT, ["batch", KV, "capacity", D]))
    for node in graph.node:
        node.input[:] = [rewired.get(x, x) for x in node.input]
    kept = [o for o in graph.output if not o.name.startswith("present.")]
    del graph.output[:]
    graph.output.extend(kept + outputs)
    kept = [x for x in graph.input if not x.name.startswith("past_key_values.")]
    del graph.input[:]
    graph.input.extend(kept + inputs)
    graph.input.extend([vi("seqlens_k", T.INT32, ["batch"]), vi("total_len", T.INT32, [])])
    while True:  # the old attention, the presents and what only they read
        used = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
        live = [n for n in graph.node if any(o in used for o in n.output)]
        if len(live) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(live)
    read = {x for n in graph.node for x in n.input}
    assert not any(x.startswith("past_key_values.") for x in read), "a past is still read"
    if "attention_mask" not in read:
        kept = [x for x in graph.input if x.name != "attention_mask"]
        del graph.input[:]
        graph.input.extend(kept)
    weights = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(weights)
    ready = {x.name for x in graph.input} | {t.name for t in graph.initializer} | {""}
    ordered, waiting = [], list(graph.node)
    while waiting:  # topological order (the new nodes were appended)
        later = []
        for n in waiting:
            if set(n.input) <= ready:
                ordered.append(n)
                ready.update(n.output)
            else:
                later.append(n)
        assert len(later) < len(waiting), "a cycle"
        waiting = later
    del graph.node[:], graph.value_info[:]
    graph.node.extend(ordered)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(model, str(out), save_as_external_data=True, location=f"{out.name}.data")
    return len(layers)


def whole_step(src: Path, rows: int, past: int, rounds: int) -> str:
    """One decode step of `src` and of its in-place form (in_place_graph) on the same cache
    (a prefill of `rows` random prompts of `past` tokens), interleaved rounds, medians."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        rewritten = Path(tmp) / "in_place.onnx"
        count = in_place_graph(src, rewritten)
        served = session(str(src))
        fused = session(str(rewritten))
    names = ["logits"] + [f"present.{i}.{s}" for i in range(count) for s in ("key", "value")]
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 1000, (rows, past)).astype(np.int64)
    empty = {n.replace("present.", "past_key_values."): np.zeros((rows, KV, 0, D), np.float32)
             for n in names[1:]}  # fmt: skip
    prompt = {
        "input_ids": ids,
        "attention_mask": np.ones((rows, past), np.int64),
        "position_ids": np.tile(np.arange(past), (rows, 1)),
    }
    got = served.run(names, prompt | empty)
    token = got[0][:, -1].argmax(-1).reshape(rows, 1)
    positions = np.full((rows, 1), past, np.int64)
    feeds = {"input_ids": token, "attention_mask": np.ones((rows, past + 1), np.int64),
             "position_ids": positions}  # fmt: skip
    io = fused.io_binding()
    io.bind_cpu_input("input_ids", token)
    io.bind_cpu_input("position_ids", positions)
    io.bind_cpu_input("seqlens_k", np.full(rows, past, np.int32))
    io.bind_cpu_input("total_len", np.array(past + 1, np.int32))
    for name, cache in zip(names[1:], got[1:], strict=True):
        tag = name[len("present.") :]
        feeds[f"past_key_values.{tag}"] = cache
        buffer = np.zeros((rows, KV, past + 64, D), np.float32)
        buffer[:, :, :past] = cache
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        io.bind_ortvalue_input(f"kv_in.{tag}", value)
        io.bind_ortvalue_output(f"kv_out.{tag}", value)
    io.bind_output("logits")
    want = served.run(["logits"], feeds)[0][:, -1]
    fused.run_with_iobinding(io)
    have = np.asarray(io.copy_outputs_to_cpu()[-1])[:, -1]
    runs = {"served": lambda: served.run(["logits"], feeds),
            "in place": lambda: fused.run_with_iobinding(io)}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name, run in list(runs.items())[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            run()  # the same token each round: the in-place rows keep their length
            times[name].append(time.perf_counter() - start)
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    return (
        f"{src.parent.name} graph, {count} layers, {rows} rows on a {past}-token past: "
        f"served {ms['served']:.1f} ms, in place {ms['in place']:.1f} ms "
        f"({ms['served'] / ms['in place']:.2f}x); logits max |diff| "
        f"{float(np.abs(want - have).max()):.2g} of {float(np.abs(want).max()):.3g}, "
        f"the same argmax in {float((want.argmax(-1) == have.argmax(-1)).mean()):.0%} of rows"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--root", type=Path, help="a llama-30 workspace: its whole graphs too")
    parser.add_argument("--release", default="llama-30")
    args = parser.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    if args.root:
        build = args.root / "build" / args.release
        for stage in ("export", "quantize"):
            for rows in (args.rows, 1):
                print(whole_step(build / stage / "model.onnx", rows, args.past, args.rounds))
        return
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
