"""Cost of the decoder methods on SmolLM2-135M-Instruct: time over a plain forward, and peak memory, per prompt length.

    python benchmarks/llm_speed.py [--tokens 100 1000] [--methods attnlrp cp_lrp input_x_gradient generic_attention] [--repeats 2]

Each (length, method) runs in a fresh process (so that its peak resident memory is its own): the model is loaded,
one prompt of `--tokens` tokens (the retrieval world's facts repeated up to that length, then its question) is
run once as a plain no-grad forward that computes the next token's logits only (`logits_to_keep=1`) and once
explained (after one warm-up of each); reported are the best of `--repeats` times, their ratio, and the peak
resident memory during the first explanation above what the process held before it (after the plain forwards;
later calls reuse what the allocator kept) (sampled every millisecond from
/proc/self/statm: Linux).
One CPU thread. Results: benchmarks/results/llm_speed.txt.
"""
from __future__ import annotations

import argparse
import json
import platform
import os
import threading
import subprocess
import sys
import time

import torch

METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention")


def prompt_ids(tokenizer, tokens: int) -> dict[str, torch.Tensor]:
    """A prompt of exactly `tokens` tokens: facts of the retrieval world repeated, then a question and answer start."""
    from relevancy.bench import llm_world

    item = llm_world.prompt("test", 0)
    tail = tokenizer(item.text, return_tensors="pt")["input_ids"][0]
    facts = tokenizer(" ".join(item.facts) + " ", return_tensors="pt")["input_ids"][0]
    fill = facts.repeat(tokens // len(facts) + 1)[: max(tokens - len(tail), 0)]
    ids = torch.cat([fill, tail])[-tokens:][None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def best_time(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_above(run) -> int:
    """The highest resident memory while `run()` runs, above what the process held before it (bytes)."""
    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak[0] - before, 0)


def one(tokens: int, method: str, repeats: int) -> dict:
    """Time and memory of one method at one length (run in its own process)."""
    import relevancy
    from relevancy.models import smollm2

    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    inputs = prompt_ids(tokenizer, tokens)

    def forward() -> None:
        with torch.no_grad():
            model(**inputs, use_cache=False, logits_to_keep=1)

    forward()
    plain = best_time(forward, repeats)
    peak = peak_above(lambda: relevancy.explain(model, inputs, method=method))  # the first call: the warm-up
    explained = best_time(lambda: relevancy.explain(model, inputs, method=method), repeats)
    return {"tokens": tokens, "method": method, "forward_s": plain, "method_s": explained, "ratio": explained / plain, "peak_mb": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("TOKENS", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.repeats)))
        return
    print(f"SmolLM2-135M-Instruct, float32, {platform.processor() or platform.machine()}, 1 thread, best of {args.repeats}")
    print(f"{'tokens':>6} {'method':<18} {'forward s':>9} {'method s':>9} {'ratio':>6} {'peak MB':>8}")
    for tokens in args.tokens:
        for method in args.methods:
            out = subprocess.run([sys.executable, __file__, "--one", str(tokens), method, "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{r['tokens']:>6} {r['method']:<18} {r['forward_s']:>9.3f} {r['method_s']:>9.3f} {r['ratio']:>6.2f} {r['peak_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
