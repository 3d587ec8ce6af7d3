"""Train the gpt2-small example's tokenizer: byte-level BPE with GPT-2's layout (50,256
byte-level tokens, then `<|endoftext|>` at id 50256, the checkpoint's eos), so that the
124M example serves text in and out as the README shows (issue 43: it shipped none, text
requests got a 400 and token ids came back as "text": "").

No hub: trained on this Python's standard library sources (plain text and code, about
40 MB, read in a fixed order), single-threaded so the merges do not depend on the thread
count. The committed `models/gpt2-small/tokenizer.json` is this script's output on Python
3.11.7; another Python's library gives another (equally valid) vocabulary.

    python scripts/make_tokenizer.py [OUT]   # default models/gpt2-small/tokenizer.json
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VOCAB = 50257  # GPT-2's: 50,256 merges and bytes, then <|endoftext|>
EOS = "<|endoftext|>"


def corpus() -> Iterator[str]:
    """Every .py file of the standard library (tests and site-packages left out), by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train() -> object:
    os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its pool
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != VOCAB - 1:
        sys.exit(f"the corpus gave {tok.get_vocab_size()} tokens, not {VOCAB - 1}")
    tok.add_special_tokens([EOS])
    assert tok.token_to_id(EOS) == VOCAB - 1
    return tok


def main(out: Path) -> None:
    tok = train()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))  # type: ignore[attr-defined]
    print(f"wrote {out}: {tok.get_vocab_size()} tokens, {EOS} = {VOCAB - 1}")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "models/gpt2-small/tokenizer.json"))
