"""serve + loadtest: configs parsed back by Triton's protobuf, a real MLServer on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import pytest

from pipelines.gate import gate
from schemas import SpecError, StageError
from schemas.artifacts import LoadTestSummary
from schemas.loader import load_release
from schemas.loadresults import (
    LoadTestResults,
    Point,
    Skipped,
    SloVerdict,
    Soak,
    WindowMetrics,
)
from stages.loadtesting import loadgen as lg
from stages.loadtesting.server import LocalServer, assemble
from stages.rendering.render import parse_triton
from tests.conftest import QUICK_LOADTEST, REPO, Workspace, gpt2_spec


def measured(ws: Workspace) -> LoadTestResults:
    """The load test's loadtest.json, parsed."""
    path = ws.out("tiny-gpt2", "loadtest") / "loadtest.json"
    return LoadTestResults.model_validate_json(path.read_text())


def _tree(ws: Workspace, dest: Path) -> Path:
    models = sorted(ws.out("tiny-gpt2", "quantize").glob("model.onnx*"))
    assemble(dest, models, ws.out("tiny-gpt2", "serve"))
    return dest


def test_triton_config_parses_back_with_dynamic_dims(built_gpt2: Workspace) -> None:
    path = built_gpt2.out("tiny-gpt2", "serve") / "serving/triton/tiny-gpt2/config.pbtxt"
    config = parse_triton(path.read_text())
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == 3  # export.dims.batch.max of the test spec
    dims = {i.name: list(i.dims) for i in config.input}
    assert dims["input_ids"] == [-1]
    assert dims["past_key_values.0.key"] == [4, -1, 16]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 64
    assert config.model_warmup[0].batch_size == 3


def test_a_malformed_triton_config_is_refused_with_its_line() -> None:
    with pytest.raises(ValueError, match=r"model_config.proto rejects it at 2:"):
        parse_triton('name: "m"\nmax_batch_size: "eight"\n')


def test_a_malformed_template_variable_is_refused_at_render(
    built_gpt2: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    templates = tmp_path / "templates"
    from stages.rendering import render as _render

    shutil.copytree(_render.TEMPLATES, templates)
    broken = templates / "triton_config.pbtxt.j2"
    broken.write_text(broken.read_text().replace("triton.max_batch_size", "triton.max_batch"))
    monkeypatch.setattr(_render, "TEMPLATES", templates)
    report = built_gpt2.run("serve", gpt2_spec())
    assert report.status.value == "failed"
    assert "stages/templates/triton_config.pbtxt.j2 does not render" in report.reasons[0]
    assert "max_batch" in report.reasons[0]
    assert not (built_gpt2.out("tiny-gpt2", "serve") / "serving").exists()
    monkeypatch.undo()
    assert built_gpt2.run("serve", gpt2_spec()).status.value == "passed"


def test_preferred_batch_sizes_beyond_the_served_batch_are_refused(
    built_gpt2: Workspace,
) -> None:
    spec = gpt2_spec()
    spec["bundle"] = {"serving": {"preferred_batch_sizes": [2, 4]}}
    with pytest.raises(SpecError) as info:  # known from the spec alone: refused at validate
        built_gpt2.spec(spec)
    assert "preferred_batch_sizes: 4 is beyond the served max_batch_size 3" in str(info.value)
    spec["bundle"] = {"serving": {"preferred_batch_sizes": [2, 3]}}  # at the limit: passes
    assert built_gpt2.run("serve", spec).status.value == "passed"
    assert built_gpt2.run("serve", gpt2_spec()).status.value == "passed"


async def _infer(url: str, ids: list[list[int]], tokens: int, stream: bool = False) -> list:
    # ignore_eos: every row decodes `tokens` (tiny-gpt2's EOS, id 1, would cut some short)
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    body = lg.v2_body({"input_ids": np.array(ids, dtype=np.int64)}, params)
    async with aiohttp.ClientSession() as s:
        path = "infer_stream" if stream else "infer"
        headers = {"content-type": "application/json"}
        async with s.post(f"{url}/v2/models/tiny-gpt2/{path}", data=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            if not stream:
                return (await resp.json())["outputs"][0]["data"]
            events = [line async for line in resp.content if line.startswith(b"data:")]
            return [json.loads(e[5:])["outputs"][0]["data"][0] for e in events]


def test_server_batches_concurrent_requests_without_mixing_rows(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    """Concurrent requests decode in one batch (joining and leaving between steps, rows of
    other lengths left-padded); each gets its own tokens back: the same as alone, the same
    as streamed, whatever arrived with it."""
    prompts = [[5, 9, 2, 7], [100, 3, 3, 1], [42, 42, 8, 0], [7, 7], [1, 2, 3, 4, 5, 6]]
    tokens = [5, 5, 5, 5, 3]
    jobs = list(zip(prompts, tokens, strict=True))
    with LocalServer(_tree(built_gpt2, tmp_path), "tiny-gpt2", tmp_path / "log", 60) as srv:
        alone = [asyncio.run(_infer(srv.url, [p], n)) for p, n in jobs]

        async def together() -> list:
            return list(await asyncio.gather(*(_infer(srv.url, [p], n) for p, n in jobs)))

        for _ in range(3):
            assert asyncio.run(together()) == alone
        assert asyncio.run(_infer(srv.url, [prompts[0]], 5, stream=True)) == alone[0]
        two_rows = asyncio.run(_infer(srv.url, prompts[:2], 5))
        assert two_rows == alone[0] + alone[1]  # [2, 5] row-major
    assert [len(a) for a in alone] == tokens
    assert len({tuple(a) for a in alone}) > 1  # different prompts, different continuations


BATCHER_CHECK = """
import asyncio, json, time
import numpy as np
from shipyard_runtime.mlserver import Batcher

batches = []

def run(key, feeds):
    batches.append([key, len(feeds["x"])])
    return {"y": feeds["x"] * 10}

async def go():
    b = Batcher(run, max_rows=4, delay=0.05)
    jobs = [("a", [[1], [2]]), ("a", [[3]]), ("b", [[4]]), ("a", [[5], [6]])]
    return await asyncio.gather(*(b.submit(k, {"x": np.array(r)}) for k, r in jobs))

results = asyncio.run(go())
busy = []

def slow(key, feeds):
    busy.append(len(feeds["x"]))
    time.sleep(0.2)
    return {"y": feeds["x"]}

async def queued():
    # one instance, busy with the first request: the next five wait and share one batch
    b = Batcher(slow, max_rows=8, delay=0.0)
    first = asyncio.ensure_future(b.submit("k", {"x": np.zeros((1, 1))}))
    await asyncio.sleep(0.05)
    rest = [b.submit("k", {"x": np.zeros((1, 1))}) for _ in range(5)]
    await asyncio.gather(first, *rest)

asyncio.run(queued())
print(json.dumps({"y": [r["y"].ravel().tolist() for r in results], "batches": batches,
                  "busy": busy}))
"""


def test_the_batcher_merges_only_compatible_requests_up_to_max_rows() -> None:
    # A process of its own: mlserver's and tritonclient's protobufs share names and cannot
    # both be imported into one process (the server never imports tritonclient).
    done = subprocess.run(
        [sys.executable, "-c", BATCHER_CHECK], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["y"] == [[10, 20], [30], [40], [50, 60]]
    # a: 2 rows + 1 row wait together; 2 more would exceed 4, so they start a batch of their own
    assert sorted(map(tuple, out["batches"])) == [("a", 2), ("a", 3), ("b", 1)]
    assert out["busy"] == [1, 5]  # requests that queued behind a busy instance batched


def test_the_server_refuses_bad_generation_requests_with_400(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    async def status(ids: list[list[int]], tokens: int) -> tuple[int, str]:
        body = lg.v2_body({"input_ids": np.array(ids, dtype=np.int64)}, {"max_new_tokens": tokens})
        async with aiohttp.ClientSession() as s:
            headers = {"content-type": "application/json"}
            url = f"{srv.url}/v2/models/tiny-gpt2/infer"
            async with s.post(url, data=body, headers=headers) as resp:
                return resp.status, await resp.text()

    with LocalServer(_tree(built_gpt2, tmp_path), "tiny-gpt2", tmp_path / "log", 60) as srv:
        too_long = asyncio.run(status([[1] * 20], 10))  # needs a past of 28 > 24
        long_prompt = asyncio.run(status([[1] * 26], 1))  # a past of 25: prefilled, too long
        # the engine's rows: 16, sized from the KV budget (the export probes batch 3)
        too_many = asyncio.run(status([[1, 2]] * 17, 1))
        off_vocab = asyncio.run(status([[1, 512]], 1))  # vocabulary is 512
        fine = asyncio.run(status([[1, 511]], 2))
    assert too_long[0] == 400 and "needs a past of 28 tokens" in too_long[1]
    assert long_prompt[0] == 400 and "needs a past of 25 tokens" in long_prompt[1]
    assert too_many[0] == 400 and "batch 17 is outside [1, 16]" in too_many[1]
    assert off_vocab[0] == 400 and "[0, 512)" in off_vocab[1]
    assert fine[0] == 200


def test_a_server_that_cannot_start_fails_clearly_and_leaves_no_process(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    tree = _tree(built_gpt2, tmp_path / "tree")
    model = tree / "serving" / "triton" / "tiny-gpt2" / "1" / "model.onnx"
    model.unlink()
    model.write_bytes(b"not an onnx file")
    before = {p.pid for p in psutil.process_iter()}
    server = LocalServer(tree, "tiny-gpt2", tmp_path / "server.log", startup=60)
    with pytest.raises(StageError, match="could not load the model|exited with code") as exc:
        server.__enter__()
    assert "server.log" in exc.value.message
    assert server.proc is not None and server.proc.returncode is not None
    leftovers = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and "mlserver" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)


def test_streaming_is_measured_on_the_openai_endpoint_with_the_specs_mix(
    built_gpt2: Workspace,
) -> None:
    """Two shapes, 3:1: prompts of 4 and 12 tokens, outputs of 2 and 6. Every streamed
    request yields its own token count, so tokens/s sits between the two shapes' rates."""
    spec = gpt2_spec()
    mix = [
        {"input_length": 4, "output_tokens": 2, "weight": 3},
        {"input_length": 12, "output_tokens": 6, "weight": 1},
    ]
    spec["loadtest"] = {
        **QUICK_LOADTEST,
        "ramp": {**QUICK_LOADTEST["ramp"], "mix": mix},
        # what the soak streams is the subject here; its growth is too short to judge
        "soak": {"seconds": 1.5, "concurrency": 2},
    }
    report = built_gpt2.run("loadtest", spec)
    assert report.status.value == "passed", report.reasons
    data = measured(built_gpt2)
    stream = data.streaming
    assert stream is not None and stream.endpoint == "/v1/completions"
    # the soak streams the same mix through the same endpoint
    assert isinstance(data.soak, Soak)
    soaked = data.soak.load
    assert data.soak.endpoint == "/v1/completions" and soaked.errors == 0
    assert data.soak.growth_ok is None and (data.soak.growth_note or "").startswith("not judged")
    assert 2 < soaked.tokens_per_s / soaked.throughput_rps < 6
    for p in stream.points:
        assert p.errors == 0 and (p.p95_itl_ms or 0) > 0
        per_request = p.tokens_per_s / p.throughput_rps
        assert 2 < per_request < 6  # a mix, mostly the short shape (3:1 gives 3.0 on average)
    assert built_gpt2.run("loadtest", gpt2_spec()).status.value == "passed"


def test_a_mix_entry_beyond_the_past_is_refused_at_validate_and_one_at_it_is_accepted(
    tmp_path: Path,
) -> None:
    ws = Workspace(tmp_path)
    for length, ok in ((20, True), (21, False)):  # 20 + 6 - 2 = 24 = past_sequence.max
        spec = gpt2_spec()
        mix = [
            {"input_length": 4, "output_tokens": 2},
            {"input_length": length, "output_tokens": 6},
        ]
        spec["loadtest"] = {**QUICK_LOADTEST, "ramp": {**QUICK_LOADTEST["ramp"], "mix": mix}}
        if ok:
            load_release(ws.write(spec))
            continue
        with pytest.raises(SpecError) as exc:
            load_release(ws.write(spec))
        assert "loadtest.ramp.mix[1]: input_length + output_tokens - 2 = 25" in str(exc.value)


def point(concurrency: int = 1, **fields: object) -> Point:
    """A measured point: 10 req/s at p95 5 ms over three agreeing windows, unless told."""
    values: dict[str, object] = {
        "concurrency": concurrency,
        "requests": 9,
        "errors": 0,
        "seconds": 0.9,
        "throughput_rps": 10.0,
        "rows_per_s": 10.0,
        "tokens_per_s": 40.0,
        "p50_latency_ms": 4.0,
        "p90_latency_ms": 5.0,
        "p95_latency_ms": 5.0,
        "p99_latency_ms": 5.0,
        "windows": 3,
        "stable": True,
        "window_throughput": [10.0, 10.0, 10.0],
        "window_metrics": WindowMetrics(
            throughput_rps=[10.0] * 3,
            tokens_per_s=[40.0] * 3,
            p95_latency_ms=[5.0] * 3,
            p95_ttft_ms=[None] * 3,
            p95_itl_ms=[None] * 3,
        ),
    }
    return Point.model_validate(values | fields)


def results(**parts: object) -> LoadTestResults:
    """A load test's results with one ramp point, a clean soak and no SLOs, unless told."""
    from schemas.loadresults import Growth, Ramp

    p = point()
    growth = Growth(
        samples=40,
        rss_start_mb=100.0,
        rss_end_mb=100.0,
        peak_rss_bytes=100 << 20,
        growth_mb_per_min=0.0,
        growth_ok=True,
        growth_limit_mb_per_min=50.0,
    )
    values: dict[str, object] = {
        "target": "local MLServer",
        "grid": [],
        "ramp": Ramp(points=[p], knee=1, knee_point=p, judged_at=1),
        "streaming": Ramp(points=[p], knee=1, knee_point=p, endpoint="/v1/completions"),
        "soak": Soak(**dict(growth), seconds=1.0, preset=None, endpoint="infer", load=p),
        "peak_rss_bytes": 0,
        "batching": Skipped(skipped="loadtest.batching_comparison is false"),
        "slo": [],
    }
    return LoadTestResults.model_validate(values | parts)


def test_errors_in_the_soak_or_the_streaming_ramp_fail_the_stage() -> None:
    from schemas.loadresults import Ramp
    from stages.loadtest import verdict

    bad = point(errors=2, first_error="HTTP 500")
    good = results()
    assert isinstance(good.soak, Soak)
    result, _ = verdict(
        good.model_copy(update={"soak": good.soak.model_copy(update={"load": bad})}), []
    )
    assert result.status.value == "failed"
    assert result.reasons == ["2 request(s) failed in the soak: HTTP 500"]
    streaming = Ramp(points=[bad], knee=1, knee_point=bad)
    result, _ = verdict(good.model_copy(update={"streaming": streaming}), [])
    assert result.reasons == ["2 request(s) failed in the streaming: HTTP 500"]
    ramp = Ramp(points=[bad], knee=1, knee_point=bad, judged_at=1)
    result, _ = verdict(good.model_copy(update={"ramp": ramp}), [])
    assert result.reasons == ["2 request(s) failed in the ramp: HTTP 500"]
    leak = good.soak.model_copy(update={"growth_ok": False, "growth_mb_per_min": 80.0})
    result, _ = verdict(good.model_copy(update={"soak": leak}), [])
    assert result.reasons == ["soak: server RSS grew 80.0 MB/min, above 50.0 (leak?)"]
    unjudged = leak.model_copy(update={"growth_ok": None, "growth_note": "not judged: short"})
    assert verdict(good.model_copy(update={"soak": unjudged}), [])[0].status.value == "passed"
    assert verdict(good, [])[0].status.value == "passed"


def test_an_slo_that_cannot_be_met_fails_the_stage_and_turns_the_gate_red(
    built_gpt2: Workspace,
) -> None:
    spec = gpt2_spec()
    spec["loadtest"] = {**QUICK_LOADTEST, "slo": {"p95_latency_ms": 0.001}}
    report = built_gpt2.run("loadtest", spec)
    assert report.status.value == "failed"
    assert report.reasons[0].startswith("SLO p95_latency_ms:")
    assert not (built_gpt2.out("tiny-gpt2", "loadtest") / "loadtest.json").exists()
    # the evidence the report points at: the server's log and the measurements that failed
    kept = built_gpt2.root / "build" / "tiny-gpt2" / "failed" / "loadtest"
    assert "kept in build/tiny-gpt2/failed/loadtest/" in report.reasons[-1]
    assert (kept / "server.log").stat().st_size > 0
    failed = LoadTestResults.model_validate_json((kept / "loadtest.json").read_text())
    assert [r.ok for r in failed.slo] == [False]
    result = gate(built_gpt2.root, [load_release(built_gpt2.write(spec))], None)
    rows = {r.check: r for r in result.rows}
    assert rows["loadtest"].verdict == "FAIL"
    assert rows["SLO p95_latency_ms"].verdict == "FAIL"
    assert not result.ok
    assert built_gpt2.run("loadtest", gpt2_spec()).status.value == "passed"
    assert not kept.exists()  # a pass clears the evidence of the failure before it


def test_load_test_measures_streaming_and_writes_plots(built_gpt2: Workspace) -> None:
    summary = built_gpt2.out("tiny-gpt2", "loadtest") / LoadTestSummary.FILE
    head = LoadTestSummary.model_validate_json(summary.read_text()).summary
    assert head.target == "local MLServer"
    assert (head.p95_ttft_ms or 0) > 0 and (head.p95_itl_ms or 0) > 0
    assert (head.tokens_per_s or 0) > 0
    for name in ("latency_throughput.png", "latency_throughput.svg", "ttft_itl.png"):
        assert (built_gpt2.out("tiny-gpt2", "loadtest") / name).stat().st_size > 1000
    data = measured(built_gpt2)
    assert [p.concurrency for p in data.ramp.points] == [1, 2]
    assert data.streaming is not None and data.streaming.endpoint == "/v1/completions"
    for p in data.ramp.points + data.streaming.points:  # what an SLO is judged on
        assert all(len(v) == 3 for v in dict(p.window_metrics).values())
    assert all((v or 0) > 0 for v in data.streaming.points[0].window_metrics.p95_itl_ms)
    assert data.grid[0].batch == 2 and data.grid[0].errors == 0
    # the plot data DVC reads is committed beside the metrics, the same bytes
    out = built_gpt2.out("tiny-gpt2", "loadtest")
    for name in ("latency_throughput.json", "streaming.json"):
        committed = out.parent / "plots" / "loadtest" / name
        assert committed.read_bytes() == (out / "plots" / name).read_bytes()
        assert json.loads(committed.read_text())  # points, not an empty list


def test_an_external_target_is_measured_without_starting_a_server(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    with LocalServer(_tree(built_gpt2, tmp_path), "tiny-gpt2", tmp_path / "log", 60) as srv:
        spec = gpt2_spec()
        spec["loadtest"] = {**QUICK_LOADTEST, "target": {"url": srv.url}}
        report = built_gpt2.run("loadtest", spec)
    assert report.status.value == "passed", report.reasons
    data = measured(built_gpt2)
    assert data.target == srv.url
    assert isinstance(data.soak, Skipped) and data.soak.skipped.startswith("external target")
    assert not (built_gpt2.out("tiny-gpt2", "loadtest") / "server.log").exists()
    assert built_gpt2.run("loadtest", gpt2_spec()).status.value == "passed"


def test_a_target_that_answers_only_errors_fails_the_stage_cleanly(
    built_gpt2: Workspace, tmp_path: Path
) -> None:
    with LocalServer(_tree(built_gpt2, tmp_path), "tiny-gpt2", tmp_path / "log", 60) as srv:
        spec = gpt2_spec()
        spec["loadtest"] = {**QUICK_LOADTEST, "target": {"url": srv.url, "model": "no-such"}}
        report = built_gpt2.run("loadtest", spec)
    assert report.status.value == "failed"
    assert report.reasons[0].startswith(f"every request to {srv.url}/v2/models/no-such/infer")
    assert "HTTP 404" in report.reasons[0]
    assert built_gpt2.run("loadtest", gpt2_spec()).status.value == "passed"


def test_stability_needs_three_agreeing_windows() -> None:
    def w(rps: float, p95: float = 10.0) -> Point:
        return point(throughput_rps=rps, p95_latency_ms=p95)

    assert lg.stable([w(100), w(104), w(98)], 0.10)
    assert not lg.stable([w(100), w(104)], 0.10)
    assert not lg.stable([w(100), w(130), w(98)], 0.10)
    assert not lg.stable([w(100), w(100, 10), w(100, 20)], 0.10)


def _slo_at(itl: float, windows: list[float], stable: bool) -> SloVerdict:
    from types import SimpleNamespace

    from schemas.loadresults import Ramp
    from stages.loadtesting.slo import check_slo

    metrics = point().window_metrics.model_copy(update={"p95_itl_ms": windows})
    p = point(stable=stable, p95_itl_ms=itl, throughput_rps=100.0, window_metrics=metrics)
    measured = results(
        ramp=Ramp(points=[p], knee=1, knee_point=p, judged_at=1),
        streaming=Ramp(points=[p], knee=1, knee_point=p),
    )
    names = ("p95_latency_ms", "p95_ttft_ms", "min_tokens_per_s", "max_memory_fraction")
    slo = SimpleNamespace(p95_itl_ms=20.0, min_throughput_rps=None, **dict.fromkeys(names))
    return check_slo(slo, measured, device_memory=1)[0]


def test_an_unstable_point_is_judged_only_when_every_window_lies_on_one_side_of_the_limit() -> None:
    # Windows 1-3 ms apart (unstable) against a 20 ms limit: a verdict either way is the same.
    far = _slo_at(2.0, [1.0, 2.0, 3.0], stable=False)
    assert far.ok and "every one of the last 3" in far.why
    # Exactly at the limit counts as meeting it (<=) in every window: still conclusive.
    assert _slo_at(20.0, [20.0, 19.0, 20.0], stable=False).ok
    # One window past the limit: the verdict depends on the window, so it is inconclusive.
    among = _slo_at(19.0, [18.0, 19.0, 20.5], stable=False)
    assert not among.ok and among.why.startswith("inconclusive")
    # Every window breaks it: a conclusive failure, not an inconclusive one.
    broken = _slo_at(30.0, [25.0, 30.0, 40.0], stable=False)
    assert not broken.ok and "breaks" in broken.why
    # A point without per-window numbers (older results) stays inconclusive when unstable.
    bare = _slo_at(2.0, [], stable=False)
    assert not bare.ok and bare.why.startswith("inconclusive")
    assert _slo_at(2.0, [1.0, 2.0, 30.0], stable=True).ok  # stable: the merged value rules


def test_the_release_candidate_soak_is_long_and_strict_unless_the_spec_says_otherwise() -> None:
    from schemas.spec.loadtest import LoadSoak

    rc = LoadSoak.model_validate({"preset": "release-candidate"})
    assert (rc.seconds, rc.max_growth_mb_per_min) == (1800.0, 5.0)
    own = LoadSoak.model_validate({"preset": "release-candidate", "seconds": 3600})
    assert (own.seconds, own.max_growth_mb_per_min) == (3600.0, 5.0)
    assert LoadSoak.model_validate({}).seconds == 10.0
    with pytest.raises(ValueError, match="release-candidate"):
        LoadSoak.model_validate({"preset": "rc"})


def test_soak_growth_flags_a_steady_climb_not_a_warm_up() -> None:
    from stages.loadtesting.load_phases import growth

    mb = 1 << 20
    t = np.linspace(0, 60, 61)
    warm = [(x, int((100 + (50 if x > 5 else 10 * x)) * mb)) for x in t]  # jump, then flat
    leak = [(x, int((100 + 2 * x) * mb)) for x in t]  # +2 MB every second
    assert growth(warm, 50).growth_ok
    climbing = growth(leak, 50)
    assert climbing.growth_ok is False
    assert climbing.growth_mb_per_min == pytest.approx(120, 1)
    # the same climb over two seconds: a slope from so few samples is noise, not a verdict
    short = [(x / 30, rss) for x, rss in leak]
    brief = growth(short, 50)
    assert brief.growth_ok is None and brief.growth_mb_per_min > 50
    assert "under 20 s" in (brief.growth_note or "") and "35 or more" in (brief.growth_note or "")
    # a steady part of exactly the minimum is judged: 30 s of samples, 20 s after the first third
    edge = growth([(x / 2, rss) for x, rss in leak], 50)
    assert edge.growth_ok is False and edge.growth_note is None


def _pt(c: int, rps: float, p95: float = 10.0, windows: list[float] | None = None) -> Point:
    """A ramp point whose windows measured `windows` (all `rps` unless told)."""
    spread = windows or [rps] * 3
    metrics = point().window_metrics.model_copy(update={"throughput_rps": spread})
    return point(
        c, throughput_rps=rps, p95_latency_ms=p95, window_throughput=spread, window_metrics=metrics
    )


def test_a_gain_inside_the_windows_noise_does_not_move_the_knee() -> None:
    """Issue 43 item 5: two builds of the same code found knees 8 and 4, from merged values
    that differed by noise. A gain counts when the point's slowest window clears the knee's
    fastest by the gain: the same scatter, whichever way it fell, gives the same knee."""
    from stages.loadtesting.load_phases import find_knee

    rising = [_pt(1, 100, windows=[96, 100, 104]), _pt(2, 190, windows=[182, 190, 198])]
    saturated = [96 * 4, 100 * 4, 104 * 4]  # 2x the requests: no more throughput
    one = [*rising, _pt(4, 380, windows=[370, 380, 392]), _pt(8, 404, windows=saturated)]
    other = [*rising, _pt(4, 380, windows=[368, 380, 390]), _pt(8, 408, windows=saturated)]
    # merged values 404 and 408 both clear 380 x 1.05 = 399: the old rule said knee 8 ...
    assert 404 >= 380 * 1.05 and 408 >= 380 * 1.05
    # ... the windows say the gain is inside the noise, both times
    assert find_knee(one, 0.05, 4, None)[0] == find_knee(other, 0.05, 4, None)[0] == 4
    # a real gain, beyond the scatter, still moves it
    real = [*rising, _pt(4, 380, windows=[370, 380, 392]), _pt(8, 600, windows=[590, 600, 610])]
    assert find_knee(real, 0.05, 4, None)[0] == 8


def test_a_step_the_windows_cannot_judge_is_decided_by_a_paired_measurement() -> None:
    """Issue 43 item 5: over four rebuilds the knee read 16, 8, 16, 16: 8 -> 16 gained
    about 10 % while the windows of the two points, measured one after the other, scattered
    over each other. Such a step is measured again interleaved with the knee (paired_step);
    steps the windows do judge are not re-measured."""
    from collections.abc import Callable

    from schemas.loadresults import PairedStep
    from stages.loadtesting.load_phases import find_knee

    asked: list[tuple[int, int]] = []

    def confirm(gains: bool) -> Callable[[int, int], PairedStep]:
        def ask(a: int, b: int) -> PairedStep:
            asked.append((a, b))
            return PairedStep(base=a, step=b, ratios=[1.1], median=1.1, gains=gains)

        return ask

    rising = [_pt(1, 8, windows=[7.7, 7.7, 7.3]), _pt(2, 10, windows=[9.3, 10.0, 9.3])]
    # the real windows of gpt2-small's ramp: 4 -> 8 gains beyond the scatter, 8 -> 16 cannot
    # be told from the windows (24.7 is neither >= 24.0 x 1.05 nor < 22.3 x 1.05)
    real = [
        *rising,
        _pt(4, 16.7, windows=[15.7, 17.3, 17.0]),
        _pt(8, 23.1, windows=[24.0, 22.3, 23.0]),
        _pt(16, 25.3, windows=[25.0, 26.3, 24.7]),
    ]
    assert find_knee(real, 0.05, 4, None, confirm(True))[0] == 16
    assert asked == [(8, 16)]  # only the step the windows could not judge
    assert find_knee(real, 0.05, 4, None, confirm(False))[0] == 8
    assert find_knee(real, 0.05, 4, None)[0] == 8  # nothing to confirm with: flat
    # a step clearly flat or clearly gaining is never re-measured
    asked.clear()
    clear = [*rising, _pt(4, 16.7, windows=[15.7, 17.3, 17.0]), _pt(8, 16, windows=[16.0] * 3)]
    assert find_knee(clear, 0.05, 4, None, confirm(True))[0] == 4 and asked == []


def test_a_paired_step_cancels_a_drift_of_the_machine_s_speed() -> None:
    """A B A B A B A windows: a machine slowing down through the step (another job
    starting) scales both sides alike; the sequential comparison it replaces does not."""
    from stages.loadtesting.load_phases import paired_step

    true = {8: 23.0, 16: 23.0 * 1.08}  # 16 streams really gain 8 %
    clock = iter(range(100))

    def slowing(concurrency: int) -> float:
        return true[concurrency] * (1 - 0.03 * next(clock))  # 3 % slower every window

    step = paired_step(slowing, 8, 16, 0.05)
    assert step.gains and abs(step.median - 1.08) < 0.005, step
    assert len(step.ratios) == 3 and (step.base, step.step) == (8, 16)
    # the same drift, measured one point after the other, hides the gain
    clock = iter(range(100))
    before = [slowing(8) for _ in range(3)]
    later = [slowing(16) for _ in range(3)]
    assert min(later) / max(before) < 1.05
    # and a step that does not gain is not made to
    flat = {8: 23.0, 16: 23.0 * 1.02}
    clock = iter(range(100))
    assert not paired_step(lambda c: flat[c] * (1 - 0.03 * next(clock)), 8, 16, 0.05).gains


def test_the_knee_is_the_last_real_gain_and_the_ramp_stops_after_four_flat_steps() -> None:
    from stages.loadtesting.load_phases import find_knee

    rising = [_pt(1, 100), _pt(2, 190), _pt(4, 300)]
    assert find_knee(rising, 0.05, 4, None) == (4, False)
    flat = [*rising, _pt(8, 310), _pt(16, 305), _pt(32, 312), _pt(64, 309)]
    assert find_knee(flat[:6], 0.05, 4, None) == (4, False)  # three flat steps: keep going
    assert find_knee(flat, 0.05, 4, None) == (4, True)
    slo_break = [*rising, _pt(8, 400, p95=250)]
    assert find_knee(slo_break, 0.05, 4, 200) == (4, True)
    assert slo_break[-1].breaks_slo is True and slo_break[-1].concurrency == 8
    assert '"breaks_slo"' not in rising[-1].model_dump_json()  # only where it broke
    assert find_knee([_pt(1, 100, p95=250)], 0.05, 4, 200) == (1, False)  # judged by the SLO
