"""Token-F1 of every method with the shipped sentiment model on the generated rationale set (offline).

    python benchmarks/text_token_f1.py [--size 64] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

from relevancy.zoo.text import load_model
from relevancy.evaluation.text_rationales import make_rationale_set, token_f1
from relevancy.families.base import SEED_METHODS

KS = (5, 10, 20, 40, 80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    rationales = make_rationale_set(args.size, seed=args.seed)
    print(f"# macro token F1, {args.size} generated reviews (seed {args.seed}), explaining the true class")
    print("| method | " + " | ".join(f"k={k}" for k in KS) + " |")
    print("| --- |" + " --- |" * len(KS))
    for method in SEED_METHODS:
        scores = token_f1(model, tokenizer, method, rationales, ks=KS)["scores"]
        print(f"| `{method}` | " + " | ".join(f"{scores[k]['macro']['f1']:.2f}" for k in KS) + " |", flush=True)


if __name__ == "__main__":
    main()
