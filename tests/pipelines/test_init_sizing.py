"""`shipyard init` sizes batch and context with the plan stage's own model (issue 40): a spec
it writes never fails `plan`, it says what it chose, and a config claiming a context no
device holds gets the context the device does hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.init import fp32_bytes, size_for_device
from schemas import SpecError
from schemas.artifacts import Arch, DimSizes
from schemas.spec.capacity import CapacityConfig
from stages.onnx.model import arch
from stages.plan import compute

SMOL = {  # a 135M Llama-family decoder's shape (GQA)
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


class _Shape:
    def __init__(self, dims: dict[str, DimSizes], model: Arch) -> None:
        self.dims, self.arch = dims, model


def planned(config: dict, memory: str, weights: int, task: str = "causal-lm") -> tuple:
    sizing = size_for_device(config, task, memory, weights)
    dims = {k: DimSizes(**v) for k, v in sizing.dims().items()}
    plan = compute(
        CapacityConfig(device_memory=memory), _Shape(dims, Arch(**arch(config))), task, weights
    )  # type: ignore[arg-type]
    return sizing, plan


def test_a_135m_decoder_on_16gib_keeps_its_full_context_at_16_rows() -> None:
    """Issue 41 item 5: the engine's rows come from the KV budget (16 here, where 8 rows x
    the full context had been the cap), the export is probed at batch 8."""
    sizing, plan = planned(SMOL, "16GiB", 4 * 135_000_000)
    assert (sizing.batch, sizing.rows, sizing.context, sizing.sequence) == (8, 16, 8192, 2048)
    assert plan.batch == 16 and plan.extreme.total <= plan.usable_bytes
    assert plan.kv_budget_tokens >= 16 * 256 and plan.kv_budget_tokens >= plan.cached_tokens
    assert "16 engine rows x 8192 tokens (the checkpoint's full context)" in sizing.note
    assert "probed at batch 8" in sizing.note


def test_a_smaller_device_lowers_the_context_first_then_the_batch() -> None:
    four, plan = planned(SMOL, "2GiB", 4 * 135_000_000)
    assert four.rows == 16 and 2048 <= four.context < 8192 and four.context % 64 == 0
    assert plan.extreme.total <= plan.usable_bytes and plan.max_batch_that_fits >= 16
    # 64 tokens more would not fit: the largest context is chosen
    more = {**four.dims()}
    more["past_sequence"] = {**more["past_sequence"], "max": more["past_sequence"]["max"] + 64}
    bigger = compute(
        CapacityConfig(device_memory="2GiB"),
        _Shape({k: DimSizes(**v) for k, v in more.items()}, Arch(**arch(SMOL))),  # type: ignore[arg-type]
        "causal-lm",
        4 * 135_000_000,
    )
    assert bigger.max_batch_that_fits < 16
    assert "the plan does not hold rows 16 x 8192 in 2GiB" in four.note
    few, plan = planned(SMOL, "1500MiB", 4 * 135_000_000)
    assert 1 <= few.rows < 16 and few.context == 2048 and plan.batch == few.rows
    assert plan.extreme.total <= plan.usable_bytes
    one, plan = planned(SMOL, "1100MiB", 4 * 135_000_000)
    assert one.rows == 1 and one.context < 2048 and plan.extreme.total <= plan.usable_bytes


def test_a_config_claiming_ten_million_positions_gets_what_the_device_holds() -> None:
    """Issue 42 item 6: init wrote past_sequence.max 9997952 and export then allocated it."""
    sizing, plan = planned({**SMOL, "max_position_embeddings": 10_000_000}, "16GiB", 5 * 10**8)
    # what the KV budget holds once beside 16 rows of 256 tokens: 64k, not 10M
    assert 32_000 < sizing.context < 70_000 and plan.extreme.total <= plan.usable_bytes
    assert plan.kv_budget_tokens >= plan.cached_tokens


def test_a_device_too_small_for_the_weights_is_refused_with_the_numbers() -> None:
    with pytest.raises(SpecError) as caught:
        size_for_device(SMOL, "causal-lm", "600MiB", 4 * 135_000_000)
    [problem] = caught.value.problems
    assert problem.startswith("--device-memory 600MiB: even batch 1 x 64 tokens needs ")
    assert "give the device's real memory" in problem


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 80),
    heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([32, 64, 128]),
    vocab=st.integers(100, 260_000),
    positions=st.integers(64, 2_000_000),
    gib=st.integers(1, 160),
    params=st.integers(10**6, 70 * 10**9),
)
def test_a_spec_init_sizes_never_fails_the_plan(
    layers: int,
    heads: int,
    group: int,
    head_dim: int,
    vocab: int,
    positions: int,
    gib: int,
    params: int,
) -> None:
    config = {
        "hidden_size": heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // group),
        "vocab_size": vocab,
        "max_position_embeddings": positions,
    }
    try:
        sizing, plan = planned(config, f"{gib}GiB", 4 * params)
    except SpecError as exc:
        assert "even batch 1 x" in exc.problems[0]
        return
    assert plan.extreme.total <= plan.usable_bytes and plan.batch >= sizing.rows >= 1
    assert 1 <= sizing.batch <= 8 and sizing.sequence <= sizing.context <= positions


def test_fp32_bytes_reads_the_safetensors_headers_only(tmp_path: Path) -> None:
    """Every parameter at 4 bytes (a bf16 checkpoint doubles), plus a tied embedding's
    second copy; the tensor data is never read."""
    header = {
        "model.embed_tokens.weight": {
            "dtype": "BF16",
            "shape": [100, 8],
            "data_offsets": [0, 1600],
        },
        "model.layers.0.mlp.down_proj.weight": {
            "dtype": "BF16",
            "shape": [8, 32],
            "data_offsets": [1600, 2112],
        },
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)  # no data: it is not read
    assert fp32_bytes([path], {}) == 4 * (800 + 256 + 800)
    assert fp32_bytes([path], {"tie_word_embeddings": False}) == 4 * (800 + 256)
