"""Cost of the decoder methods on SmolLM2-135M-Instruct: time over a plain forward, and peak memory, per prompt length.

    python benchmarks/llm_speed.py [--tokens 100 1000] [--methods attnlrp attnlrp+checkpoint ...] [--repeats 2]

Each (length, method) runs in a fresh process (so that its peak resident memory is its own): the model is loaded,
one prompt of `--tokens` tokens (the retrieval world's facts repeated up to that length, then its question) is
run as a plain no-grad forward that computes the next token's logits only (`logits_to_keep=1`, the model's own
sdpa attention) and explained (after one warm-up of each); reported are the best of `--repeats` times, their
ratio, the peak resident memory of the first plain forward and of the first explanation, each above what the
process held before it (sampled every millisecond from /proc/self/statm: Linux), the ratio of the process's
two peaks (what it held with the model loaded, about 1 GB with torch, plus each), and `x fwd peak`: the ratio of
the two peaks counting the weights (513 MiB) but not torch's own memory, as `benchmarks/speed_memory.py` counts.
A method written `NAME+checkpoint` runs with `checkpoint=True` (each layer recomputed in the backward).
One CPU thread. Results: benchmarks/results/llm_speed.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name, today  # noqa: E402

METHODS = ("attnlrp", "attnlrp+checkpoint", "cp_lrp", "input_x_gradient", "input_x_gradient+checkpoint",
           "generic_attention", "transformer_attribution", "transformer_attribution+checkpoint", "lrp", "lrp+checkpoint")


def prompt_ids(tokenizer, tokens: int) -> dict[str, torch.Tensor]:
    """A prompt of exactly `tokens` tokens: facts of the retrieval world repeated, then a question and answer start."""
    from relevancy.worlds import language as llm_world

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

    name, _, option = method.partition("+")
    options = {option: True} if option else {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    base = resident_bytes()  # the process with the model loaded
    forward_peak = peak_above(forward)  # the first call: the warm-up
    plain = best_time(forward, repeats)
    peak = peak_above(lambda: relevancy.explain(model, inputs, method=name, **options))  # the first call: the warm-up
    explained = best_time(lambda: relevancy.explain(model, inputs, method=name, **options), repeats)
    return {"tokens": tokens, "method": method, "forward_s": plain, "method_s": explained, "ratio": explained / plain,
            "base_mb": base / 2**20, "weights_mb": weights / 2**20, "forward_peak_mb": forward_peak / 2**20, "peak_mb": peak / 2**20}


def child(argv: list[str]) -> dict:
    """Run this Python on `argv` in a fresh process (its peak memory its own) and read the JSON line it prints last."""
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
    print(f"SmolLM2-135M-Instruct, float32, {cpu_name()}, 1 thread, best of {args.repeats}, {today()}")
    print(f"{'tokens':>6} {'method':<34} {'forward s':>9} {'method s':>9} {'ratio':>6} {'fwd peak MB':>11} {'peak MB':>8} "
          f"{'peak ratio':>10} {'x fwd peak':>10}")
    for tokens in args.tokens:
        for method in args.methods:
            r = child([__file__, "--one", str(tokens), method, "--repeats", str(args.repeats)])
            print(f"{r['tokens']:>6} {r['method']:<34} {r['forward_s']:>9.3f} {r['method_s']:>9.3f} {r['ratio']:>6.2f} "
                  f"{r['forward_peak_mb']:>11.0f} {r['peak_mb']:>8.0f} "
                  f"{(r['base_mb'] + r['peak_mb']) / (r['base_mb'] + r['forward_peak_mb']):>10.2f} "
                  f"{(r['weights_mb'] + r['peak_mb']) / (r['weights_mb'] + r['forward_peak_mb']):>10.2f}", flush=True)


if __name__ == "__main__":
    main()
