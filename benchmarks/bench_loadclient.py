"""Our aiohttp load client vs wrk, and dynamic batching on vs off, side by side in one run.

Needs the tiny example built (`make release`) and wrk (`apt-get install wrk`). Starts the
bundle's own MLServer on loopback and, against the same endpoint, body and concurrency:

1. wrk and our client, alternating (wrk, ours, wrk, ours, ...), in two layouts:
   - shared: server and load generator on every core (what a 2-core CI box does);
   - pinned: the server on the last core, the load generator (ours or wrk) on the others,
     so the comparison asks only whether the client can drive the server as hard as wrk.
2. A quick ramp with batching on to find the knee, then batching off at that concurrency.

    .venv/bin/python benchmarks/bench_loadclient.py [--release tiny-gpt2] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.loadtesting import loadgen as lg  # noqa: E402
from stages.loadtesting.server import LocalServer, assemble  # noqa: E402

WINDOW = 1.0


def wrk(url: str, body: bytes, concurrency: int, seconds: float, cpus: set[int]) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [[{body.decode()}]]\n"
        )
    cmd = ["wrk", f"-t{len(cpus)}", f"-c{concurrency}", f"-d{seconds:g}s", "-s", script.name, url]
    out = subprocess.run(
        ["taskset", "-c", ",".join(map(str, sorted(cpus))), *cmd],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.unlink(script.name)
    if "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def ours(req: lg.Request, concurrency: int, seconds: float) -> float:
    windows = max(3, round(seconds / WINDOW))
    point = lg.run(lg.measure(req, concurrency, seconds / windows, windows, 1e-9, 60.0))
    assert point.errors == 0, point
    return point.throughput_rps


def compare(
    tree: Path, args: argparse.Namespace, body: bytes, server: set[int] | None, client: set[int]
) -> tuple[float, float]:
    """Median req/s of wrk and of ours, alternated `args.repeats` times."""
    os.sched_setaffinity(0, client)
    with LocalServer(tree, args.release, tree / "server.log", 120, cpus=server) as srv:
        url = f"{srv.url}/v2/models/{args.release}/infer"
        req = lg.Request(url, body)
        ours(req, args.concurrency, 2.0)  # warm-up
        w, o = [], []
        for _ in range(args.repeats):
            w.append(wrk(url, body, args.concurrency, args.seconds, client))
            o.append(ours(req, args.concurrency, args.seconds))
    print(f"  wrk  req/s: {', '.join(f'{x:.0f}' for x in w)}")
    print(f"  ours req/s: {', '.join(f'{x:.0f}' for x in o)}")
    return median(w), median(o)


def knee(req: lg.Request, cap: int) -> int:
    best, at, c = 0.0, 1, 1
    while c <= cap:
        rps = ours(req, c, 3.0)
        print(f"  ramp c={c:<3} {rps:8.1f} req/s")
        if rps >= best * 1.05:
            best, at = rps, c
        c *= 2
    return at


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--release", default="tiny-gpt2")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=int, default=32, help="ramp cap for the knee")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed: apt-get install wrk")
    cores = sorted(os.sched_getaffinity(0))
    build = ROOT / "build" / args.release
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tree = Path(tmp_name) / "tree"
        assemble(tree, sorted((build / "quantize").glob("model.onnx*")), build / "serve")
        ids = np.random.default_rng(0).integers(0, 500, (1, 16)).astype(np.int64)
        body = lg.v2_body({"input_ids": ids}, {"max_new_tokens": 1})
        layouts = {"shared": (None, set(cores))}
        if len(cores) > 1:
            layouts["pinned"] = ({cores[-1]}, set(cores[:-1]))
        for name, (server, client) in layouts.items():
            print(
                f"{name}: server on {sorted(server or cores)}, load generator on {sorted(client)}"
            )
            w, o = compare(tree, args, body, server, client)
            results[f"client_ratio_{name}"] = o / w
            print(f"{name}: ours {o:.1f} / wrk {w:.1f} req/s = {o / w:.3f}x (goal >= 0.90)")
        os.sched_setaffinity(0, set(cores))
        print("batching on: ramp for the knee")
        with LocalServer(tree, args.release, tree / "server.log", 120) as srv:
            req = lg.Request(f"{srv.url}/v2/models/{args.release}/infer", body)
            k = knee(req, args.cap)
            on = ours(req, k, args.seconds)
        with LocalServer(tree, args.release, tree / "server.log", 120, batching=False) as srv:
            req = lg.Request(f"{srv.url}/v2/models/{args.release}/infer", body)
            ours(req, k, 2.0)
            off = ours(req, k, args.seconds)
        print(f"batching at the knee (c={k}): on {on:.1f} / off {off:.1f} req/s = {on / off:.2f}x")
        results.update(batching_ratio=on / off, knee=k)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
