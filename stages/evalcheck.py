"""evalcheck: the model runs in eval mode, deterministically, with no active random ops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from schemas import ReleaseSpec
from stages._contract import StageContext, StageIO, StageResult, release_memory
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.onnx.graph import constant_values, node_scope

NAME = "evalcheck"
RANDOM_OPS = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
}


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export"),
        upstream=("export/model.onnx",),
        reads_model=True,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    net, lay = m.load_with_layout(ctx.root, release)
    flat = m.adapter(release.task, net, lay)
    feeds = sh.make_inputs(lay, sh.trace_sizes(release.export.dims), seed=0)
    problems = _training_modules(flat, "after model.eval()")
    problems += _nondeterministic_modules(flat, lay, feeds)
    problems += _training_modules(flat, "after a forward pass")
    n = sum(1 for _ in flat.modules())
    del net, flat  # the ONNX checks below run without the PyTorch weights in memory
    release_memory()
    model_path = ctx.upstream("export") / "model.onnx"
    problems += _random_nodes(model_path)
    problems += _onnx_repeatable(model_path, feeds)
    if problems:
        # the inputs every check above ran on: evidence, kept in failed/evalcheck/
        np.savez(ctx.work / "failed_inputs.npz", **feeds)  # type: ignore[arg-type]
        return StageResult.failed(f"{len(problems)} inference-mode problem(s)", problems)
    return StageResult.passed(
        f"{n} modules in eval mode, two forward passes bit-identical in "
        "PyTorch and ONNX Runtime, no active random ops in the graph",
        metrics={"modules": n},
    )


def _training_modules(flat: Any, when: str) -> list[str]:
    names = [
        name.removeprefix("model.") or "(root)"
        for name, mod in flat.named_modules()
        if mod.training and name
    ]
    if not names:
        return []
    return [
        f"module(s) in training mode {when}: {', '.join(names[:10])}; a module that "
        "overrides train()/eval() or sets self.training must not do so at inference"
    ]


def _nondeterministic_modules(flat: Any, lay: sh.Layout, feeds: dict[str, np.ndarray]) -> list[str]:
    """Run twice under different RNG seeds; say where the two runs first part ways.

    Runs that differ are run again on one thread before they count: on a loaded machine
    PyTorch's intra-op threads can split an elementwise op at other boundaries, and the
    vectorized and scalar paths round an element differently (the matrix once saw GPT-2's
    GELU give two outputs for one input while other work ran). One thread splits nothing;
    dropout and sampling still differ there."""
    import torch

    def twice() -> list[Any]:
        runs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            runs.append(m.traced_run(flat, lay, feeds))
        return runs

    def same(runs: list[Any]) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))

    runs = twice()
    if same(runs):
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = twice()
    finally:
        torch.set_num_threads(threads)
    if same(runs):
        return []
    (out_a, mods_a), (out_b, mods_b) = runs
    where = f"the forward of the root module {type(flat.model).__name__}"
    previous = None
    for (name, in_a, a, _), (_, in_b, b, _) in zip(mods_a, mods_b, strict=True):
        if np.array_equal(a, b):
            previous = name
            continue
        if in_a is not None and np.array_equal(in_a, in_b):
            where = f"module {name!r} (same input, different output)"
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else None
            caller = f"module {parent!r}" if parent else where
            where = f"{caller}, between {previous!r} and {name!r}" if previous else caller
        break
    return [
        f"two forward passes on the same input differ; randomness enters in {where} "
        "(dropout or sampling active at inference?)"
    ]


def _random_nodes(path: Path) -> list[str]:
    from stages.onnx import stream

    graph = stream.skeleton(path).graph
    constants = constant_values(graph)
    problems = []
    for node in graph.node:
        where = f"node {node.name or node.op_type!r} (from {node_scope(node) or 'unknown'})"
        if node.op_type in RANDOM_OPS:
            problems.append(f"random op {node.op_type} at {where}: inference must be deterministic")
        elif node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            mode = constants.get(node.input[2])
            if mode is None or bool(mode.any()):
                problems.append(
                    f"active Dropout at {where}: training_mode is "
                    f"{'computed at run time' if mode is None else 'true'}"
                )
    return problems


def _onnx_repeatable(path: Path, feeds: dict[str, np.ndarray]) -> list[str]:
    import onnxruntime as ort

    from stages.onnx import stream

    with stream.external_view(path) as view:  # the weights read from the file, not a parse
        session = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
        first, second = session.run(None, feeds), session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    differ = [n for n, a, b in zip(names, first, second, strict=True) if not np.array_equal(a, b)]
    if differ:
        return [f"ONNX Runtime gives different results for the same input on outputs {differ}"]
    return []
