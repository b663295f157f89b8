"""Does AttnLRP's map shatter in a deeper vision tower? Agreement with patch occlusion and in-patch noise of the pixel
maps, per tower depth, on small random LLaVA models (the lxt authors' concern with vision-language models: gradient
shattering in the vision tower, which they remedy with a gamma rule tuned per layer).

    OMP_NUM_THREADS=1 python benchmarks/vlm_shattering.py [--depths 2 6 12] [--images 8]

Models: transformers' `LlavaForConditionalGeneration` with a 2-layer Llama decoder of width 64, the tower's
second-to-last layer's patch tokens, transformers' own random initialisation (seed 0), float64, and two kinds of tower:
a random CLIP tower of width 64 (4 heads, MLP 256) at 32 px with 4 px patches (8 x 8), `--depths` layers, on random
images; and the shipped shapes CLIP's tower (6 layers, width 96, 64 px, 8 px patches), trained and untrained, on
`--images` shapes scenes. Prompt: `<s>`, the image's placeholders, 6 text tokens; the explained token: each row's
predicted next token.
- agreement: Spearman's rank correlation, per image, between a method's patch scores and the drop of the explained
  logit when the patch's pixels are set to 0 (patch occlusion, the slow reference; 64 forwards per image), averaged;
- in-patch cancellation: `1 - sum_patches |sum of the patch's pixel scores| / sum_pixels |pixel score|`: the share of
  a map's magnitude that cancels within patches (0: every patch's pixels agree in sign; near 1: pixels alternate,
  the noise gradient shattering makes).
Then the remedy: the gamma rule (`GammaLinear`) on every Linear of the trained shapes tower, gamma 0.25, 1 and 4.
Random weights are not trained ones, and the decoder and projector here are random: the explained token means
nothing, occlusion is the only ground truth. Results: benchmarks/results/vlm_shattering.txt.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name, today  # noqa: E402

IMAGE_TOKEN, SIDE, PATCH = 95, 32, 4
METHODS = ("attnlrp", "cp_lrp", "input_x_gradient")


def build(vision: object) -> torch.nn.Module:
    """A LLaVA of the tower config `vision`, a 2-layer Llama decoder of width 64, transformers' random weights (seed 0)."""
    import transformers

    text = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2,
        vision_feature_select_strategy="default")).double().eval()


def random_tower(depth: int) -> object:
    import transformers

    return transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=depth, num_attention_heads=4,
                                         image_size=SIDE, patch_size=PATCH)


def shapes_tower(trained: bool) -> torch.nn.Module:
    """A LLaVA whose tower is the shipped shapes CLIP's (6 layers, width 96, 64 px, 8 px patches), trained or not."""
    from relevancy.worlds.shapes_clip import load_clip

    clip, _ = load_clip()
    model = build(clip.config.vision_config)
    if trained:
        tower = model.model.vision_tower
        getattr(tower, "vision_model", tower).load_state_dict(clip.vision_model.state_dict())
    return model.double().eval()


class GammaLinear(nn.Linear):
    """A Linear under LRP's gamma rule in the gradient x input form (zennit's `Gamma`: the weights `w + gamma w+` in
    the backward, the forward's value kept): `z_gamma * stop_gradient(z / z_gamma)`. The remedy the lxt authors tune
    per layer; here one gamma on every Linear of the tower, set by swapping the class of the benchmark's own modules."""

    gamma = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.detach(), None if self.bias is None else self.bias.detach()
        z = F.linear(x, w, b)
        modified = F.linear(x, w + self.gamma * w.clamp(min=0), None if b is None else b + self.gamma * b.clamp(min=0))
        modified = modified + 1e-9 * torch.where(modified >= 0, 1.0, -1.0).to(modified.dtype)
        return modified * (z / modified).detach()


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the rank correlation of `a` and `b` `(B, N)`."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def occlusion(model: torch.nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """`(B, patches)`: the explained logit's drop when each patch's pixels are set to 0 (relevancy's `token_ablation`
    of the image's patches)."""
    import relevancy

    return relevancy.explain(model, batch, method="token_ablation", target=target.tolist(), ablate="image").image_scores.flatten(1)


def cancellation(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """Per row, the share of the pixel map's magnitude that cancels within patches."""
    patches = pixels.unflatten(-1, (-1, patch)).unflatten(-3, (-1, patch)).sum((-3, -1))
    return 1 - patches.abs().flatten(1).sum(1) / pixels.abs().flatten(1).sum(1)


def batch_of(images: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """`<s>`, the image's placeholders, 6 text tokens; one row per image."""
    generator = torch.Generator().manual_seed(1)
    tokens = (images.shape[-1] // patch) ** 2
    ids = torch.cat([torch.tensor([1] + [IMAGE_TOKEN] * tokens), torch.randint(2, 90, (6,), generator=generator)])
    return {"input_ids": ids.expand(len(images), -1).clone(), "attention_mask": torch.ones(len(images), len(ids), dtype=torch.long),
            "pixel_values": images.double()}


def measure(name: str, model: torch.nn.Module, batch: dict[str, torch.Tensor], patch: int, methods: tuple[str, ...] = METHODS) -> None:
    """One line per method: agreement with patch occlusion and in-patch cancellation."""
    import relevancy

    target = relevancy.explain(model, batch, method="input_x_gradient").target
    truth = occlusion(model, batch, target)
    for method in methods:
        explanation = relevancy.explain(model, batch, method=method, target=target)
        agreement = spearman(explanation.image_scores.flatten(1), truth)
        print(f"{name:<26} {method:<18} {float(agreement.mean()):>19.2f} ± {float(agreement.std()):.2f} "
              f"{float(cancellation(explanation.pixel_scores, patch).mean()):>22.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="*", default=[2, 6, 12, 24])
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args()
    from relevancy.worlds.scenes import make_scenes

    torch.set_num_threads(1)
    print(f"small LLaVA models (2-layer random Llama decoder of width 64), float64, {args.images} images, {cpu_name()}, {today()}")
    print(f"{'tower':<26} {'method':<18} {'agreement with occlusion':>25} {'in-patch cancellation':>22}")
    noise = torch.randn(args.images, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for depth in args.depths:
        measure(f"random CLIP, {depth} layers", build(random_tower(depth)), batch_of(noise, PATCH), PATCH)
    scenes = make_scenes(args.images, seed=10**9 + 7).images
    for trained in (False, True):
        model = shapes_tower(trained)
        patch = model.config.vision_config.patch_size
        measure(f"shapes CLIP, {'trained' if trained else 'random'}", model, batch_of(scenes, patch), patch)
    linears = [module for module in model.model.vision_tower.modules() if type(module) is nn.Linear]
    for module in linears:
        module.__class__ = GammaLinear
    for gamma in (0.25, 1.0, 4.0):
        GammaLinear.gamma = gamma
        measure(f"trained, tower gamma {gamma}", model, batch_of(scenes, patch), patch, ("attnlrp", "cp_lrp"))


if __name__ == "__main__":
    main()
