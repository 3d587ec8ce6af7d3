"""The example releases as the README serves them (issue 43): the 124M example ships its
own tokenizer (GPT-2's layout: 50,257 tokens, `<|endoftext|>` the checkpoint's eos), and
both examples listen where the README's requests go."""

from __future__ import annotations

import importlib.util
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

TOKENIZER = REPO / "models" / "gpt2-small" / "tokenizer.json"


def preset(name: str) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", REPO / "scripts/make_checkpoint.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.PRESETS[name])


def test_the_124m_example_ships_a_tokenizer_of_its_own_vocabulary() -> None:
    from tokenizers import Tokenizer

    config = preset("gpt2-small")
    tok = Tokenizer.from_file(str(TOKENIZER))
    assert tok.get_vocab_size() == config["vocab_size"] == 50257
    assert tok.token_to_id("<|endoftext|>") == config["eos_token_id"] == 50256
    for text in ("def add(a, b):", "Hello, world! naïve café 東京 🙂\n\tx = 1"):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text and max(ids) < 50256
    # every id the model can emit decodes to something (a token-id prompt's text was "")
    assert all(tok.decode([i]) for i in range(50256))


@pytest.mark.skipif(
    platform.python_version() != "3.11.7",
    reason="the committed tokenizer is trained on Python 3.11.7's standard library",
)
def test_the_committed_tokenizer_is_what_make_tokenizer_trains(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.json"
    subprocess.run([sys.executable, str(REPO / "scripts/make_tokenizer.py"), str(out)], check=True)
    assert out.read_bytes() == TOKENIZER.read_bytes()


def test_both_examples_listen_where_the_readme_sends_requests() -> None:
    readme = (REPO / "README.md").read_text()
    http = set(re.findall(r"curl -sN? localhost:(\d+)/v[12]/", readme))
    assert http == {"8000"}, http
    for name in ("tiny-gpt2", "gpt2-small"):
        spec = yaml.safe_load((REPO / "releases" / f"{name}.yaml").read_text())
        port = ((spec.get("bundle") or {}).get("serving") or {}).get("port", 8000)
        assert port == 8000, (name, port)
