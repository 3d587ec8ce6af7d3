"""The PyTorch step's child process (stages._contract.in_child): results and StageErrors come
back, a crash or a kill is a StageError naming the step, and the parent never imports torch."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas import StageError
from stages._contract import in_child
from tests.conftest import REPO, Workspace, gpt2_spec


def _fail(stage: str) -> None:
    raise StageError(stage, "the model is wrong", "fix the model")


def _crash() -> None:
    raise KeyError("a bug")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(autouse=True)
def real_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest runs the PyTorch step in-process for speed; here it is the subject."""
    monkeypatch.setenv("SHIPYARD_STAGE_CHILD", "1")


@pytest.mark.parametrize("child", ["1", "0"])
def test_a_result_and_a_stage_error_come_back(monkeypatch: pytest.MonkeyPatch, child: str) -> None:
    monkeypatch.setenv("SHIPYARD_STAGE_CHILD", child)
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


def test_in_process_mode_still_pickles_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """What cannot cross to a child fails in the tests' in-process mode too."""
    monkeypatch.setenv("SHIPYARD_STAGE_CHILD", "0")
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        in_child(lambda: 1)


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


def _mapped_rss() -> int:
    """Resident kB of the safetensors files mapped in this process."""
    total, mapped = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            mapped = head[-1].endswith(".safetensors")
        elif mapped and head[:1] == ["Rss:"]:
            total += int(head[1])
    return total


def _tiny_net() -> tuple[Any, Any, dict[str, Any]]:
    from schemas.loader import load_release
    from stages.onnx import model as m
    from stages.onnx import shapes as sh

    ws_root = REPO
    release = load_release(REPO / "releases" / "tiny-gpt2.yaml")
    net, lay = m.load_with_layout(ws_root, release)
    flat = m.adapter(release.task, net, lay)
    feeds = sh.make_inputs(lay, sh.trace_sizes(release.export.dims), seed=0)
    return net, (flat, lay), feeds


def test_paged_weights_give_the_same_outputs_and_leave_the_resident_set() -> None:
    from stages.onnx import model as m

    net, (flat, lay), feeds = _tiny_net()
    want = m.torch_outputs(flat, lay, feeds)
    assert _mapped_rss() > 0, "the checkpoint is not memory-mapped: nothing to test"
    with m.weights_paged(net):
        got = m.torch_outputs(flat, lay, feeds)
        again = m.torch_outputs(flat, lay, feeds)  # faulted back in, unchanged
    assert _mapped_rss() == 0
    for a, b, c in zip(want, got, again, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_weight_written_in_memory_is_never_dropped() -> None:
    """A mapping with a written (copy-on-write) page would lose the write if dropped: the
    model would silently run with the file's weights. Such a mapping is left alone."""
    import gc

    import torch

    from stages.onnx import model as m

    gc.collect()  # models other tests loaded in this process, unreachable but not yet freed
    others = set(m._clean_checkpoint_maps())
    net, (flat, lay), feeds = _tiny_net()
    weight = next(p for n, p in net.named_parameters() if n.endswith("c_fc.weight"))
    with torch.no_grad():
        weight.mul_(1.5)  # in place: the mapped page is copied and written
    want = m.torch_outputs(flat, lay, feeds)
    assert _mapped_rss() > 0
    assert set(m._clean_checkpoint_maps()) - others == set()
    with m.weights_paged(net):
        got = m.torch_outputs(flat, lay, feeds)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def _refuse(_: str) -> None:
    from schemas import Refused

    raise Refused("no tokenizer.json", "point it at the tokenizer folder")


def test_a_refusal_from_shared_code_pickles_and_knows_no_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from schemas import Refused

    error = pickle.loads(pickle.dumps(Refused("message", "hint")))
    assert (type(error), error.stage, error.message, error.hint) == (Refused, "", "message", "hint")
    assert str(error) == "message\n  fix: hint"
    assert isinstance(error, StageError)
    for child in ("1", "0"):
        monkeypatch.setenv("SHIPYARD_STAGE_CHILD", child)
        with pytest.raises(Refused, match="no tokenizer.json"):
            in_child(_refuse, "x")
