"""Regenerate models/tiny-gpt2: a 2-layer GPT-2 with seeded random weights (no hub).

Deterministic for the pinned torch/transformers: the same bytes every run.
Usage: python scripts/make_tiny_gpt2.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = dict(
    n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=1
)


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-gpt2"))
