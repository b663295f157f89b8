"""The cost of `attnlrp` on state-space decoders against a plain autograd gradient of the same logit through the same
model (the floor: a recurrence's backward can cost more than its forward), at 1,000 tokens, in one process:

    python benchmarks/state_space_speed.py [--tokens 1000] [--layers 4] [--repeats 3] [--threads 1]

Models: random float32 `MambaForCausalLM` with mamba-130m's shape and `Mamba2ForCausalLM` with mamba2-130m's
(width 768, state 16 / 128), at reduced depth (`--layers`; said in the table): the full 24 layers do not change the
ratio, each layer costs the same. Each figure is the median of `--repeats` runs after a warm-up; the CPU is named.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

import relevancy  # noqa: E402
from machine import cpu_name  # noqa: E402

SHAPES = {
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=768, state_size=16, expand=2, conv_kernel=4)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(hidden_size=768, state_size=128, expand=2, conv_kernel=4,
                                                         num_heads=24, head_dim=64, n_groups=1, chunk_size=256)),
}


def build(family: str, layers: int) -> torch.nn.Module:
    config_name, model_name, options = SHAPES[family]
    config = getattr(transformers, config_name)(vocab_size=50280, num_hidden_layers=layers, **options)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_gradient(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Autograd's gradient of the last position's top logit at the token embeddings, through the model's own forward."""
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, use_cache=False).logits[0, -1]
    torch.autograd.grad(logits.max(), embeddings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}, {args.threads} thread(s), torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.tokens} tokens, {args.layers} layers, float32, median of {args.repeats}")
    print("| model | forward (s) | plain gradient (s) | attnlrp (s) | attnlrp / plain gradient | cp_lrp / plain gradient |")
    print("|---|---|---|---|---|---|")
    for family in SHAPES:
        model = build(family, args.layers)
        ids = torch.randint(3, 50000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            forward = median_seconds(lambda: model(input_ids=ids, use_cache=False), args.repeats)
        plain = median_seconds(lambda: plain_gradient(model, ids), args.repeats)
        timed = {method: median_seconds(lambda: relevancy.explain(model, inputs, method=method), args.repeats)
                 for method in ("attnlrp", "cp_lrp")}
        print(f"| {family} | {forward:.2f} | {plain:.2f} | {timed['attnlrp']:.2f} | {timed['attnlrp'] / plain:.2f} | "
              f"{timed['cp_lrp'] / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
