"""Run the architecture matrix and write the README's table from what just ran.

Usage: python scripts/architecture_matrix.py [--check] [NAME ...]
  (no flag)  run every architecture (or the named ones) and rewrite the table in README.md
  --check    run them and exit 1 if README.md's table differs from the results
Tiny random-weight models are built from transformers configs; nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures import architectures as matrix  # noqa: E402


def main(argv: list[str]) -> int:
    check = "--check" in argv
    names = [a for a in argv if a != "--check"]
    rows = matrix.run_matrix(names or None)
    print(matrix.table(rows))
    if check:
        if matrix.readme_table() != matrix.table(rows):
            print("README.md's architecture table is stale: run scripts/architecture_matrix.py")
            return 1
        return 0
    if names:
        print("(ran a subset: README.md left as it is)")
        return 0
    matrix.write_readme(rows)
    print("wrote the table into README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
