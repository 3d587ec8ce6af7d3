"""A fresh clone with the shared remote vs one without, side by side (issue 14).

Clone A builds from nothing and pushes its outputs and run-cache to a real S3 API on
localhost (moto's server mode, the same dvc-s3 path CI uses with a real bucket). Clone B, a
fresh clone of A's commit (its dvc.lock and metrics), pulls (`shipyard cache pull`) and
runs `dvc repro --pull`: it must recompute 0 stages. Prints A's time, B's time and the
ratio. (A clone whose dvc.lock predates A's build cannot be served by DVC's run-cache alone:
the per-stage metrics files are `cache: false` so that git carries them for `dvc metrics
diff`, and the run-cache does not carry uncached outputs between machines.)

`--stale-lock`: B's dvc.lock and metrics files are removed first, as on a branch whose
lock predates A's build: only DVC's run-cache (pulled with the outputs) can serve it.

`--trusted`: provenance on, as CI runs it. A builds with a builder key (each stage signs its
attestation); B trusts that key and builds with `shipyard build --pull`, which checks every
output DVC restores against its attestation before the next stage reads it (and rebuilds
any that fails): the cost of the check, and that honest outputs all pass it.

Usage: python benchmarks/bench_shared_cache.py [TARGET] [--stale-lock] [--trusted]   (default
  bundle@tiny-gpt2; `bundle@gpt2-small` needs its generated checkpoint: `make release` first)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def timed(cmds: list[list[str]], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = "".join(sh(c, cwd, env) for c in cmds)
    return time.perf_counter() - start, out


def moto() -> tuple[subprocess.Popen[bytes], str]:
    sys.path.insert(0, str(REPO))
    from tests.s3_server import start_moto

    try:
        return start_moto()
    except RuntimeError as exc:
        sys.exit(str(exc))


def clone(into: Path, env: dict[str, str], source: Path = REPO) -> Path:
    sh(["git", "clone", "-q", str(source), str(into)], REPO, env)
    for f in REPO.glob("models/*/*.safetensors"):  # generated checkpoints are not in git
        target = into / f.relative_to(REPO)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    return into


def main() -> None:
    import boto3

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    stale = "--stale-lock" in sys.argv[1:]
    trusted = "--trusted" in sys.argv[1:]
    target = args[0] if args else "bundle@tiny-gpt2"
    proc, url = moto()
    try:
        env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "SHIPYARD_DVC_REMOTE": "s3://shipyard-bench/dvc",
            "SHIPYARD_DVC_ENDPOINT": url,
        }
        boto3.client(
            "s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing"
        ).create_bucket(Bucket="shipyard-bench")
        with tempfile.TemporaryDirectory() as tmp:
            env_a, env_b = env, env
            if trusted:
                from tests.keys import keypair  # REPO is on sys.path (moto())

                key, public = keypair(Path(tmp), "builder")
                env_a = {**env, "SHIPYARD_BUILDER_KEY": str(key)}
                env_b = {**env_a, "SHIPYARD_TRUSTED_BUILDERS": str(public)}
            a = clone(Path(tmp) / "a", env)
            t_a, out_a = timed([["dvc", "repro", target]], a, env_a)
            built = len(re.findall(r"Running stage '", out_a))
            # A commits what it built (dvc.lock, the metrics), as a developer or CI does;
            # B is a fresh clone of that commit
            sh(["git", "add", "-A"], a, env)
            sh(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "A"], a, env)
            t_push, _ = timed([["shipyard", "cache", "push"]], a, env)
            b = clone(Path(tmp) / "b", env, source=a)
            if stale:
                (b / "dvc.lock").unlink()
                for metrics in b.glob("build/*/metrics"):
                    shutil.rmtree(metrics)
            t_pull, pulled = timed([["shipyard", "cache", "pull"]], b, env_b)
            # --pull: a stage restored from the run-cache needs its outputs' objects, which
            # `dvc pull` fetches only for what this clone's dvc.lock names
            if trusted:
                release = target.split("@", 1)[1]
                until = target.split("@", 1)[0]
                t_repro, out_b = timed(
                    [["shipyard", "build", release, "--pull", "--until", until]], b, env_b
                )
                out_b = (b / "build" / ".logs" / f"{release}.log").read_text()
                checked = out_b.count("trusted ") + pulled.count("trusted ")
                rebuilt = out_b.count("rebuild ") + pulled.count("rebuild ")
            else:
                t_repro, out_b = timed([["dvc", "repro", "--pull", target]], b, env_b)
            rerun = re.findall(r"Running stage '([^']+)'", out_b)
            bundle = f"build/{target.split('@', 1)[1]}/bundle" if "@" in target else None
            if bundle:
                sh(["shipyard", "verify", bundle], b, env)
    finally:
        proc.kill()
    t_b = t_pull + t_repro
    lock = "no dvc.lock (a lock older than the build)" if stale else "A's dvc.lock"
    print(f"dvc repro {target} on a fresh clone with {lock}, S3 remote on localhost (moto)")
    print(f"A (no remote)   : {t_a:7.1f} s  ({built} stages ran); push {t_push:.1f} s")
    print(f"B (pull + repro): {t_b:7.1f} s  (pull {t_pull:.1f} s + repro {t_repro:.1f} s)")
    print(f"stages B reran  : {len(rerun)} {rerun if rerun else ''}")
    if trusted:
        print(f"provenance      : {checked} restored outputs checked, {rebuilt} rebuilt")
    print(f"B / A           : {t_b / t_a:.3f}  ({t_a / t_b:.1f}x faster)")
    if rerun:
        sys.exit("B recomputed stages: the shared remote did not restore everything")


if __name__ == "__main__":
    main()
