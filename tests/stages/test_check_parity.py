from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from schemas.details import ParityDetails
from schemas.release import ParityConfig, Tolerance
from stages.onnx.compare import compare, tolerance
from tests.conftest import Workspace, generic_spec, gpt2_spec


def test_parity_passes_at_min_opt_max_and_odd_shapes(built_gpt2: Workspace) -> None:
    report = built_gpt2.run("parity", gpt2_spec())
    assert report.status.value == "passed"
    details = ParityDetails.model_validate(report.details)
    assert {row.shape for row in details.comparisons} == {"min", "opt", "max", "odd"}
    assert details.layerwise is None and "layerwise" not in report.details  # on-failure only


def test_layerwise_always_maps_every_gpt2_block_to_an_onnx_tensor(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(parity={"layerwise": "always"})
    layers = ParityDetails.model_validate(built_gpt2.run("parity", spec).details).layerwise
    assert layers is not None
    modules = [row.module for row in layers.layers]
    assert {"transformer.h.0.attn[0]", "transformer.h.1.mlp", "transformer.ln_f", "lm_head"} <= set(
        modules
    )
    assert layers.first_divergent is None


def test_divergent_layer_is_named_first(ws: Workspace) -> None:
    spec = generic_spec("divergent", "divergent")
    for stage in ("pin", "export"):
        ws.run(stage, spec)
    report = ws.run("parity", spec)
    assert report.status.value == "failed"
    assert report.reasons[-1].startswith("what the failed run wrote is kept in ")
    assert report.reasons[-2].startswith("first diverging layer: skew (ONNX tensor")
    # the inputs that failed, kept beside the report and outside DVC's outputs
    kept = ws.root / "build" / "divergent" / "failed" / "parity"
    with np.load(kept / "failed_inputs_0.npz") as feeds:
        assert list(feeds) == ["x"] and feeds["x"].ndim == 3
    assert sorted(p.name for p in ws.out("divergent", "parity").iterdir()) == ["report.json"]
    layers = ParityDetails.model_validate(report.details).layerwise
    assert layers is not None and layers.first_divergent is not None
    first = layers.layers[0]
    assert first.module == "first" and first.ok
    assert layers.first_divergent.module == "skew" and not layers.first_divergent.ok


def test_tight_tolerance_turns_a_pass_into_a_failure(built_gpt2: Workspace) -> None:
    spec = gpt2_spec(parity={"tolerance": {"atol": 0.0, "rtol": 0.0}, "outputs": {}})
    report = built_gpt2.run("parity", spec)
    assert report.status.value == "failed"
    assert "first diverging layer" in report.reasons[-2]


def test_per_output_glob_tolerance_wins_over_default() -> None:
    cfg = ParityConfig(outputs={"present.*": Tolerance(atol=1.0, rtol=0.0)})
    assert tolerance(cfg, "present.3.key").atol == 1.0
    assert tolerance(cfg, "logits").atol == cfg.tolerance.atol


@pytest.mark.parametrize(
    "statistic,expected_ok", [("max", False), ("mean", True), ("quantile", True)]
)
def test_statistic_decides_how_one_outlier_counts(statistic: str, expected_ok: bool) -> None:
    ref = np.zeros(1000, np.float32)
    out = ref.copy()
    out[0] = 0.5  # one element far off, the rest exact
    cfg = ParityConfig(statistic=statistic, quantile=0.99)
    result = compare(ref, out, Tolerance(atol=0.01, rtol=0.0), cfg)
    assert result.ok is expected_ok and result.max_abs == 0.5


def test_nan_in_output_is_a_failure() -> None:
    ref = np.ones(4, np.float32)
    out = ref.copy()
    out[1] = np.nan
    assert compare(ref, out, Tolerance(), ParityConfig()).ok is False


def test_shape_mismatch_is_a_failure_with_a_note() -> None:
    result = compare(np.ones((2, 3)), np.ones((3, 2)), Tolerance(), ParityConfig())
    assert not result.ok and result.note is not None and "!= reference" in result.note
    assert result.error == float("inf") and result.max_abs == float("inf")


def test_empty_outputs_agree() -> None:
    """A zero-size output (an empty KV cache) has nothing to disagree about."""
    empty = np.zeros((2, 0, 4), np.float32)
    assert compare(empty, empty.copy(), Tolerance(), ParityConfig()).dump() == {
        "ok": True,
        "error": 0.0,
        "max_abs": 0.0,
    }
    one = compare(np.zeros(1), np.zeros(1), Tolerance(), ParityConfig())  # size 1 is not empty
    assert one.dump() == {"ok": True, "error": 0.0, "max_abs": 0.0}
    assert compare(np.zeros(1), np.ones(1), Tolerance(), ParityConfig()).ok is False


@pytest.mark.parametrize("statistic", ["max", "mean", "quantile"])
def test_a_normalized_error_of_exactly_one_passes_and_just_above_fails(statistic: str) -> None:
    """The limit is <= 1 for every statistic: at 1 it passes, at 1.5 it fails."""
    cfg = ParityConfig(statistic=statistic, quantile=0.5)
    tol = Tolerance(atol=0.25, rtol=0.0)
    ref = np.zeros(4, np.float64)
    at = compare(ref, np.full(4, 0.25), tol, cfg)
    assert at.dump() == {"ok": True, "error": 1.0, "max_abs": 0.25}
    past = compare(ref, np.full(4, 0.375), tol, cfg)
    assert past.ok is False and past.error == 1.5


@pytest.mark.parametrize("statistic", ["max", "mean", "quantile"])
def test_zero_tolerance_accepts_exact_equality_and_nothing_else(statistic: str) -> None:
    exact, cfg = Tolerance(atol=0.0, rtol=0.0), ParityConfig(statistic=statistic)
    assert compare(np.zeros(3), np.zeros(3), exact, cfg).dump() == {
        "ok": True,
        "error": 0.0,
        "max_abs": 0.0,
    }
    assert compare(np.zeros(3), np.full(3, 1e-12), exact, cfg).ok is False


def _naive(ref: np.ndarray, out: np.ndarray, tol: Tolerance, cfg: ParityConfig) -> dict:
    """The comparator's definition in whole-array numpy (what the chunked one must equal)."""
    diff = np.abs(ref.astype(np.float64) - out.astype(np.float64))
    finite = ref[np.isfinite(ref)].astype(np.float64)
    scale = max(1.0, float(np.sqrt(np.mean(finite**2)))) if tol.scale == "rms" else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = np.where(diff == 0, 0.0, diff / (tol.atol * scale + tol.rtol * np.abs(ref)))
    reduce = {"max": np.max, "mean": np.mean}.get(cfg.statistic)
    error = float(reduce(norm)) if reduce else float(np.quantile(norm, cfg.quantile))
    error = error if np.isfinite(error) and np.isfinite(diff).all() else float("inf")
    max_abs = float(np.max(diff)) if np.isfinite(diff).all() else float("inf")
    return {"ok": error <= 1.0, "error": error, "max_abs": max_abs}


@pytest.mark.parametrize("statistic", ["max", "mean", "quantile"])
@pytest.mark.parametrize("poison", [None, np.nan, np.inf])
@pytest.mark.parametrize("scale", ["rms", "none"])
def test_the_chunked_comparator_equals_the_whole_array_definition(
    monkeypatch: pytest.MonkeyPatch, statistic: str, poison: float | None, scale: str
) -> None:
    """Across chunk boundaries (a chunk of 7 elements over 100), with a NaN or inf in the
    last chunk, every statistic gives what the whole-array formula gives, the tensor's RMS
    (above 20 here: an outlier column) summed chunk by chunk."""
    import stages.onnx.compare as comparator

    monkeypatch.setattr(comparator, "CHUNK", 7)
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((4, 25)).astype("f4")
    ref[:, 7] *= 150
    out = ref + rng.normal(0, 1e-3, ref.shape).astype("f4")
    out[0, 3] = ref[0, 3]  # an exact element
    if poison is not None:
        out[3, 24] = poison
    extra = {"quantile": 0.9} if statistic == "quantile" else {}
    cfg = ParityConfig(statistic=statistic, **extra)
    tol = Tolerance(atol=1e-4, rtol=1e-3, scale=scale)
    got, want = compare(ref, out, tol, cfg), _naive(ref, out, tol, cfg)
    assert got.ok == want["ok"] and got.max_abs == want["max_abs"]
    assert got.error == pytest.approx(want["error"], rel=1e-12, abs=0)
    if poison is not None:
        assert got.error == float("inf") and not got.ok
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
    scaled = got.atol_scale if got.atol_scale is not None else 1.0
    assert rms > 20 and scaled == (pytest.approx(rms) if scale == "rms" else 1)


def test_rms_scale_forgives_rounding_that_follows_the_tensor_and_nothing_more() -> None:
    """A tensor of magnitude 100 (RMS) whose element near zero is off by 1e-3, what float32
    rounding of values that size leaves: a fixed atol of 1e-4 fails it, the RMS-scaled one
    passes. An error of 1% of the tensor's scale (a real defect) fails either way, and a
    tensor of magnitude below 1 is judged exactly as numpy.allclose judges it."""
    rng = np.random.default_rng(5)
    ref = (rng.standard_normal(4096) * 100).astype("f4")
    ref[0] = 0.01
    noisy = ref.copy()
    noisy[0] += 1e-3
    cfg = ParityConfig()
    assert not compare(ref, noisy, Tolerance(scale="none"), cfg).ok
    scaled = compare(ref, noisy, Tolerance(), cfg)
    assert scaled.ok and scaled.atol_scale == pytest.approx(100, rel=0.05)
    broken = ref.copy()
    broken[0] += 1.0  # 1% of the RMS
    assert not compare(ref, broken, Tolerance(), cfg).ok
    small = rng.uniform(-0.5, 0.5, 4096).astype("f4")
    off = small + rng.normal(0, 2e-4, small.shape).astype("f4")
    got = compare(small, off, Tolerance(), cfg)
    assert got.atol_scale is None and "atol_scale" not in got.dump()
    assert got.ok == bool(np.allclose(off, small, atol=1e-4, rtol=1e-3))


def _resident_kb(name: str) -> int:
    """Resident kB of the mappings of files called `name` in this process."""
    total, hit = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            hit = head[-1].endswith(name)
        elif hit and head[:1] == ["Rss:"]:
            total += int(head[1])
    return total


@pytest.mark.parametrize("statistic", ["max", "mean", "quantile"])
def test_a_memory_mapped_reference_gives_the_same_and_leaves_the_resident_set(
    tmp_path: Path, statistic: str
) -> None:
    """Parity's saved reference, memory-mapped read-only: the same result as in memory, and
    its pages are dropped chunk by chunk (all of a 4 MB reference is read, none stays).
    A writable mapping or a strided view keeps its pages (dropping could lose a write)."""
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((1000, 1000)).astype("f4")
    out = ref + rng.normal(0, 1e-4, ref.shape).astype("f4")
    np.save(tmp_path / "ref.npy", ref)
    extra = {"quantile": 0.9} if statistic == "quantile" else {}
    cfg, tol = ParityConfig(statistic=statistic, **extra), Tolerance(atol=1e-4, rtol=1e-3)
    mapped = np.load(tmp_path / "ref.npy", mmap_mode="r")
    assert compare(mapped, out, tol, cfg) == compare(ref, out, tol, cfg)
    assert _resident_kb("ref.npy") <= 8  # the header's page and a last partial page at most
    np.asarray(mapped).sum()  # the pages fault back in, unchanged
    assert _resident_kb("ref.npy") > 3000
    del mapped
    writable = np.load(tmp_path / "ref.npy", mmap_mode="r+")
    compare(writable, out, tol, cfg)
    assert _resident_kb("ref.npy") > 3000
    del writable
    strided = np.load(tmp_path / "ref.npy", mmap_mode="r")[:, ::2]
    compare(strided, out[:, ::2], tol, cfg)
    assert _resident_kb("ref.npy") > 3000
