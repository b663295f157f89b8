"""Cost of each method in forward passes on the default text model: `python benchmarks/text_speed.py`.

A batch of 8 texts of 128 tokens (Drugs.com test reviews, truncated); each method's median wall time over
`--repeats` runs divided by the median time of a plain forward pass (`model(**batch)`, no gradients), all in
one process on the same threads. Prints a table; `--json PATH` also writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch

import relevancy
from relevancy.zoo.text import encode, load_model
from relevancy.families.base import SEED_METHODS
from machine import timed


def texts(count: int, length: int, tokenizer) -> list[str]:
    try:
        from relevancy.zoo.text.data import drug_reviews

        pool = [r.text for r in drug_reviews("test")]
    except FileNotFoundError:
        pool = ["I started taking this medication in March and it worked wonders for my headaches. " * 8] * count
    long_enough = [t for t in pool if len(tokenizer(t)["input_ids"]) >= length]
    if len(long_enough) < count:
        raise RuntimeError(f"only {len(long_enough)} texts reach {length} tokens")
    return long_enough[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=list(SEED_METHODS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = encode(tokenizer, texts(args.batch, args.length, tokenizer), max_length=args.length)
    assert batch["input_ids"].shape == (args.batch, args.length), batch["input_ids"].shape

    def forward():
        with torch.no_grad():
            model(**batch)

    base = timed(forward, max(args.repeats, 5))
    rows = {"forward": (base, 1.0)}
    for method in args.methods:
        seconds = timed(lambda: relevancy.explain(model, batch, method=method), args.repeats)
        rows[method] = (seconds, seconds / base)
    print(f"default text model (MiniLM-L6 BERT), batch {args.batch} x {args.length} tokens, {args.threads} threads, "
          f"torch {torch.__version__}")
    print(f"{'method':26s} {'seconds':>9s} {'forwards':>9s}")
    for name, (seconds, ratio) in rows.items():
        print(f"{name:26s} {seconds:9.3f} {ratio:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {"seconds": s, "forwards": r} for name, (s, r) in rows.items()}, f, indent=2)


if __name__ == "__main__":
    main()
