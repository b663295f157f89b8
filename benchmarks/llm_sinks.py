"""Attention sinks on the llm-retrieval prompts: how much of SmolLM2-135M-Instruct's relevance lands on the first
and the last token, and what the evidence share is with the first token and without it (`exclude="first"`).

    OMP_NUM_THREADS=1 python benchmarks/llm_sinks.py [--n 24] [--batch 8] [--methods attnlrp cp_lrp ...]

The prompts, the explained token (each prompt's true answer) and the evidence are the llm-retrieval benchmark's
(`relevancy.evaluation.llm_retrieval`: the first N test prompts, right-padded). Per method, means over the prompts
the model answers right:
- `first`, `last`: `expl.sink_share`, the share of each map's positive relevance on the prompt's first token
  ("Question") and on its last;
- `share (all)`: the positive relevance on the supporting fact over the positive relevance on every prompt token,
  with the first token and then with it excluded (`explain(..., exclude="first")`: zeroed and masked);
- `top is first`: how often the first token holds the map's highest score;
- `share (facts)`: the benchmark's own evidence share (over the facts' tokens only, which never include the first
  token, so excluding it leaves this number as it is).
Results: benchmarks/results/llm_sinks.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import relevancy
from relevancy.worlds import language as llm_world
from relevancy.evaluation.llm_retrieval import answer_ids, encode, evidence_scores
from relevancy.core.files import write_atomic
from relevancy.models import smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, today  # noqa: E402

METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention", "attention_gradcam", "rollout", "raw_attention")


def share(scores: torch.Tensor, evidence: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row: positive relevance on the evidence over positive relevance on every valid token."""
    positive = scores.double().clamp(min=0) * valid
    return (positive * evidence).sum(1) / positive.sum(1).clamp(min=1e-300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "llm_sinks.md")
    args = parser.parse_args()
    model, tokenizer = smollm2()
    items = llm_world.prompts("test", args.n)
    rows = []
    for method in args.methods:
        found: dict[str, list[torch.Tensor]] = {k: [] for k in ("first", "last", "with", "without", "top", "facts", "right")}
        for start in range(0, len(items), args.batch):
            part = items[start:start + args.batch]
            inputs, context, evidence = encode(tokenizer, part)
            answers = answer_ids(tokenizer, part, inputs)
            expl = relevancy.explain(model, inputs, method=method, target=answers.tolist())
            valid = inputs["attention_mask"].bool()
            kept = expl.excluding("first")
            found["first"].append(expl.sink_share[:, 0])
            found["last"].append(expl.sink_share[:, 1])
            found["with"].append(share(expl.scores, evidence, valid))
            found["without"].append(share(kept.scores, evidence, kept.attention_mask.bool()))
            found["top"].append((torch.where(valid, expl.scores.double(), -torch.inf).argmax(1) == 0).double())
            found["facts"].append(evidence_scores(expl.scores, context, evidence)["share"])
            found["right"].append(expl.logits.argmax(-1).cpu() == answers)
        right = torch.cat(found.pop("right"))
        means = {k: float(torch.cat(v).double()[right].mean()) for k, v in found.items()}
        rows.append((method, means))
        print(method, {k: round(v, 3) for k, v in means.items()}, flush=True)
    lines = [f"# Attention sinks on llm-retrieval (SmolLM2-135M-Instruct, float32; first {args.n} test prompts, "
             f"{int(right.sum())} answered right; {cpu_name()}, {today()})", "",
             "| method | sink share: first | last | evidence share (all tokens) | without the first token | top token is the first | evidence share (facts) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| `{m}` | {v['first']:.3f} | {v['last']:.3f} | {v['with']:.3f} | {v['without']:.3f} | {v['top']:.3f} | {v['facts']:.3f} |" for m, v in rows]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
