"""Which token mixer of a shipped retrieval decoder carries the fact: its greedy accuracy on the benchmark's test
prompts with each kind of mixer switched off in every layer (its output replaced by zeros through a forward hook,
removed after), beside the whole model's.

    python benchmarks/retrieval_branches.py [--mixer mamba2] [--weights FOLDER] [--n 1000]

The Mamba-2 hybrid (Falcon-H1's layer) adds a Mamba-2 mixer's and an attention's outputs side by side in each layer:
switching one off leaves the other; each kind is switched off in every layer, then in one layer at a time. Where
accuracy falls to a guess among the asked kind's values (0.5 with two
people) without one mixer and stays without the other, the first finds the fact. Prints a markdown table."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from relevancy.worlds import retrieval_models  # noqa: E402
from training.retrieval_models import accuracy  # noqa: E402

#: the mixers of each layer that can be switched off, by the name of their module in the decoder layer
MIXERS = {"attention": "self_attn", "Mamba-2": "mamba", "gated DeltaNet": "linear_attn"}


@contextmanager
def switched_off(model: torch.nn.Module, child: str, only: int | None = None):
    """Every decoder layer's (or layer `only`'s) `child` module returning zeros of its output's shape (tuples: the
    first element)."""
    def zero(_module, _args, output):
        return (torch.zeros_like(output[0]), *output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)

    layers = [layer for k, layer in enumerate(model.model.layers) if only in (None, k) and hasattr(layer, child)]
    handles = [getattr(layer, child).register_forward_hook(zero) for layer in layers]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixer", default="mamba2", choices=tuple(retrieval_models.ARCHITECTURES))
    ap.add_argument("--weights", default=None, help="a trained folder (default: the shipped model of --mixer)")
    ap.add_argument("--n", type=int, default=1000, help="test prompts of world seed 0 (the benchmark's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = retrieval_models.load(args.mixer) if args.weights is None else retrieval_models.load_folder(Path(args.weights))
    rows = [("none (the whole model)", accuracy(model, tokenizer, args.n, seed=0))]
    for name, child in MIXERS.items():
        with switched_off(model, child) as layers:
            if layers:
                rows.append((f"{name}, every layer ({layers})", accuracy(model, tokenizer, args.n, seed=0)))
        for k in range(len(model.model.layers)):
            with switched_off(model, child, only=k) as layers:
                if layers:
                    rows.append((f"{name}, layer {k}", accuracy(model, tokenizer, args.n, seed=0)))
    kinds = list(rows[0][1])
    print(f"| switched off | {' | '.join(kinds)} |\n|---|{'---|' * len(kinds)}")
    for name, found in rows:
        print(f"| {name} | {' | '.join(f'{found[k]:.3f}' for k in kinds)} |")


if __name__ == "__main__":
    main()
