"""`shipyard serve RELEASE[@VERSION|@CHANNEL]` (issue 43 item 1): a built or published
bundle served by its own launcher from a verified private copy: the OpenAI and V2 front
doors answer with the token and refuse without it, the process is the launcher (exec), the
token is not in its environment block, nothing is written into the registry, and every
bad target, a tampered version and `--device cuda` without CUDA are refused before
anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pipelines.registry import Registry
from stages.loadtesting.server import free_ports
from tests.conftest import Workspace

TOKEN = "serve-cli-test-token-0123456789"
SHIPYARD = str(Path(sys.executable).parent / "shipyard")


@pytest.fixture(scope="module")
def published(built_gpt2: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The built tiny-gpt2 published and promoted to production in a folder registry."""
    registry = tmp_path_factory.mktemp("serve-registry") / "registry"
    reg = Registry(str(registry))
    facts = json.loads((built_gpt2.out("tiny-gpt2", "bundle") / "shipyard.json").read_text())
    reg.publish(built_gpt2.out("tiny-gpt2", "bundle"), "tiny-gpt2", facts["version"])
    reg.promote("tiny-gpt2", facts["version"], "production", "serve test")
    return built_gpt2, registry, facts["version"]


def shipyard_serve(
    ws: Workspace, serve_dir: Path, *args: str, token: str | None = TOKEN
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIPYARD_API_TOKEN")}
    env |= {"SHIPYARD_ROOT": str(ws.root), "SHIPYARD_SERVE_DIR": str(serve_dir)}
    if token is not None:
        env["SHIPYARD_API_TOKEN"] = token
    return subprocess.Popen(
        [SHIPYARD, "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def refused(ws: Workspace, serve_dir: Path, *args: str) -> tuple[int, str]:
    proc = shipyard_serve(ws, serve_dir, *args)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def get(url: str, body: Any = None, auth: bool = True) -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = f"Bearer {TOKEN}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_channel_is_served_from_a_verified_copy_with_both_front_doors(
    published: Any, tmp_path: Path
) -> None:
    import openai

    ws, registry, version = published
    before = files(registry)
    http, grpc, metrics = free_ports(3)
    proc = shipyard_serve(
        ws,
        tmp_path / "served",
        "tiny-gpt2@production",
        "--registry",
        str(registry),
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
    )
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "never ready"
            try:
                if get(f"{url}/v2/health/ready", auth=False)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        done = client.completions.create(
            model="tiny-gpt2", prompt="def add", max_tokens=4, temperature=0
        )
        assert done.usage is not None and done.usage.completion_tokens == 4
        body = {
            "inputs": [
                {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}
            ],
            "parameters": {"max_new_tokens": 3},
        }
        status, answer = get(f"{url}/v2/models/tiny-gpt2/infer", body)
        assert status == 200 and answer["outputs"][0]["shape"] == [1, 3], answer
        assert get(f"{url}/v2/models/tiny-gpt2/infer", body, auth=False)[0] == 401
        # this process became the launcher, on the copy; the token is not in its environ
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        copy = tmp_path / "served" / f"serve-{proc.pid}" / "bundle"
        assert str(copy / "serving/mlserver/shipyard_serve.py").encode() in cmdline
        assert TOKEN.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        facts = json.loads((copy / "shipyard.json").read_text())
        assert (facts["release"], facts["version"]) == ("tiny-gpt2", version)
        assert not list(copy.rglob("__pycache__"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "serving tiny-gpt2@" in out and "(production)" in out, out[-2000:]
    assert files(registry) == before  # nothing written into the registry
    from pipelines.serving import sweep

    assert sweep(tmp_path / "served") == [tmp_path / "served" / f"serve-{proc.pid}"]
    assert not (tmp_path / "served" / f"serve-{proc.pid}").exists()


def test_bad_targets_and_devices_are_refused_before_anything_runs(
    published: Any, tmp_path: Path
) -> None:
    import onnxruntime as ort

    ws, registry, version = published
    served = tmp_path / "served"
    cases = [
        (("tiny-gpt2@",), "write RELEASE, RELEASE@VERSION or RELEASE@CHANNEL"),
        (("no-such",), "is not a built bundle"),
        (("tiny-gpt2@9.9.9", "--registry", str(registry)), "9.9.9"),
        (("tiny-gpt2@canary", "--registry", str(registry)), "has no 'canary' channel"),
        (("Bad/Name",), "is not valid"),
    ]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        cases.append((("tiny-gpt2", "--device", "cuda"), "has no CUDA execution provider"))
    for args, message in cases:
        code, out = refused(ws, served, *args)
        assert code != 0 and message in out, (args, out)
        assert "Traceback" not in out, out
        assert not list(served.glob("serve-*")), args  # nothing copied, or removed again
    # a published version whose bytes changed after publishing is refused, and not served
    model = next((registry / "releases" / "tiny-gpt2" / version).rglob("*.onnx"))
    model.chmod(0o644)
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    try:
        code, out = refused(ws, served, f"tiny-gpt2@{version}", "--registry", str(registry))
        assert code != 0 and "does not match its manifest" in out, out
        assert not list(served.glob("serve-*"))
    finally:
        data[-1] ^= 1
        model.write_bytes(bytes(data))


def test_the_runtime_never_falls_back_to_the_cpu_when_cuda_is_asked(
    built_gpt2: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHIPYARD_DEVICE=cuda (the launcher's --device cuda) without a CUDA provider is an
    error naming the fix, not a CPU session; an unknown device is refused; cpu runs."""
    import onnxruntime as ort

    from shipyard_runtime import session as s

    model = built_gpt2.out("tiny-gpt2", "export") / "model.onnx"
    monkeypatch.setenv(s.DEVICE_ENV, "cpu")
    assert s.session_from(model, {}).get_providers() == ["CPUExecutionProvider"]
    monkeypatch.setenv(s.DEVICE_ENV, "tpu")
    with pytest.raises(RuntimeError, match="cpu or cuda"):
        s.session_from(model, {})
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: scripts/gpu_check.sh runs it")
    monkeypatch.setenv(s.DEVICE_ENV, "cuda")
    with pytest.raises(RuntimeError, match="no CUDA execution provider.*gpu extra"):
        s.session_from(model, {})
