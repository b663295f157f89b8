"""Make tests/golden/vlm_lxt_reference.pt: lxt's AttnLRP and CP-LRP composed over whole vision-language decoders (tiny
random LLaVA with a Llama and with a Qwen2 decoder, Gemma 3, Idefics3, PaliGemma 1 and 2, InternVL with a Qwen2 and with a
Llama decoder and with several tiles, LLaVA-NeXT, LLaVA-OneVision, Mistral 3, Pixtral-12B's LLaVA), text and pixel maps, in float64.

    /work/venvs/lxt/bin/python benchmarks/vlm_lxt_reference.py [--out tests/golden/vlm_lxt_reference.pt] [--only FAMILY ...]

`--only`: those families recorded (again) into the existing file, every other entry kept as it was recorded.

Run it in a venv with lxt (never a dependency of relevancy; see `llm_lxt_reference.py`: lxt 2.1, transformers 5.24).
lxt maps decoders only; "lxt's rules composed over the whole model" is here:
- the decoder: lxt's own map of its family (`lxt.efficient.models.llama` / `qwen2` / `gemma3`, `attnLRP` or `cp_LRP`;
  Gemma 3's also patches `Gemma3RMSNorm`, the projector's `mm_soft_emb_norm` among them); lxt 2.1 has no map of
  Gemma or Gemma 2 (PaliGemma's decoders), so its Gemma 3 map is carried over to their classes, the same patches
  (gated MLP, the norm's divisor constant, dropout, attention) on `GemmaMLP` / `Gemma2MLP`, `GemmaRMSNorm` /
  `Gemma2RMSNorm` and their modeling module (`carried_gemma3_map`; the tiny Gemma 2 has no attention soft-cap);
- the vision tower (transformers' CLIP, SigLIP, Idefics3, InternVL modules) and the projector: lxt's patches as its ViT map
  (`lxt.efficient.models.vit_torch`) and its decoder maps use them: every attention function of the tower's modeling
  module wrapped by `patch_attention` (AttnLRP: queries and keys 1/4, values 1/2) or `patch_cp_attention` (CP-LRP:
  queries and keys detached), `torch.nn.LayerNorm` by `layer_norm_forward` (the divisor constant), and the
  activation classes of the tower's MLP and the projector (QuickGELU, GELU, tanh-GELU) by `non_linear_forward`
  (the identity rule), the tower's RMSNorms (InternViT-6B's layout: its layers' norms, its query and key norms) by
  `rms_norm_forward` (the divisor constant); InternViT's layer scale, the pixel shuffle and the projector's Linears
  are plain autograd (a constant factor, reshapes, linear maps: lxt has no InternViT map, its generic rules composed
  as for the other towers). One adaptation: lxt's LayerNorm keeps its input's memory layout, and Idefics3's pixel shuffle
  views the tower's output, so the patched LayerNorm returns `.contiguous()` (the same values);
- the model (float64, eval, attention through transformers' `sdpa`: an exact float64 softmax) runs its own forward
  from `input_ids` and `pixel_values`, the token embeddings made a leaf by a hook on the embedding's output, with
  position ids counting real tokens (PaliGemma's from 1), the token types its forward takes (`vlm_models.own_types`:
  Gemma 3's 1 at the image's tokens, PaliGemma's prefix as the inputs hold it); each row's target is the
  plain model's most probable next token after its last real token; the maps are input x gradient summed over
  the width at the embeddings `(B, T)` and over the colour channels at the pixels `(B, H, W)`;
- LLaVA-NeXT and LLaVA-OneVision (`vlm_models.TILED`): LLaVA's maps (lxt's Llama map and the CLIP tower's patches;
  OneVision's: lxt's Qwen2 map and the SigLIP tower's) on the model's own forward from its tiles and `image_sizes`
  (the tiles' features unpadded, OneVision's interpolated, and laid out by the model, its newline embedding a
  parameter), the pixel map per tile `(B, tiles, H, W)`;
- Mistral 3 (`vlm_models.SIZED`): lxt 2.1 has no Mistral map, so its Llama map is carried over to the Mistral classes
  (`carried_llama_map`); the Pixtral tower's patches as the other towers' (attention, its RMSNorms), its gated MLP as
  lxt's Llama map patches one, the projector's RMSNorm by `rms_norm_forward`, the 2-D RoPE, the patch merger's unfold
  and the Linears plain autograd (`pixtral_map`); the model's own forward from its pixels and `image_sizes`;
  Pixtral-12B's LLaVA (`SIZED` too) likewise, its projector LLaVA's (the GELU's identity rule, the Linears).
- InternVL with the processor's tiles (`vlm_models.INTERN_TILED`): InternVL's maps on the model's own forward from
  every row's tiles one after the other (`pixel_values` `(B * tiles, 3, H, W)`; `image_sizes`, which only relevancy
  reads, not given to it), the pixel map per tile `(B, tiles, H, W)`.
Inputs: `tests/vlm_models.py`'s two rows padded right and left, and each row alone. The file holds the models'
checksums (not their weights), the inputs, the targets and the maps; padded rows equal single ones to 1e-10 (checked).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from llm_lxt_reference import last_real, lxt_applied, lxt_models, positions, write_golden  # noqa: E402
from vlm_models import FAMILIES, INTERN_TILED, PREFIX_FAMILIES, SIZED, TILED, alone, build, checksum, embedding_leaf, inputs, own_types  # noqa: E402

#: family -> (lxt's decoder map module, the tower's transformers modeling module)
MAPS = {"llava": ("llama", "clip"), "llava_full": ("qwen2", "clip"), "gemma3": ("gemma3", "siglip"), "idefics3": ("llama", "idefics3"),
        "paligemma": ("gemma", "siglip"), "paligemma2": ("gemma2", "siglip"), "internvl": ("qwen2", "internvl"),
        "internvl_rms": ("llama", "internvl"), "llava_next": ("llama", "clip"), "llava_onevision": ("qwen2", "siglip"),
        "mistral3": ("mistral", "pixtral"), "pixtral": ("mistral", "pixtral"), "internvl_tiles": ("qwen2", "internvl")}
VARIANTS = {"attnLRP": "attnlrp", "cp_LRP": "cp_lrp"}


def carried_gemma3_map(decoder: str, variant: str) -> dict:
    """lxt's Gemma 3 patch map (`variant`) on the classes of transformers' `decoder` module ("gemma" or "gemma2"), each
    Gemma 3 class's patch on its namesake, the attention patch on the module."""
    gemma3 = getattr(lxt_models("gemma3"), variant)
    module = importlib.import_module(f"transformers.models.{decoder}.modeling_{decoder}")
    prefix = "Gemma" if decoder == "gemma" else "Gemma2"
    return {module if not isinstance(target, type) else getattr(module, target.__name__.replace("Gemma3", prefix))
            if target.__name__.startswith("Gemma3") else target: patch for target, patch in gemma3.items()}


def carried_llama_map(variant: str) -> dict:
    """lxt's Llama patch map (`variant`) on transformers' Mistral classes (a Llama decoder by another name: gated MLP,
    RMSNorm, attention), each Llama class's patch on its namesake, the attention patch on the module."""
    from transformers.models.mistral import modeling_mistral

    return {modeling_mistral if not isinstance(target, type) else getattr(modeling_mistral, target.__name__.replace("Llama", "Mistral"))
            if target.__name__.startswith("Llama") else target: patch for target, patch in getattr(lxt_models("llama"), variant).items()}


def decoder_map(decoder: str, variant: str) -> dict:
    """lxt's patch map of the decoder's family, or its Gemma 3 map carried over (Gemma, Gemma 2: no map in lxt 2.1),
    or its Llama map (Mistral: none in lxt 2.1)."""
    if decoder == "mistral":
        return carried_llama_map(variant)
    return carried_gemma3_map(decoder, variant) if decoder in ("gemma", "gemma2") else getattr(lxt_models(decoder), variant)


def pixtral_map(family: str, variant: str) -> dict:
    """The Pixtral tower beyond `tower_map`'s patches: its gated MLP as lxt's Llama map patches a gated MLP; Mistral
    3's projector's RMSNorm by `rms_norm_forward` (the divisor constant; Pixtral-12B's LLaVA projector has none)."""
    lxt_models("llama")
    from lxt.efficient.patches import cp_gated_mlp_forward, gated_mlp_forward, patch_method, rms_norm_forward
    from transformers.models.mistral3.modeling_mistral3 import Mistral3RMSNorm
    from transformers.models.pixtral.modeling_pixtral import PixtralMLP

    mlp = {PixtralMLP: partial(patch_method, gated_mlp_forward if variant == "attnLRP" else cp_gated_mlp_forward)}
    return {**mlp, Mistral3RMSNorm: partial(patch_method, rms_norm_forward)} if family == "mistral3" else mlp


def tower_map(variant: str, tower_module: object | None = None) -> dict:
    """lxt's patches for the tower and projector: attention, LayerNorm, the RMSNorms of the tower's modeling module
    (where given), the activations (identity rule)."""
    lxt_models("llama")  # lxt.efficient entered as a bare namespace (see there)
    from lxt.efficient.patches import layer_norm_forward, non_linear_forward, patch_attention, patch_cp_attention, patch_method, rms_norm_forward
    from transformers import activations

    def contiguous_layer_norm(self, x):
        return layer_norm_forward(self, x).contiguous()

    rms_norms = [cls for name, cls in vars(tower_module).items() if isinstance(cls, type) and name.endswith("RMSNorm")
                 and cls.__module__ == tower_module.__name__] if tower_module is not None else []
    gelus = {activations.QuickGELUActivation, activations.GELUActivation, type(activations.ACT2FN["gelu_pytorch_tanh"])}
    def cp_attention(module) -> bool:
        """lxt's CP-LRP patch wraps transformers' one shared ALL_ATTENTION_FUNCTIONS in place, so after the decoder's
        patch the tower's sdpa is wrapped already (lxt then says it failed); the tower's own eager function is
        wrapped before that check."""
        patch_cp_attention(module)
        return module.eager_attention_forward.__module__ == patch_cp_attention.__module__

    return {"attention": patch_attention if variant == "attnLRP" else cp_attention,
            torch.nn.LayerNorm: partial(patch_method, contiguous_layer_norm),
            **{cls: partial(patch_method, rms_norm_forward) for cls in rms_norms},
            **{cls: partial(patch_method, non_linear_forward, keep_original=True) for cls in gelus}}


def batches(family: str, inputs: Callable = inputs, alone: Callable = alone) -> dict[str, dict[str, torch.Tensor]]:
    """The two rows padded right and left, and each alone (`inputs`, `alone`: the family's test models')."""
    out = {side: inputs(family, side) for side in ("right", "left")}
    return {**out, **{f"single{row}": alone(out["right"], row) for row in range(2)}}


def recorded(family: str, variant: str, data: dict[str, dict], maps: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The maps `{batch name: (text, image)}` as the reference records them, each padded row checked equal to its
    row alone to 1e-10 of the map's maximum (the image map's row dimension first)."""
    for row in range(2):
        text, image = maps[f"single{row}"]
        for side in ("right", "left"):
            padded_text, padded_image = maps[side][0][row], maps[side][1][row]
            keep = data[side]["attention_mask"][row].bool()
            scale = max(float(text.abs().max()), float(image.abs().max()))
            gap = max(float((padded_text[keep] - text[0]).abs().max()), float((padded_image - image[0]).abs().max())) / scale
            assert gap < 1e-10, f"{family} {variant} row {row} {side}: padded differs from single by {gap:.1e}"
    entry = {name: {"text": text, "image": image} for name, (text, image) in maps.items()}
    print(f"{family} {variant}: text maxima {[round(float(m['text'].abs().max()), 4) for m in entry.values()]}, "
          f"image maxima {[round(float(m['image'].abs().max()), 4) for m in entry.values()]}")
    return entry


def run(model: torch.nn.Module, family: str, batch: dict[str, torch.Tensor], target: torch.Tensor | None):
    """`(logits at each row's last real token, text map (B, T), pixel map (B, H, W); LLaVA-NeXT's (B, tiles, H, W))`;
    with `target` None no backward."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pixels = batch["pixel_values"].clone().requires_grad_(True)
    first = int(family in PREFIX_FAMILIES)  # PaliGemma counts positions from 1
    sizes = {"image_sizes": batch["image_sizes"]} if family in TILED or family in SIZED else {}
    with embedding_leaf(model) as leaf:
        logits = model(input_ids=ids, pixel_values=pixels, attention_mask=mask, position_ids=positions(mask) + first, use_cache=False,
                       **own_types(family, ids, batch), **sizes).logits
    logits = logits[torch.arange(len(ids)), last_real(mask)]
    if target is None:
        return logits.detach(), None, None
    logits.gather(1, target[:, None]).sum().backward()
    text = (leaf["text"] * leaf["text"].grad).sum(-1).detach()
    image = (pixels * pixels.grad).detach()
    if family in INTERN_TILED:  # the rows' tiles one after the other: (B, tiles, H, W)
        return logits.detach(), text, image.sum(-3).unflatten(0, (len(ids), -1))
    return logits.detach(), text, image.sum(-3) if family in TILED else image.flatten(1, -3).sum(1)


def out_path(doc: str, name: str, only: bool = False) -> Path | tuple[Path, list[str]]:
    """The `--out` argument of a reference script (default `tests/golden/<name>`); with `only`, also its `--only`
    families (none: every family)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden" / name)
    if only:
        parser.add_argument("--only", nargs="+", choices=[*FAMILIES, *TILED, *SIZED, *INTERN_TILED], default=[])
    args = parser.parse_args()
    return (args.out, args.only) if only else args.out


def sdpa_models(families: dict, build: Callable) -> Iterator[tuple[str, torch.nn.Module]]:
    """Each family's tiny model, every config's attention transformers' `sdpa` (an exact float64 softmax)."""
    for family in families:
        model = build(family)
        for config in (model.config, model.config.get_text_config(), model.config.vision_config):
            config._attn_implementation = "sdpa"
        yield family, model


def main() -> None:
    out, only = out_path(__doc__, "vlm_lxt_reference.pt", only=True)
    import transformers

    golden: dict = torch.load(out, weights_only=False) if only else {"transformers": transformers.__version__, "models": {}}
    for family, model in sdpa_models(only or {**FAMILIES, **TILED, **SIZED, **INTERN_TILED}, build):
        decoder, tower = MAPS[family]
        decoder_module = importlib.import_module(f"transformers.models.{decoder}.modeling_{decoder}")
        tower_module = importlib.import_module(f"transformers.models.{tower}.modeling_{tower}")
        data = batches(family)
        entry = {"checksum": checksum(model), "inputs": data,
                 "targets": {name: run(model, family, batch, None)[0].argmax(-1) for name, batch in data.items()}}
        for variant, key in VARIANTS.items():
            patches = {**tower_map(variant, tower_module), **(pixtral_map(family, variant) if family in SIZED else {})}
            attention = patches.pop("attention")
            with ExitStack() as stack:
                stack.enter_context(lxt_applied(decoder_module, decoder_map(decoder, variant)))
                stack.enter_context(lxt_applied(tower_module, {tower_module: attention, **patches}))
                maps = {name: run(model, family, batch, entry["targets"][name])[1:] for name, batch in data.items()}
            entry[key] = recorded(family, variant, data, maps)
        golden["models"][family] = entry
    write_golden(golden, out)


if __name__ == "__main__":
    main()
