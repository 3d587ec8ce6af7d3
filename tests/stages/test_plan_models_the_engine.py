"""The capacity plan models the engine that will serve (issue 40): its KV cache and
activations at the planned extreme against the engine's own peak RSS, measured in a process
of its own on a real export (8 layers, 1k-token context, batch 8): the traced graph's
engine (kv.Batch) and the fused graph's, which writes its cache in place (kv.Slots)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.artifacts import CapacityPlan, ModelInfo
from schemas.spec.capacity import CapacityConfig
from stages.plan import Shaped, compute, in_place
from tests.conftest import REPO, Workspace, gpt2_spec

BATCH, CONTEXT, CHUNK = 8, 1024, 128

# Runs the engine at the extreme: BATCH sequences of the longest total the export allows
# (past_sequence.max + 2; half prompt, prefilled in chunks of CHUNK, half generated), all in
# the batch together at the end. Prints the
# peak RSS growth over the loaded, warmed-up engine (VmHWM reset through clear_refs).
ENGINE = """
import json, queue, sys
import numpy as np
import onnxruntime as ort
from shipyard_runtime.generation.params import parse
from shipyard_runtime.generation.core import Engine, EngineSettings, Graph

path, batch, context, chunk = sys.argv[1], *map(int, sys.argv[2:5])
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key))
    return int(line.split()[1]) * 1024
graph = Graph(ort.InferenceSession(path, providers=["CPUExecutionProvider"]))
settings = EngineSettings(max_rows=batch, max_context=context, chunk=chunk,
                          max_past=context - chunk, kv_budget_tokens=int(sys.argv[5]))
engine = Engine(graph, settings)
import shipyard_runtime.generation.kv as kvm
slots = [0]
def counting(advance):  # the padded cache the batch held at its largest (either kind)
    def counted(self, *presents):
        advance(self, *presents)
        slots[0] = max(slots[0], len(self) * self.length)
    return counted
kvm.Batch.advance = counting(kvm.Batch.advance)
kvm.Slots.advance = counting(kvm.Slots.advance)
def run(n, prompt, tokens):
    done = []
    for i in range(n):
        q = queue.Queue()
        engine.submit([(7 * i + j) % 1000 for j in range(prompt)],
                      parse({"max_tokens": tokens, "ignore_eos": True}), q.put)
        done.append(q)
    for q in done:
        while True:
            e = q.get(timeout=600)
            if e.finish or e.error:
                assert not e.error, e.error
                break
run(1, 8, 4)  # warm-up: sessions, arenas, threads
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
total = context - chunk + 2  # the longest sequence the export's past allows
run(batch, total // 2, total - total // 2)
print(json.dumps({"base": base, "peak": status("VmHWM:"), "slots": slots[0]}))
engine.close()
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelInfo]:
    import torch
    import transformers

    ws = Workspace(tmp_path_factory.mktemp("plan-engine"))
    folder = ws.root / "models" / "mem-gpt2"
    config = transformers.GPT2Config(
        n_layer=8, n_embd=256, n_head=4, vocab_size=1000, n_positions=CONTEXT
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    spec = gpt2_spec(name="mem-gpt2", pins={})
    spec["model"] = {"kind": "hf", "path": "models/mem-gpt2"}
    spec["export"]["dims"] = {
        "batch": {"min": 1, "opt": 2, "max": BATCH},
        "sequence": {"min": 1, "opt": 16, "max": CHUNK},
        "past_sequence": {"min": 0, "opt": 16, "max": CONTEXT - CHUNK},
    }
    for stage in ("pin", "export"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", report.reasons
    out = ws.out("mem-gpt2", "export")
    info = ModelInfo.model_validate_json((out / ModelInfo.FILE).read_text())
    return out / "model.onnx", info


def _weights(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.glob("model.onnx*"))


def _engine_growth(path: Path, plan: CapacityPlan) -> int:
    """The engine's peak RSS growth on `path` at the plan's extreme (BATCH rows at the
    longest total the export allows, all in the batch together at the end), checked to
    have reached it, and its whole peak (weights, runtime and all) checked to be within
    the plan's extreme."""
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, str(path), str(BATCH), str(CONTEXT), str(CHUNK)]
        + [str(plan.kv_budget_tokens)],  # the serve stage's default budget
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    # the run did reach the extreme: every row in the batch at (almost) the longest total
    # (rows prefilled one chunk apart finish a few steps apart, and leave at once)
    total = CONTEXT - CHUNK + 2
    assert rss["slots"] >= BATCH * (total - 1), (rss["slots"], BATCH * total)
    assert rss["peak"] <= plan.extreme.total, (rss, plan.extreme)
    return int(rss["peak"] - rss["base"])


def test_the_plan_holds_the_engines_own_peak_at_the_planned_extreme(
    export: tuple[Path, ModelInfo],
) -> None:
    """KV cache + activations planned for batch 8 at the export's longest sequence cover
    what the engine really grows by there (within 3 % of allocator slack), and not by more
    than 15 %."""
    path, info = export
    assert not in_place(path)  # the traced graph: three copies for the length of a step
    cap = CapacityConfig(device_memory="64GiB", max_batch=BATCH)
    plan = compute(cap, info, "causal-lm", _weights(path))
    assert (plan.batch, plan.context, plan.kv_copies) == (BATCH, CONTEXT, 3)
    assert plan.kv_budget_tokens == plan.cached_tokens * BATCH  # every row at its longest
    planned = plan.extreme.kv_cache + plan.extreme.activations
    assert plan.cached_tokens == CONTEXT - CHUNK + 2  # what the engine counts, not 1024
    grown = _engine_growth(path, plan)
    kv_once = plan.kv_bytes_per_sequence * BATCH
    assert grown > 0.8 * kv_once, (grown, kv_once)
    print(f"engine grew {grown / 2**20:.1f} MiB; planned {planned / 2**20:.1f} MiB")
    # within the allocator's slack (which the plan's runtime_overhead reserves) of the plan
    assert grown <= planned * 1.03, (grown, planned, plan.extreme)
    assert planned <= grown / 0.85, (grown, planned, plan.extreme)


@pytest.fixture(scope="module")
def fused_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Shaped]:
    """init's default for a Llama-family decoder, the fused INT4 graph, with a KV cache as
    large as the traced test's (8 layers, 4 KV heads of 64 for 8 query heads: 16 KiB a
    token), and the shape the plan reads of it (what export records from the config)."""
    import torch
    import transformers

    from pipelines.init import _Shape
    from schemas.artifacts import Arch, DimSizes
    from stages.onnx.model import arch
    from tests.fixtures.fused import fused_of

    root = tmp_path_factory.mktemp("plan-fused")
    config = transformers.LlamaConfig(
        num_hidden_layers=8,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=CONTEXT,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "checkpoint")
    path = fused_of(root / "checkpoint", root / "fused")
    dims = {
        "batch": DimSizes(min=1, opt=2, max=BATCH),
        "sequence": DimSizes(min=1, opt=16, max=CHUNK),
        "past_sequence": DimSizes(min=0, opt=16, max=CONTEXT - CHUNK),
    }
    return path, _Shape(dims, Arch(**arch(config.to_dict())))


def test_the_plan_holds_the_in_place_engines_peak_and_charges_it_no_third_copy(
    fused_export: tuple[Path, Shaped],
) -> None:
    """Issue 40 item 2 for init's default graph: the fused graph's engine writes its cache
    in place (kv.Slots), so the plan charges its budget twice (its buffers remade as rows
    join and grow) and one prompt's chunk beside it, not the traced engine's three copies.
    That covers the engine's own peak at the extreme within 3 % and is within 15 % of it;
    three copies would have overcharged by a third."""
    path, shape = fused_export
    assert in_place(path)
    cap = CapacityConfig(device_memory="64GiB", max_batch=BATCH)
    plan = compute(cap, shape, "causal-lm", _weights(path), in_place=True)
    assert (plan.kv_copies, plan.kv_prefill_bytes) == (2, plan.kv_bytes_per_sequence)
    assert plan.kv_budget_tokens == plan.cached_tokens * BATCH == BATCH * (CONTEXT - CHUNK + 2)
    kv_once = plan.kv_bytes_per_sequence * BATCH
    assert plan.extreme.kv_cache == 2 * kv_once + plan.kv_bytes_per_sequence
    planned = plan.extreme.kv_cache + plan.extreme.activations
    grown = _engine_growth(path, plan)
    traced = compute(cap, shape, "causal-lm", 0)  # what the plan charged before
    print(
        f"in-place engine grew {grown / 2**20:.1f} MiB; planned {planned / 2**20:.1f} MiB "
        f"(three copies: {(traced.extreme.kv_cache + traced.extreme.activations) / 2**20:.1f})"
    )
    assert grown <= planned * 1.03, (grown, planned, plan.extreme)
    assert planned <= grown / 0.85, (grown, planned, plan.extreme)
    assert grown < 0.8 * (traced.extreme.kv_cache + traced.extreme.activations)
