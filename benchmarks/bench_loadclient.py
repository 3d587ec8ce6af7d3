"""Our aiohttp load client vs wrk, and dynamic batching on vs off, side by side in one run.

Needs the tiny example built (`make release`) and wrk (`apt-get install wrk`). Starts the
bundle's own MLServer on loopback and, against the same endpoint and concurrency:
1. wrk and our client, alternating (wrk, ours, wrk, ours), same body and duration;
2. a quick ramp with batching on to find the knee, then batching off at that concurrency.

    .venv/bin/python benchmarks/bench_loadclient.py [--release tiny-gpt2] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import _loadgen as lg  # noqa: E402
from stages._server import LocalServer, assemble  # noqa: E402

WINDOW = 1.0


def wrk(url: str, body: bytes, concurrency: int, seconds: float, tmp: Path) -> float:
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{body.decode()}]]\n"
    )
    out = subprocess.run(
        ["wrk", "-t2", f"-c{concurrency}", f"-d{seconds:g}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def ours(req: lg.Request, concurrency: int, seconds: float) -> float:
    windows = max(3, round(seconds / WINDOW))
    point = lg.run(lg.measure(req, concurrency, seconds / windows, windows, 1e-9, 60.0))
    assert point["errors"] == 0, point
    return float(point["throughput_rps"])


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", default="tiny-gpt2")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cap", type=int, default=32, help="ramp cap for the knee")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed: apt-get install wrk")
    build = ROOT / "build" / args.release
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        assemble(tmp / "tree", sorted((build / "quantize").glob("model.onnx*")), build / "serve")
        ids = np.random.default_rng(0).integers(0, 500, (1, 16)).astype(np.int64)
        body = lg.v2_body({"input_ids": ids}, {"max_new_tokens": 1})
        log = tmp / "server.log"
        with LocalServer(tmp / "tree", args.release, log, 120) as srv:
            url = f"{srv.url}/v2/models/{args.release}/infer"
            req = lg.Request(url, body)
            ours(req, args.concurrency, 2.0)  # warm-up
            runs = []
            for _ in range(2):
                runs.append(("wrk", wrk(url, body, args.concurrency, args.seconds, tmp)))
                runs.append(("ours", ours(req, args.concurrency, args.seconds)))
            for name, rps in runs:
                print(f"{name:5} c={args.concurrency}: {rps:8.1f} req/s")
            w = np.mean([r for n, r in runs if n == "wrk"])
            o = np.mean([r for n, r in runs if n == "ours"])
            print(f"client: ours {o:.1f} / wrk {w:.1f} req/s = {o / w:.3f}x (goal >= 0.90)")
            print("batching on: ramp for the knee")
            k = knee(req, args.cap)
            on = ours(req, k, args.seconds)
        with LocalServer(tmp / "tree", args.release, log, 120, batching=False) as srv:
            req = lg.Request(f"{srv.url}/v2/models/{args.release}/infer", body)
            ours(req, k, 2.0)
            off = ours(req, k, args.seconds)
        print(f"batching at the knee (c={k}): on {on:.1f} / off {off:.1f} req/s = {on / off:.2f}x")
        print(json.dumps({"client_ratio": o / w, "batching_ratio": on / off, "knee": k}))


if __name__ == "__main__":
    main()
