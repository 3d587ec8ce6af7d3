"""Build chosen architecture-matrix families with `shipyard init` unedited, once on a quiet
machine and once beside a CPU hog (two processes spinning, one per core), and print each
stage's status and the quantize verdict (the recipe shipped, or the fallback, and what
decided each speed check) side by side (issue 40: a verdict that depends on what else the
machine is doing is not reproducible).

Usage: python scripts/busy_builds.py [NAME ...]   (default: Llama Qwen2 Qwen3)
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures import architectures as matrix  # noqa: E402


def _spin() -> None:
    while True:
        pass


def verdict(root: Path, slug: str) -> dict[str, Any]:
    report = json.loads((root / "build" / slug / "quantize" / "report.json").read_text())
    details = report.get("details", {})
    rows = details.get("recipes", [])
    return {
        "summary": report["summary"][:120],
        "chosen": [r["recipe"] for r in rows if r.get("chosen")],
        "speed": [
            (r["recipe"], sorted((k, c["fast"], c["decided_by"]) for k, c in r["speed"].items()))
            for r in rows
            if r.get("speed")
        ],
    }


def build(names: list[str], busy: bool) -> dict[str, Any]:
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2 if busy else 0)]
    for h in hogs:
        h.start()
    try:
        out = {}
        with tempfile.TemporaryDirectory(prefix="shipyard-busy-") as tmp:
            root = matrix.workspace(Path(tmp) / "repo")
            for arch in matrix.ARCHITECTURES:
                if arch.name in names and arch.task == "causal-lm":
                    row = matrix.run_architecture(arch, root)
                    statuses = {s: v["status"] for s, v in row["stages"].items()}
                    out[arch.name] = {"stages": statuses, **verdict(root, matrix.slug_of(arch))}
        return out
    finally:
        for h in hogs:
            h.terminate()
            h.join()


def _verdicts(run: dict[str, Any]) -> list[tuple[str, list[tuple[str, bool]]]]:
    return [(recipe, [(k, fast) for k, fast, _ in checks]) for recipe, checks in run["speed"]]


def main(argv: list[str]) -> int:
    names = argv or ["Llama", "Qwen2", "Qwen3"]
    quiet, busy = build(names, False), build(names, True)
    same = True
    for name in quiet:
        q, b = quiet[name], busy[name]
        # the verdicts must agree; what decided one may differ (a busy machine widens the
        # timing's interval until the cost model decides, by design)
        agree = (q["stages"], q["chosen"], _verdicts(q)) == (b["stages"], b["chosen"], _verdicts(b))
        same &= agree
        moved = sum(
            x[2] != y[2]
            for (_, cq), (_, cb) in zip(q["speed"], b["speed"], strict=False)
            for x, y in zip(cq, cb, strict=False)
        )
        total = sum(len(c) for _, c in q["speed"])
        print(
            f"{name}: {'same statuses and verdicts' if agree else 'DIFFERENT'} "
            f"({moved} of {total} speed checks decided by the other means)"
        )
        for label, run in (("quiet", q), ("busy ", b)):
            failed = [s for s, v in run["stages"].items() if v not in ("passed", "skipped")]
            print(f"  {label}: stages {failed if failed else 'all pass'}; {run['summary']}")
            print(f"         speed checks {run['speed']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
