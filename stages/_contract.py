"""The stage contract: what a stage declares (StageIO) and what it gets to run (StageContext)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from pydantic import BaseModel, ValidationError

from schemas import StageError, StageReport, StageStatus

if TYPE_CHECKING:
    from schemas import ReleaseSpec
from schemas.artifacts import Artifact
from schemas.report import Check

A = TypeVar("A", bound=Artifact)

ALWAYS_VISIBLE = ("name",)
# Stages whose output folder ships as it is (the bundle): their report lives in a folder
# beside it, so that the shipped folder holds nothing unhashed (verify skips only the
# manifest and the signature).
REPORT_APART = ("bundle",)


# Each stage run's provenance (pipelines/provenance.py), `shipyard run-stage` writes it: a
# DVC out of its own, outside the stage's folders, so that a stage reading an upstream
# folder never depends on who built it (a rebuild with new code but the same bytes reruns
# nothing downstream but the bundle, which ships the attestations).
ATTESTATIONS = "attestations"


def attestation_file(stage: str) -> str:
    """Where a stage's attestation lives, relative to its release's build folder."""
    return f"{ATTESTATIONS}/{stage}.json"


def report_dir(build: Path, stage: str) -> Path:
    """The folder holding `report.json` of `stage` in a release's build folder."""
    return build / (f"{stage}-report" if stage in REPORT_APART else stage)


# Every stage runs these (the runner, the spec defaults), so every stage depends on them.
# (The stage module's own imports are derived from the code: pipelines/closure.py.)
COMMON_CODE = (
    "stages/__init__.py",
    "stages/_contract.py",
    "schemas/release.py",
    "schemas/loader.py",
    # `shipyard run-stage` attests every stage's outputs (ATTESTATIONS)
    "pipelines/provenance.py",
)


# Where each stage's plot data is committed, like its metrics: the runner copies every
# file a Plot names there (build/<release>/plots/<stage>/<name>), a DVC plot output with
# `cache: false`, so `dvc plots diff HEAD` reads a commit's data from git in a clone that
# never built it (inside the stage's cached folder it lived in no commit).
PLOTS_DIR = "plots"


@dataclass(frozen=True)
class Plot:
    """A DVC plot over a data file the stage writes (`file`, relative to its output folder):
    one row per point, `x` and `y` the fields. The compiler declares the committed copy
    (`committed`) in the stage's `plots:` in dvc.yaml, so `dvc plots show` / `dvc plots
    diff` render it with these fields and labels; its id there is that path."""

    name: str
    file: str
    x: str
    y: str
    title: str
    x_label: str
    y_label: str
    template: str = "linear"

    def committed(self, stage: str) -> str:
        """The committed copy, relative to the release's build folder."""
        return f"{PLOTS_DIR}/{stage}/{Path(self.file).name}"


@dataclass(frozen=True)
class StageIO:
    """What the compiler needs to know about a stage; `io()` returns it without side effects.

    params:   top-level spec sections the stage reads (its DVC `params:`; nothing else is visible)
    reads:    the typed artifacts it reads (schemas/artifacts.py); their files become deps
    upstream: other upstream outputs as `stage` (whole output folder) or `stage/file`
    reads_model: the stage loads the checkpoint, so the model files are dependencies: pin's
              are the model's paths; the others' is pin's lock.json, which holds the
              sha256 of every file under them (VersionLock.files)
    code:     files it reads that are not Python modules (templates, the runtime it ships);
              the Python modules it imports are derived from the code (pipelines/closure.py)
    data:     (slot, path) data files from the spec, e.g. the calibration set; None = unused
    plots:    DVC plots over files it writes (the stage's `plots:` in dvc.yaml; a release
              that draws fewer than another writes an empty list for the others)
    sealed_by: an `upstream` stage whose output records, by sha256, every file the stage
              takes from the other `upstream` folders, and the stage refuses any file that
              differs (bundle: the manifest, checked by verify_bundle). DVC then depends on
              that stage's folder and the `reads` files only: a change upstream reruns the
              sealing stage, and this one when the seal changes. Ten folder deps less for
              bundle, each of which DVC walked file by file on every `dvc repro`.
    attests:  stages whose provenance attestation it reads (the bundle ships them); their
              attestation files (attestation_file) become deps
    """

    params: tuple[str, ...]
    reads: tuple[type[Artifact], ...] = ()
    upstream: tuple[str, ...] = ()
    reads_model: bool = False
    code: tuple[str, ...] = ()
    data: tuple[tuple[str, str | None], ...] = ()
    plots: tuple[Plot, ...] = ()
    sealed_by: str | None = None
    attests: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.sealed_by is not None and self.sealed_by not in self.upstream:
            raise ValueError(f"sealed_by={self.sealed_by!r} must be one of upstream")

    def upstream_files(self) -> tuple[str, ...]:
        """Every upstream dependency: the artifacts' files, then the other outputs. An
        artifact its stage writes only sometimes is a dependency on that stage's folder (DVC
        refuses a dep that does not exist), as is one whose whole folder is declared. With
        `sealed_by`, the other upstream folders are left to the sealing stage's output."""
        sealed = self.sealed_by is not None
        found = [
            a.STAGE if a.OPTIONAL else a.location()
            for a in self.reads
            if sealed or a.STAGE not in self.upstream
        ]
        folders = (self.sealed_by,) if self.sealed_by is not None else self.upstream
        return tuple(dict.fromkeys([*found, *folders]))

    def template(self) -> tuple[Any, ...]:
        """Everything but the per-release data paths: must agree across releases."""
        return (
            self.params,
            self.upstream_files(),
            self.reads_model,
            self.code,
            tuple(slot for slot, _ in self.data),
            self.attests,
        )


@dataclass(frozen=True)
class StageResult:
    status: StageStatus
    summary: str
    reasons: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # for people, never read by code
    optional: bool = False  # a skip is acceptable (StageReport.optional)
    checks: list[Check] = field(default_factory=list)  # verdicts the gate lists (SLOs)

    @classmethod
    def passed(cls, summary: str, **kw: Any) -> StageResult:
        return cls(StageStatus.PASSED, summary, **kw)

    @classmethod
    def failed(cls, summary: str, reasons: list[str], **kw: Any) -> StageResult:
        return cls(StageStatus.FAILED, summary, reasons, **kw)

    @classmethod
    def skipped(cls, reason: str, **kw: Any) -> StageResult:
        return cls(StageStatus.SKIPPED, f"skipped: {reason}", [reason], **kw)


@runtime_checkable
class Stage(Protocol):
    """What a stage module is (stages/<name>.py): its name, what it declares, what it does.
    The runner checks each module against it before running one (`check_stage`)."""

    NAME: str

    def io(self, release: ReleaseSpec) -> StageIO: ...

    # `release` is the ReleaseSpec scoped to the sections the stage declared (`scoped`:
    # reading another raises)
    def run(self, ctx: StageContext, release: ReleaseSpec) -> StageResult: ...


def check_stage(name: str, module: Any) -> Stage:
    """`module` as a Stage, or a clear error naming what it lacks."""
    if not isinstance(module, Stage):
        lacks = [a for a in ("NAME", "io", "run") if not hasattr(module, a)]
        raise RuntimeError(f"stages/{name}.py is not a stage: it has no {', '.join(lacks)}")
    if name != module.NAME:
        raise RuntimeError(f"stages/{name}.py names itself {module.NAME!r}, not {name!r}")
    import inspect

    for attr, count in (("io", 1), ("run", 2)):
        params = inspect.signature(getattr(module, attr)).parameters
        if len(params) != count:
            raise RuntimeError(
                f"stages/{name}.py: {attr}() takes {len(params)} parameter(s), "
                f"a stage's takes {count} ({'release' if count == 1 else 'ctx, release'})"
            )
    return module


M = TypeVar("M", bound=BaseModel)
# What a scoped section refuses besides its undeclared fields: the ways to read it whole.
WHOLE_READS = frozenset({"model_dump", "model_dump_json", "model_copy"})


def scoped(spec: M, sections: Iterable[str], prefix: str = "") -> M:
    """The release spec as a stage sees it: only the sections its StageIO declares.

    It is the spec's own type (a ReleaseSpec for `run(ctx, release: ReleaseSpec)`: an
    instance of a subclass made once per type and section set, holding the same values),
    whose undeclared sections raise when read: reading one is a bug (DVC would not rerun
    the stage when it changes). A dotted param (`bundle.serving`) declares one sub-section:
    the stage then sees `release.bundle.serving` and nothing else of `bundle`, and DVC
    reruns it only when that sub-section changes. Dumping or copying a scoped section
    whole is refused too (it would read the undeclared ones).
    """
    declared = frozenset(sections) | (frozenset(ALWAYS_VISIBLE) if not prefix else frozenset())
    values: dict[str, Any] = {}
    for name in type(spec).model_fields:
        value = getattr(spec, name)
        nested = [s.split(".", 1)[1] for s in declared if s.startswith(name + ".")]
        if name not in declared and nested:
            value = scoped(value, nested, f"{prefix}{name}.")
        values[name] = value
    visible = frozenset(s.split(".", 1)[0] for s in declared)
    cls = _scoped_class(type(spec), visible, prefix)
    return cls.model_construct(_fields_set=set(spec.model_fields_set), **values)


_SCOPED: dict[tuple[type[BaseModel], frozenset[str], str], type[Any]] = {}


def _rebuild(
    base: type[M], visible: frozenset[str], prefix: str, values: dict[str, Any], given: set[str]
) -> M:
    return _scoped_class(base, visible, prefix).model_construct(_fields_set=given, **values)


def _scoped_class(base: type[M], visible: frozenset[str], prefix: str) -> type[M]:
    key = (base, visible, prefix)
    if key in _SCOPED:
        return cast("type[M]", _SCOPED[key])
    hidden = frozenset(base.model_fields) - visible
    shown = sorted(prefix + s for s in visible)

    def refusal(name: str) -> str | None:
        if name in hidden:
            return (
                f"stage reads spec section {prefix + name!r} without declaring it in "
                f"io().params (declared: {shown})"
            )
        if name in WHOLE_READS:
            return (
                f"stage reads spec {prefix.rstrip('.') or 'release'!r} whole ({name}) but "
                f"declares only {shown} in io().params"
            )
        return None

    def __getattribute__(self: BaseModel, name: str) -> Any:  # noqa: N807
        if refusal(name):
            raise AttributeError(name)  # on to __getattr__, which says why
        return base.__getattribute__(self, name)

    def __getattr__(self: BaseModel, name: str) -> Any:  # noqa: N807
        why = refusal(name)
        if why:
            raise AttributeError(why)
        return base.__getattr__(self, name)  # type: ignore[attr-defined]

    def __reduce__(self: BaseModel) -> tuple[Any, ...]:
        # the class is made at run time: pickle (a stage's child process) rebuilds it
        fields = base.__getattribute__(self, "__dict__")
        return (_rebuild, (base, visible, prefix, dict(fields), set(self.model_fields_set)))

    methods = {
        "__getattribute__": __getattribute__,
        "__getattr__": __getattr__,
        "__reduce__": __reduce__,
    }
    sub = type(f"Scoped{base.__name__}", (base,), methods)
    _SCOPED[key] = sub
    return cast("type[M]", sub)


@dataclass
class StageContext:
    """Where a stage runs: the repo root, its build folder and a temp folder for its outputs."""

    stage: str
    release: str
    root: Path
    work: Path  # temp output folder; renamed to `out` when the stage finishes
    spec_path: Path
    reads: tuple[type[Artifact], ...] = ()  # what io() declares; ctx.read refuses the rest

    @property
    def build(self) -> Path:
        return self.root / "build" / self.release

    def upstream(self, stage: str) -> Path:
        """The finished output folder of an upstream stage of the same release."""
        path = self.build / stage
        if not (report_dir(self.build, stage) / "report.json").is_file():
            raise StageError(
                self.stage,
                f"upstream output {path} is missing",
                f"run `dvc repro {stage}@{self.release}` first",
            )
        return path

    def write(self, artifact: Artifact) -> None:
        """Write an artifact this stage produces into its output folder."""
        if self.stage != artifact.STAGE:
            raise RuntimeError(
                f"stage {self.stage} writes {type(artifact).__name__}, which "
                f"belongs to stage {artifact.STAGE}"
            )
        write_json(self.work / artifact.FILE, artifact.model_dump(mode="json", exclude_none=True))

    def read(self, kind: type[A], optional: bool = False) -> A:
        """An upstream artifact, validated. Reading one that io().reads does not declare is
        a bug (DVC would not rerun the stage when it changes): it raises at once.
        `optional`: the upstream stage writes it only sometimes (None when absent)."""
        if kind not in self.reads:
            raise RuntimeError(
                f"stage {self.stage} reads {kind.__name__} without declaring it in io().reads"
            )
        if optional != kind.OPTIONAL:
            raise RuntimeError(f"{kind.__name__} is read with optional={kind.OPTIONAL}")
        path = self.upstream(kind.STAGE) / kind.FILE
        if not path.is_file():
            if optional:
                return None  # type: ignore[return-value]
            raise StageError(
                self.stage,
                f"upstream artifact {path} is missing",
                f"rerun `dvc repro {kind.STAGE}@{self.release}`",
            )
        try:
            return kind.model_validate_json(path.read_text(encoding="utf-8"))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise StageError(
                self.stage,
                f"upstream artifact {path} does not match {kind.__name__}: {where}: {first['msg']}",
                f"rerun `dvc repro -f {kind.STAGE}@{self.release}` (it was written by other code)",
            ) from None

    def path(self, relative: str) -> Path:
        """A path from the spec (relative to the repo root)."""
        return (self.root / relative).resolve()

    def log(self, message: str) -> None:
        print(f"  [{self.stage}@{self.release}] {message}", file=sys.stderr, flush=True)

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Any]:
        """Rich progress bar on a terminal, a line per ~10 % in CI logs."""
        with progress_bar(f"{self.stage}@{self.release}: {description}", total) as advance:
            yield advance


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Any]:
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal and not os.environ.get("CI"):
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    state = {"done": 0, "shown": -1}
    start = time.monotonic()

    def advance(n: int = 1) -> None:
        state["done"] += n
        tenth = int(10 * state["done"] / max(total, 1))
        if tenth != state["shown"]:
            state["shown"] = tenth
            print(
                f"  {description}: {state['done']}/{total} ({time.monotonic() - start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    yield advance


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's malloc_trim), so
    that a stage which drops the PyTorch model before loading ONNX Runtime really peaks
    lower: without the trim, freed weights stay in the process as reusable heap."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)


def map_big_blocks(threshold: int = 128 << 10) -> None:
    """glibc: every allocation of `threshold` bytes or more gets a mapping of its own, given
    back to the OS when freed. By default glibc raises that threshold each time such a
    block is freed (up to 32 MiB), so a process that runs ONNX Runtime over many shapes
    keeps the freed tensors below it as heap that only grows: kvcheck's ONNX Runtime
    child rose 0.2 GB with each longer full pass on a 30-layer model (1.82 GB peak; 1.31
    with this). Setting it fixes it (mallopt M_MMAP_THRESHOLD). No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def write_json(path: Path, data: Any) -> None:
    """Write JSON with sorted keys, atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def link_or_copy(source: Path, target: Path) -> None:
    """Hard-link big artifacts instead of copying them; copy across file systems."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def read_report(folder: Path) -> StageReport:
    return StageReport.model_validate_json((folder / "report.json").read_text(encoding="utf-8"))


def publish(work: Path, out: Path) -> None:
    """Move a finished temp folder into place; whatever was there before is replaced.

    Concurrent runs of one stage may publish at once: a check-then-move would let one of
    them find `out` refilled by the other. So: try the rename; while a previous output is
    in the way, move it aside (to this run's own trash) and try again. Each run lands whole.
    """
    trash = out.with_name(f".{out.name}.{os.getpid()}.old")  # per run, like the temp
    for _ in range(100):
        try:
            os.replace(work, out)  # succeeds when `out` is absent
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
                raise
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):  # another run moved it first
            os.replace(out, trash)
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not publish {work} to {out}: other runs kept replacing it")


def in_child(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh Python process (`python -m stages._child`), returning its
    result and re-raising its StageError. The stages run their PyTorch step this way: torch,
    the model and what the tracer leaves behind go when the child exits, so the ONNX Runtime
    work that follows runs in a process that never imported torch (issue 14: peak memory;
    in one process, 0.2 GB stayed behind and the probes peaked on top of it). A plain
    subprocess rather than multiprocessing's spawn, which re-runs the caller's main script.
    `fn` and the arguments are pickled: module-level functions and plain data.

    SHIPYARD_STAGE_CHILD=0 runs it in this process instead, after the same pickling of the
    call and its result: the test suite's in-process stages (a child pays torch's import,
    about 3 s, per stage); tests of the child itself and the end-to-end builds keep it."""
    import pickle
    import subprocess
    import tempfile

    if os.environ.get("SHIPYARD_STAGE_CHILD") == "0":
        call, call_args = pickle.loads(pickle.dumps((fn, args)))
        try:
            value = call(*call_args)
        except StageError as exc:
            raise pickle.loads(pickle.dumps(exc)) from None
        return pickle.loads(pickle.dumps(value))

    stage = getattr(args[0], "stage", "stage") if args else "stage"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryDirectory(prefix="shipyard-child-") as tmp:
        result = Path(tmp) / "result.pickle"
        done = subprocess.run(
            [sys.executable, "-m", "stages._child", str(result)],
            input=pickle.dumps((fn, args)),
            env=env,
            check=False,
        )
        if done.returncode != 0 or not result.is_file():
            killed = done.returncode < 0
            raise StageError(
                stage,
                f"the step ({fn.__name__}) "
                + (f"was killed by signal {-done.returncode}" if killed else "crashed")
                + " in its child process",
                "it was most likely killed for memory: free memory or lower `shipyard build -j`"
                if killed
                else "see the child's traceback above; report it with the spec",
            )
        kind, value = pickle.loads(result.read_bytes())
    if kind == "error":
        raise value
    return value
