"""The PyTorch step's child process (stages._runtime.in_child): results and StageErrors come
back, a crash or a kill is a StageError naming the step, and the parent never imports torch."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from schemas import StageError
from stages._runtime import in_child
from tests.conftest import REPO, Workspace, gpt2_spec


def _fail(stage: str) -> None:
    raise StageError(stage, "the model is wrong", "fix the model")


def _crash() -> None:
    raise KeyError("a bug")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_result_and_a_stage_error_come_back() -> None:
    assert in_child(divmod, 17, 5) == (3, 2)
    with pytest.raises(StageError) as caught:
        in_child(_fail, "export")
    assert (caught.value.stage, caught.value.message, caught.value.hint) == (
        "export",
        "the model is wrong",
        "fix the model",
    )


def test_stage_error_pickles_by_its_parts() -> None:
    error = pickle.loads(pickle.dumps(StageError("parity", "message", "hint")))
    assert (error.stage, error.message, error.hint) == ("parity", "message", "hint")
    assert str(error) == str(StageError("parity", "message", "hint"))


def test_a_crash_and_a_kill_are_stage_errors(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StageError, match=r"\(_crash\) crashed in its child process"):
        in_child(_crash)
    assert "KeyError: 'a bug'" in capfd.readouterr().err  # the child's traceback is shown
    with pytest.raises(StageError, match=r"\(_kill\) was killed by signal 9") as caught:
        in_child(_kill)
    assert "memory" in caught.value.hint


def test_export_and_parity_never_import_torch_in_the_stage_process(ws: Workspace) -> None:
    """The point of the child: torch and the traced model live and die there."""
    spec = gpt2_spec()
    path = ws.write(spec)
    assert ws.run("pin", spec).status.value == "passed"
    script = textwrap.dedent(
        f"""
        import sys
        from schemas.loader import load_release
        from stages import execute
        from pathlib import Path
        for stage in ("export", "parity"):
            report = execute(stage, load_release({str(path)!r}), Path({str(path)!r}),
                             Path({str(ws.root)!r}))
            assert report.status.value == "passed", (stage, report.reasons)
        print("torch imported:", "torch" in sys.modules, "transformers" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "SHIPYARD_ROOT": str(ws.root)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch imported: False False" in done.stdout
    assert (Path(ws.out(spec["name"], "export")) / "model.onnx").is_file()
