"""A bundle's Triton entries on a real Triton server on 127.0.0.1 (the CPU build that
`scripts/install_triton.py` puts in `.triton/`): random free ports, health-checked, stopped
with its process group (the python-backend stubs go with it).

    python -m stages.serving.triton_server build/tiny-gpt2/bundle tiny-gpt2-generate

runs one in the foreground on Triton's default ports (HTTP 8000, gRPC 8001, metrics 8002).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from schemas import Refused, StageError
from stages.serving.server import LocalServer, free_ports

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


def command(root: Path, repository: Path, models: list[str], ports: list[int]) -> list[str]:
    http, grpc, metrics = ports
    return [
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={root / 'backends'}",
        "--model-control-mode=explicit",
        *(f"--load-model={m}" for m in models),
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        "--allow-gpu-metrics=false",
        "--exit-timeout-secs=5",
    ]


def environment(root: Path) -> dict[str, str]:
    """The server's libraries; for the model, numpy 1.26 first, then this venv's packages."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(root / "lib"), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the bundle stays as signed
    env["SHIPYARD_SITE_PACKAGES"] = os.pathsep.join(
        [str(root / "site-packages"), sysconfig.get_paths()["purelib"]]
    )
    return env


class TritonServer(LocalServer):
    """`with TritonServer(tree, [model], log, startup) as s:` -> s.grpc is ready."""

    WHO, PRODUCT, STAGE, HINT = "Triton", "Triton", "serve", "read the log above"

    def __init__(self, tree: Path, models: list[str], log: Path, startup: float) -> None:
        super().__init__(tree, models[0], log, startup)
        self.models = models
        self.grpc = ""

    def _start(self) -> TritonServer:
        root = home()
        ports = free_ports(3)
        self.url, self.grpc = f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        repository = self.tree / "serving" / "triton"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command(root, repository, self.models, ports),
                cwd=self.tree,
                env=environment(root),
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

    def _ready_url(self) -> str:
        return f"{self.url}/v2/health/ready"

    def _load_failed(self) -> bool:
        return False  # no log marker to watch: its exit code and readiness tell


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m stages.serving.triton_server BUNDLE MODEL...", file=sys.stderr)
        return 2
    try:
        root = home()
    except StageError as exc:
        print(exc, file=sys.stderr)
        return 1
    bundle = Path(argv[0]).resolve()
    args = command(root, bundle / "serving" / "triton", argv[1:], [8000, 8001, 8002])
    os.execve(args[0], args, environment(root))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
