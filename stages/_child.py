"""The child process of `stages._contract.in_child`: reads a pickled (function, arguments)
from stdin, runs it, and pickles ("ok", result) or ("error", StageError) to the file named
by its argument. Anything else it raises is a bug: its traceback goes to stderr and the
exit status is not 0, which the parent reports."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from schemas import StageError


def main() -> None:
    fn, args = pickle.load(sys.stdin.buffer)
    try:
        outcome = ("ok", fn(*args))
    except StageError as exc:
        outcome = ("error", exc)
    Path(sys.argv[1]).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    main()
