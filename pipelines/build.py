"""`shipyard build [NAMES] -j N`: several releases at once, within the machine's memory.

DVC's own machinery does the work: `dvc repro --single-item <stage>@<release>` for each
stage of a release, in pipeline order, one release per worker. DVC releases its repository
lock while a stage's command runs and holds only read locks on the stage's deps and write
locks on its outs (dvc/stage/run.py, `unlocked_repo`), so stages of different releases run
side by side; `--wait-for-lock` makes each wait (instead of failing) for the short moments
another holds the repository lock to read or write dvc.lock. `--single-item` is what makes
this safe: a plain `dvc repro bundle@a` also walks the stage every release shares (`code`,
the fingerprints), taking its write lock even when there is nothing to do, so two of them
collide. `code` runs first, alone, and each release then reproduces only its own stages,
each checked against dvc.lock (unchanged ones are skipped, the run-cache still restores).

`dvc repro` itself has no `--jobs` (DVC's parallel runs are `dvc exp run --queue`, which
copies the workspace per run and commits experiments, not a build), hence this wrapper.

Trust: with `SHIPYARD_TRUSTED_BUILDERS` set, an output DVC restores instead of building (its
run-cache, or `--pull` from the shared remote) is checked against its attestation
(pipelines/provenance.py) right after its stage and before the next stage reads it; one no
trusted builder signed for these inputs is evicted with its cached objects and run-cache
entries, and the stage runs here (`--force`), said as `rebuild <stage>@<release>: why`. A
plain `dvc repro` restores without asking; `shipyard provenance` can only check afterwards.

Memory: a release's peak is estimated from its checkpoint (`PEAK_PER_WEIGHT_BYTE` times the
weight bytes plus `BASE_BYTES` for the interpreter, torch and ONNX Runtime), and a release
starts only while the estimates of everything running fit in `--memory` (default: 80 % of
MemAvailable). One release always runs, however big: the limit orders work, it never refuses
it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines import provenance
from pipelines.fingerprint import CODE_STAGE
from schemas import ShipyardError, SpecError

# export's measured peak on gpt2-small was 8.1x the checkpoint (issue 14); the estimate keeps
# that margin. BASE: python + torch + transformers + onnxruntime imported, measured ~0.9 GB.
PEAK_PER_WEIGHT_BYTE = 8.0
BASE_BYTES = 1 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class Job:
    release: str
    estimate: int
    log: Path
    started: float = 0.0
    process: subprocess.Popen[bytes] | None = None


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 8 GiB where there is no /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def parse_memory(text: str) -> int:
    """'12GiB', '512MiB', '2e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "gb": 10**9}
    units.update({"mb": 10**6, "kb": 10**3, "b": 1})
    t = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        value = float(t) * factor
    except ValueError:
        raise SpecError(
            "--memory", [f"--memory {text!r} is not a size; write e.g. 12GiB, 512MiB or 2e9"]
        ) from None
    if value <= 0:
        raise SpecError("--memory", [f"--memory {text!r} must be positive"])
    return int(value)


def weight_bytes(root: Path, model: object) -> int:
    """Bytes of the checkpoint a release loads (every shard of a sharded one)."""
    kind = getattr(model, "kind", "")
    if kind == "hf":
        folder = root / str(getattr(model, "path", ""))
        return sum(f.stat().st_size for f in folder.glob("*") if f.suffix in WEIGHT_SUFFIXES)
    weights = getattr(model, "weights", None)
    path = root / weights if weights else None
    return path.stat().st_size if path and path.is_file() else 0


def estimate(root: Path, model: object) -> int:
    return int(BASE_BYTES + PEAK_PER_WEIGHT_BYTE * weight_bytes(root, model))


def admit(waiting: list[tuple[str, int]], running: list[int], budget: int, jobs: int) -> list[str]:
    """Which waiting releases (name, estimate; biggest first) start now, given the estimates
    of those running: within `jobs` and `budget`; a release that does not fit waits while a
    smaller one behind it may start; with nothing running, the first always starts."""
    used, count, start = sum(running), len(running), []
    for name, need in waiting:
        if count >= jobs:
            break
        if count and used + need > budget:
            continue
        start.append(name)
        used, count = used + need, count + 1
    return start


def _dvc() -> str:
    dvc = Path(sys.executable).with_name("dvc")
    return str(dvc if dvc.exists() else "dvc")


def build(
    root: Path,
    names: list[str],
    jobs: int,
    budget: int | None = None,
    say: Callable[[str], None] = print,
    pull: bool = False,
    until: str | None = None,
) -> int:
    """Build the named releases (default: all); returns how many failed."""
    from pipelines import compiler

    if jobs < 1:
        raise SpecError("--jobs", [f"-j {jobs}: give at least 1 job"])
    releases = {spec.name: spec for _, spec in compiler.discover(root)}
    unknown = [n for n in names if n not in releases]
    if unknown:
        raise SpecError(
            "releases/",
            [f"no release named {', '.join(unknown)}; releases/ has {', '.join(sorted(releases))}"],
        )
    stages = _stages(until)  # every argument checked before the checkout is
    if compiler.is_stale(root):
        raise ShipyardError("dvc.yaml is stale; run `shipyard compile` first")
    trusted = bool(provenance.trusted_keys())
    if trusted:
        say("restored outputs are checked against their attestations (trusted builders set)")
    chosen = names or sorted(releases)
    budget = budget or int(0.8 * available_memory())
    logs = root / "build" / ".logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending = sorted(
        (Job(r, estimate(root, releases[r].model), logs / f"{r}.log") for r in chosen),
        key=lambda j: (-j.estimate, j.release),
    )
    say(
        f"building {len(pending)} release(s), at most {jobs} at once within "
        f"{budget / 2**30:.1f} GiB: "
        + ", ".join(f"{j.release} (~{j.estimate / 2**30:.1f} GiB)" for j in pending)
    )
    # the fingerprints are cheap: with trusted builders they are computed here, never restored
    shared = subprocess.run(
        [_dvc(), "repro", "--single-item", *(["--force"] if trusted else []), CODE_STAGE],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if shared.returncode != 0:
        raise ShipyardError(f"`dvc repro code` failed: {(shared.stderr or shared.stdout)[-800:]}")
    running: list[Job] = []
    failed = 0
    while pending or running:
        waiting = [(j.release, j.estimate) for j in pending]
        for name in admit(waiting, [j.estimate for j in running], budget, jobs):
            job = next(j for j in pending if j.release == name)
            _start(root, job, stages, pull)
            say(f"started {job.release}")
            pending.remove(job)
            running.append(job)
        time.sleep(0.2)
        for job in list(running):
            assert job.process is not None
            code = job.process.poll()
            if code is None:
                continue
            running.remove(job)
            seconds = time.monotonic() - job.started
            text = job.log.read_text(encoding="utf-8", errors="replace")
            ran = text.count("Running stage '")
            for line in text.splitlines():
                if line.startswith(REBUILT):
                    say(f"{job.release}: {line}")
            if code == 0:
                say(f"{job.release}: ok, {ran} stage(s) ran, {seconds:.1f} s")
            else:
                failed += 1
                tail = "\n".join(text.strip().splitlines()[-15:])
                say(
                    f"{job.release}: FAILED (exit {code}) after {seconds:.1f} s; "
                    f"log {job.log.relative_to(root)}:\n{tail}"
                )
    return failed


def _stages(until: str | None) -> list[str]:
    from stages import STAGES

    names = list(STAGES)
    if until is not None and until not in names:
        raise SpecError(
            "--until", [f"--until {until}: no such stage; choose one of {', '.join(names)}"]
        )
    return names[: names.index(until) + 1] if until else names


def _start(root: Path, job: Job, stages: list[str], pull: bool) -> None:
    """One worker per release (`python -m pipelines.build`): its stages in pipeline order,
    stopping at the first failure."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-m", "pipelines.build", job.release, ",".join(stages)]
    with job.log.open("wb") as log:
        job.process = subprocess.Popen(
            [*command, *(["--pull"] if pull else [])],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    job.started = time.monotonic()


REBUILT = "rebuild "  # the line a worker writes for an evicted, untrusted restore


def _repro(root: Path, target: str, *flags: str) -> tuple[int, str]:
    """`dvc repro --single-item` of one stage: its output streamed to the worker's log as it
    comes (a long stage shows its progress) and returned."""
    with subprocess.Popen(
        [_dvc(), "--wait-for-lock", "repro", "--single-item", *flags, target],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return proc.returncode, "".join(lines)


def reproduce(root: Path, release: str, stages: list[str], pull: bool) -> int:
    """A worker: each stage by `dvc repro --single-item`; with trusted builders, every output
    this worker did not build (restored, pulled or already there) is checked before the
    next stage reads it, and rebuilt here when no trusted builder attested it for these
    inputs. Returns an exit code."""
    from pipelines import cache

    trusted = provenance.trusted_keys()
    for stage in stages:
        target = f"{stage}@{release}"
        code, text = _repro(root, target, *(["--pull"] if pull else []))
        if code != 0:
            return code
        if not trusted or f"Running stage '{target}'" in text:
            continue  # built here: nothing came from elsewhere
        # restored from the run-cache ("is cached"), pulled from the remote ("Pulling data"),
        # or left as it was ("didn't change"): whatever restored it, an output this worker
        # did not build is checked before the next stage reads it (issue 42 item 3: an output
        # `cache pull` had evicted came back by `--pull` unchecked)
        paths = provenance.stage_paths(root, stage, release)
        who, problems = (
            provenance.check(root, paths, trusted)
            if paths is not None
            else (None, ["not in dvc.yaml: run `shipyard compile`"])
        )
        if not problems:
            print(f"trusted {target}: restored, built by {who}", flush=True)
            continue
        print(f"{REBUILT}{target}: {problems[0]} (restored by DVC; evicted)", flush=True)
        cache.evict(root, stage, release)
        code, _ = _repro(root, target, "--force")
        if code != 0:
            return code
    return 0


if __name__ == "__main__":  # a worker of `shipyard build`
    import argparse

    from stages import repo_root

    cli = argparse.ArgumentParser(prog="python -m pipelines.build")
    cli.add_argument("release")
    cli.add_argument("stages", help="comma-separated, in pipeline order")
    cli.add_argument("--pull", action="store_true")
    args = cli.parse_args()
    sys.exit(reproduce(repo_root(), args.release, args.stages.split(","), args.pull))
