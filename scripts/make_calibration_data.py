"""Regenerate the example calibration and evaluation sets and the tiny-gpt2 tokenizer.

Texts are paragraphs of the Python standard library's own docstrings: prose, argument lists
and code examples of many lengths, which is the mix the example model is "deployed" on.
A byte-level BPE tokenizer (vocab 512 = tiny-gpt2's) is trained on them, then every
paragraph that tokenizes to more than MAX_TOKENS is dropped, so the data set satisfies the
release spec's checks. Usage: python scripts/make_calibration_data.py
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "json",
    "os",
    "pathlib",
    "collections",
    "itertools",
    "functools",
    "re",
    "string",
    "textwrap",
    "argparse",
    "logging",
    "subprocess",
    "shutil",
    "random",
    "statistics",
    "decimal",
    "fractions",
    "datetime",
    "calendar",
    "heapq",
    "bisect",
    "csv",
    "zipfile",
    "tarfile",
    "gzip",
    "hashlib",
    "hmac",
    "secrets",
    "uuid",
    "typing",
    "dataclasses",
    "enum",
    "contextlib",
    "threading",
    "queue",
    "asyncio",
    "socket",
    "sqlite3",
    "pickle",
    "copy",
    "pprint",
    "inspect",
    "ast",
    "tokenize",
    "unittest",
    "doctest",
    "timeit",
    "traceback",
    "warnings",
    "weakref",
    "io",
    "tempfile",
    "glob",
    "fnmatch",
    "difflib",
    "html",
    "base64",
    "struct",
    "codecs",
    "math",
    "operator",
]
VOCAB, MAX_TOKENS, KEEP, EVAL = 512, 64, 480, 64


def paragraphs() -> list[str]:
    found: set[str] = set()
    for name in MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            for para in (doc or "").split("\n\n"):
                text = " ".join(para.split())
                if 20 <= len(text) <= 600:
                    found.add(text)
    # A stable, content-addressed order: the same set always gives the same file.
    return sorted(found, key=lambda t: hashlib.sha256(t.encode()).hexdigest())


def train(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def main() -> None:
    texts = paragraphs()
    tok = train(texts)
    kept = [t for t in texts if len(tok.encode(t).ids) <= MAX_TOKENS][:KEEP]
    tok.save(str(ROOT / "models" / "tiny-gpt2" / "tokenizer.json"))
    out = ROOT / "data" / "calibration" / "docstrings.jsonl"
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in kept), encoding="utf-8")
    # The evaluation set: further paragraphs, disjoint from every calibration sample.
    rest = [t for t in texts if len(tok.encode(t).ids) <= MAX_TOKENS][KEEP : KEEP + EVAL]
    evaluation = ROOT / "data" / "eval" / "docstrings.jsonl"
    evaluation.parent.mkdir(exist_ok=True)
    evaluation.write_text("".join(json.dumps({"text": t}) + "\n" for t in rest), "utf-8")
    print(
        f"wrote {out.relative_to(ROOT)} ({len(kept)} of {len(texts)} paragraphs) and "
        f"models/tiny-gpt2/tokenizer.json (vocab {tok.get_vocab_size()})"
    )


if __name__ == "__main__":
    main()
