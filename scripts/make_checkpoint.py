"""Regenerate an example checkpoint: a GPT-2 with seeded random weights (no hub).

Deterministic for the pinned torch/transformers: the same bytes every run.
Usage: python scripts/make_checkpoint.py {tiny-gpt2|gpt2-small} [OUT_DIR]
  tiny-gpt2   2 layers, 149K parameters; committed under models/tiny-gpt2
  gpt2-small  GPT-2-small geometry (12 layers, 768 wide, 124M parameters); ~500 MB, not
              committed: `make release` generates it into models/gpt2-small, beside the
              committed tokenizer.json (scripts/make_tokenizer.py's)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

PRESETS = {
    "tiny-gpt2": dict(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=512,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "gpt2-small": dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        vocab_size=50257,
        n_positions=1024,
        bos_token_id=50256,
        eos_token_id=50256,
    ),
}


def main(preset: str, out: Path) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**PRESETS[preset])).eval()
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PRESETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(PRESETS)}}} [OUT_DIR]")
    main(sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else f"models/{sys.argv[1]}"))
