"""`shipyard build`: the memory-aware admission of releases, and its refusals through the CLI.
(Two real releases built side by side: tests/pipelines/test_end_to_end.py.)"""

from __future__ import annotations

import pytest

from pipelines.build import admit, estimate, parse_memory, weight_bytes
from schemas import ShipyardError
from schemas.loader import load_release
from tests.conftest import Workspace, gpt2_spec
from tests.pipelines.test_cli import shipyard

GIB = 1 << 30


def test_admit_fills_the_budget_and_lets_a_smaller_release_pass_a_big_one() -> None:
    waiting = [("big", 6 * GIB), ("mid", 5 * GIB), ("small", 3 * GIB)]
    # exactly at the budget fits; one byte over does not
    assert admit(waiting, [], 9 * GIB, 3) == ["big", "small"]
    assert admit(waiting, [], 9 * GIB - 1, 3) == ["big"]
    assert admit(waiting, [6 * GIB], 9 * GIB, 3) == ["small"]  # mid waits for memory
    assert admit(waiting, [], 100 * GIB, 2) == ["big", "mid"]  # the job count caps it
    assert admit(waiting, [1, 1], 100 * GIB, 2) == []


def test_admit_always_starts_one_release_when_nothing_runs() -> None:
    """The limit orders work, it never refuses it: a release above the budget runs alone."""
    assert admit([("huge", 50 * GIB), ("tiny", 1)], [], 8 * GIB, 4) == ["huge"]
    assert admit([("huge", 50 * GIB)], [1], 8 * GIB, 4) == []


@pytest.mark.parametrize(
    ("text", "want"),
    [("12GiB", 12 * GIB), ("512MiB", 512 << 20), ("2e9", 2 * 10**9), ("1.5gb", 15 * 10**8)],
)
def test_memory_sizes_parse(text: str, want: int) -> None:
    assert parse_memory(text) == want


@pytest.mark.parametrize("text", ["lots", "0GiB", "-1GiB", ""])
def test_a_bad_memory_size_is_refused_with_the_fix(text: str) -> None:
    with pytest.raises(ShipyardError, match="--memory"):
        parse_memory(text)


def test_the_estimate_grows_with_every_shard_of_the_checkpoint(ws: Workspace) -> None:
    ws.write(gpt2_spec())
    release = load_release(ws.root / "releases" / "tiny-gpt2.yaml")
    folder = ws.root / "models" / "tiny-gpt2"
    one = weight_bytes(ws.root, release.model)
    assert one == (folder / "model.safetensors").stat().st_size
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 1000)
    assert weight_bytes(ws.root, release.model) == one + 1000
    assert estimate(ws.root, release.model) > 8 * weight_bytes(ws.root, release.model)


def test_build_refuses_an_unknown_release_naming_the_known_ones() -> None:
    done = shipyard("build", "no-such-release", "-j", "2")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no release named no-such-release" in done.stderr
    assert "tiny-gpt2" in done.stderr and "gpt2-small" in done.stderr


def test_build_refuses_zero_jobs_and_a_bad_memory_size() -> None:
    done = shipyard("build", "tiny-gpt2", "-j", "0")
    assert done.returncode != 0 and "-j 0: give at least 1 job" in done.stderr
    done = shipyard("build", "tiny-gpt2", "--memory", "lots")
    assert done.returncode != 0 and "--memory 'lots' is not a size" in done.stderr
