"""Cost of `attnlrp` on a vision-language decoder of LLaVA-1.5-7B's or Qwen2.5-VL-7B's shape (random weights): time
over a plain forward and peak memory, for one explained token.

    OMP_NUM_THREADS=1 python benchmarks/vlm_speed.py [--model llava|qwen2_5_vl] [--tower-layers 4] [--decoder-layers 2]
        [--methods ...] [--repeats 2]

`--model qwen2_5_vl`: transformers' `Qwen2_5_VLForConditionalGeneration` with Qwen2.5-VL-7B's widths (a tower of
width 1280, 16 heads, SwiGLU MLP 3420, 14-pixel patches, windows of 112 pixels with full attention in every eighth
block, the 2 x 2 merger to 3584; a Qwen2 decoder of width 3584, 28 heads over 4 key-value heads, MLP 18944,
vocabulary 152064, M-RoPE) and reduced depth (`--tower-layers` of 32, `--decoder-layers` of 28), one image of 50 x 20
= 1,000 patches (700 x 280 pixels, 250 merged tokens) and 24 text tokens.

The model: transformers' `LlavaForConditionalGeneration` with LLaVA-1.5-7B's widths and token counts (a CLIP ViT-L/14
tower at 336 px: 577 tokens of width 1024, 16 heads, MLP 4096, the second-to-last layer's 576 patch tokens; the
two-layer GELU projector to 4096; a Llama decoder of width 4096, 32 heads, MLP 11008, vocabulary 32064) and reduced
depth (`--tower-layers` of 24, `--decoder-layers` of 32: the CPU's time; the ratios are per layer alike), float32,
random weights. The prompt: `<s>`, the image's 576 placeholder tokens and 24 text tokens (600 positions), one image.
Each method runs in a fresh process (its peak resident memory its own, `llm_speed.py`'s sampling): the plain forward is
the model's own no-grad forward computing the next token's logits only (`logits_to_keep=1`, its sdpa attention); the
explanation is `relevancy.explain(model, inputs, method=...)` for the predicted next token, text and pixels. Reported:
the best of `--repeats` of each after a warm-up, forward and explanation interleaved, the ratio, the peaks of the
calls after the warm-ups above what the process held with the model loaded (glibc told to map every allocation of
64 KiB or more on its own, `MALLOC_MMAP_THRESHOLD_`, so that freed tensors leave the resident memory at once), and the
ratio of the process's totals (model included). `NAME+checkpoint`: `checkpoint=True` (the tower's and the decoder's
inputs kept only, their layers run again by bisection in the backward, `relevancy.lrp.segments`). One CPU thread. Results: benchmarks/results/vlm_speed.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_speed import best_time, child, peak_above, resident_bytes  # noqa: E402
from machine import cpu_name, today  # noqa: E402

METHODS = ("attnlrp", "attnlrp+checkpoint", "cp_lrp", "input_x_gradient")
IMAGE_TOKEN = 32000
#: glibc maps every allocation from 64 KiB up on its own and unmaps it when freed (a fixed threshold, not glibc's
#: sliding one), so the resident memory follows the tensors alive and a warmed-up call's peak is its own
MMAP_THRESHOLD = 65536


#: Qwen2.5-VL's image: 50 x 20 patches of 14 pixels (1,000), two temporal copies, merged 2 x 2 into 250 tokens
QWEN_GRID, QWEN_IMAGE_TOKEN = (1, 50, 20), 151655


def build_qwen(tower_layers: int, decoder_layers: int) -> torch.nn.Module:
    """A random Qwen2.5-VL-7B-shaped model of reduced depth, float32, eval mode (full attention in the tower's last
    block of every eight, as the released model's `fullatt_block_indexes` 7, 15, 23, 31)."""
    import transformers

    vision = dict(depth=tower_layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[k for k in range(tower_layers) if k % 8 == 7] or [tower_layers - 1])
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=decoder_layers, num_attention_heads=28,
                num_key_value_heads=4, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=QWEN_IMAGE_TOKEN,
                                           video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_prompt() -> dict[str, torch.Tensor]:
    """`<|vision_start|>`, 250 image placeholders, `<|vision_end|>`, 24 text tokens; one random image's flattened patches."""
    generator = torch.Generator().manual_seed(1)
    count = QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2]
    ids = torch.cat([torch.tensor([151652] + [QWEN_IMAGE_TOKEN] * (count // 4) + [151653]),
                     torch.randint(2, 150000, (24,), generator=generator)])[None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_grid_thw": torch.tensor([QWEN_GRID]),
            "pixel_values": torch.randn(count, 3 * 2 * 14 * 14, generator=generator)}


def build(tower_layers: int, decoder_layers: int) -> torch.nn.Module:
    """A random LLaVA-1.5-7B-shaped model of reduced depth, float32, eval mode."""
    import transformers

    vision = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=tower_layers, num_attention_heads=16,
                                           image_size=336, patch_size=14, projection_dim=768)
    text = transformers.LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=decoder_layers,
                                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, projector_hidden_act="gelu",
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def prompt() -> dict[str, torch.Tensor]:
    """`<s>`, 576 image placeholders, 24 text tokens; one random image."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([1] + [IMAGE_TOKEN] * 576), torch.randint(2, 32000, (24,), generator=generator)])[None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(1, 3, 336, 336, generator=generator)}


#: --model -> (builder, prompt, description)
MODELS = {"llava": (build, prompt, "LLaVA-1.5-7B's widths, {t} of 24 tower layers, {d} of 32 decoder layers, random weights, "
                                   "576 image + 24 text tokens"),
          "qwen2_5_vl": (build_qwen, qwen_prompt, "Qwen2.5-VL-7B's widths, {t} of 32 tower blocks, {d} of 28 decoder layers, random "
                                                  "weights, 1,000 patches (250 image tokens) + 26 text tokens")}


def one(model_name: str, method: str, tower_layers: int, decoder_layers: int, repeats: int) -> dict:
    """Time and memory of one method (run in its own process)."""
    import relevancy

    torch.set_num_threads(1)
    builder, make_prompt, _ = MODELS[model_name]
    model, inputs = builder(tower_layers, decoder_layers), make_prompt()

    def forward() -> None:
        with torch.no_grad():
            model(**inputs, use_cache=False, logits_to_keep=1)

    name, _, option = method.partition("+")
    options = {option: True} if option else {}
    def explain() -> None:
        relevancy.explain(model, inputs, method=name, **options)

    forward(), explain()  # warm-ups: the first explanation recognises the layout once (`causal_lm.layouts.recognised`)
    base = resident_bytes()
    forward_peak, peak = peak_above(forward), peak_above(explain)
    plain, explained = float("inf"), float("inf")
    for _ in range(repeats):  # interleaved: a load that comes and goes on a shared machine hits both alike
        plain, explained = min(plain, best_time(forward, 1)), min(explained, best_time(explain, 1))
    return {"method": method, "forward_s": plain, "method_s": explained, "ratio": explained / plain,
            "base_mb": base / 2**20, "forward_peak_mb": forward_peak / 2**20, "peak_mb": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="llava")
    parser.add_argument("--tower-layers", type=int, default=4)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", metavar="METHOD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.one, args.tower_layers, args.decoder_layers, args.repeats)))
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the children's: every tensor mapped and given back when freed
    print(MODELS[args.model][2].format(t=args.tower_layers, d=args.decoder_layers) +
          f", float32, {cpu_name()}, 1 thread, best of {args.repeats}, {today()}")
    print(f"{'method':<22} {'forward s':>9} {'method s':>9} {'ratio':>6} {'fwd peak MB':>11} {'peak MB':>8} {'peak ratio':>10} {'total ratio':>11}")
    for method in args.methods:
        r = child([__file__, "--one", method, "--model", args.model, "--tower-layers", str(args.tower_layers), "--decoder-layers", str(args.decoder_layers),
                   "--repeats", str(args.repeats)])
        print(f"{r['method']:<22} {r['forward_s']:>9.3f} {r['method_s']:>9.3f} {r['ratio']:>6.2f} {r['forward_peak_mb']:>11.0f} "
              f"{r['peak_mb']:>8.0f} {r['peak_mb'] / max(r['forward_peak_mb'], 1):>10.2f} "
              f"{(r['base_mb'] + r['peak_mb']) / (r['base_mb'] + r['forward_peak_mb']):>11.2f}", flush=True)


if __name__ == "__main__":
    main()
