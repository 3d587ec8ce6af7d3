"""A moto S3 server (a real S3 API) on a free localhost port: for the registry and DVC-remote
tests (tests/conftest.py), the mutation script and the shared-cache benchmark. No pytest
here, so scripts can import it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

MOTO = str(Path(sys.executable).with_name("moto_server"))


def start_moto(wait_s: float = 30.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start moto_server and return it with its URL once it accepts connections; a server
    that does not come up within `wait_s` is killed and reported."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [MOTO, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait(timeout=10)
    raise RuntimeError(f"moto_server did not accept connections within {wait_s:.0f} s")
