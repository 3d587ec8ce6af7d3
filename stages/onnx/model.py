"""Loading the PyTorch model and describing its graph inputs/outputs (shared by stages).

torch and transformers are imported inside functions so `shipyard compile` stays fast.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import Refused
from schemas.artifacts import ModelInfo
from schemas.tasks import TASKS
from stages.onnx.shapes import POSITIONS, TOTAL, Layout, Tensor

if TYPE_CHECKING:
    from schemas import ReleaseSpec
    from schemas.spec.export import ExportConfig
    from schemas.spec.model import HfModel, ModelSource, PythonModel
    from stages.onnx.pooling import Pooling


def model_paths(model: ModelSource) -> tuple[str, str]:
    """The two DVC dependencies of a model: its code/config and its weights (may coincide)."""
    if model.kind == "hf":
        return model.path, model.path
    return model.source, model.weights or model.source


def load_model(root: Path, model: ModelSource, task: str) -> Any:
    """Build the nn.Module from the spec and put it in eval mode."""
    module = _load_hf(root, model, task) if model.kind == "hf" else _load_py(root, model)
    return module.eval()


def _load_hf(root: Path, model: HfModel, task: str) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    folder = root / model.path
    if not (folder / "config.json").is_file():
        raise Refused(
            f"model.path {model.path}: no config.json in {folder}",
            "point model.path at a Hugging Face folder (config.json + *.safetensors); "
            "for the example run `python scripts/make_checkpoint.py tiny-gpt2`",
        )
    if not list(folder.glob("*.safetensors")):
        raise Refused(
            f"model.path {model.path}: no *.safetensors checkpoint in {folder}",
            "save the model with safe_serialization=True",
        )
    _check_shards(folder, model.path)
    auto = getattr(transformers, TASKS[task].auto_class)
    return auto.from_pretrained(folder, local_files_only=True, attn_implementation="eager")


def _check_shards(folder: Path, shown: str) -> None:
    """A sharded checkpoint (`*.safetensors.index.json`) must have every shard it lists."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Refused(
                f"model.path {shown}: {index.name} is not a safetensors index "
                "(no weight_map of tensor -> shard file)",
                "re-save the checkpoint with save_pretrained(..., safe_serialization=True)",
            ) from None
        missing = [f for f in shards if not (folder / f).is_file()]
        if missing:
            raise Refused(
                f"model.path {shown}: {index.name} lists {len(shards)} shard(s); missing: "
                + ", ".join(missing),
                "copy every shard of the checkpoint into the folder",
            )


def _load_py(root: Path, model: PythonModel) -> Any:
    import torch

    source = root / model.source
    if not source.exists():
        raise Refused(
            f"model.source {model.source} does not exist",
            "give the file or folder that holds the factory's module",
        )
    folder = str(source if source.is_dir() else source.parent)
    module_name, factory_name = model.entrypoint.split(":")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise Refused(
            f"model.entrypoint {model.entrypoint}: {exc}",
            f"make {factory_name} importable from {model.source}",
        ) from None
    net = factory()
    if not isinstance(net, torch.nn.Module):
        raise Refused(
            f"model.entrypoint {model.entrypoint} returned "
            f"{type(net).__name__}, not a torch.nn.Module",
        )
    if model.weights:
        net.load_state_dict(_read_weights(root / model.weights), strict=True)
    return net


def _read_weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise Refused(
            f"model.weights {path} does not exist",
            "give the path of a safetensors state dict",
        )
    return load_file(path)


def model_config(model: ModelSource, root: Path) -> dict[str, Any]:
    """The HF config.json as a dict (empty for python models)."""
    if model.kind != "hf":
        return {}
    data: dict[str, Any] = json.loads((root / model.path / "config.json").read_text())
    return data


def arch(config: dict[str, Any]) -> dict[str, int]:
    """Layers, heads, KV heads, head dim, hidden, vocab, positions from an HF config."""

    def pick(*keys: str, default: int = 0) -> int:
        return next((int(config[k]) for k in keys if config.get(k) is not None), default)

    hidden = pick("hidden_size", "n_embd", "d_model", "dim")  # dim: DistilBERT
    heads = pick("num_attention_heads", "n_head", "n_heads")
    return {
        "layers": pick("num_hidden_layers", "n_layer", "n_layers"),
        "heads": heads,
        "kv_heads": pick("num_key_value_heads", default=heads),
        "head_dim": pick("head_dim", default=hidden // heads if heads else 0),
        "hidden": hidden,
        "vocab": pick("vocab_size"),
        "positions": max(pick("max_position_embeddings", "n_positions") - _offset(config), 0),
        "labels": len(config.get("id2label") or {}) or 2,
    }


def arch_of(config: dict[str, Any], lay: Layout) -> dict[str, int]:
    """arch(config), completed from the graph's own tensors where the config says nothing (a
    python model has no config): layers, KV heads and head dim from the past_key_values
    inputs [batch, kv_heads, past_sequence, head_dim], the vocabulary from the logits. The
    capacity plan sizes the KV cache from these; it refuses a cache it cannot size."""
    out = arch(config)
    keys = [
        t for t in lay.inputs if t.name.startswith("past_key_values.") and t.name.endswith(".key")
    ]
    if keys and not (out["layers"] and out["kv_heads"] and out["head_dim"]):
        axes = keys[0].axes
        out["layers"] = len(keys)
        out["kv_heads"] = axes[1] if len(axes) == 4 and isinstance(axes[1], int) else 0
        out["head_dim"] = axes[3] if len(axes) == 4 and isinstance(axes[3], int) else 0
        out["heads"] = out["heads"] or out["kv_heads"]
    logits = next((t for t in lay.outputs if t.name == "logits"), None)
    if not out["vocab"] and logits and logits.axes and isinstance(logits.axes[-1], int):
        out["vocab"] = logits.axes[-1]
    return out


def load_with_layout(root: Path, release: ReleaseSpec) -> tuple[Any, Layout]:
    """The model in eval mode and its graph layout (which depends on what forward takes)."""
    import inspect

    net = load_model(root, release.model, release.task)
    forward = frozenset(inspect.signature(net.forward).parameters)
    pooled = embedding_pooling(root, release)
    if pooled:  # the embedding: pooling (+ normalize) inside the graph; net.pooling says which
        from stages.onnx import pooling

        net = pooling.wrap(net, pooled)
    config = model_config(release.model, root)
    return net, layout(release.task, release.export, config, forward)


def embedding_pooling(root: Path, release: ReleaseSpec) -> Pooling | None:
    """The pooling a text-embedding release exports (None for other tasks)."""
    if not TASKS[release.task].pooled:
        return None
    from stages.onnx import pooling

    folder = root / release.model.path if release.model.kind == "hf" else None
    return pooling.resolve(folder, release.export)


def label_names(config: dict[str, Any]) -> list[str]:
    """config.id2label in id order (what a label task's scores mean)."""
    id2label = config.get("id2label") or {}
    return [str(id2label[k]) for k in sorted(id2label, key=int)]


def layout(
    task: str, export: ExportConfig, config: dict[str, Any], forward: frozenset[str] = frozenset()
) -> Layout:
    """Inputs/outputs of the exported graph: declared by the spec, or derived from the task
    (TASKS) and the config. `forward`: the model forward's parameter names; token_type_ids
    becomes an input when the model takes it."""
    if export.inputs:
        inputs = tuple(
            Tensor(t.name, t.dtype, tuple(t.shape), t.low, t.high) for t in export.inputs
        )
        outs = [(o.name, tuple(o.shape or ())) for o in export.outputs or []] or [("output", ())]
        return Layout(inputs, tuple(Tensor(n, "float32", axes) for n, axes in outs))
    spec, a = TASKS[task], arch(config)
    seq = TOTAL if spec.kv_cache else "sequence"
    ids = Tensor("input_ids", "int64", ("batch", "sequence"), 0, a["vocab"])
    ins = [ids, Tensor("attention_mask", "int64", ("batch", seq), 1, 2)]
    if spec.kv_cache and POSITIONS in forward:
        # without it a left-padded row numbers its tokens from the pads: wrong logits for
        # every padded request (tiny-gpt2: 0.57 off); the runtime derives it from the mask
        ins.append(Tensor(POSITIONS, "int64", ("batch", "sequence"), 0, a["positions"] or 1))
    if "token_type_ids" in forward and not spec.kv_cache:
        # segment ids index a table of type_vocab_size rows (BERT: 2, RoBERTa: 1)
        segments = max(int(config.get("type_vocab_size") or 1), 1)
        ins.append(Tensor("token_type_ids", "int64", ("batch", "sequence"), 0, segments))
    sizes: dict[str, int] = {"vocab": a["vocab"], "labels": a["labels"], "hidden": a["hidden"]}
    outs_: list[Tensor] = [
        Tensor(o.name, "float32", tuple(sizes.get(x, x) for x in o.axes)) for o in spec.outputs
    ]
    if spec.kv_cache:
        kv = ("batch", a["kv_heads"], "past_sequence", a["head_dim"])
        for i in range(a["layers"]):
            ins += [Tensor(f"past_key_values.{i}.{k}", "float32", kv) for k in ("key", "value")]
        for i in range(a["layers"]):
            outs_ += [
                Tensor(f"present.{i}.{k}", "float32", (*kv[:2], TOTAL, kv[3]))
                for k in ("key", "value")
            ]
    return Layout(tuple(ins), tuple(outs_))


# RoBERTa-style models number positions from padding_idx + 1: 514 embeddings serve 512 tokens
OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer", "mpnet"})


def _offset(config: dict[str, Any]) -> int:
    if config.get("model_type") in OFFSET_POSITIONS:
        return int(config.get("pad_token_id") or 0) + 1
    return 0


def layout_from_info(info: ModelInfo) -> Layout:
    """The Layout recorded by the export stage (ModelInfo)."""
    return Layout(
        tuple(Tensor(t.name, t.dtype, tuple(t.axes)) for t in info.inputs),
        tuple(Tensor(t.name, t.dtype, tuple(t.axes)) for t in info.outputs),
    )


def adapter(task: str, net: Any, lay: Layout) -> Any:
    """An nn.Module taking the layout's inputs positionally and returning its outputs flat."""
    import torch

    names = tuple(t.name for t in lay.inputs)

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = net

        def forward(self, *args: Any) -> Any:
            return _forward(task, self.model, names, args, len(lay.outputs))

    return Flat().eval()


def _forward(task: str, net: Any, names: tuple[str, ...], args: tuple[Any, ...], n_out: int) -> Any:
    spec = TASKS[task]
    if spec.kv_cache and n_out > 1:
        from transformers.cache_utils import DynamicCache

        named = dict(zip(names, args, strict=True))
        past = [named[n] for n in names if n.startswith("past_key_values.")]
        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        given = {n: named[n] for n in ("input_ids", "attention_mask", POSITIONS) if n in named}
        out = net(**given, cache=cache, use_cache=True)
        present = out.cache
        flat = [t for layer in present.layers for t in (layer.keys, layer.values)]
        return (out.logits, *flat)
    if spec.outputs:  # a task's model: named inputs, named outputs
        out = net(**dict(zip(names, args, strict=True)))
        values = tuple(getattr(out, o.attribute) for o in spec.outputs)
        return values[0] if len(values) == 1 else values
    return net(*args)


def torch_outputs(module: Any, lay: Layout, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run the adapter on numpy feeds; outputs as float numpy arrays."""
    import torch

    args = [torch.from_numpy(feeds[t.name]) for t in lay.inputs]
    with torch.no_grad():
        out = module(*args)
    outs = out if isinstance(out, tuple | list) else (out,)
    return [o.detach().numpy() for o in outs]


def named_run(module: Any, lay: Layout) -> Any:
    """The adapter as a function of named feeds returning named outputs (stages/onnx/kvcache
    Run): what the KV-cache walks and produced pasts call for PyTorch."""
    names = [t.name for t in lay.outputs]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, torch_outputs(module, lay, feeds), strict=True))

    return run


def traced_run(flat: Any, lay: Layout, feeds: dict[str, np.ndarray]) -> tuple[list[Any], list[Any]]:
    """Outputs, plus (module name, first input, first output, every tensor output) per
    module in execution order: a module returning several tensors (a rotary embedding's
    cos and sin) is compared output by output.

    Names drop the adapter's `model.` prefix; the user's root module is not hooked.
    """
    seen: list[tuple[str, np.ndarray | None, np.ndarray, list[np.ndarray]]] = []

    def hook(name: str) -> Any:
        def record(_mod: Any, inp: Any, out: Any) -> None:
            outs = _tensors(out)
            if outs:
                first_in = _first_tensor(inp)
                arrays = [t.numpy().copy() for t in outs]
                seen.append(
                    (name, None if first_in is None else first_in.numpy().copy(), arrays[0], arrays)
                )

        return record

    handles = [
        mod.register_forward_hook(hook(name.removeprefix("model.")))
        for name, mod in flat.named_modules()
        if name and name != "model"
    ]
    try:
        outs = torch_outputs(flat, lay, feeds)
    finally:
        for h in handles:
            h.remove()
    return outs, seen


def _tensors(value: Any) -> list[Any]:
    """A module output's tensors, in order: the value itself, or the items of a tuple/list."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value.detach()]
    items = value if isinstance(value, tuple | list) else ()
    return [v.detach() for v in items if isinstance(v, torch.Tensor)]


def _first_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    items = value if isinstance(value, tuple | list) else ()
    return next((v.detach() for v in items if isinstance(v, torch.Tensor)), None)


MADV_DONTNEED = 4


@contextmanager
def weights_paged(net: Any) -> Iterator[None]:
    """While it runs, the checkpoint's pages leave this process's resident set after each
    module that has weights: a forward pass holds about one layer of a memory-mapped
    safetensors checkpoint, not all of it (issue 14: peak memory; the parity reference
    of gpt2-small held 0.5 GB of weights next to 0.5 GB of activations).

    Only a mapping of a `.safetensors` file none of whose pages was written (smaps:
    Anonymous 0 kB) is dropped: its pages are the file's bytes, and the next read faults
    them back in from the page cache, unchanged. A checkpoint read into memory (a python
    model, or an HF model loaded without mmap) has no such mapping, and nothing happens."""
    import ctypes

    spans = _clean_checkpoint_maps()
    if not spans:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def drop(*_: Any) -> None:
        for start, end in spans:
            libc.madvise(start, end - start, MADV_DONTNEED)

    handles = [
        mod.register_forward_hook(drop)
        for mod in net.modules()
        if next(mod.parameters(recurse=False), None) is not None
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        drop()


def _clean_checkpoint_maps() -> list[tuple[int, int]]:
    """Address ranges of safetensors files mapped in this process with no written page."""
    spans, current = [], None
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:  # not Linux
        return []
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = None
            if len(head) >= 6 and head[-1].endswith(".safetensors"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = (start, end)
        elif current and head[:1] == ["Anonymous:"] and head[1] == "0":
            spans.append(current)
    return spans
