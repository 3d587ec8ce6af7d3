"""Pydantic models for Shipyard: the release spec, stage reports, the manifest, errors."""

from __future__ import annotations

from schemas.errors import (
    GateError,
    Refused,
    RegistryError,
    ShipyardError,
    SpecError,
    StageError,
)
from schemas.release import ReleaseSpec
from schemas.report import StageReport, StageStatus

__all__ = [
    "GateError",
    "RegistryError",
    "ReleaseSpec",
    "ShipyardError",
    "SpecError",
    "Refused",
    "StageError",
    "StageReport",
    "StageStatus",
]
