"""No-op `dvc repro` of the example release vs a bare DVC project's no-op, side by side.

The bare project has the same stage count, each a trivial `cp`, so the ratio shows what
Shipyard's dvc.yaml (foreach, params, code and model deps) adds to DVC's own fixed cost.
Usage: python benchmarks/bench_noop_repro.py [TARGET]   (builds first if needed)
  TARGET, e.g. bundle@tiny-gpt2, times `dvc repro TARGET` against a bare chain of the
  same length; without it, the whole dvc.yaml against a bare chain of all its stages.
Goal (issue 2): <= 1.5x.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ROUNDS = 5
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}


def repro(cwd: Path, target: str = "") -> str:
    done = subprocess.run(
        [str(BIN / "dvc"), "repro", *([target] if target else [])],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def best_noop(cwd: Path, target: str = "") -> float:
    repro(cwd, target)  # build (or confirm up to date) before timing
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        out = repro(cwd, target)
        times.append(time.perf_counter() - start)
        assert "Running stage" not in out, f"not a no-op in {cwd}:\n{out}"
    return min(times)


def bare_project(root: Path, stages: int) -> None:
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=root, check=True)
    (root / "in0").write_text("seed\n")
    lines = ["stages:"]
    for i in range(stages):
        lines += [
            f"  s{i}:",
            f"    cmd: cp in{i} in{i + 1}",
            f"    deps: [in{i}]",
            f"    outs: [in{i + 1}]",
        ]
    (root / "dvc.yaml").write_text("\n".join(lines) + "\n")


def main() -> None:
    import yaml

    target = sys.argv[1] if len(sys.argv) > 1 else ""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    # a foreach stage counts once per release; the `code` (fingerprint) stage once
    count = len(stages) if target else sum(len(s.get("foreach", [0])) for s in stages.values())
    with tempfile.TemporaryDirectory() as tmp:
        bare_project(Path(tmp), count)
        t_bare = best_noop(Path(tmp))
    t_ours = best_noop(REPO, target)
    print(
        f"{count} stages each{f' (dvc repro {target})' if target else ''}; "
        f"best of {ROUNDS} no-op runs"
    )
    print(f"bare DVC no-op     : {t_bare:.2f} s")
    print(f"shipyard no-op     : {t_ours:.2f} s")
    print(f"ratio shipyard/bare: {t_ours / t_bare:.2f}x  (goal <= 1.5x)")


if __name__ == "__main__":
    main()
