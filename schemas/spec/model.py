"""`model`: where the model comes from (a Hugging Face folder or a Python factory)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.spec.base import RepoPath, Strict


class HfModel(Strict):
    kind: Literal["hf"] = Field(description="A local Hugging Face folder.")
    path: RepoPath = Field(
        description="Folder with config.json and *.safetensors, relative to the repo root."
    )


class PythonModel(Strict):
    kind: Literal["python"] = Field(description="A model built by a Python factory.")
    entrypoint: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`module:factory`; the factory takes no arguments and returns an nn.Module.",
    )
    source: RepoPath = Field(
        description="File or folder holding the module, put on sys.path (a DVC dependency)."
    )
    weights: RepoPath | None = Field(
        default=None, description="Optional safetensors state dict loaded into the module."
    )


ModelSource = Annotated[HfModel | PythonModel, Field(discriminator="kind")]
