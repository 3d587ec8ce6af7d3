"""`shipyard serve RELEASE[@VERSION|@CHANNEL]`: a built or published bundle served by its
own launcher (`serving/mlserver/shipyard_serve.py`: the token, the limits, the OpenAI and
V2 front doors on one set of ports), from a private copy that is verified before it runs.

- `RELEASE` alone: this checkout's `build/RELEASE/bundle`; `RELEASE@1.2.0`: that published
  version; `RELEASE@production`: the version the channel points at, with the digest the
  pointer names and the channel's signature policy (`Registry.checkout`).
- The copy is a real copy (never a link) in `$SHIPYARD_SERVE_DIR` (default
  `$XDG_CACHE_HOME/shipyard/served`, else `~/.cache/shipyard/served`), one folder per
  server process, `serve-<pid>`: the server writes nothing into the bundle or the registry,
  and a registry writer cannot change what was verified. A folder whose process has ended is
  removed by the next `shipyard serve`.
- This process becomes the launcher (exec, the same pid): a supervisor's signals reach the
  server, its exit status is the server's, and the launcher's own re-exec takes the token
  out of the environment block (/proc/<pid>/environ) as it does when run by hand.
- `--device cuda` runs the model on ONNX Runtime's CUDA execution provider; refused here,
  before anything is copied, when this onnxruntime has none.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import RegistryError, ShipyardError
from stages.bundling import layout

if TYPE_CHECKING:
    from pipelines.registry import CheckedOut

SERVE_DIR_ENV = "SHIPYARD_SERVE_DIR"
LAUNCHER = Path(layout.LAUNCHER)


class ServeError(ShipyardError):
    """`shipyard serve` refused what it was asked: a target that is not one, a release that
    does not exist, a device this machine lacks (a flag or an argument is wrong: exit 2, as
    for SpecError). A bundle that is missing, tampered with or cannot be served is refused
    with RegistryError (exit 5), as `shipyard verify` refuses it."""

    exit_code = 2


def serve_dir() -> Path:
    given = os.environ.get(SERVE_DIR_ENV)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "shipyard" / "served"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(folder: Path) -> None:
    """rm -rf, read-only folders included (a bundle's copy keeps its modes)."""

    def writable(func: Any, path: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)
            func(path)

    if folder.exists() or folder.is_symlink():
        shutil.rmtree(folder, onerror=writable)  # onexc from Python 3.12


def sweep(root: Path) -> list[Path]:
    """Remove the copies of servers that have ended (`serve-<pid>` whose pid is gone)."""
    removed = []
    for folder in sorted(root.glob("serve-*")):
        pid = folder.name.removeprefix("serve-")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            remove(folder)
            removed.append(folder)
    return removed


def checkout(
    target: str, registry_url: str, served: Path, repo: Path
) -> tuple[Path, CheckedOut, str]:
    """The verified private copy of `target` under `served`/serve-<pid>/bundle, what it is,
    and where it came from; a release without a version or channel is the bundle built in
    the repository `repo`."""
    from pipelines.registry import CheckedOut, Registry, check_name
    from schemas.facts import FactsHead
    from stages.bundling.oms import load_manifest, read_facts, verify_bundle

    name, at, ref = target.partition("@")
    check_name(name)
    if at and not ref:
        raise ServeError(f"{target!r}: write RELEASE, RELEASE@VERSION or RELEASE@CHANNEL")
    served.mkdir(parents=True, exist_ok=True)
    sweep(served)
    folder = served / f"serve-{os.getpid()}"
    remove(folder)  # a reused pid's leftover
    folder.mkdir(mode=0o700)
    into = folder / "bundle"
    try:
        if at:
            what = Registry(registry_url).checkout(name, ref, into)
            return into, what, f"{registry_url} ({name}@{ref})"
        source = repo / "build" / name / "bundle"
        if not (source / "manifest.json").is_file():
            # no such release (nor a spec of it) is an argument mistake; a release whose
            # bundle is not built, a missing bundle
            unknown = not (repo / "releases" / f"{name}.yaml").is_file()
            raise (ServeError if unknown else RegistryError)(
                f"{source} is not a built bundle: build it (`dvc repro bundle@{name}`), or "
                f"serve a published one ({name}@VERSION or {name}@CHANNEL)"
            )
        shutil.copytree(source, into, symlinks=True)
        problems = verify_bundle(into)
        if problems:
            raise RegistryError(
                f"{source} does not match its manifest; refusing to serve it:\n"
                + "\n".join(f"  {p}" for p in problems[:20])
                + "\n  rebuild it (`dvc repro bundle@"
                + name
                + "`)"
            )
        facts = read_facts(into, FactsHead)
        digest = load_manifest(into / "manifest.json").digest
        return into, CheckedOut(release=name, version=facts.version, digest=digest), str(source)
    except BaseException:
        remove(folder)
        raise


def run(target: str, registry_url: str, device: str, launcher_args: list[str], repo: Path) -> int:
    """Check, copy, verify, then exec the copy's launcher (returns only on a refusal)."""
    if device == "cuda":
        from shipyard_runtime.session import cuda_missing

        problem = cuda_missing()
        if problem:
            raise ServeError(f"--device cuda: {problem}")
    try:
        bundle, what, source = checkout(target, registry_url, serve_dir(), repo)
    except (OSError, ValueError) as exc:  # a RegistryError is neither: it passes as it is
        raise ServeError(f"{target}: {exc}") from None
    launcher = bundle / LAUNCHER
    if not launcher.is_file():
        remove(bundle.parent)
        raise RegistryError(
            f"{target} has no {LAUNCHER} (a bundle of a task MLServer does not serve, or "
            "built before the launcher existed): rebuild it"
        )
    channel = f" ({what.channel})" if what.channel else ""
    print(
        f"serving {what.label}{channel}, digest {what.digest[:16]}, from {source}; "
        f"verified copy in {bundle}; device {device}",
        file=sys.stderr,
        flush=True,
    )
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    argv = [sys.executable, str(launcher), *launcher_args, "--device", device]
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)
    return 1  # not reached
