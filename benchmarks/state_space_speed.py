"""The cost of `attnlrp` on state-space decoders against a plain autograd gradient of the same logit through the same
model (the floor: a recurrence's backward can cost more than its forward), at 1,000 tokens, in one process:

    python benchmarks/state_space_speed.py [--tokens 1000] [--layers 4] [--repeats 3] [--threads 1]

Models: random float32 `MambaForCausalLM` with mamba-130m's shape, `Mamba2ForCausalLM` with mamba2-130m's (width 768,
state 16 / 128), `FalconH1ForCausalLM` with Falcon-H1-0.5B's layer and `Qwen3NextForCausalLM` with Qwen3-Next-80B's
(dense MLPs), at reduced depth (`--layers`; said in the table): the full depth does not change the ratio, each layer
(pair of layers for Qwen3-Next: `--layers 2`) costs the same. Each figure is the median of `--repeats` runs after a warm-up; the CPU is named.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

import relevancy  # noqa: E402
from machine import cpu_name, timed  # noqa: E402

SHAPES = {
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=768, state_size=16, expand=2, conv_kernel=4)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(hidden_size=768, state_size=128, expand=2, conv_kernel=4,
                                                         num_heads=24, head_dim=64, n_groups=1, chunk_size=256)),
    # Falcon-H1-0.5B's layer: attention (8 heads, 2 key-value heads) beside a Mamba-2 mixer (24 heads of 64, state 128)
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, mamba_d_ssm=1536,
                       mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=128,
                       mamba_rms_norm=True, max_position_embeddings=4096)),
    # Qwen3-Next-80B-A3B's layers (width 2048; linear attention: 16 key heads and 32 value heads of 128), dense MLPs
    # (its experts left out: the mixture's cost is the same in both passes), linear then full attention
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(hidden_size=2048, intermediate_size=512, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                        mlp_only_layers=list(range(48)), layer_types=["linear_attention", "full_attention"] * 24)),
}


def build(family: str, layers: int) -> torch.nn.Module:
    config_name, model_name, options = SHAPES[family]
    options = {key: value[:layers] if key == "layer_types" else value for key, value in options.items()}
    config = getattr(transformers, config_name)(vocab_size=50280, num_hidden_layers=layers, **options)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


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
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}, {args.threads} thread(s), torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.tokens} tokens, {args.layers} layers, float32, median of {args.repeats}")
    print("| model | forward (s) | plain gradient (s) | attnlrp (s) | attnlrp / plain gradient | cp_lrp / plain gradient |")
    print("|---|---|---|---|---|---|")
    for family in args.models.split(","):
        model = build(family, args.layers)
        ids = torch.randint(3, 50000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            forward = timed(lambda: model(input_ids=ids, use_cache=False), args.repeats)
        plain = timed(lambda: plain_gradient(model, ids), args.repeats)
        seconds = {method: timed(lambda: relevancy.explain(model, inputs, method=method), args.repeats)
                 for method in ("attnlrp", "cp_lrp")}
        print(f"| {family} | {forward:.2f} | {plain:.2f} | {seconds['attnlrp']:.2f} | {seconds['attnlrp'] / plain:.2f} | "
              f"{seconds['cp_lrp'] / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
