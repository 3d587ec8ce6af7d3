"""No-op `dvc repro` of the example release vs a bare DVC project's no-op, side by side.

The bare project has the same stage count, each a trivial `cp`, so the ratio shows what
Shipyard's dvc.yaml (foreach, params, code and model deps) adds to DVC's own fixed cost.
Usage: python benchmarks/bench_noop_repro.py [TARGET]   (builds first if needed)
  TARGET, e.g. bundle@tiny-gpt2, times `dvc repro TARGET` against a bare chain of the
  same length; without it, the whole dvc.yaml against a bare chain of all its stages.
  --growth: the no-op at 2, 8 and 32 releases (copies of tiny-gpt2 whose outputs are
  recorded with `dvc commit`, not rebuilt) against bare chains of the same stage counts;
  prints the cost per stage, which should stay flat as releases are added.
Goal (issues 2, 14): <= 1.5x.
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


def many_releases(root: Path, count: int) -> int:
    """A copy of the repo with `count` copies of the built tiny-gpt2 release; returns the
    stage count. The copies' outputs are recorded with `dvc commit` (no build), which is all
    a no-op `dvc repro` looks at."""
    import shutil

    import yaml

    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file() and not name.startswith(("releases/", "build/")):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / "releases").mkdir()
    text = (REPO / "releases" / "tiny-gpt2.yaml").read_text()
    built = REPO / "build" / "tiny-gpt2"
    if not (built / "bundle").is_dir():
        sys.exit("build tiny-gpt2 first: make release RELEASE_TARGETS=bundle@tiny-gpt2")
    for i in range(count):
        name = f"tiny-{i:03d}"
        spec = text.replace("name: tiny-gpt2", f"name: {name}")
        spec = spec.replace("timing-caches/tiny-gpt2", f"timing-caches/{name}")
        (root / "releases" / f"{name}.yaml").write_text(spec)
        shutil.copytree(built, root / "build" / name, symlinks=True)
    steps = (
        ["git", "init", "-q"],
        ["shipyard", "compile"],
        ["shipyard", "fingerprint"],  # each copy's build/.params
        ["dvc", "commit", "-f", "-q"],
    )
    for cmd in steps:
        subprocess.run(cmd, cwd=root, env=ENV, check=True, capture_output=True)
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    return sum(len(s.get("foreach", [0])) for s in stages.values())


def growth() -> None:
    rows = []
    for count in (2, 8, 32):
        with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as bare:
            stages = many_releases(Path(ours), count)
            bare_project(Path(bare), stages)
            t_bare, t_ours = best_noop(Path(bare)), best_noop(Path(ours))
        rows.append((count, stages, t_bare, t_ours))
        print(f"  {count} releases done", file=sys.stderr)
    print(f"no-op dvc repro, best of {ROUNDS} runs, by release count")
    print("releases  stages  bare s  shipyard s  ratio  bare ms/stage  shipyard ms/stage")
    for count, stages, t_bare, t_ours in rows:
        print(
            f"{count:8d}  {stages:6d}  {t_bare:6.2f}  {t_ours:10.2f}  {t_ours / t_bare:5.2f}"
            f"  {1000 * t_bare / stages:13.1f}  {1000 * t_ours / stages:17.1f}"
        )


def main() -> None:
    import yaml

    if sys.argv[1:] == ["--growth"]:
        growth()
        return
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
