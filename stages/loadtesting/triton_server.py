"""A bundle's Triton entries on a real Triton server on 127.0.0.1 (the CPU build that
`scripts/install_triton.py` puts in `.triton/`): random free ports, health-checked, stopped
with its process group (the python-backend stubs go with it).

    SHIPYARD_API_TOKEN=... python -m stages.loadtesting.triton_server build/tiny-gpt2/bundle \
        tiny-gpt2-generate [--no-auth]

runs one in the foreground on Triton's default ports (HTTP 8000, gRPC 8001, metrics 8002),
on 127.0.0.1, from a hard-linked copy of the bundle (the server never writes into it).

The token check is the MLServer launcher's (issue 43): the token comes from
`SHIPYARD_API_TOKEN` or the file `SHIPYARD_API_TOKEN_FILE` names; without one the server
does not start unless `--no-auth`. Triton checks no token itself, and its
`--*-restricted-api` takes the expected value on its command line (which any local user
can read in /proc), so: the server forwards each request's `authorization` header (HTTP and
gRPC, a stream's metadata too; on the HTTP generate extension, which forwards no header,
the body's `authorization` key) as a request parameter, and the python-backend model
compares it with the token, which it reads from a 0600 file in the server's private folder
(never its environment or command line). A model whose backend runs no such check (the
onnxruntime entry) is refused unless `--no-auth`. The APIs that change the server or read
beyond a request (model repository, shared memory, trace, logging) are restricted to a
header whose value is drawn at random per start and told to no one: they are off, as the
MLServer launcher's repository API is without `--admin-api`. Health, metadata, model
config and statistics stay open on loopback (read-only).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from schemas import Refused, StageError
from shipyard_runtime.front_door import TOKEN_FILE_ENV, check_auth, read_token
from stages.bundling import layout
from stages.loadtesting.server import LocalServer, dies_with, free_ports

HOME = Path(__file__).resolve().parents[2] / ".triton"


def home() -> Path:
    """The installed server: SHIPYARD_TRITON_HOME, else the repository's `.triton/`."""
    root = Path(os.environ.get("SHIPYARD_TRITON_HOME") or HOME)
    if not (root / "ready").is_file():
        raise Refused(
            f"no Triton server installed at {root}",
            "run `python scripts/install_triton.py .triton` (`make test` does)",
        )
    return root


LOOPBACK = "127.0.0.1"
# the header forwarded to the model as a request parameter, whatever its case (HTTP/1.1
# header names are case-insensitive; gRPC's are lower case)
AUTH_PATTERN = "^" + "".join(f"[{c.upper()}{c}]" for c in "authorization") + "$"
OFF_APIS = "model-repository,shared-memory,trace,logging"  # restricted to a secret no one has
NO_AUTH_ENV = "SHIPYARD_TRITON_NO_AUTH"  # the launcher's --no-auth, for the model


def command(
    root: Path, repository: Path, models: list[str], ports: list[int], host: str = LOOPBACK
) -> list[str]:
    """The server's command line: every port bound to `host`, loopback unless told (Triton
    binds 0.0.0.0 by default, and it checks no token: issue 43); the `authorization`
    header forwarded to the models, which check it; the admin APIs off."""
    import secrets

    http, grpc, metrics = ports
    off = f"{OFF_APIS}:shipyard-off={secrets.token_urlsafe(32)}"
    return [
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={root / 'backends'}",
        "--model-control-mode=explicit",
        *(f"--load-model={m}" for m in models),
        f"--http-address={host}",
        f"--grpc-address={host}",
        f"--metrics-address={host}",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        f"--http-header-forward-pattern={AUTH_PATTERN}",
        f"--grpc-header-forward-pattern={AUTH_PATTERN}",
        f"--http-restricted-api={off}",
        f"--grpc-restricted-protocol={off}",
        "--allow-gpu-metrics=false",
        "--exit-timeout-secs=5",
    ]


def guard(scratch: Path, token: str | None) -> dict[str, str]:
    """The model's token check, as environment for the server: the token in a 0600 file in
    the server's private folder (`scratch`), or --no-auth (`token` None)."""
    if token is None:
        return {NO_AUTH_ENV: "1"}
    file = scratch / "api-token"
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(token)
    return {TOKEN_FILE_ENV: str(file)}


def checked(repository: Path, models: list[str], token: str | None) -> None:
    """Refuse, with a token set, a model that cannot check it: only the python-backend
    entries compare the forwarded header (an onnxruntime entry would answer anyone)."""
    from stages.rendering.render import parse_triton

    for model in models:
        config = repository / model / "config.pbtxt"
        if not config.is_file():
            raise Refused(f"{model}: no {config}", "name a folder under serving/triton/")
        try:
            backend = parse_triton(config.read_text(encoding="utf-8")).backend
        except ValueError as exc:
            raise Refused(f"{config}: {exc}", "rebuild the bundle") from None
        if token is not None and backend != "python":
            raise Refused(
                f"{model} runs on Triton's {backend} backend, which checks no API token",
                "serve the python-backend (-generate) entry, or pass --no-auth on loopback",
            )


def environment(root: Path, auth: dict[str, str] | None = None) -> dict[str, str]:
    """The server's libraries; for the model, numpy 1.26 first, then this venv's packages;
    the token check's file (`auth`, from `guard`), never the token itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIPYARD_API_TOKEN")}
    env.pop(NO_AUTH_ENV, None)
    env.update(auth or {TOKEN_FILE_ENV: os.devnull})  # no guard: an empty token, refused
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(root / "lib"), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the bundle stays as signed
    env["SHIPYARD_SITE_PACKAGES"] = os.pathsep.join(
        [str(root / "site-packages"), sysconfig.get_paths()["purelib"]]
    )
    return env


def private_tree(bundle: Path, into: Path) -> Path:
    """`bundle` as a tree the server may write into: every folder made anew, every file
    hard-linked (symlinked where `into` is on another file system: never copied, a model
    may be GBs). Triton's python-backend stub writes `__pycache__` beside model.py whatever
    PYTHONDONTWRITEBYTECODE says; in this tree it lands in a folder of its own, and the
    bundle stays as signed (issue 43). A bundle holding a symlink is refused: the server
    could write through it (a verified bundle has none)."""
    into.mkdir(parents=True, exist_ok=True)
    for source in sorted(bundle.rglob("*")):
        target = into / source.relative_to(bundle)
        if source.is_symlink():
            raise Refused(
                f"{source} is a symlink: a bundle holds none",
                "serve a bundle as built or pulled (`shipyard verify` it first)",
            )
        if source.is_dir():
            target.mkdir(exist_ok=True)
            continue
        try:
            os.link(source, target)
        except OSError:  # another file system (a tmpfs /tmp): Python caches by this path
            os.symlink(source, target)
    return into


class TritonServer(LocalServer):
    """`with TritonServer(tree, [model], log, startup) as s:` -> s.grpc is ready."""

    WHO, PRODUCT, STAGE, HINT = "Triton", "Triton", "serve", "read the log above"

    def __init__(
        self, tree: Path, models: list[str], log: Path, startup: float, token: str | None
    ) -> None:
        super().__init__(tree, models[0], log, startup)
        self.models, self.token = models, token
        self.grpc = self.metrics = ""
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    def _start(self) -> TritonServer:
        root = home()
        ports = free_ports(3)
        self.url, self.grpc = f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        self.metrics = f"http://127.0.0.1:{ports[2]}/metrics"
        self._scratch = tempfile.TemporaryDirectory(prefix="shipyard-triton-")
        served = private_tree(self.tree, Path(self._scratch.name) / "bundle")
        repository = served / layout.TRITON
        checked(repository, self.models, self.token)
        auth = guard(Path(self._scratch.name), self.token)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command(root, repository, self.models, ports),
                cwd=served,
                preexec_fn=self._child(os.getpid()),  # dies with the process that started it
                env=environment(root, auth),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        super().stop()
        if self._scratch is not None:
            with contextlib.suppress(OSError):  # a stub's last files, racing its exit
                self._scratch.cleanup()
            self._scratch = None

    def _ready_url(self) -> str:
        return f"{self.url}/v2/health/ready"

    def _load_failed(self) -> bool:
        return False  # no log marker to watch: its exit code and readiness tell


USAGE = "usage: python -m stages.loadtesting.triton_server BUNDLE MODEL... [--no-auth]"


def main(argv: list[str]) -> int:
    no_auth = "--no-auth" in argv
    argv = [a for a in argv if a != "--no-auth"]
    if len(argv) < 2 or any(a.startswith("-") for a in argv):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        root = home()
        try:
            token = read_token(dict(os.environ))
            check_auth(token, no_auth, LOOPBACK)
        except SystemExit as exc:  # the MLServer launcher's refusals, named for it
            raise Refused(str(exc).removeprefix("shipyard_serve: ")) from None
    except StageError as exc:
        print(exc, file=sys.stderr)
        return 1
    bundle = Path(argv[0]).resolve()
    with tempfile.TemporaryDirectory(prefix="shipyard-triton-") as scratch:
        try:
            served = private_tree(bundle, Path(scratch) / "bundle")
            checked(served / layout.TRITON, argv[1:], token)
            auth = guard(Path(scratch), token)
        except StageError as exc:
            print(exc, file=sys.stderr)
            return 1
        args = command(root, served / layout.TRITON, argv[1:], [8000, 8001, 8002])
        return _foreground(args, environment(root, auth), served)


def _foreground(args: list[str], env: dict[str, str], cwd: Path) -> int:
    """Run the server until it exits, as if it were this process: SIGTERM, SIGINT and SIGHUP
    are passed on to it (a supervisor signals this process), it dies with this process
    (Linux's parent-death signal), and its exit status is this process's (128 + a signal
    that ended it)."""
    import signal

    server = subprocess.Popen(args, env=env, cwd=cwd, preexec_fn=dies_with(os.getpid()))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: server.send_signal(number))
    code = server.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
