"""How often SmolLM2-135M-Instruct answers the generated retrieval prompts right (greedy next token).

    python benchmarks/llm_world_accuracy.py [--split test] [--n 90] [--people 1 2 3]

A prompt counts as answered when the model's most probable next token is the answer's token. Prints the
accuracy per number of people (each with three facts) and per kind of fact. Results: benchmarks/results/llm_world_accuracy.txt.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from relevancy.worlds import language as llm_world
from relevancy.models import smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="test", choices=list(llm_world.SPLIT_SEEDS))
    parser.add_argument("--n", type=int, default=90)
    parser.add_argument("--people", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    model, tokenizer = smollm2()
    for people in args.people:
        hits: dict[str, list[bool]] = defaultdict(list)
        for item in llm_world.prompts(args.split, args.n, n_people=people):
            ids = tokenizer(item.text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                predicted = int(model(ids).logits[0, -1].argmax())
            hits[item.kind].append(tokenizer.decode(predicted) == item.answer)
        total = [hit for kind in hits.values() for hit in kind]
        kinds = ", ".join(f"{kind} {sum(v) / len(v):.2f} ({len(v)})" for kind, v in sorted(hits.items()))
        print(f"{people} people ({3 * people} facts): {sum(total) / len(total):.2f} of {len(total)} answered; {kinds}", flush=True)


if __name__ == "__main__":
    main()
