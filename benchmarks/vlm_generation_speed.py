"""Cost of explaining a vision-language decoder's whole generation: `explain_generation(..., image=...)`'s one
forward and batched backward passes (to the token embeddings and the pixels together) against G separate `explain`
calls, one per generated token on its prefix, text and image.

    OMP_NUM_THREADS=1 python benchmarks/vlm_generation_speed.py [--new-tokens 4 8] [--method attnlrp] [--repeats 2]

The model: a random LLaVA of reduced size (a CLIP tower at 224 px, 14 px patches: 256 image tokens, width 384, 4
layers; a Llama decoder of width 512, 4 layers, vocabulary 32064), float32, one CPU thread, through a processor
stand-in that gives `<s>`, the 256 placeholders and 12 text tokens with one random image. The separate calls are timed
on the tokens the generation produced, so that both explain the same G rows (checked equal to 1e-4 of each row's
largest value, text and image); the greedy decoding is timed alone too. Reported: the best of `--repeats` after a
warm-up. Results: benchmarks/results/vlm_generation_speed.txt.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generation_speed import best_time  # noqa: E402
from machine import cpu_name, today  # noqa: E402

import relevancy  # noqa: E402
from relevancy.generation import decode  # noqa: E402

IMAGE_TOKEN = 32000
SIDE, PATCH = 224, 14


def build() -> torch.nn.Module:
    """The reduced random LLaVA, float32, eval mode."""
    import transformers

    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=6,
                                           image_size=SIDE, patch_size=PATCH)
    text = transformers.LlamaConfig(vocab_size=32064, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, projector_hidden_act="gelu",
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


class Prompt:
    """A processor stand-in: `<s>`, the image's placeholders and 12 random text tokens, one random image (what
    `explain_generation` reads from a processor: its output, `image_token`, the image processor's normalisation)."""

    image_token = "<image>"
    image_processor = type("ImageProcessor", (), {"image_mean": [0.5] * 3, "image_std": [0.5] * 3})()

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        ids = torch.cat([torch.tensor([1] + [IMAGE_TOKEN] * (SIDE // PATCH) ** 2), torch.randint(2, 32000, (12,), generator=generator)])
        self.inputs = {"input_ids": ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                       "pixel_values": torch.randn(1, 3, SIDE, SIDE, generator=generator)}
        self.tokenizer = self
        self.picture = self.inputs["pixel_values"][0]  # the image given (the stand-in answers its own output)

    def __call__(self, images: object, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return dict(self.inputs)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--method", default="attnlrp")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, processor = build(), Prompt()
    inputs = processor.inputs
    start = inputs["input_ids"].shape[1]
    print(f"# {today()}, {cpu_name()}, 1 thread, random LLaVA (CLIP 224 px / 14: 256 image tokens, width 384, 4 layers; "
          f"Llama width 512, 4 layers) float32, method {args.method}, prompt {start} tokens, best of {args.repeats}")
    print("new tokens | generated | decoding s | explain_generation s | G explain calls s | ratio")
    for new in args.new_tokens:
        decoding, _ = best_time(lambda: decode(model, inputs["input_ids"], inputs["attention_mask"], new, set(), {},
                                               {"pixel_values": inputs["pixel_values"]}), args.repeats)
        together, result = best_time(lambda: relevancy.explain_generation(model, processor, "-", new, args.method, image=processor.picture),
                                     args.repeats)
        ids = torch.cat([inputs["input_ids"][0], result.generated_ids])

        def separately() -> list:
            return [relevancy.explain(model, {"input_ids": ids[None, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long),
                                              "pixel_values": inputs["pixel_values"]}, method=args.method, target=int(ids[start + g]))
                    for g in range(len(result.generated_ids))]

        apart, rows = best_time(separately, args.repeats)
        for g, row in enumerate(rows):
            for mine, theirs in ((result.scores[g, :start + g], row.scores[0]), (result.image_scores[g], row.image_scores[0])):
                error = (mine - theirs).abs().max() / theirs.abs().max()
                assert error < 1e-4, f"row {g} differs by {error:.3g} of its maximum"
        print(f"{new} | {len(result.generated_ids)} | {decoding:.2f} | {together:.2f} | {apart:.2f} | {apart / together:.2f}")


if __name__ == "__main__":
    main()
