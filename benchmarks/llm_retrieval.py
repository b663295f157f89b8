"""Which explanation of SmolLM2-135M-Instruct is more faithful: relevancy's methods, lxt's AttnLRP and CP-LRP,
captum's and inseq's gradient methods, side by side on the same retrieval prompts in one process.

    OMP_NUM_THREADS=1 python benchmarks/llm_retrieval.py [--n 30] [--batch 1] [--deletion-batch 32]
                                                         [--methods attnlrp cp_lrp ...] [--others lxt captum inseq]

Prompts and metrics: `relevancy.evaluation.llm_retrieval` (what `relevancy evaluate --benchmark llm-retrieval`
computes): the first N test prompts of the generated retrieval world, each prompt's true answer explained; evidence
share, pointing, the deletion test (facts' tokens removed most / least relevant first, area under the answer's
log-probability), a random row; the table is over the prompts the model answers right, the JSON has all prompts
too. Time: a method's seconds over a plain no-grad forward of the same prompts, explained `--batch` at a time
(default 1: captum and inseq explain one prompt per call, so every tool is timed on single prompts); one process,
one CPU thread.

The others (the `llm-bench` extra; never dependencies of relevancy):
- lxt 2.1's AttnLRP and CP-LRP (its efficient patches of transformers' Llama classes, input x relevance at the
  embeddings, the target's logit), and the largest difference of its AttnLRP map to relevancy's;
- captum 0.9's `LLMGradientAttribution` around `LayerGradientXActivation` and `LayerIntegratedGradients`
  (`--ig-steps`, default 20, not captum's 50, to fit the run; zero embeddings as the baseline) at the embedding
  layer, summed over the embedding: captum explains the answer token's log-probability;
- inseq 0.7's `saliency` and `input_x_gradient`, with inseq's default attributed function (the answer token's
  probability) and aggregation (the L2 norm over the embedding, so its maps are never negative). inseq's
  `integrated_gradients` (about 30 s a prompt here) and `attention` (it needs eager attention) are left out.
Results: benchmarks/results/llm_retrieval.md and .json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from relevancy.evaluation.llm_retrieval import DEFAULT_METHODS, Explainer, evaluate_llm_retrieval, llm_report
from relevancy.core.files import strict_json, write_atomic
from relevancy.models import smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_lxt_reference import lxt_patched, positions  # noqa: E402
from machine import cpu_name, today  # noqa: E402

OTHERS = ("lxt", "captum", "inseq")
RESULTS = Path(__file__).resolve().parent / "results"


def lxt_explainer(variant: str) -> Explainer:
    """lxt's `variant` ("attnLRP" or "cp_LRP") map `(B, T)` for the target tokens' logits."""
    def run(model: torch.nn.Module, inputs: dict, target: torch.Tensor) -> torch.Tensor:
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        with lxt_patched("llama", variant):
            embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeddings, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
            logits[torch.arange(len(ids)), mask.sum(1) - 1, target].sum().backward()
        return (embeddings * embeddings.grad).sum(-1).detach() * mask
    return run


def rows(tokenizer, inputs: dict) -> list[tuple[int, str]]:
    """Each row's length and text, checked to tokenize back to the same ids (captum and inseq take texts)."""
    out = []
    for ids, length in zip(inputs["input_ids"].tolist(), inputs["attention_mask"].sum(1).tolist()):
        text = tokenizer.decode(ids[:length])
        if tokenizer(text)["input_ids"] != ids[:length]:
            raise ValueError(f"the prompt {text!r} does not tokenize back to its ids")
        out.append((length, text))
    return out


def captum_explainer(tokenizer, layer_method: str, **options) -> Explainer:
    """captum's `LLMGradientAttribution` around `layer_method` at the embedding layer, one prompt per call."""
    import captum.attr as attr

    def run(model: torch.nn.Module, inputs: dict, target: torch.Tensor) -> torch.Tensor:
        method = attr.LLMGradientAttribution(getattr(attr, layer_method)(model, model.get_input_embeddings()), tokenizer)
        scores = torch.zeros(inputs["input_ids"].shape, dtype=torch.float64)
        for row, (length, text) in enumerate(rows(tokenizer, inputs)):
            result = method.attribute(attr.TextTokenInput(text, tokenizer), target=target[row:row + 1], **options)
            scores[row, :length] = result.token_attr[0].double()
        return scores
    return run


def inseq_explainer(model: torch.nn.Module, tokenizer, method: str) -> Explainer:
    """inseq's `method` with its default attributed function and aggregation, one prompt per call."""
    import inseq

    wrapped = inseq.load_model(model, method, tokenizer=tokenizer)

    def run(model: torch.nn.Module, inputs: dict, target: torch.Tensor) -> torch.Tensor:
        scores = torch.zeros(inputs["input_ids"].shape, dtype=torch.float64)
        for row, (length, text) in enumerate(rows(tokenizer, inputs)):
            output = wrapped.attribute(input_texts=text, generated_texts=text + tokenizer.decode([int(target[row])]),
                                       show_progress=False)
            sequence = output.sequence_attributions[0]
            ids = [token.id for token in sequence.target]
            if ids[:length] != inputs["input_ids"][row, :length].tolist() or ids[length] != int(target[row]):
                raise ValueError(f"inseq tokenized the prompt {text!r} differently")
            scores[row, :length] = sequence.aggregate().target_attributions[:length, 0].double()
        return scores
    return run


def explainers(model: torch.nn.Module, tokenizer, others: list[str], ig_steps: int) -> dict[str, Explainer]:
    """The other tools' explainers, named for the table."""
    chosen: dict[str, Callable[[], Explainer]] = {}
    if "lxt" in others:
        chosen["lxt 2.1 AttnLRP"] = lambda: lxt_explainer("attnLRP")
        chosen["lxt 2.1 CP-LRP"] = lambda: lxt_explainer("cp_LRP")
    if "captum" in others:
        chosen["captum 0.9 gradient x input"] = lambda: captum_explainer(tokenizer, "LayerGradientXActivation")
        chosen[f"captum 0.9 integrated gradients ({ig_steps} steps)"] = lambda: captum_explainer(
            tokenizer, "LayerIntegratedGradients", n_steps=ig_steps)
    if "inseq" in others:
        chosen["inseq 0.7 saliency"] = lambda: inseq_explainer(model, tokenizer, "saliency")
        chosen["inseq 0.7 input x gradient"] = lambda: inseq_explainer(model, tokenizer, "input_x_gradient")
    return {name: make() for name, make in chosen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1, help="prompts explained at a time (default 1)")
    parser.add_argument("--deletion-batch", type=int, default=32, help="perturbed prompts read at a time (default 32)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--others", nargs="*", default=list(OTHERS), choices=OTHERS)
    parser.add_argument("--ig-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "llm_retrieval")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    began = time.perf_counter()
    results = evaluate_llm_retrieval(model, tokenizer, methods=args.methods, n=args.n, batch_size=args.batch,
                                     explainers=explainers(model, tokenizer, args.others, args.ig_steps),
                                     deletion_batch_size=args.deletion_batch, progress=True)
    results["model"] = "SmolLM2-135M-Instruct (Q4_1 dequantised, float32)"
    results["machine"] = f"{cpu_name()}, 1 thread, {today()}; {time.perf_counter() - began:.0f} s in all"
    report = llm_report(results) + f"\nMachine: {results['machine']}. Command: python benchmarks/llm_retrieval.py " \
                                   f"--n {args.n} --batch {args.batch} --deletion-batch {args.deletion_batch}\n"
    write_atomic(args.out.with_suffix(".json"), json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n")
    write_atomic(args.out.with_suffix(".md"), report)
    print(report)


if __name__ == "__main__":
    main()
