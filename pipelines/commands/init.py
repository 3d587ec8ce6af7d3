"""`shipyard init MODEL_FOLDER --data DATA`: write a release spec from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipelines.commands import _common


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "init",
        help="write releases/<name>.yaml from a model folder",
        description="Read a Hugging Face model folder (its config, tokenizer and weights) "
        "and write releases/<name>.yaml: the task detected from the checkpoint, export "
        "shapes, calibration and evaluation on --data, and a capacity plan for "
        "--device-memory. The spec is validated like a hand-written one; review it, then "
        "`shipyard compile`.",
    )
    parser.add_argument("model_folder", help="a Hugging Face folder inside the repository")
    parser.add_argument(
        "--data", required=True, help="JSONL of texts in the repo: calibration and evaluation"
    )
    parser.add_argument("--name", help="release name (default: the folder's name)")
    parser.add_argument("--task", help="override the task detected from the checkpoint")
    parser.add_argument("--device-memory", default="16GiB", help="memory of the target device")
    parser.add_argument("--force", action="store_true", help="replace an existing spec")
    parser.add_argument("--tokenizer", help="tokenizer folder, when the model folder has none")
    parser.add_argument(
        "--eval-data",
        help="a separate data file for evaluation (default: --data, with a warning: scores "
        "on calibration data read better than they are)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from pipelines.init import SIZING, init, same_data
    from schemas.loader import load_release

    root = _common.root()
    folder = Path(args.model_folder).resolve()
    target = init(
        root,
        folder,
        args.data,
        name=args.name,
        task=args.task,
        device_memory=args.device_memory,
        force=args.force,
        tokenizer=args.tokenizer,
        eval_data=args.eval_data,
    )
    print(f"wrote {target.relative_to(root)}; review it, then `shipyard compile`")
    if SIZING.get(target.stem):
        print(SIZING[target.stem])
    warning = same_data(load_release(target))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0
