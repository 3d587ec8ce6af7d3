"""TensorRT build and engine parity; imported only where TensorRT and a CUDA device exist
(the engine stage checks first). Written against TensorRT 10+ through Polygraphy.

TensorRT 10/11 engines here are strongly typed: INT8 comes from the Q/DQ nodes in the ONNX.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Refused
from schemas.artifacts import CapacityPlan, EngineBuild, EngineParityRow, ModelInfo
from stages._contract import StageContext, StageResult
from stages.onnx import shapes as sh

if TYPE_CHECKING:
    from schemas import ReleaseSpec
    from schemas.spec.engine import EngineConfig
    from schemas.spec.parity import ParityConfig, Tolerance


def build_and_check(
    ctx: StageContext,
    release: ReleaseSpec,
    info: ModelInfo,
    profiles: list[dict[str, Any]],
    model: Path,
    details: dict[str, Any],
) -> StageResult:
    import tensorrt as trt

    cfg = release.engine
    shared = ctx.root / cfg.timing_cache if cfg.timing_cache else None
    local = ctx.work / "timing.cache"
    plan, seconds = build(model, profiles, cfg, shared, local)
    save_timing_cache(local, shared)
    from stages.tensorrt import triton as trt_entry

    capability, gpu = device_facts()
    plan_name = trt_entry.plan_name(capability)
    # The plan lives once, in the TensorRT Triton entry's version folder, where Triton
    # loads it from (cc_model_filenames name files inside the version folder).
    model_dir = ctx.work / trt_entry.trt_model_dir(ctx.release)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / plan_name).write_bytes(plan)
    # The same comparator and settings as the parity stage (per-output tolerances, statistic);
    # engine.parity, when set, replaces the default tolerance.
    parity = engine_parity(plan, model, profiles, info, release.parity, cfg.parity)
    graphs = []
    if cfg.cuda_graphs.enabled:
        from stages.tensorrt.cuda_graphs import cuda_graph_check

        graphs = cuda_graph_check(plan, profiles, cfg.cuda_graphs.batch_sizes)
    details.update(
        tensorrt=trt.__version__,
        gpu=gpu,
        compute_capability=capability,
        build_seconds=round(seconds, 1),
        parity=[p.model_dump() for p in parity],
        cuda_graphs=[g.model_dump() for g in graphs],
    )
    render_triton(ctx, release, profiles, capability)
    layout = trt_entry.check_trt_layout(model_dir)
    if layout:
        raise Refused(
            f"the TensorRT Triton entry is not loadable: {'; '.join(layout)}",
            "fix triton_trt_values / the template so every named file is in version 1",
        )
    details["plan"] = f"{trt_entry.trt_model_dir(ctx.release)}/1/{plan_name}"
    ctx.write(
        EngineBuild(
            tensorrt=trt.__version__,
            gpu=gpu,
            compute_capability=capability,
            plan=details["plan"],
            parity=parity,
            cuda_graphs=graphs,
        )
    )
    bad = [p.why for p in parity if not p.ok] + [g.why for g in graphs if not g.ok]
    summary = (
        f"TensorRT {trt.__version__} on {gpu} (sm {capability}): {len(profiles)} profile(s), "
        f"parity at {len(parity)} shapes, CUDA graphs at batch {cfg.cuda_graphs.batch_sizes}"
    )
    if bad:
        return StageResult.failed(summary, bad, details=details)
    return StageResult.passed(summary, details=details)


def save_timing_cache(local: Path, shared: Path | None) -> None:
    """Drop Polygraphy's sibling lock file (not an output), then update the shared cache
    atomically: written beside it and renamed, so a reader never sees half a cache."""
    local.with_name(local.name + ".lock").unlink(missing_ok=True)
    if shared is None or not local.is_file():
        return
    shared.parent.mkdir(parents=True, exist_ok=True)
    tmp = shared.with_name(f".{shared.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(local, tmp)
        os.replace(tmp, shared)
    finally:
        tmp.unlink(missing_ok=True)


def compatibility_level(trt: Any, name: str) -> Any:
    """The HardwareCompatibilityLevel for a spec value, looked up only when asked for:
    SAME_COMPUTE_CAPABILITY first appears in TensorRT 10.9, so reading it eagerly broke
    every build on 10.0-10.8."""
    attr = {
        "none": "NONE",
        "ampere_plus": "AMPERE_PLUS",
        "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
    }[name]
    level = getattr(trt.HardwareCompatibilityLevel, attr, None)
    if level is None:
        raise Refused(
            f"engine.hardware_compatibility {name!r} needs a newer TensorRT than "
            f"{getattr(trt, '__version__', '?')} (no HardwareCompatibilityLevel.{attr})",
            "upgrade TensorRT (>= 10.9 for same_compute_capability) or choose another level",
        )
    return level


def build(
    model: Path, profiles: list[dict[str, Any]], cfg: EngineConfig, shared: Path | None, cache: Path
) -> tuple[bytes, float]:
    """Parse strongly typed, add the profiles, build; the timing cache is read from the
    shared one (when given) and written to `cache` in the stage's own folder."""
    import tensorrt as trt
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        Profile,
    )

    trt_profiles = []
    for p in profiles:
        prof = Profile()
        for name, s in p["shapes"].items():
            prof.add(name, min=s["min"], opt=s["opt"], max=s["max"])
        trt_profiles.append(prof)
    config = CreateConfig(
        profiles=trt_profiles,
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: int(cfg.workspace)},
        builder_optimization_level=cfg.optimization_level,
        hardware_compatibility_level=compatibility_level(trt, cfg.hardware_compatibility),
        version_compatible=cfg.version_compatible,
        load_timing_cache=str(shared) if shared is not None and shared.is_file() else None,
    )
    network = NetworkFromOnnxPath(str(model), strongly_typed=True)
    start = time.monotonic()
    try:
        plan = EngineBytesFromNetwork(network, config, save_timing_cache=str(cache))()
    except Exception as exc:  # Polygraphy raises PolygraphyException with the parser's log
        raise Refused(
            f"TensorRT could not build {model.name}: {exc}",
            "read the TensorRT log above; unsupported ops need a plugin or a different opset",
        ) from None
    return bytes(plan), time.monotonic() - start


def device_facts() -> tuple[str, str]:
    from cuda.bindings import runtime as cudart

    from stages.tensorrt.cuda_graphs import _ok

    props = _ok(cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    return f"{props.major}.{props.minor}", props.name.decode(errors="replace").strip("\x00")


def parity_shapes(profile: dict[str, Any], info: ModelInfo) -> dict[str, Any]:
    """Input shapes at the profile's min, opt and max, and at an odd size in between; the
    odd one is chosen per named dim, so past + sequence still equals total_sequence."""
    picked = {k: {n: s[k] for n, s in profile["shapes"].items()} for k in sh.BOUNDS}
    odd = sh.corners(profile["dims"], (), odd_avoid={})["odd"]
    picked["odd"] = {t.name: [sh.axis_size(a, odd) for a in t.axes] for t in info.inputs}
    return picked


def _feeds(info: ModelInfo, shapes: dict[str, list[int]], seed: int) -> dict[str, Any]:
    tensors = [
        sh.token_tensor(t.name, t.dtype, t.axes, info.arch.vocab, (t.low, t.high))
        for t in info.inputs
    ]
    return sh.seeded_inputs(tensors, shapes, seed)


def engine_parity(
    plan: bytes,
    model: Path,
    profiles: list[dict[str, Any]],
    info: ModelInfo,
    parity: ParityConfig,
    default: Tolerance | None = None,
) -> list[EngineParityRow]:
    """TensorRT vs ONNX Runtime per profile at min/opt/max/odd; names the first bad layer."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    rows = []
    with OnnxrtRunner(SessionFromOnnx(str(model))) as ort_runner:
        for i, profile in enumerate(profiles):
            # EngineFromBytes allows host code, as trtexec does: version-compatible engines load
            with TrtRunner(EngineFromBytes(plan), optimization_profile=i) as trt:
                for label, shapes in parity_shapes(profile, info).items():
                    feeds = _feeds(info, shapes, seed=i)
                    want = ort_runner.infer(feeds)
                    have = trt.infer(feeds)
                    rows.append(judge(profile["name"], label, want, have, parity, default))
    if any(not r.ok for r in rows):
        try:
            rows.append(first_diverging_layer(plan, model, profiles, info, rows, parity, default))
        except Exception as exc:  # a diagnosis; its failure must not hide the verdict
            bad = next(r for r in rows if not r.ok)
            rows.append(bad.model_copy(update={"why": f"could not localize the divergence: {exc}"}))
    return rows


def judge(
    profile: str,
    label: str,
    want: dict[str, Any],
    have: dict[str, Any],
    parity: ParityConfig,
    default: Tolerance | None = None,
) -> EngineParityRow:
    """One parity row from the shared comparator: a NaN, a missing output or a shape
    mismatch fails, and the first failing output is named."""
    from stages.onnx.compare import compare_outputs

    results = compare_outputs(want, have, parity, default)
    bad = [r for r in results if not r.ok]
    worst = max((r.error for r in results), default=0.0)
    if not bad:
        why = f"ok ({parity.statistic} normalized error {worst:.3g} <= 1)"
    else:
        first = bad[0]
        why = f"{first.output} out of tolerance: " + (
            first.note or f"{parity.statistic} normalized error {first.error:.3g} > 1"
        )
    return EngineParityRow(
        profile=profile, shape=label, ok=not bad, why=f"profile {profile} {label}: {why}"
    )


def onnx_with_every_tensor(model: Path) -> Any:
    """An ONNX Runtime session loader whose outputs are every tensor of the graph.
    SessionFromOnnx takes bytes or a path, never a ModelProto: serialize first."""
    from polygraphy import constants
    from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
    from polygraphy.backend.onnxrt import SessionFromOnnx

    return SessionFromOnnx(
        BytesFromOnnx(ModifyOutputs(OnnxFromPath(str(model)), outputs=constants.MARK_ALL))
    )


def first_diverging_layer(
    plan: bytes,
    model: Path,
    profiles: list[dict[str, Any]],
    info: ModelInfo,
    rows: list[EngineParityRow],
    parity: ParityConfig,
    default: Tolerance | None = None,
) -> EngineParityRow:
    """Rebuild with every tensor marked as an output at the first failing shape; the first
    tensor in graph order that disagrees with ONNX Runtime's is the diverging layer."""
    from polygraphy import constants
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineFromNetwork,
        ModifyNetworkOutputs,
        NetworkFromOnnxPath,
        Profile,
        TrtRunner,
    )

    from stages.onnx.compare import compare_outputs

    bad = next(r for r in rows if not r.ok)
    index = next(i for i, p in enumerate(profiles) if p["name"] == bad.profile)
    shapes = parity_shapes(profiles[index], info)[bad.shape]
    feeds = _feeds(info, shapes, seed=index)
    prof = Profile()
    for name, s in shapes.items():
        prof.add(name, min=s, opt=s, max=s)
    network = ModifyNetworkOutputs(
        NetworkFromOnnxPath(str(model), strongly_typed=True), outputs=constants.MARK_ALL
    )
    with TrtRunner(EngineFromNetwork(network, CreateConfig(profiles=[prof]))) as runner:
        have = runner.infer(feeds)
    with OnnxrtRunner(onnx_with_every_tensor(model)) as ort_runner:
        want = ort_runner.infer(feeds)
    common = {n: v for n, v in want.items() if n in have}  # ORT returns graph order
    for row in compare_outputs(common, have, parity, default):
        if not row.ok:
            return bad.model_copy(update={"why": f"first diverging tensor: {row.output}"})
    why = "no single intermediate tensor diverges; the outputs do"
    return bad.model_copy(update={"why": why})


def render_triton(
    ctx: StageContext, release: ReleaseSpec, profiles: list[dict[str, Any]], capability: str
) -> None:
    from stages.tensorrt import triton as trt_entry

    plan_batch = ctx.read(CapacityPlan).batch
    values = trt_entry.triton_trt_values(
        profiles,
        release.bundle.serving,
        plan_batch,
        release.engine.cuda_graphs,
        capability,
        portable=release.engine.hardware_compatibility != "none",
    )
    trt_entry.render_trt_triton(ctx.work, ctx.release, values)
