"""TensorRT control flow that needs no GPU, with a fake `tensorrt` module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from schemas import StageError
from stages._tensorrt import compatibility_level


def fake_trt(*levels: str) -> SimpleNamespace:
    return SimpleNamespace(
        __version__="10.8.0", HardwareCompatibilityLevel=SimpleNamespace(**{n: n for n in levels})
    )


def test_a_tensorrt_before_10_9_builds_with_level_none() -> None:
    trt = fake_trt("NONE", "AMPERE_PLUS")  # 10.0-10.8: no SAME_COMPUTE_CAPABILITY
    assert compatibility_level(trt, "none") == "NONE"
    assert compatibility_level(trt, "ampere_plus") == "AMPERE_PLUS"


def test_a_level_the_installed_tensorrt_lacks_is_a_stage_error_naming_the_version() -> None:
    with pytest.raises(StageError, match="needs a newer TensorRT than 10.8.0"):
        compatibility_level(fake_trt("NONE", "AMPERE_PLUS"), "same_compute_capability")
    trt = fake_trt("NONE", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY")
    assert compatibility_level(trt, "same_compute_capability") == "SAME_COMPUTE_CAPABILITY"
