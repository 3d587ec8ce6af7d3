"""The bundle's own MLServer on 127.0.0.1: random free ports, health-checked, always stopped.

The server runs in its own process group, so stopping it stops everything it started; a
server that exits or never becomes ready fails with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType

from schemas import Refused, StageError
from stages._contract import link_or_copy
from stages.bundling import layout

POLL = 0.2
STOP_SECONDS = 10.0
LOG_TAIL = 40


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel reports free on loopback right now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def assemble(tree: Path, model_files: list[Path], serve: Path) -> None:
    """The bundle's serving layout in `tree`: the model where serving.yaml's `model_path`
    puts it (hard links), the configs (copies)."""
    import yaml

    model_path = yaml.safe_load((serve / "serving.yaml").read_text(encoding="utf-8"))["model_path"]
    for f in model_files:
        link_or_copy(f, tree / Path(model_path).parent / f.name)
    for f in serve.rglob("*"):
        if f.is_file() and f.name != "report.json":
            target = tree / f.relative_to(serve)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)  # copies: the server's settings are edited below


def log_tail(log: Path, lines: int = LOG_TAIL) -> str:
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def dies_with(parent: int, cpus: Collection[int] | None = None) -> Callable[[], None]:
    """A preexec_fn: the child pinned to `cpus` when asked, and killed when the process that
    started it dies, however it dies (kill -9 of a load test left its server serving 48
    minutes): Linux's parent-death signal, kept across the launcher's re-exec; a parent
    already gone means no server at all."""
    prctl = None
    if sys.platform.startswith("linux"):  # resolved here: the child only calls it
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)

    return setup


class LocalServer:
    """`with LocalServer(...) as server:` -> server.url is ready to take requests."""

    def __init__(
        self,
        tree: Path,
        model: str,
        log: Path,
        startup: float,
        batching: bool = True,
        cpus: set[int] | None = None,
        token: str | None = None,
        admin: bool = False,
        token_file: Path | None = None,
    ) -> None:
        self.tree, self.model, self.log, self.startup = tree, model, log, startup
        self.batching = batching
        self.cpus = cpus  # pin the server (and every thread it starts) to these cores
        # None: --no-auth (loopback only); a token: clients send it as a bearer token
        self.token, self.admin = token, admin
        self.token_file = token_file  # the token from this file instead of the environment
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = self.grpc = ""
        self.ports: list[int] = []

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends to be let in."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _configure(self) -> None:
        self.ports = free_ports(3)  # given to the launcher: the hashed settings stay as built
        entry = self.tree / layout.at(layout.MLSERVER_ENTRY, self.model)
        model_settings = entry / "model-settings.json"
        ms = json.loads(model_settings.read_text())
        if not self.batching:  # one request at a time: what batching is measured against
            extra = ms["parameters"]["extra"]
            extra["batching"]["enabled"] = False
            if extra.get("engine"):
                extra["engine"]["max_rows"] = 1
        model_settings.write_text(json.dumps(ms, indent=2))
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        self.grpc = f"127.0.0.1:{self.ports[1]}"

    def __enter__(self) -> LocalServer:
        for attempt in (1, 2):  # a port taken between free_ports() and bind: once more
            try:
                return self._start()
            except StageError:
                if attempt == 2 or "address already in use" not in log_tail(self.log).lower():
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> LocalServer:
        self._configure()
        if not (Path(sys.executable).parent / "mlserver").is_file():
            raise Refused(
                f"MLServer is not installed next to {sys.executable}",
                "install the project (`make release` sets up .venv with mlserver)",
            )
        http, grpc, metrics = self.ports
        command = [
            sys.executable,
            str(self.tree / layout.LAUNCHER),
            *("--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc)),
            *("--metrics-port", str(metrics)),
            *(["--admin-api"] if self.admin else []),
            *([] if self.token else ["--no-auth"]),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHIPYARD_API_TOKEN")}
        if self.token_file is not None:
            env["SHIPYARD_API_TOKEN_FILE"] = str(self.token_file)
        elif self.token:
            env["SHIPYARD_API_TOKEN"] = self.token
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=self.tree,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: stop() ends it and its children
                preexec_fn=self._child(os.getpid()),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _child(self, parent: int) -> Callable[[], None]:
        """Run in the server's process before it starts: see `dies_with`."""
        return dies_with(parent, self.cpus)

    # what _wait_ready and _fail say; a subclass for another server changes these
    WHO, PRODUCT, STAGE = "the server", "MLServer", "loadtest"
    HINT = "read the log above; raise loadtest.startup_seconds if the model is just slow"

    def _ready_url(self) -> str:
        return f"{self.url}/v2/models/{self.model}/ready"

    def _load_failed(self) -> bool:
        tail = log_tail(self.log, 200)
        return "Couldn't load model" in tail or "Traceback" in tail or "shipyard_serve:" in tail

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup
        ready = self._ready_url()
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self._fail(f"{self.WHO} exited with code {code} before it was ready")
            if self._load_failed():
                self._fail(f"{self.WHO} could not load the model")
            try:
                request = urllib.request.Request(ready, headers=self.headers)
                with urllib.request.urlopen(request, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL)
        self._fail(f"{self.WHO} was not ready within {self.startup:g} s")

    def _fail(self, why: str) -> None:
        self.stop()
        raise Refused(
            f"{why} ({self.PRODUCT} from {self.tree.name}, log {self.log.name}):\n"
            f"{log_tail(self.log)}",
            self.HINT,
        )

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL; idempotent."""
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGKILL, STOP_SECONDS)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # stragglers after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)

    def rss(self) -> int:
        """Resident memory of the server and its children, in bytes."""
        import psutil

        assert self.proc is not None
        try:
            proc = psutil.Process(self.proc.pid)
            return int(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]))
        except psutil.Error:
            return 0
