"""Where SmolLM2-135M-Instruct's explanations put the relevance on the generated retrieval prompts, and their cost.

    python benchmarks/llm_retrieval.py [--n 30] [--batch 6] [--methods attnlrp cp_lrp ...] [--lxt]

Prompts: `relevancy.bench.llm_world` test split (two people, six facts). Only prompts the model answers right
(greedy next token = the answer) are scored, explaining that answer. Per method: `evidence share`, the positive
relevance on the supporting fact's tokens over the positive relevance on the context's tokens (the facts; the
evidence is about 1/6 of them); `pointing`, how often the context token with the most relevance lies in the
supporting fact; `time`, seconds per batch over a plain no-grad forward of the same batch (one process, one CPU
thread; the plain forward computes the logits at every position, the methods at the read one only, so the
attention-only methods come out below 1). `--lxt`: lxt 2.1's own AttnLRP on the same prompts (the `llm-bench` extra), its time and its largest
difference to relevancy's attnlrp map (relative to the map's maximum). Results: benchmarks/results/llm_retrieval.txt.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import relevancy
from relevancy.bench import llm_world
from relevancy.models import smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_lxt_reference import last_real, lxt_patched, positions  # noqa: E402

METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention", "attention_gradcam", "rollout", "raw_attention")


def masks(item: llm_world.RetrievalPrompt, offsets: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(context, evidence)` token masks of one prompt."""
    start = item.text.index("\n") + 1
    context = torch.tensor(item.token_mask(offsets, (start, start + len(" ".join(item.facts)))))
    return context, torch.tensor(item.token_mask(offsets)) & context


def lxt_attnlrp(model: torch.nn.Module, encoded: dict, target: torch.Tensor) -> torch.Tensor:
    """lxt's AttnLRP map `(B, T)` for the target tokens (lxt's patches on transformers' Llama classes)."""
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with lxt_patched("llama", "attnLRP"):
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeddings, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        logits[torch.arange(len(ids)), last_real(mask), target].sum().backward()
    return (embeddings * embeddings.grad).sum(-1).detach() * mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--lxt", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    items = llm_world.prompts("test", args.n)
    totals = {name: {"share": [], "pointing": [], "ratio": []} for name in args.methods + (["lxt attnlrp"] if args.lxt else [])}
    differences, answered = [], 0
    for start in range(0, len(items), args.batch):
        part = items[start:start + args.batch]
        encoded = tokenizer([item.text for item in part], return_tensors="pt", padding=True, return_offsets_mapping=True)
        offsets = encoded.pop("offset_mapping")
        encoded = dict(encoded)
        began = time.perf_counter()
        with torch.no_grad():
            model(**encoded, use_cache=False)
        forward = time.perf_counter() - began
        maps = {}
        for method in args.methods:
            began = time.perf_counter()
            explanation = relevancy.explain(model, encoded, method=method)
            totals[method]["ratio"].append((time.perf_counter() - began) / forward)
            maps[method] = explanation.scores
        target = explanation.target
        if args.lxt:
            began = time.perf_counter()
            maps["lxt attnlrp"] = lxt_attnlrp(model, encoded, target)
            totals["lxt attnlrp"]["ratio"].append((time.perf_counter() - began) / forward)
            if "attnlrp" in maps:
                differences.append(float(((maps["lxt attnlrp"] - maps["attnlrp"]).abs().amax(1) / maps["attnlrp"].abs().amax(1)).max()))
        for row, item in enumerate(part):
            if tokenizer.decode(int(target[row])) != item.answer:
                continue
            answered += 1
            context, evidence = masks(item, offsets[row].tolist())
            for method, scores in maps.items():
                positive = scores[row].clamp(min=0)
                totals[method]["share"].append(float(positive[evidence].sum() / positive[context].sum().clamp(min=1e-30)))
                best = torch.where(context, scores[row], torch.tensor(float("-inf"), dtype=scores.dtype)).argmax()
                totals[method]["pointing"].append(bool(evidence[best]))
    print(f"SmolLM2-135M-Instruct (Q4_1 dequantised, float32), {platform.processor() or platform.machine()}, 1 thread; "
          f"{answered} of {len(items)} test prompts answered right, batches of {args.batch}")
    print(f"{'method':<20} {'evidence share':>15} {'pointing':>9} {'time / forward':>15}")
    for method, values in totals.items():
        share = sum(values["share"]) / len(values["share"])
        pointing = sum(values["pointing"]) / len(values["pointing"])
        ratio = sum(values["ratio"]) / len(values["ratio"])
        print(f"{method:<20} {share:>15.3f} {pointing:>9.3f} {ratio:>15.2f}")
    if differences:
        print(f"lxt attnlrp vs relevancy attnlrp: largest difference / map maximum {max(differences):.1e}")


if __name__ == "__main__":
    main()
