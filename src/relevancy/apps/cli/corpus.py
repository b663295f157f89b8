"""`relevancy explain-corpus PROMPTS --out DIR [--model smollm2|FOLDER] [--method M] [--generate] ...`.

The options are defined in `relevancy.apps.cli` (which loads no torch); this is the handler. The request is checked
before the model loads (a bad one is one line, exit status 2, and writes nothing); under torchrun each process loads
the model onto its own device and `relevancy.explain_corpus` shares the batches out. Rank 0 draws the progress bar and
prints the summary.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path

import torch

from ...core.files import check_folder
from ..common import MAX_NEW_TOKENS, UsageError, at_least, at_most

#: the units --memory-budget takes
UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def memory_size(text: str) -> int:
    """`--memory-budget` in bytes: a number with a unit (512MiB, 8GiB, 2GB; none: bytes); a UsageError otherwise."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise UsageError(f"--memory-budget must be a size such as 512MiB or 8GiB (units: {', '.join(u for u in UNITS if u)}), got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def _check(args: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    """`(memory budget in bytes, latent parts)`; a UsageError for anything wrong that needs no model."""
    path = Path(args.prompts)
    if not path.exists():
        raise UsageError(f"PROMPTS {args.prompts}: no such file or folder (a .jsonl or text file, or a saved dataset's folder)")
    at_most("--max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    at_least("--max-batch", args.max_batch, 1)
    if args.generate and args.target_column is not None:
        raise UsageError("--generate explains the model's own continuation: leave out --target-column")
    latent = () if args.latent is None else tuple(part.strip() for part in args.latent.split(","))
    if any(part not in ("layers", "heads") for part in latent):
        raise UsageError(f"--latent takes 'layers', 'heads' or 'layers,heads', got {args.latent!r}")
    check_folder(args.out)
    return memory_size(args.memory_budget), latent


def _prompts(path: Path):
    """A prompts file's path as given, or the dataset saved in a folder."""
    if path.is_dir():
        from ...core.extras import require

        return require("datasets", "corpus").load_from_disk(str(path))
    return path


def _device(choice: str) -> torch.device:
    """`--device`: auto is this process's GPU under torchrun (LOCAL_RANK), else the first GPU, else the CPU."""
    if choice != "auto":
        try:
            return torch.device(choice)
        except RuntimeError:
            raise UsageError(f"--device must be 'auto', 'cpu' or a torch device such as cuda:0, got {choice!r}") from None
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def run_explain_corpus(args: argparse.Namespace) -> list[Path]:
    """Explain the corpus; rank 0 prints the summary and returns the report's files."""
    budget, latent = _check(args)
    from ...corpus import explain_corpus
    from ...models import load_language_model

    threads = torch.get_num_threads()
    if args.threads is not None:
        at_least("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    try:
        device = _device(args.device)
        model, tokenizer = load_language_model(args.model)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        if (dtype is not None and dtype != next(model.parameters()).dtype) or device != next(model.parameters()).device:
            model = copy.deepcopy(model).to(device=device, dtype=dtype)  # the loader's cached model stays as loaded
        summary = explain_corpus(model, tokenizer, _prompts(Path(args.prompts)), args.method,
                                 targets="generate" if args.generate else None, out=args.out,
                                 prompt_column=args.prompt_column, target_column=args.target_column, id_column=args.id_column,
                                 max_new_tokens=args.max_new_tokens, latent=latent or False, memory_budget=budget,
                                 max_batch=args.max_batch, progress=not args.quiet)
    finally:
        torch.set_num_threads(threads)
    if not summary.files:  # not rank 0
        return []
    print(summary, file=sys.stderr)
    return list(summary.files)
