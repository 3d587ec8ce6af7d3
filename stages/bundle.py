"""bundle: model + manifest + reports + model card + serving configs + monitoring (alert
rules from the load test's baseline, their promtool tests, a Grafana dashboard) + cluster
manifests (KServe and plain Kubernetes, sized from the plan and the load test), all
hashed."""

from __future__ import annotations

from typing import Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import CapacityPlan, LoadTestSummary, ModelInfo
from schemas.facts import BundleFacts
from schemas.manifest import (
    BUNDLE_UNHASHED,
    FACTS_FILE,
    MANIFEST_FILE,
    PROVENANCE_DIR,
    Manifest,
)
from schemas.tasks import TASKS
from stages._contract import (
    StageContext,
    StageIO,
    StageResult,
    link_or_copy,
)
from stages.bundling import cluster, monitoring
from stages.bundling.files import CHECKED, payload, provenance
from stages.bundling.hashing import hash_shards
from stages.bundling.oms import (
    build_manifest,
    load_manifest,
    read_facts,
    verify_bundle,
    write_manifest,
)

NAME = "bundle"
RENDERED = {"MODEL_CARD.md": "MODEL_CARD.md.j2"}


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "bundle.model_card"),
        reads=(ModelInfo, LoadTestSummary, CapacityPlan),
        upstream=(*CHECKED, "manifest"),
        # the manifest hashes every payload file; verify_bundle refuses any that differs
        sealed_by="manifest",
        code=("stages/templates/MODEL_CARD.md.j2",),
        attests=(*CHECKED, "manifest"),  # shipped as attestations/<stage>.json, hashed here
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    content = load_manifest(ctx.upstream("manifest") / MANIFEST_FILE)
    for name, source in payload(ctx).items():
        link_or_copy(source, ctx.work / name)
    link_or_copy(ctx.upstream("manifest") / FACTS_FILE, ctx.work / FACTS_FILE)
    facts = read_facts(ctx.work, BundleFacts)  # written by this build's manifest stage
    info = ctx.read(ModelInfo).model_dump()
    values = facts.serving.model_dump()
    loadtest = ctx.read(LoadTestSummary)
    shown = loadtest.model_dump(exclude_none=True)  # as summary.json has it
    rendered = render(ctx, release, info, values | {"loadtest": shown}, content, facts)
    generates = TASKS[release.task].serving == "generate"
    shipped = monitoring.files(
        ctx.release, loadtest.summary, facts.serving.max_queue_depth, generates
    )
    shipped |= cluster.files(
        ctx.release,
        release.version,
        ctx.read(CapacityPlan),
        loadtest.summary.peak_rss_mb,
        facts.serving.max_batch_size,
        cluster.defaults(ctx.release, release.version),
    )
    for name, text in shipped.items():
        (ctx.work / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx.work / name).write_text(text, encoding="utf-8")
    rendered += list(shipped)
    chain = provenance(ctx, (*CHECKED, "manifest"))  # who built each stage: not in its payload
    for name, source in chain.items():
        link_or_copy(source, ctx.work / name)
    own = attest_files(ctx, release)  # every file shipped so far, signed by the builder
    shard = content.predicate.serialization.shard_size
    extra = hash_shards({n: ctx.work / n for n in [*rendered, *chain, own]}, shard)
    digests = {r.name: r.digest for r in content.predicate.resources} | extra
    final = build_manifest(content.subject[0].name, digests, shard)
    write_manifest(ctx.work / MANIFEST_FILE, final)
    problems = verify_bundle(ctx.work)
    if problems:  # what ships must verify as it is, or nothing ships
        raise StageError(
            NAME,
            "the assembled bundle does not verify: " + "; ".join(problems[:5]),
            "a payload file changed while the bundle was assembled; rerun the bundle stage",
        )
    files = sum(1 for p in ctx.work.rglob("*") if p.is_file())
    return StageResult.passed(
        f"{files} files in build/{ctx.release}/bundle; bundle digest {final.digest} "
        "(OMS root digest: manifest.json's subject, what a signature covers)",
        metrics={"files": files},
        details={"serving": values, "bundle_digest": final.digest},
    )


# The bundle's own file list, signed by the builder: every file of the bundle but the seal
# (manifest.json, model.sig) and itself. `shipyard verify --provenance` holds the shipped
# files to it by name and digest, so a bundle edited and re-sealed (its manifest rebuilt, a
# signature of someone else's) fails: a changed model card or alert rule, a file added,
# renamed or deleted.
OWN_ATTESTATION = f"{PROVENANCE_DIR}/bundle.json"


def attest_files(ctx: StageContext, release: ReleaseSpec) -> str:
    from stages.bundling.dsse import builder_key_from_env, envelope
    from stages.bundling.hashing import hash_files

    files = {
        p.relative_to(ctx.work).as_posix(): p
        for p in sorted(ctx.work.rglob("*"))
        if p.is_file()
        and p.relative_to(ctx.work).as_posix() not in (*BUNDLE_UNHASHED, OWN_ATTESTATION)
    }
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [
            {"name": n, "digest": {"sha256": d}} for n, d in sorted(hash_files(files).items())
        ],
        "predicateType": "https://shipyard.dev/provenance/stage-run/v1",
        "predicate": {
            "stage": NAME,
            "release": release.name,
            "command": f"shipyard run-stage {NAME}: the files it ships",
            "inputs": [],
        },
    }
    try:
        key = builder_key_from_env()
    except (OSError, ValueError, TypeError) as exc:
        raise StageError(
            NAME, f"cannot read the builder key: {exc}", "fix SHIPYARD_BUILDER_KEY"
        ) from None
    path = ctx.work / OWN_ATTESTATION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envelope(statement, key), encoding="utf-8")
    return OWN_ATTESTATION


def render(
    ctx: StageContext,
    release: ReleaseSpec,
    info: dict[str, Any],
    values: dict[str, Any],
    content: Manifest,
    facts: BundleFacts,
) -> list[str]:
    from stages.rendering.render import render as render_templates

    context = {
        **values,
        "release": ctx.release,
        "version": release.version,
        "task": release.task,
        "info": info,
        "card": release.bundle.model_card.model_dump(),
        "stages": {n: v.model_dump(exclude_none=True) for n, v in facts.stages.items()},
        # The card cannot carry the digest of a bundle that contains the card: it shows the
        # root digest of everything else (the manifest stage's), and says so.
        "content_digest": content.digest,
        "quant": facts.quantization.model_dump(exclude_none=True),
        "evaluation": facts.evaluation,
    }
    render_templates(ctx.work, RENDERED, context, trim=False)
    return list(RENDERED)
