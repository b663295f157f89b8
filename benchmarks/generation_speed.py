"""Cost of explaining a whole generation on SmolLM2-135M-Instruct: `explain_generation`'s one forward and G
backward passes against G separate `explain` calls (one per generated token, each on its prefix), and the share
of the greedy decoding in it; with `--batch N`, N prompts explained in one call against one call per prompt.

    python benchmarks/generation_speed.py [--new-tokens 8 32] [--context 0] [--method attnlrp] [--repeats 2] [--batch 0]

One prompt (the start of a story, which the model continues past 64 tokens; `--context`: after that many
tokens of the retrieval world's facts, repeated), one CPU thread, float32; reported: the
best of `--repeats` times after a warm-up. The separate calls are timed on the tokens the generation produced, so
that both explain the same G rows (checked equal to 1e-4 of each row's largest value).
Results: benchmarks/results/generation_speed.txt.
"""
from __future__ import annotations

import argparse
import time

import torch
from machine import cpu_name, today

import relevancy
from relevancy.worlds import language as llm_world
from relevancy.generation import decode, stop_tokens
from relevancy.models import smollm2


PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: the prompts of `--batch` (of different lengths: the batch is left-padded)
PROMPTS = (PROMPT, "The capital of France is", "Question: Where does Mia live?\nAnswer: Mia lives in",
           "A list of fruits: apples, pears,", "def add(a, b):\n    return", "The weather today")


def best_time(run, repeats: int) -> tuple[float, object]:
    """The best wall time of `repeats` runs of `run()` after one warm-up, and the last result."""
    result = run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=0, help="tokens of facts before the story's start")
    parser.add_argument("--method", default="attnlrp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help=f"also N prompts (1 to {len(PROMPTS)}) in one call against N calls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    facts = " ".join(llm_world.prompt("test", 0).facts) + "\n"
    filler = tokenizer(facts * (args.context // 10 + 1), add_special_tokens=False)["input_ids"][: args.context]
    prompt = tokenizer.decode(filler) + PROMPT
    prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    print(f"# {today()}, {cpu_name()}, 1 thread, SmolLM2-135M-Instruct float32, method {args.method}, "
          f"prompt {prompt_ids.shape[1]} tokens, best of {args.repeats}")
    print("new tokens | generated | decoding s | explain_generation s | G explain calls s | ratio")
    for new in args.new_tokens:
        decoding, _ = best_time(lambda: decode(model, prompt_ids, torch.ones_like(prompt_ids), new, stop_tokens(model, tokenizer), {}),
                                args.repeats)
        together, result = best_time(lambda: relevancy.explain_generation(model, tokenizer, prompt, new, args.method), args.repeats)
        ids = torch.cat([prompt_ids[0], result.generated_ids])
        start = result.prompt_length

        def separately() -> list[torch.Tensor]:
            return [relevancy.explain(model, ids[None, : start + g], method=args.method, target=int(ids[start + g])).scores[0]
                    for g in range(len(result.generated_ids))]

        apart, rows = best_time(separately, args.repeats)
        for g, row in enumerate(rows):
            error = (result.scores[g, : start + g] - row).abs().max() / row.abs().max()
            assert error < 1e-4, f"row {g} differs by {error:.3g} of its maximum"
        print(f"{new} | {len(result.generated_ids)} | {decoding:.2f} | {together:.2f} | {apart:.2f} | {apart / together:.2f}")
    if args.batch:
        batch_speed(model, tokenizer, list(PROMPTS[: args.batch]), args.new_tokens, args.method, args.repeats)


def batch_speed(model, tokenizer, prompts: list[str], news: list[int], method: str, repeats: int) -> None:
    """`explain_generation` on the prompts as one batch against one call per prompt (the results checked equal)."""
    print(f"\nprompts | new tokens | one call s | a call per prompt s | ratio")
    for new in news:
        together, batched = best_time(lambda: relevancy.explain_generation(model, tokenizer, prompts, new, method), repeats)
        apart, alone = best_time(lambda: [relevancy.explain_generation(model, tokenizer, p, new, method) for p in prompts], repeats)
        for one, other in zip(batched, alone):
            assert one.generated_ids.tolist() == other.generated_ids.tolist(), "the batch decoded other tokens"
            error = ((one.scores - other.scores).abs().amax(1) / other.scores.abs().amax(1)).max()
            assert error < 1e-4, f"a batched row differs by {error:.3g} of its maximum"
        print(f"{len(prompts)} | {new} | {together:.2f} | {apart:.2f} | {apart / together:.2f}")


if __name__ == "__main__":
    main()
