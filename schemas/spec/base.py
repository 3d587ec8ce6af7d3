"""What every section shares: the strict base model, names, patterns and path rules."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field

SCHEMA_VERSION = 1


NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"


# Semantic Versioning 2.0.0 (semver.org's regular expression): a version becomes a registry
# path. pydantic's (Rust) `$` matches only at the very end; Python code uses re.fullmatch.
SEMVER_PATTERN = (
    r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-((?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


SHA256_PATTERN = r"^[0-9a-f]{64}$"


# Every string of a spec is capped (a megabyte of free text is a mistake or an attack);
# longer prose fields say so with their own max_length.
MAX_STR = 1024


MAX_PROSE = 8192


# PEP 508 distribution names.
PACKAGE_NAME = r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$"


def _repo_relative(value: str) -> str:
    """Syntactic half of the path rule (the loader resolves symlinks against the repo)."""
    if "\0" in value or "\\" in value:
        raise ValueError(f"{value[:80]!r}: NUL bytes and backslashes are not allowed in paths")
    if value.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", value):
        raise ValueError(f"{value[:80]!r} is absolute; give a path relative to the repo root")
    normal = posixpath.normpath(value)
    if normal == "." or normal == ".." or normal.startswith("../"):
        raise ValueError(
            f"{value[:80]!r} {'is the repo root itself' if normal == '.' else 'leaves the repo'}; "
            "give a path inside the repository (e.g. models/<name>)"
        )
    return value


# A path in the repository: relative, and (checked by the loader) resolving inside it.
RepoPath = Annotated[
    str,
    Field(min_length=1, max_length=MAX_STR, json_schema_extra={"x-repo-path": True}),
    AfterValidator(_repo_relative),
]


def _specifier(value: str) -> str:
    try:
        SpecifierSet(value)
    except InvalidSpecifier:
        raise ValueError(
            f"{value[:80]!r} is not a PEP 440 version specifier; write e.g. `==2.13.0` or "
            "`>=3.11,<3.12`"
        ) from None
    if not value.strip():
        raise ValueError("an empty specifier pins nothing; write e.g. `==2.13.0`")
    return value


Specifier = Annotated[str, Field(max_length=256), AfterValidator(_specifier)]


PackageName = Annotated[str, Field(pattern=PACKAGE_NAME, max_length=128)]


def _inside_model_folder(value: str) -> str:
    _repo_relative(value)
    return value


CheckpointName = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_inside_model_folder)]


def _semver(value: str) -> str:
    if not re.fullmatch(SEMVER_PATTERN, value):
        shown = value if len(value) <= 40 else value[:39] + "…"
        raise ValueError(
            f"{shown!r} is not a Semantic Versioning 2.0 version; write MAJOR.MINOR.PATCH, "
            "e.g. 1.0.0 or 1.1.0-rc.1 (it names the registry folder, so nothing else)"
        )
    return value


def _positive_bytes(value: ByteSize) -> ByteSize:
    if value <= 0:
        raise ValueError(f"must be more than 0 bytes (found {int(value)}); write e.g. `24GiB`")
    return value


PositiveBytes = Annotated[ByteSize, AfterValidator(_positive_bytes)]


class Strict(BaseModel):
    # .inf and .nan are valid YAML floats; no limit, tolerance or size of ours means either.
    model_config = ConfigDict(
        extra="forbid", frozen=True, str_max_length=MAX_STR, allow_inf_nan=False
    )
