"""One line saying what is wrong with a file a pydantic model read (the registry's files,
stage reports, a bundle's facts)."""

from __future__ import annotations


def first_problem(exc: Exception) -> str:
    """The first validation error's field and message ("the file" when it is the whole
    document), else the error's own text, in one line."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        e = exc.errors()[0]
        return f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}"
    return " ".join(str(exc).split())
