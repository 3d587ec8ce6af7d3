"""Sentence embeddings inside the graph: the pooling (and normalization) that define an
embedding model, so every client gets the model's embedding and evaluation compares it.

The settings come from a sentence-transformers folder (`modules.json`, the Pooling module's
`config.json`, a Normalize module) or, for a plain encoder folder, from the spec
(`export.pooling`, `export.normalize`). The math follows sentence-transformers' Pooling and
Normalize modules for right-padded batches (what the exported graph is fed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Refused

if TYPE_CHECKING:
    from schemas.spec.export import ExportConfig

MODES = ("mean", "cls", "max", "last-token")
# sentence-transformers' Pooling config key for each mode
ST_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last-token",
}
NORMALIZE = "sentence_transformers.models.Normalize"
POOLING = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class Pooling:
    mode: str
    normalize: bool
    source: str  # where the settings came from, for the report


def from_folder(folder: Path) -> Pooling | None:
    """The pooling a sentence-transformers folder declares; None for a plain folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    where = f"{modules_file}"
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        types = [m["type"] for m in modules]
        pooling = next(m for m in modules if m["type"] == POOLING)
        config = json.loads((folder / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
        raise Refused(
            f"{where}: not a readable sentence-transformers pipeline ({exc})",
            "give modules.json with a Pooling module and its config.json",
        ) from None
    modes = [mode for key, mode in ST_KEYS.items() if config.get(key)]
    extra = [t for t in types if t not in (POOLING, NORMALIZE) and not t.endswith(".Transformer")]
    if len(modes) != 1 or extra:
        raise Refused(
            f"{where}: {'modules ' + ', '.join(extra) if extra else f'pooling modes {modes}'} "
            "cannot be exported",
            "one pooling mode (mean, cls, max or last-token), optionally Normalize, is supported",
        )
    return Pooling(modes[0], NORMALIZE in types, f"{modules_file.name} (sentence-transformers)")


def resolve(folder: Path | None, export: ExportConfig) -> Pooling:
    """The folder's pooling if it has one (the spec may repeat it, not contradict it), else
    the spec's."""
    found = from_folder(folder) if folder else None
    mode, normalize = export.pooling, export.normalize
    if found:
        if (mode and mode != found.mode) or (
            normalize is not None and normalize != found.normalize
        ):
            raise Refused(
                f"export.pooling/normalize ({mode}, {normalize}) contradict the model folder's "
                f"sentence-transformers modules ({found.mode}, normalize {found.normalize})",
                "remove export.pooling and export.normalize: the folder defines the embedding",
            )
        return found
    if not mode:
        raise Refused(
            "task text-embedding needs a pooling: the model folder has no sentence-transformers "
            "modules.json and export.pooling is not set",
            f"set export.pooling to one of {', '.join(MODES)} (and export.normalize if wanted)",
        )
    return Pooling(mode, bool(normalize), "export.pooling (spec)")


def wrap(net: Any, pooling: Pooling) -> Any:
    """An nn.Module returning sentence_embedding [batch, hidden] and token_embeddings."""
    import torch

    settings = pooling

    class Pooled(torch.nn.Module):
        pooling = settings  # what the export records (a class attribute, not a weight)

        def __init__(self) -> None:
            super().__init__()
            self.encoder = net

        def forward(self, input_ids: Any, attention_mask: Any, **kw: Any) -> Any:
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kw)
            tokens = out.last_hidden_state
            pooled = pool(tokens, attention_mask, pooling.mode)
            if pooling.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return _Out(sentence_embedding=pooled, token_embeddings=tokens)

    return Pooled().eval()


@dataclass
class _Out:
    sentence_embedding: Any
    token_embeddings: Any


def pool(tokens: Any, mask: Any, mode: str) -> Any:
    """sentence-transformers' pooling over the tokens the mask keeps."""
    import torch

    keep = mask.unsqueeze(-1).to(tokens.dtype)
    if mode == "cls":
        return tokens[:, 0]
    if mode == "max":
        return torch.where(keep > 0, tokens, torch.finfo(tokens.dtype).min).max(dim=1).values
    if mode == "last-token":
        last = mask.sum(dim=1).to(torch.long) - 1
        index = last.clamp(min=0).view(-1, 1, 1).expand(-1, 1, tokens.shape[-1])
        return tokens.gather(1, index).squeeze(1)
    summed = (tokens * keep).sum(dim=1)
    return summed / keep.sum(dim=1).clamp(min=1e-9)
