"""Make tests/golden/encoder_lxt_reference.pt: lxt's AttnLRP and CP-LRP maps on tiny random encoders, in float64: a
BERT classifier, a DINOv2 classifier and torchvision's VisionTransformer.

    /tmp/lxtenv/bin/python benchmarks/encoder_lxt_reference.py [--out tests/golden/encoder_lxt_reference.pt]

Run it in a venv with lxt 2.1 (never a dependency of relevancy; see `llm_lxt_reference.py`), transformers 5.24.
- torchvision's ViT: lxt's own map `lxt.efficient.models.vit_torch.cp_LRP` (the identity rule on GELU and
  LayerNorm, queries and keys of `nn.MultiheadAttention` detached); lxt has no AttnLRP map of it.
- BERT and DINOv2: lxt 2.1's BERT module is a copy of transformers 4's modeling file, which transformers 5 cannot
  import, and lxt has no DINOv2 map; so lxt's patches are composed as its maps use them (as for the vision towers in
  `vlm_lxt_reference.py`): the modeling module's attention function wrapped by `patch_attention` (AttnLRP: queries
  and keys 1/4, values 1/2) or `patch_cp_attention` (CP-LRP: queries and keys detached), `torch.nn.LayerNorm` by
  `layer_norm_forward` (the divisor constant) and the activations (BERT's GELU and its pooler's tanh, as lxt's own
  BERT map; DINOv2's GELU) by `non_linear_forward` (the identity rule). Attention runs through `sdpa` (an exact
  float64 softmax).
- CLIP (transformers' `CLIPModel`, QuickGELU in the image tower, GELU in the text tower): lxt's patches of its
  modeling module as for BERT and DINOv2, and the pair logit `exp(logit_scale) * <u / |u|, v / |v|>` of image i
  with text i composed from lxt's rules, as lxt has no map of it: each L2 norm under `stop_gradient` (the divisor
  constant, as `layer_norm_forward`) and each unit vector under `divide_gradient(., 2)` (the uniform rule on a
  product of two inputs); the features are the model's `get_image_features` / `get_text_features`.
Each map is input x gradient of the target's logit (the plain model's most likely class; CLIP: the pair logit) at
the embeddings, summed over the width: BERT's and CLIP's text tower's token embeddings `(B, T)`, the patch
embeddings' tokens `(B, N)` of the images. Inputs: two rows (BERT's and CLIP's texts padded right) and each alone.
The file holds the models' configs (CLIP's) and weights, the inputs, targets and maps (CLIP's: `image`, `text`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from clip_leaves import clip_embedding_maps  # noqa: E402
from llm_lxt_reference import lxt_applied, lxt_models, restore_class_attributes, write_golden  # noqa: E402
from vlm_lxt_reference import tower_map  # noqa: E402

VARIANTS = {"attnLRP": "attnlrp", "cp_LRP": "cp_lrp"}
BERT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=40, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DINOV2 = dict(image_size=28, patch_size=14, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
              num_labels=5, layerscale_value=0.5)
TORCHVISION_VIT = dict(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5)
CLIP = dict(projection_dim=16,
            vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, hidden_act="quick_gelu", attention_dropout=0.0),
            text_config=dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=12, hidden_act="gelu", attention_dropout=0.0, pad_token_id=0,
                             bos_token_id=58, eos_token_id=59))


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn at random (LayerNorms and biases too: a default 1 / 0 hides rule mistakes)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    return model.double().eval()


def build(name: str) -> torch.nn.Module:
    """The tiny float64 model `name` ("bert", "dinov2", "torchvision_vit", "clip") with its fixed random weights."""
    torch.manual_seed(7)
    if name == "bert":
        import transformers

        return _randomised(transformers.BertForSequenceClassification(transformers.BertConfig(**BERT)))
    if name == "dinov2":
        import transformers

        return _randomised(transformers.Dinov2ForImageClassification(transformers.Dinov2Config(**DINOV2)))
    if name == "clip":
        import transformers

        return _randomised(transformers.CLIPModel(transformers.CLIPConfig(**CLIP)))
    from torchvision.models.vision_transformer import VisionTransformer

    return _randomised(VisionTransformer(**TORCHVISION_VIT))


def inputs(name: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two rows ("batch"; BERT's second padded right) and each alone ("single0", "single1")."""
    generator = torch.Generator().manual_seed(3)
    if name in ("bert", "clip"):
        vocab = BERT["vocab_size"] if name == "bert" else CLIP["text_config"]["bos_token_id"]
        ids = torch.randint(3, vocab, (2, 9), generator=generator)
        if name == "clip":  # begin- and end-of-text tokens, the second row's end at 5
            ids[:, 0], ids[0, 8], ids[1, 5] = CLIP["text_config"]["bos_token_id"], *[CLIP["text_config"]["eos_token_id"]] * 2
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        ids[1, 6:] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        alone = [{"input_ids": ids[r:r + 1, :int(mask[r].sum())], "attention_mask": mask[r:r + 1, :int(mask[r].sum())]} for r in range(2)]
        if name == "clip":  # image r with text r
            pixels = torch.randn(2, 3, 32, 32, generator=generator, dtype=torch.float64)
            batch["pixel_values"] = pixels
            alone = [{**row, "pixel_values": pixels[r:r + 1]} for r, row in enumerate(alone)]
    else:
        side = DINOV2["image_size"] if name == "dinov2" else TORCHVISION_VIT["image_size"]
        batch = {"pixel_values": torch.randn(2, 3, side, side, generator=generator, dtype=torch.float64)}
        alone = [{"pixel_values": batch["pixel_values"][r:r + 1]} for r in range(2)]
    return {"batch": batch, **{f"single{r}": row for r, row in enumerate(alone)}}


def leaf_module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Where the map is read: BERT's word embeddings, DINOv2's patch embeddings, torchvision's patch convolution."""
    if name == "bert":
        return model.bert.embeddings.word_embeddings
    if name == "dinov2":
        return model.dinov2.embeddings.patch_embeddings
    return model.conv_proj


def run(model: torch.nn.Module, name: str, batch: dict[str, torch.Tensor], target: torch.Tensor | None):
    """`(logits, map (B, N))`; with `target` None no backward."""
    leaf = {}

    def hook(_module, _args, output):
        leaf["x"] = output.detach().requires_grad_(True)
        return leaf["x"]

    handle = leaf_module(model, name).register_forward_hook(hook)
    try:
        logits = model(batch["pixel_values"]) if name == "torchvision_vit" else model(**batch).logits
    finally:
        handle.remove()
    if target is None:
        return logits.detach(), None
    logits.gather(1, target[:, None]).sum().backward()
    relevance = leaf["x"] * leaf["x"].grad
    return logits.detach(), (relevance.sum(1) if name == "torchvision_vit" else relevance.sum(-1)).flatten(1).detach()


def run_clip(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`(pair logits (B,), maps {"image": (B, N), "text": (B, T)})` of image r with text r, the similarity under
    lxt's rules (the modeling module's own patched by the caller)."""
    from lxt.efficient.rules import divide_gradient, stop_gradient

    def similarity() -> torch.Tensor:
        image = model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
        text = model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).pooler_output
        units = [divide_gradient(f / stop_gradient(f.norm(dim=-1, keepdim=True)), 2) for f in (image, text)]
        return model.logit_scale.exp() * (units[0] * units[1]).sum(-1)

    return clip_embedding_maps(model, similarity)


def clip_entry() -> dict:
    """CLIP's entry: config, weights, inputs, and per variant and input the maps of both towers (checked: the
    composed logits are the model's own, a padded row equals its text alone)."""
    model = build("clip")
    for config in (model.config, model.config.vision_config, model.config.text_config):
        config._attn_implementation = "sdpa"
    data = inputs("clip")
    entry = {"config": CLIP, "state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "inputs": data}
    for variant, key in VARIANTS.items():
        with patched("clip", variant):
            found = {part: run_clip(model, batch) for part, batch in data.items()}
        for part, batch in data.items():
            own = model(**batch).logits_per_image.diagonal().detach()
            assert torch.allclose(found[part][0], own, rtol=1e-12, atol=0), f"clip {variant} {part}: logits differ"
        maps = {part: tower_maps for part, (_, tower_maps) in found.items()}
        for row in range(2):
            for tower, single in maps[f"single{row}"].items():
                single = single[0]
                gap = float((maps["batch"][tower][row, :len(single)] - single).abs().max() / single.abs().max())
                assert gap < 1e-10, f"clip {variant} {tower} row {row}: batched differs from single by {gap:.1e}"
        entry[key] = maps
        print(f"clip {variant}: maxima {[round(float(m.abs().max()), 4) for part in maps.values() for m in part.values()]}")
    return entry


@contextmanager
def classes_patched(patch_map: dict) -> Iterator[None]:
    """lxt's patches of classes (`patch_method` on each key) applied, and every patched class's forward given back."""
    saved = {cls: {key: cls.__dict__.get(key) for key in ("forward", "original_forward")} for cls in patch_map}
    try:
        for cls, patch in patch_map.items():
            patch(cls)
        yield
    finally:
        restore_class_attributes(saved)


def patched(name: str, variant: str) -> ExitStack:
    """lxt's rules for model `name` under `variant` ("attnLRP", "cp_LRP"), applied for the `with` block; transformers'
    models: its modeling module's attention, LayerNorm and activations."""
    stack = ExitStack()
    if name == "torchvision_vit":
        stack.enter_context(classes_patched(lxt_models("vit_torch").cp_LRP))
        return stack
    patches = tower_map(variant)  # lxt.efficient entered as a bare namespace there
    from lxt.efficient.patches import non_linear_forward, patch_method

    attention = patches.pop("attention")
    if name == "bert":  # the pooler's tanh, as lxt's own BERT map
        patches[torch.nn.Tanh] = partial(patch_method, non_linear_forward, keep_original=True)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    stack.enter_context(lxt_applied(module, {module: attention, **patches}))
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden/encoder_lxt_reference.pt")
    args = parser.parse_args()
    import transformers

    golden: dict = {"transformers": transformers.__version__, "models": {}}
    for name in ("bert", "dinov2", "torchvision_vit"):
        model = build(name)
        if name != "torchvision_vit":
            model.config._attn_implementation = "sdpa"
        data = inputs(name)
        entry = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "inputs": data,
                 "targets": {key: run(model, name, batch, None)[0].argmax(-1) for key, batch in data.items()}}
        variants = {"cp_LRP": "cp_lrp"} if name == "torchvision_vit" else VARIANTS
        for variant, key in variants.items():
            with patched(name, variant):
                maps = {part: run(model, name, batch, entry["targets"][part])[1] for part, batch in data.items()}
            for row in range(2):
                single = maps[f"single{row}"][0]
                gap = float((maps["batch"][row, :len(single)] - single).abs().max() / single.abs().max())
                assert gap < 1e-10, f"{name} {variant} row {row}: batched differs from single by {gap:.1e}"
            entry[key] = maps
            print(f"{name} {variant}: maxima {[round(float(m.abs().max()), 4) for m in maps.values()]}")
        golden["models"][name] = entry
    golden["models"]["clip"] = clip_entry()
    write_golden(golden, args.out)


if __name__ == "__main__":
    main()
