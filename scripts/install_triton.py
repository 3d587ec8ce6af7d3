"""Install a CPU Triton Inference Server with the python backend into a folder (`.triton/`).

Triton is not on PyPI as a server, but the `nvidia-pytriton` wheel ships a `tritonserver`
binary and the python backend, which run on CPU-only machines. This unpacks that wheel
(without its Python dependencies: its client pins numpy<2), lays out a backend folder with
the stub for this Python, and installs numpy 1.26 beside it: the stub's C++ reads numpy
arrays with the numpy 1 ABI, so under numpy 2 a BYTES tensor decodes as garbage. The
project's own packages (onnxruntime, tokenizers, pydantic, jinja2) come from the venv.

    python scripts/install_triton.py .triton

Layout: `bin/tritonserver`, `lib/` (its shared libraries), `backends/python/`,
`site-packages/` (numpy 1.26, first on the model's path). Idempotent: `ready` marks a
complete install; a half-done one is removed and redone.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
STUB_NUMPY = "numpy==1.26.4"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--quiet", *args], check=True)


def main(target: Path) -> int:
    if (target / "ready").is_file():
        return 0
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if (
        not ctypes.util.find_library(f"python{version}")
        and shutil.which("apt-get")
        and (os.geteuid() == 0)
    ):
        subprocess.run(["apt-get", "install", "-y", "-q", f"libpython{version}"], check=False)
    if not ctypes.util.find_library(f"python{version}"):
        print(
            f"install_triton: the python backend's stub links libpython{version}.so, which "
            f"this machine lacks: `apt-get install -y libpython{version}`",
            file=sys.stderr,
        )
        return 1
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, unpacked = Path(tmp) / "wheels", Path(tmp) / "pytriton"
        pip("download", "--no-deps", "--dest", str(wheels), PYTRITON)
        wheel = next(wheels.glob("*.whl"))
        pip("install", "--no-deps", "--no-compile", "--target", str(unpacked), str(wheel))
        server = unpacked / "pytriton" / "tritonserver"
        stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            print(f"install_triton: {PYTRITON} has no stub for Python {version}", file=sys.stderr)
            return 1
        (target / "bin").mkdir(parents=True)
        shutil.copy2(server / "bin" / "tritonserver", target / "bin" / "tritonserver")
        shutil.copytree(unpacked / "nvidia_pytriton.libs", target / "lib")
        backend = target / "backends" / "python"
        shutil.copytree(server / "backends" / "python", backend, ignore=_pycache)
        shutil.copy2(stub, backend / "triton_python_backend_stub")
    pip("install", "--no-deps", "--target", str(target / "site-packages"), STUB_NUMPY)
    (target / "ready").write_text(f"{PYTRITON}\n{STUB_NUMPY}\n")
    return 0


def _pycache(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".triton").resolve()))
