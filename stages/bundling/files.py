"""Which upstream files go into a bundle, under which names: shared by the manifest stage
(which hashes them) and the bundle stage (which assembles them)."""

from __future__ import annotations

from pathlib import Path

from schemas.artifacts import NOT_SHIPPED, ModelInfo, QuantInfo
from schemas.manifest import PROVENANCE_DIR
from stages import STAGES
from stages._contract import StageContext, attestation_file
from stages.bundling.layout import MODEL_DIR

DIAGNOSTICS = ("server.log", ".lock")  # stay in the build folder


# Every stage before the manifest: their reports ship, and their verdicts gate the bundle.
CHECKED = tuple(STAGES)[: tuple(STAGES).index("manifest")]


def payload(ctx: StageContext) -> dict[str, Path]:
    """Bundle path -> upstream file, for the model, the stage reports and the serving configs.

    The ONNX model is stored once, inside Triton's version folder (Triton needs it there;
    serving.yaml and MLServer point at the same file). The load-test server log stays in the
    build folder: it is a diagnostic, not something a deployment needs.
    """
    quantized = ctx.upstream("quantize")
    files = {
        f"{MODEL_DIR.format(release=ctx.release)}/{p.name}": p
        for p in sorted(quantized.glob("model.onnx*"))
    }
    files["model/model_info.json"] = ctx.upstream(ModelInfo.STAGE) / ModelInfo.FILE
    # the checkpoint's config and tokenizer (export copies them): a client needs nothing else
    files.update(_outputs(ctx.upstream("export") / "model_files", "model/files/", "-"))
    files["model/quant_info.json"] = ctx.upstream(QuantInfo.STAGE) / QuantInfo.FILE
    for stage in CHECKED:
        files[f"reports/{stage}.json"] = ctx.upstream(stage) / "report.json"
    files.update(_outputs(ctx.upstream("serve"), "", "serve"))
    engine = ctx.upstream("engine")
    files.update(
        {k: v for k, v in _outputs(engine, "", "engine").items() if k.startswith("serving/")}
        | {
            f"engine/{p.name}": p
            for p in sorted(engine.glob("*"))
            if p.is_file() and p.name != "report.json" and f"engine/{p.name}" not in NOT_SHIPPED
        }
    )
    loadtest = _outputs(ctx.upstream("loadtest"), "reports/loadtest/", "loadtest")
    files.update({k: v for k, v in loadtest.items() if not k.endswith(DIAGNOSTICS)})
    return files


def provenance(ctx: StageContext, stages: tuple[str, ...]) -> dict[str, Path]:
    """Each stage's signed provenance, where `shipyard run-stage` wrote one (a stage run
    through the Python API has none; `shipyard verify --provenance` names it missing). Not
    in the manifest's payload: who built a stage is not what it built, so a rebuild with new
    code but the same bytes reruns the bundle (which ships the attestations), not the
    manifest and every stage between."""
    found = {f"{PROVENANCE_DIR}/{s}.json": ctx.build / attestation_file(s) for s in stages}
    return {name: path for name, path in found.items() if path.is_file()}


def _outputs(folder: Path, prefix: str, producer: str) -> dict[str, Path]:
    """Every file the `producer` stage wrote but its report (which goes under reports/) and
    the artifacts that feed the facts instead of shipping."""
    return {
        prefix + p.relative_to(folder).as_posix(): p
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name != "report.json"
        and f"{producer}/{p.relative_to(folder).as_posix()}" not in NOT_SHIPPED
    }
