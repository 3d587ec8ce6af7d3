"""Build chosen architecture-matrix families with `shipyard init` unedited, once on a quiet
machine and once beside a CPU hog (two processes spinning, one per core), and print each
stage's status and the quantize verdict (the recipe shipped, or the fallback, and what
decided each speed check) side by side (issue 40: a verdict that depends on what else the
machine is doing is not reproducible).

Usage: python scripts/busy_builds.py [NAME ...]   (default: Llama Qwen2 Qwen3)
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.artifacts import QuantInfo  # noqa: E402
from tests.fixtures import architectures as matrix  # noqa: E402


def _spin() -> None:
    while True:
        pass


def verdict(root: Path, slug: str) -> dict[str, Any]:
    """What quantize shipped and each recipe's speed verdict, from its QuantInfo artifact."""
    info = QuantInfo.model_validate_json(
        (root / "build" / slug / "quantize" / QuantInfo.FILE).read_text()
    )
    rows = info.recipes or []
    return {
        "summary": f"method {info.method}, {len(info.float_nodes)} node(s) in float",
        "chosen": [r.recipe for r in rows if r.chosen],
        # (recipe, [(timed?, fast enough?, what decided)]): too slow is said in `why`
        "speed": [
            (
                r.recipe,
                [
                    (
                        r.speedup is not None,
                        "below quantization.min_speedup" not in r.why,
                        r.speed_decided_by or "",
                    )
                ],
            )
            for r in rows
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


def _verdicts(run: dict[str, Any]) -> list[tuple[str, list[tuple[bool, bool]]]]:
    return [(recipe, [(t, fast) for t, fast, _ in checks]) for recipe, checks in run["speed"]]


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
