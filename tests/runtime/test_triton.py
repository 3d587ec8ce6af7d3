"""The Triton entry that generates (issue 25): the serve stage's decoupled python-backend
model, loaded by a real Triton server (the CPU build `scripts/install_triton.py` installs)
and driven by `tritonclient` gRPC streaming. It must produce the tokens the engine produces
in-process on the same graph (the engine is itself checked against transformers), stream
one response per token with the finish reason on the last, refuse bad requests with
INVALID_ARG naming the problem, batch concurrent streams, and survive a cancelled one."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shipyard_runtime.generation.core import Engine, Graph
from shipyard_runtime.generation.params import parse_tensor_request
from shipyard_runtime.session import session_from
from shipyard_runtime.settings import RuntimeSettings
from stages.loadtesting.server import assemble
from stages.loadtesting.triton_server import TritonServer
from stages.rendering.render import parse_triton
from stages.serving.configs import check_generate
from tests.conftest import REPO, Workspace, gpt2_spec

MODEL = "tiny-gpt2-generate"
TOKEN = "triton-test-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
VARIED = {"repetition_penalty": 5.0}  # the random-weight model repeats one token otherwise


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = Workspace(tmp_path_factory.mktemp("triton"))
    spec = gpt2_spec()
    spec["export"]["dims"]["past_sequence"]["max"] = 120
    # FP32: dynamic INT8 takes one activation scale over the whole batch, so a sequence's
    # tokens would depend on what it is batched with, and "the tokens it gets alone" would
    # not be a fixed answer to compare with
    spec["quantization"] = {"method": "none"}
    for stage in ("pin", "export", "quantize", "plan", "serve"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    tree = ws.root / "tree"
    assemble(
        tree,
        sorted(ws.out("tiny-gpt2", "quantize").glob("model.onnx*")),
        ws.out("tiny-gpt2", "serve"),
    )
    return tree


@pytest.fixture(scope="module")
def server(tree: Path) -> Iterator[TritonServer]:
    with TritonServer(tree, [MODEL], tree.parent / "triton.log", 90, TOKEN) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tree: Path) -> Iterator[Any]:
    """The same graph and settings, in-process: what Triton must reproduce."""
    settings = settings_of(tree)
    assert settings.engine is not None
    session = session_from(tree / "serving/triton/tiny-gpt2/1/model.onnx", {})
    engine = Engine(Graph(session), settings.engine)

    def generate(prompt: list[int], **given: Any) -> list[int]:
        events: queue.Queue[Any] = queue.Queue()
        engine.submit(prompt, parse_tensor_request(given), events.put)
        out = []
        while True:
            event = events.get(timeout=30)
            assert not event.error, event.error
            out.append(event.token)
            if event.finish:
                return out

    yield generate
    engine.close()


def settings_of(tree: Path) -> RuntimeSettings:
    config = parse_triton((tree / f"serving/triton/{MODEL}/config.pbtxt").read_text())
    return RuntimeSettings.model_validate_json(config.parameters["runtime"].string_value)


def tensor(name: str, value: Any) -> Any:
    import tritonclient.grpc as grpcclient

    if isinstance(value, bool):
        array = np.array([value], dtype=bool)
        kind = "BOOL"
    elif isinstance(value, list):
        array, kind = np.array(value, dtype=np.int64), "INT64"
    else:
        raw = value if isinstance(value, bytes) else str(value).encode()
        array, kind = np.array([raw], dtype=np.object_), "BYTES"
    t = grpcclient.InferInput(name, list(array.shape), kind)
    t.set_data_from_numpy(array)
    return t


class Stream:
    """One gRPC stream; requests sent on it, responses collected by request id."""

    def __init__(self, server: TritonServer, headers: dict[str, str] | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(server.grpc)
        self.responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error)),
            headers=AUTH if headers is None else headers,
        )

    def send(self, rid: str, prompt: list[int] | str, stream: bool | None = None, **p: Any) -> None:
        inputs = [tensor("input_ids" if isinstance(prompt, list) else "text_input", prompt)]
        if p:
            inputs.append(tensor("sampling_parameters", json.dumps(p)))
        if stream is not None:
            inputs.append(tensor("stream", stream))
        self.client.async_stream_infer(MODEL, inputs, request_id=rid)

    def collect(self, ids: set[str]) -> dict[str, list[dict[str, Any]]]:
        """Every response of these requests, until each has its finish reason or error."""
        out: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        open_ = set(ids)
        while open_:
            result, error = self.responses.get(timeout=60)
            if error is not None:  # errors carry no id here: one request per error test
                rid = next(iter(open_))
                out[rid].append({"error": error.message()})
                open_.discard(rid)
                continue
            rid = result.get_response().id
            finish = result.as_numpy("finish_reason")
            text = result.as_numpy("text_output")
            out[rid].append(
                {
                    "ids": result.as_numpy("output_ids").tolist(),
                    "text": text[0].decode() if text is not None else None,
                    "finish": finish[0].decode() if finish is not None else None,
                }
            )
            if finish is not None:
                open_.discard(rid)
        return out

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(server: TritonServer) -> Iterator[Stream]:
    s = Stream(server)
    yield s
    s.close()


def one(stream: Stream, prompt: list[int] | str, stream_flag: bool | None = None, **p: Any) -> Any:
    stream.send("r", prompt, stream_flag, **p)
    return stream.collect({"r"})["r"]


# ------------------------------------------------------------------ the served model
def test_the_entry_is_a_decoupled_python_model_with_its_inputs(server: TritonServer) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    meta = client.get_model_metadata(MODEL)
    config = client.get_model_config(MODEL).config
    client.close()
    assert meta.platform == "python" and config.model_transaction_policy.decoupled
    assert {i.name: i.datatype for i in meta.inputs} == {
        "text_input": "BYTES",
        "input_ids": "INT64",
        "sampling_parameters": "BYTES",
        "stream": "BOOL",
    }
    assert {o.name for o in meta.outputs} == {"output_ids", "text_output", "finish_reason"}


def test_a_stream_gives_one_response_per_token_and_the_engines_tokens(
    stream: Stream, reference: Any
) -> None:
    prompt = [5, 9, 11, 40, 2]
    got = one(stream, prompt, max_tokens=12, ignore_eos=True, **VARIED)
    assert [len(r["ids"]) for r in got] == [1] * 12
    assert [r["finish"] for r in got] == [None] * 11 + ["length"]
    assert [r["ids"][0] for r in got] == reference(prompt, max_tokens=12, ignore_eos=True, **VARIED)


def test_without_streaming_one_response_carries_every_token(stream: Stream, reference: Any) -> None:
    prompt = list(range(60, 80))
    (got,) = one(stream, prompt, False, max_new_tokens=7, ignore_eos=True, **VARIED)
    assert got["finish"] == "length"
    assert got["ids"] == reference(prompt, max_tokens=7, ignore_eos=True, **VARIED)


def test_text_in_and_out_with_the_shipped_tokenizer(stream: Stream, tree: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tree / "serving/text/tokenizer.json"))
    got = one(stream, "def add(a, b):", max_tokens=10, ignore_eos=True, **VARIED)
    ids = [r["ids"][0] for r in got]
    assert "".join(r["text"] for r in got) == tok.decode(ids)


def test_a_seed_repeats_its_sample_and_stops_end_with_finish_stop(stream: Stream) -> None:
    ask = {"max_tokens": 10, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    first = [r["ids"][0] for r in one(stream, [3, 4, 5], **ask)]
    assert [r["ids"][0] for r in one(stream, [3, 4, 5], **ask)] == first
    # a stop token id taken from the sample ends it there, finish "stop"
    stopped = one(stream, [3, 4, 5], **ask, stop_token_ids=[first[3]])
    assert stopped[-1]["finish"] == "stop" and len(stopped) == first.index(first[3]) + 1


@pytest.mark.parametrize(
    ("ask", "message"),
    [
        ({"max_tokens": 4, "best_of": 2}, "unknown parameter 'best_of'"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1}, "temperature"),
        ({"max_tokens": 4, "max_new_tokens": 4}, "not both"),
        ({"max_tokens": 500}, "exceeds the served context"),
    ],
)
def test_each_bad_parameter_is_an_invalid_argument(
    stream: Stream, server: TritonServer, ask: dict[str, Any], message: str
) -> None:
    (got,) = one(stream, [1, 2, 3], **ask)  # a gRPC stream carries the message only
    assert "error" in got and message in got["error"], got
    # Triton's HTTP generate extension maps INVALID_ARG to 400
    status, body = generate(
        server, {"input_ids": [1, 2, 3], "sampling_parameters": json.dumps(ask)}
    )
    assert status == 400 and message in body["error"], (status, body)


def generate(
    server: TritonServer, body: dict[str, Any], auth: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST to the generate extension; `auth` goes in the body, where Triton makes it a
    request parameter (it forwards no header there)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{server.url}/v2/models/{MODEL}/generate",
        data=json.dumps({**body, **(AUTH if auth is None else auth)}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_generate_extension_answers_with_text(server: TritonServer) -> None:
    ask = {"max_tokens": 5, "ignore_eos": True, **VARIED}
    status, body = generate(
        server, {"text_input": "def add", "sampling_parameters": json.dumps(ask), "stream": False}
    )
    assert status == 200, body
    assert body["finish_reason"] == "length" and len(body["output_ids"]) == 5
    assert isinstance(body["text_output"], str) and body["text_output"]


def test_malformed_requests_are_refused_by_name(stream: Stream) -> None:
    cases: list[tuple[list[Any], str]] = [
        ([tensor("input_ids", [1, 2]), tensor("text_input", "hi")], "exactly one of"),
        ([tensor("sampling_parameters", "{}")], "exactly one of"),
        ([tensor("input_ids", [1, 10**6])], "token ids must lie in"),
        ([tensor("input_ids", [1]), tensor("sampling_parameters", "{max")], "not JSON"),
        ([tensor("input_ids", [1]), tensor("sampling_parameters", "[1]")], "a JSON object"),
        ([tensor("text_input", b"\xff\xfe")], "UTF-8"),
    ]
    for inputs, message in cases:
        stream.client.async_stream_infer(MODEL, inputs, request_id="bad")
        (got,) = stream.collect({"bad"})["bad"]
        assert message in got.get("error", ""), (message, got)
    # the server still generates after every refusal
    assert one(stream, [1, 2, 3], max_tokens=2)[-1]["finish"] == "length"


def test_concurrent_streams_each_get_their_own_tokens(stream: Stream, reference: Any) -> None:
    prompts = {f"s{i}": list(range(10 + 7 * i, 14 + 9 * i)) for i in range(5)}
    for rid, prompt in prompts.items():
        stream.send(rid, prompt, max_tokens=6 + len(rid), ignore_eos=True, **VARIED)
    got = stream.collect(set(prompts))
    for rid, prompt in prompts.items():
        want = reference(prompt, max_tokens=6 + len(rid), ignore_eos=True, **VARIED)
        assert [r["ids"][0] for r in got[rid]] == want, rid


def test_a_cancelled_stream_leaves_and_the_server_goes_on(server: TritonServer) -> None:
    """A stream cancelled after its first token, beside 8 others: the engine drops it, the
    others end at their length, and the next request runs. Alone, the tiny model can end
    all its tokens before the cancel reaches it (a step and a draw take well under a
    millisecond); its neighbours keep it running long enough, and a try whose cancel still
    came too late is made again, up to 3 times: where cancelling does not work, every try
    ends without the engine seeing one."""
    before = server.log.read_text(errors="replace").count("a request was cancelled")
    for attempt in range(3):
        others = Stream(server)
        ids = {f"other-{attempt}-{i}" for i in range(8)}
        for rid in sorted(ids):
            others.send(rid, [2, 3, 4], max_tokens=100, ignore_eos=True)
        first = Stream(server)
        first.send(f"long-{attempt}", list(range(1, 9)), max_tokens=100, ignore_eos=True)
        _, error = first.responses.get(timeout=30)  # it is running
        assert error is None, error.message()
        first.close(cancel=True)
        seen = False
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = server.log.read_text(errors="replace").count("a request was cancelled") > before
        try:
            ended = others.collect(ids)
        finally:
            others.close()
        assert all(got[-1]["finish"] == "length" for got in ended.values()), ended
        if seen:
            break
    else:
        raise AssertionError("the engine never saw the cancellation, in 3 tries")
    after = Stream(server)
    try:
        assert one(after, [1, 2, 3], max_tokens=3)[-1]["finish"] == "length"
    finally:
        after.close()


# ------------------------------------------------------------------ the token check
def test_every_inference_needs_the_token_over_grpc_http_and_streams(server: TritonServer) -> None:
    """Issue 43: the Triton entry checks the token the MLServer launcher does: a request
    without it, with another one, or with a scheme other than Bearer is refused before it
    runs, over gRPC (unary and stream) and HTTP; the header's case does not matter."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    body = {
        "input_ids": [1, 2, 3],
        "sampling_parameters": json.dumps({"max_tokens": 2}),
        "stream": False,
    }
    wrong = [
        {},
        {"authorization": "Bearer " + TOKEN[:-1] + "X"},
        {"authorization": "Basic " + TOKEN},
        {"authorization": TOKEN},
        {"x-api-key": TOKEN},
    ]
    for auth in wrong:
        status, answer = generate(server, body, auth)
        assert status == 400 and "a valid API token is required" in answer["error"], auth
        refused = Stream(server, auth)
        try:
            (got,) = one(refused, [1, 2, 3], max_tokens=2)
            assert "a valid API token is required" in got.get("error", ""), (auth, got)
        finally:
            refused.close()
    for name in ("Authorization", "AUTHORIZATION", "authorization"):
        status, answer = generate(server, body, {name: f"bearer {TOKEN}"})
        assert status == 200 and len(answer["output_ids"]) == 2, (name, answer)
        accepted = Stream(server, {name.lower(): f"bearer {TOKEN}"})  # gRPC: lower case
        try:
            assert len(one(accepted, [1, 2, 3], max_tokens=2)) == 2
        finally:
            accepted.close()
    # the HTTP header is not what Triton forwards on generate: it is refused, not let in
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{server.url}/v2/models/{MODEL}/generate",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **AUTH},
    )
    with pytest.raises(urllib.error.HTTPError) as refused_header:
        urllib.request.urlopen(request, timeout=60)
    assert refused_header.value.code == 400
    assert "a valid API token is required" in refused_header.value.read().decode()
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        inputs = [tensor("input_ids", [1, 2, 3])]
        with pytest.raises(InferenceServerException, match="decoupled|a valid API token"):
            client.infer(MODEL, inputs)  # a decoupled model over unary gRPC: refused
    finally:
        client.close()


def test_the_admin_apis_are_off_and_the_token_is_in_no_process_block(
    server: TritonServer,
) -> None:
    """Loading, unloading, shared memory, trace and logging are refused (restricted to a
    header value drawn per start and told to no one); health and metadata answer. The token
    is in no server process's command line or environment (/proc), only in a 0600 file."""
    import urllib.error
    import urllib.request

    import psutil
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert client.is_server_ready() and client.get_model_metadata(MODEL).name == MODEL
        for call in (
            lambda: client.unload_model(MODEL, headers=AUTH),
            lambda: client.load_model(MODEL, headers=AUTH),
            lambda: client.get_model_repository_index(headers=AUTH),
            lambda: client.get_system_shared_memory_status(headers=AUTH),
            lambda: client.get_log_settings(headers=AUTH),
        ):
            with pytest.raises(InferenceServerException, match="restricted|unavailable|denied"):
                call()
        assert client.is_model_ready(MODEL)
    finally:
        client.close()
    request = urllib.request.Request(
        f"{server.url}/v2/repository/models/{MODEL}/unload", data=b"{}", headers=AUTH
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code in (401, 403), refused.value.code
    assert server.proc is not None
    parent = psutil.Process(server.proc.pid)
    processes = [parent, *parent.children(recursive=True)]
    assert len(processes) >= 2  # the server and the model's stub
    for proc in processes:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in environ and TOKEN.encode() not in cmdline, proc.name()
    file = Path(parent.environ()["SHIPYARD_API_TOKEN_FILE"])
    assert file.read_text() == TOKEN and file.stat().st_mode & 0o777 == 0o600


def test_the_launcher_refuses_no_token_and_an_entry_that_checks_none(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a token the launcher starts nothing (unless --no-auth); with one it refuses
    to serve the onnxruntime entry, which answers whoever asks."""
    from stages.loadtesting.triton_server import main

    monkeypatch.delenv("SHIPYARD_API_TOKEN", raising=False)
    monkeypatch.delenv("SHIPYARD_API_TOKEN_FILE", raising=False)
    assert main([str(tree), MODEL]) == 1
    assert "no API token" in capsys.readouterr().err
    monkeypatch.setenv("SHIPYARD_API_TOKEN", TOKEN)
    assert main([str(tree), "tiny-gpt2"]) == 1
    assert "onnxruntime backend, which checks no API token" in capsys.readouterr().err
    assert main([str(tree), MODEL, "--no-auth"]) == 1
    assert "--no-auth with a token set" in capsys.readouterr().err
    monkeypatch.setenv("SHIPYARD_API_TOKEN", "short")
    assert main([str(tree), MODEL]) == 1
    assert "at least 16 printable characters" in capsys.readouterr().err


def test_a_server_started_without_the_launcher_does_not_load_the_model(tree: Path) -> None:
    """tritonserver run on the bundle by hand (no token file, no --no-auth) fails to load
    the entry rather than serve it unchecked."""
    import subprocess

    from stages.loadtesting.server import free_ports
    from stages.loadtesting.triton_server import command, environment, home, private_tree

    root = home()
    served = private_tree(tree, tree.parent / "by-hand")
    env = environment(root)
    env.pop("SHIPYARD_API_TOKEN_FILE")
    log = tree.parent / "by-hand.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command(root, served / "serving" / "triton", [MODEL], free_ports(3)),
            cwd=served,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code != 0
    assert "no API token for this model" in log.read_text(errors="replace")


# ------------------------------------------------------------------ the rendered config
def test_the_serve_stage_refuses_a_generate_config_that_is_not_decoupled(tree: Path) -> None:
    path = tree / f"serving/triton/{MODEL}/config.pbtxt"
    config = parse_triton(path.read_text())
    check_generate(config)
    config.model_transaction_policy.decoupled = False
    with pytest.raises(ValueError, match="must be decoupled"):
        check_generate(config)
    config = parse_triton(path.read_text())
    config.parameters["runtime"].string_value = '{"task": "causal-lm"}'
    with pytest.raises(ValueError):
        check_generate(config)


def test_the_generate_entry_ships_the_engine_and_reads_the_one_model_copy(tree: Path) -> None:
    version = tree / f"serving/triton/{MODEL}/1"
    mlserver = tree / "serving/mlserver/tiny-gpt2/shipyard_runtime"
    shipped = sorted(p.relative_to(mlserver) for p in mlserver.rglob("*.py"))
    assert len(shipped) > 10 and Path("generation/core.py") in shipped
    for module in shipped:
        copy = version / "shipyard_runtime" / module
        if module != Path("mlserver.py"):  # the MLServer adapter is MLServer's entry's own
            assert copy.read_bytes() == (mlserver / module).read_bytes()
    assert not (version / "shipyard_runtime" / "mlserver.py").exists()
    assert (version / "model.py").read_bytes() == (REPO / "shipyard_runtime/triton.py").read_bytes()
    assert not list(version.glob("*.onnx"))  # the model is stored once, in tiny-gpt2/1/


def test_every_port_listens_on_loopback_only(server: TritonServer, tree: Path) -> None:
    """Issue 43: Triton binds 0.0.0.0 unless told, and checks no token; the entry binds
    127.0.0.1 (HTTP, gRPC and metrics) unless a host is given, and writes nothing into the
    bundle it serves."""
    import ipaddress

    import psutil

    assert server.proc is not None
    listening: list[Any] = []
    for _ in range(100):  # the metrics port may open just after HTTP answers ready
        listening = [
            c.laddr
            for c in psutil.Process(server.proc.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        if len(listening) == 3:
            break
        time.sleep(0.1)
    assert len(listening) == 3, listening

    def loopback(ip: str) -> bool:  # gRPC listens as ::ffff:127.0.0.1
        address = ipaddress.ip_address(ip)
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    assert all(loopback(a.ip) for a in listening), listening
    assert not list(tree.rglob("__pycache__"))


def test_the_private_tree_links_every_file_and_refuses_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files hard-linked (symlinked across file systems, never copied); what the server
    writes there stays there; a bundle holding a symlink is refused (the server could write
    through it)."""
    from schemas import Refused
    from stages.loadtesting.triton_server import private_tree

    bundle = tmp_path / "bundle"
    (bundle / "serving" / "triton" / "m" / "1").mkdir(parents=True)
    (bundle / "serving" / "triton" / "m" / "1" / "model.py").write_text("x = 1\n")
    (bundle / "model.onnx").write_bytes(b"weights")
    served = private_tree(bundle, tmp_path / "a")
    model = served / "serving" / "triton" / "m" / "1" / "model.py"
    assert model.stat().st_ino == (bundle / "serving/triton/m/1/model.py").stat().st_ino
    (model.parent / "__pycache__").mkdir()
    assert not (bundle / "serving" / "triton" / "m" / "1" / "__pycache__").exists()

    def cross_device(source: Any, target: Any) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr("os.link", cross_device)
    linked = private_tree(bundle, tmp_path / "b")
    assert (linked / "model.onnx").is_symlink()
    assert (linked / "model.onnx").read_bytes() == b"weights"
    monkeypatch.undo()
    (bundle / "escape").symlink_to(tmp_path)
    with pytest.raises(Refused, match="is a symlink"):
        private_tree(bundle, tmp_path / "c")


def test_the_foreground_server_gets_the_signal_and_its_status_is_ours(tmp_path: Path) -> None:
    """`python -m stages.loadtesting.triton_server` runs Triton as a child now (it serves a
    private tree): a SIGTERM to it reaches the server, and it exits 128 + 15 as the server
    would have."""
    import signal
    import subprocess
    import sys

    marker = tmp_path / "got"
    child = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path("
        f"{str(marker)!r}).write_text('term'), signal.signal(signal.SIGTERM, "
        "signal.SIG_DFL), signal.raise_signal(signal.SIGTERM)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    wrapper = (
        "import sys, pathlib\n"
        "from stages.loadtesting.triton_server import _foreground\n"
        f"sys.exit(_foreground([sys.executable, '-c', {child!r}], {{}}, pathlib.Path('.')))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert marker.read_text() == "term"


def test_the_entry_exports_the_engines_series_on_tritons_metrics_port(
    server: TritonServer, stream: Stream
) -> None:
    """Issue 43 item 4: the Triton entry exported no engine metrics. Its series carry the
    names and labels of an MLServer bundle's (the bundle's dashboard and alerts read them)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(server.metrics, timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("shipyard_")
        }

    model = (("model_name", MODEL),)
    before = scrape()
    got = one(stream, [1, 2, 3], max_tokens=5, ignore_eos=True)
    assert [r.get("finish") for r in got] == [None] * 4 + ["length"], got
    after = scrape()

    def grew(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert after[("shipyard_model_info", model)] == 1
    assert grew("shipyard_generated_tokens_total") == 5
    assert grew("shipyard_prompt_tokens_total") == 3
    assert grew("shipyard_time_to_first_token_seconds_count") == 1
    assert grew("shipyard_inter_token_latency_seconds_count") == 4
    assert grew("shipyard_requests_finished_total", (*model, ("reason", "length"))) == 1
    assert grew("shipyard_e2e_request_latency_seconds_count") == 1
    # the histograms have the engine's buckets, as prometheus_client writes them
    from shipyard_runtime.metrics import LATENCY

    edges = {
        dict(labels)["le"]
        for name, labels in after
        if name == "shipyard_time_to_first_token_seconds_bucket"
    }
    assert {float(e) for e in edges if e != "+Inf"} == set(LATENCY)
