"""Where a transformers vision-language decoder (`...ForConditionalGeneration`) keeps its vision tower, projector and
decoder, and what each part of the tower and projector must be.

The decoder is recognised by `causal_lm.layouts` itself, on a view of the decoder (`DecoderView`: the bare decoder,
its head and its text config, the shape a `...ForCausalLM` has), so a LLaVA with a Llama, Mistral or Qwen2 decoder,
Gemma 3 and Idefics3 / SmolVLM get the decoder layouts' checks and rule forwards unchanged. The tower's encoder layers
are checked with the same parts (a LayerNorm, self-attention, an MLP `fc2(act(fc1(x)))`) and run the same rules:
norms with a constant divisor, the identity rule on the activation; attention is switched through the configs.
Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's tower (`QwenVisionLayout`: blocks with a fused-`qkv` attention, the 2 x 2
patch merger as the projector; Qwen3-VL's DeepStack mergers beside it) is checked with the same parts; its images are
of any size (`patch_pixels`, `blocks_on_patches`). PaliGemma 1 and 2
(SigLIP, one Linear, a Gemma or Gemma 2 decoder) differ by their token types (a bidirectional prefix) and position ids
counted from 1 (`token_types`, `first_position`). InternVL's tower, InternViT, has layers of its own parts (`layers`,
`layer`, `residual`: the layer scale a constant factor on each branch, query and key norms where configured), its
projector a LayerNorm before LLaVA's MLP over the pixel-shuffled tokens.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..base import UnsupportedModelError
from ...lrp.engine import Session
from ..causal_lm.layouts import (
    GATED_MLP, LAYER_NORM, ONE_PLUS_RMS_NORM, RMS_NORM, Part, Residual, RuleForward, fits_attention, fits_plain_mlp, layer_misfit,
    plain_mlp, rule_forwards,
)

VISION_ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, out_proj", fits_attention("q_proj", "k_proj", "v_proj", "out_proj"),
                        owns=("q_proj", "k_proj", "v_proj", "out_proj"))
VISION_MLP = Part("an MLP fc2(act(fc1(x)))", fits_plain_mlp("fc1", "fc2", "activation_fn"), plain_mlp("fc1", "fc2", "activation_fn"))
#: an encoder layer of CLIP's, SigLIP's and Idefics3's vision transformers
TOWER_LAYER = (("layer_norm1", (LAYER_NORM,)), ("self_attn", (VISION_ATTENTION,)), ("layer_norm2", (LAYER_NORM,)), ("mlp", (VISION_MLP,)))
#: the tower's norms outside its layers (those it has)
TOWER_NORMS = ("pre_layrnorm", "post_layernorm")
#: the tower's encoder layer: `x + attn(layer_norm1(x))`, then `x + mlp(layer_norm2(x))` (CLIP's, SigLIP's)
TOWER_RESIDUAL = Residual("self_attn", "mlp", before_attention="layer_norm1", before_mlp="layer_norm2")


def _fits_projector(module: nn.Module, width: int) -> bool:
    """LLaVA's projector `linear_2(act(linear_1(x)))` from the tower's width (or several layers' side by side)."""
    first, second = getattr(module, "linear_1", None), getattr(module, "linear_2", None)
    return (isinstance(first, nn.Linear) and isinstance(second, nn.Linear) and first.in_features % width == 0
            and second.in_features == first.out_features and callable(getattr(module, "act", None)))


LLAVA_PROJECTOR = Part("LLaVA's projector linear_2(act(linear_1(x)))", _fits_projector, plain_mlp("linear_1", "linear_2", "act"))


def _fits_normed_projector(module: nn.Module, width: int) -> bool:
    """InternVL's projector `linear_2(act(linear_1(layer_norm(x))))` over k x k tower tokens side by side."""
    norm = getattr(module, "layer_norm", None)
    return (_fits_projector(module, width) and isinstance(norm, nn.Module)
            and LAYER_NORM.fits(norm, module.linear_1.in_features))


def _normed_projector(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """InternVL's projector as the model computes it: its LayerNorm (its own rule forward), then LLaVA's MLP."""
    mlp = plain_mlp("linear_1", "linear_2", "act")(module, session)
    return lambda x: mlp(module.layer_norm(x))


#: InternVL's projector; its LayerNorm, over the pixel-shuffled tokens' width, a part of its own
NORMED_PROJECTOR = Part("InternVL's projector linear_2(act(linear_1(layer_norm(x))))", _fits_normed_projector, _normed_projector)
SHUFFLED_LAYER_NORM = Part("a LayerNorm over k x k tower tokens side by side",
                           lambda module, width: isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1
                           and module.normalized_shape[0] % width == 0 and LAYER_NORM.fits(module, module.normalized_shape[0]),
                           LAYER_NORM.forward)
#: InternViT's attention: q_proj, k_proj, v_proj, projection_layer (its query and key norms parts of their own)
INTERNVIT_ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, projection_layer",
                           fits_attention("q_proj", "k_proj", "v_proj", "projection_layer"), owns=("q_proj", "k_proj", "v_proj", "projection_layer"))
#: a query or key norm that is not there (InternViT's `nn.Identity` where `use_qk_norm` is off)
NO_NORM = Part("nn.Identity", lambda module, width: isinstance(module, nn.Identity), owns=())
#: InternViT's layer scale: `lambda_1`, `lambda_2`, a constant factor of the width on each branch (`INTERNVIT_RESIDUAL`)
LAYER_SCALE = Part("a layer scale lambda_1, lambda_2 of the width", lambda module, width: all(
    isinstance(getattr(module, name, None), nn.Parameter) and tuple(getattr(module, name).shape) == (width,) for name in ("lambda_1", "lambda_2")),
    owns=("lambda_1", "lambda_2"))
INTERNVIT_NORMS = (LAYER_NORM, RMS_NORM)  # `norm_type`: layer_norm (InternViT-300M) or rms_norm (InternViT-6B)
INTERNVIT_LAYER = (("layernorm_before", INTERNVIT_NORMS), ("attention", (INTERNVIT_ATTENTION,)), ("attention.q_norm", (RMS_NORM, NO_NORM)),
                   ("attention.k_norm", (RMS_NORM, NO_NORM)), ("layernorm_after", INTERNVIT_NORMS), ("mlp", (VISION_MLP,)), ("", (LAYER_SCALE,)))
INTERNVIT_RESIDUAL = Residual("attention", "mlp", before_attention="layernorm_before", before_mlp="layernorm_after",
                              branch_scale=("lambda_1", "lambda_2"))
#: PaliGemma's projector: one Linear from the tower's width (the decoder map's Linear rule)
TOWER_LINEAR = Part("a Linear from the tower's width", lambda module, width: isinstance(module, nn.Linear) and module.in_features == width)


@dataclass(frozen=True)
class ImageSpan:
    """Which tokens around and among an image's placeholders are the image's own: `before` tokens right before the
    first placeholder (Qwen2-VL's vision start, Gemma 3's begin of image, InternVL's `<img>`), `after` right after the
    last (their ends, Mistral 3's `[IMG_END]`), and with `inside` every other token between the first and the last
    (Mistral 3's `[IMG_BREAK]` after each row of placeholders). Known by their place, as the processor writes them
    (InternVL's and Mistral 3's configs name no id for them); `named`: the config's ids of the tokens before and
    after where it names them, which alone are the image's there (Qwen2-VL's processor writes the placeholders
    only, its chat template the tokens around them). They delimit the image and are no words of the text."""

    before: int = 0
    inside: bool = False
    after: int = 0
    named: tuple[str, ...] = ()

    def delimiters(self, ids: torch.Tensor, image: torch.Tensor, config: Any) -> torch.Tensor:
        """The image's own tokens other than its placeholders `(N,)` (bool) in one sequence of tokens `ids` `(N,)`
        whose placeholders are `image` `(N,)` (bool), of a model of `config`; none where it holds no placeholder."""
        found = torch.zeros_like(image)
        where = image.nonzero()[:, 0]
        if not len(where):
            return found
        first, last = int(where[0]), int(where[-1])
        found[max(first - self.before, 0):first] = True
        found[last + 1:last + 1 + self.after] = True
        if self.inside:
            found[first:last] = ~image[first:last]
        if self.named:
            known = [int(value) for name in self.named if (value := getattr(config, name, None)) is not None]
            found &= torch.isin(ids, torch.tensor(known, dtype=ids.dtype, device=ids.device))
        return found


#: Qwen2-VL's vision start and end, where the prompt holds them; Gemma 3's begin and end of image
QWEN_SPAN = ImageSpan(before=1, after=1, named=("vision_start_token_id", "vision_end_token_id"))
GEMMA3_SPAN = ImageSpan(before=1, after=1, named=("boi_token_index", "eoi_token_index"))


@dataclass(frozen=True)
class VisionLanguageLayout:
    """One vision-language layout: the classes it maps, the attribute of the tower, of the projector and of the
    bare decoder on the model's inner `model`, and the projector's ruled parts (path on the projector, "" for itself; the other
    operations of a projector, Gemma 3's average pooling and matrix product, Idefics3's pixel shuffle and Linear,
    are linear and need none)."""

    name: str
    classes: tuple[str, ...]
    tower: str
    projector: str
    decoder: str
    #: how many tokens one image takes in the decoder, from the model's config and the tower's prefix tokens (None:
    #: it depends on the image's size, Qwen2-VL's `image_grid_thw`)
    image_tokens: Callable[[Any, int], int] | None
    projector_parts: tuple[tuple[str, Part], ...] = ()
    #: the `token_type_ids` the model's own forward reads: "images" 1 at the image's placeholders, made again from
    #: them (Gemma 3: each image's tokens attend to each other); "prefix" the processor's, 0 on the prefix (image and
    #: prompt, attending to each other both ways) and 1 after it (causal; PaliGemma), all 0 where none are given;
    #: None: none
    token_types: str | None = None
    #: the position id of a row's first real token (PaliGemma counts from 1)
    first_position: int = 0
    #: what `explain_generation` puts between the image's token and a text prompt that does not hold it (PaliGemma's
    #: processor puts its BOS there itself: nothing)
    image_separator: str = "\n"
    #: the tower's layers (their path on the vision transformer), each of the `layer` parts, their residual adds
    #: (whose attention the tower's attention sites are) and the tower's norms outside them (those it has)
    layers: str = "encoder.layers"
    layer: tuple[tuple[str, tuple[Part, ...]], ...] = TOWER_LAYER
    residual: Residual = TOWER_RESIDUAL
    norms: tuple[str, ...] = TOWER_NORMS
    #: what the tower's norms outside its layers must be (Pixtral's `ln_pre` an RMSNorm)
    norm: Part = LAYER_NORM
    #: whether the projector reads the config's `vision_feature_layer` (the others the tower's last layer)
    feature_layer: bool = False
    #: the processor's setting that gives one image per row, named where `pixel_values` hold more
    one_image: str = ""
    #: the tokens the processor writes around and among the image's placeholders (none: LLaVA's, PaliGemma's)
    image_span: ImageSpan = ImageSpan()
    #: the vision config's `model_type` this layout maps among its classes' (None: any; Pixtral-12B's LLaVA class
    #: with a Pixtral tower is a layout of its own, `PIXTRAL`)
    tower_type: str | None = None

    def transformer(self, model: nn.Module) -> nn.Module:
        """The vision transformer of the tower (`vision_model` inside a `...VisionModel`, else the tower)."""
        tower = getattr(model.model, self.tower)
        return getattr(tower, "vision_model", tower)

    def tower_prefix(self, model: nn.Module) -> int:
        """The tower's tokens before its patch tokens: CLIP's [CLS] (counted in its `num_positions`), InternViT's
        `cls_token`; none for SigLIP and Pixtral (no `embeddings`)."""
        embeddings = getattr(self.transformer(model), "embeddings", None)
        positions = getattr(embeddings, "num_positions", None)
        if positions is None:
            return int(isinstance(getattr(embeddings, "cls_token", None), nn.Parameter))
        return int(positions) - patch_count(model.config)

    def tower_layers(self, model: nn.Module) -> nn.ModuleList | None:
        """The tower's layers (at `layers` on the vision transformer), None where there is no list of them."""
        found = self.transformer(model)
        for name in self.layers.split("."):
            found = getattr(found, name, None)
        return found if isinstance(found, nn.ModuleList) else None

    def tower_norms(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The tower's norms outside its layers `(name, norm)`, those it has (InternViT's `nn.Identity` is none)."""
        transformer = self.transformer(model)
        found = ((name, getattr(transformer, name, None)) for name in self.norms)
        return [(name, norm) for name, norm in found if norm is not None and not isinstance(norm, nn.Identity)]

    def image_token_count(self, model: nn.Module) -> int:
        """The placeholder tokens one image takes in the decoder's sequence (its features are put there)."""
        return int(self.image_tokens(model.config, self.tower_prefix(model)))

    def misfit(self, model: nn.Module) -> str | None:
        """What of the tower or projector does not fit this layout (by its path), or None."""
        width = model.config.vision_config.hidden_size
        layers = self.tower_layers(model)
        if layers is None:
            return f"model.{self.tower} has no {self.layers} (a list of layers)"
        for index, layer in enumerate(layers):
            problem = layer_misfit(layer, self.layer, width, f"model.{self.tower}.{self.layers}.{index}", f"{self.name} vision tower")
            if problem is not None:
                return problem
        for name, norm in self.tower_norms(model):
            if not self.norm.fits(norm, width):
                return f"model.{self.tower}.{name} ({type(norm).__name__}) is not {self.norm.what}"
        projector = getattr(model.model, self.projector)
        for path, part in self.projector_parts:
            module = getattr(projector, path) if path else projector
            if not part.fits(module, width):
                return f"model.{self.projector}{'.' + path if path else ''} ({type(module).__name__}) is not {part.what}"
        return None

    def ruled(self, model: nn.Module) -> list[tuple[nn.Module, RuleForward]]:
        """The tower's and projector's modules that run a rule forward under a rule set, with it."""
        found = [(_at(layer, path), kinds) for layer in self.tower_layers(model) for path, kinds in self.layer]
        found += [(norm, (self.norm,)) for _, norm in self.tower_norms(model)]
        projector = getattr(model.model, self.projector)
        found += [(getattr(projector, path) if path else projector, (part,)) for path, part in self.projector_parts]
        return rule_forwards(found, model.config.vision_config.hidden_size)


def _at(module: nn.Module, path: str) -> nn.Module:
    """The module at the dotted `path` on `module` ("" for itself)."""
    for name in path.split(".") if path else ():
        module = getattr(module, name)
    return module


def square(size: int | tuple[int, ...] | list[int]) -> int:
    """A size of the config as one side: an int, or a square pair (InternViT's `image_size`, `patch_size`)."""
    if isinstance(size, (tuple, list)):
        if len(size) != 2 or size[0] != size[1]:
            raise UnsupportedModelError(f"cannot map a vision tower of non-square size {tuple(size)}: relevancy maps square images and patches")
        return int(size[0])
    return int(size)


def patch_count(config: Any) -> int:
    """The patches of the tower's square grid (`vision_config`'s image and patch size)."""
    return (square(config.vision_config.image_size) // square(config.vision_config.patch_size)) ** 2


LLAVA = VisionLanguageLayout("llava", ("LlavaForConditionalGeneration",), "vision_tower", "multi_modal_projector", "language_model",
                             lambda config, prefix: patch_count(config) + prefix * (config.vision_feature_select_strategy == "full"),  # [CLS] kept
                             (("", LLAVA_PROJECTOR),), feature_layer=True)
GEMMA3 = VisionLanguageLayout("gemma3", ("Gemma3ForConditionalGeneration",), "vision_tower", "multi_modal_projector", "language_model",
                              lambda config, prefix: config.mm_tokens_per_image,  # the patches average-pooled
                              (("mm_soft_emb_norm", ONE_PLUS_RMS_NORM),), token_types="images", image_span=GEMMA3_SPAN)
#: PaliGemma 1 and 2: SigLIP's patch tokens through one Linear, a Gemma or Gemma 2 decoder over a bidirectional prefix
PALIGEMMA = VisionLanguageLayout("paligemma", ("PaliGemmaForConditionalGeneration",), "vision_tower", "multi_modal_projector",
                                 "language_model", lambda config, prefix: patch_count(config), (("linear", TOWER_LINEAR),),
                                 token_types="prefix", first_position=1, image_separator="")
IDEFICS3 = VisionLanguageLayout("idefics3", ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"), "vision_model", "connector",
                                "text_model", lambda config, prefix: patch_count(config) // config.scale_factor ** 2,  # pixel shuffle
                                one_image="without image splitting (do_image_splitting=False)")
#: InternVL 3 / 3.5: InternViT (its [CLS] cropped), pixel shuffle, a LayerNorm and an MLP, a Qwen2 / Qwen3 / Llama decoder
INTERNVL = VisionLanguageLayout("internvl", ("InternVLForConditionalGeneration",), "vision_tower", "multi_modal_projector", "language_model",
                                lambda config, prefix: round(patch_count(config) * config.downsample_ratio ** 2),  # pixel shuffle
                                (("layer_norm", SHUFFLED_LAYER_NORM), ("", NORMED_PROJECTOR)), layers="encoder.layer", layer=INTERNVIT_LAYER,
                                residual=INTERNVIT_RESIDUAL, norms=("layernorm",), feature_layer=True, image_span=ImageSpan(before=1, after=1))


def _fits_merged_projector(module: nn.Module, width: int) -> bool:
    """Mistral 3's projector: an RMSNorm `norm` of the tower's width (a part of its own), the `patch_merger` (k x k
    patches unfolded side by side into one Linear `merging_layer` back to the width), then LLaVA's MLP."""
    merging = getattr(getattr(module, "patch_merger", None), "merging_layer", None)
    return (_fits_projector(module, width) and isinstance(merging, nn.Linear) and merging.out_features == width
            and merging.in_features % width == 0 and isinstance(getattr(module, "norm", None), nn.Module))


def _merged_projector(module: nn.Module, session: Session) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mistral 3's projector as the model computes it: its norm (its own rule forward), the patch merger's unfold and
    Linear (linear maps, plain autograd), LLaVA's MLP under `plain_mlp`'s rule (the identity rule at the GELU)."""
    mlp = plain_mlp("linear_1", "linear_2", "act")(module, session)
    return lambda features, image_sizes: mlp(module.patch_merger(module.norm(features), image_sizes))


MERGED_PROJECTOR = Part("Mistral 3's projector linear_2(act(linear_1(patch_merger(norm(x)))))", _fits_merged_projector, _merged_projector)
#: Pixtral's attention: q_proj, k_proj, v_proj, o_proj (2-D rotary on queries and keys, a constant rotation)
PIXTRAL_ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, o_proj", fits_attention("q_proj", "k_proj", "v_proj", "o_proj"),
                         owns=("q_proj", "k_proj", "v_proj", "o_proj"))
PIXTRAL_LAYER = (("attention_norm", (RMS_NORM,)), ("attention", (PIXTRAL_ATTENTION,)), ("ffn_norm", (RMS_NORM,)), ("feed_forward", (GATED_MLP,)))
PIXTRAL_RESIDUAL = Residual("attention", "feed_forward", before_attention="attention_norm", before_mlp="ffn_norm")
#: Mistral 3 (Mistral Small 3.1 / 3.2): a Pixtral tower (RMSNorms, 2-D RoPE, images of any size, `image_sizes`), the
#: merged projector, a Mistral decoder; the image's token count comes from its size (`mistral3.py`)
#: what the Pixtral tower's processor writes: `[IMG_BREAK]` after each row of placeholders, `[IMG_END]` after the last
PIXTRAL_SPAN = ImageSpan(inside=True, after=1)
MISTRAL3 = VisionLanguageLayout("mistral3", ("Mistral3ForConditionalGeneration",), "vision_tower", "multi_modal_projector", "language_model",
                                None, (("norm", RMS_NORM), ("", MERGED_PROJECTOR)), layers="transformer.layers", layer=PIXTRAL_LAYER,
                                residual=PIXTRAL_RESIDUAL, norms=("ln_pre",), norm=RMS_NORM, feature_layer=True, image_span=PIXTRAL_SPAN)
#: Pixtral-12B: LLaVA's class with a Pixtral tower (Mistral 3's, its images of any size) and LLaVA's projector, no
#: patch merger (each patch one token), a Mistral decoder
PIXTRAL = replace(MISTRAL3, name="pixtral", classes=LLAVA.classes, projector_parts=LLAVA.projector_parts, tower_type="pixtral")


def _fits_merger_mlp(module: nn.Module, width: int) -> bool:
    """Qwen2-VL's merger MLP `Sequential(Linear, act, Linear)` from k x k neighbouring tower tokens side by side."""
    if not isinstance(module, nn.Sequential) or len(module) != 3:
        return False
    first, act, second = module
    return (isinstance(first, nn.Linear) and isinstance(second, nn.Linear) and first.in_features % width == 0
            and second.in_features == first.out_features and not list(act.parameters()))


def _fits_stacked_merger(module: nn.Module, width: int) -> bool:
    """Qwen3-VL's patch merger `linear_fc2(act_fn(linear_fc1(...)))` over k x k tokens side by side (`hidden_size`),
    its `norm` (a part of its own) over one token of the `width` or, DeepStack's, over the k x k side by side."""
    first, act, second, hidden = (getattr(module, name, None) for name in ("linear_fc1", "act_fn", "linear_fc2", "hidden_size"))
    return (isinstance(hidden, int) and hidden % width == 0 and isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
            and first.in_features == first.out_features == second.in_features == hidden and isinstance(act, nn.Module)
            and not list(act.parameters()))


def _stacked_merger(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """Qwen3-VL's merger as the model computes it: its norm (its own rule forward) before or after the k x k tokens
    are put side by side (`use_postshuffle_norm`), the MLP under `plain_mlp`'s rule (the identity rule at the GELU)."""
    mlp = plain_mlp("linear_fc1", "linear_fc2", "act_fn")(module, session)

    def forward(x: torch.Tensor) -> torch.Tensor:
        normed = module.norm(x.view(-1, module.hidden_size) if module.use_postshuffle_norm else x)
        return mlp(normed.view(-1, module.hidden_size))

    return forward


#: Qwen2-VL's vision attention: one fused `qkv` Linear and `proj` (2-D rotary on queries and keys, a constant)
FUSED_VISION_ATTENTION = Part("self-attention with a fused qkv and proj", fits_attention("qkv", "proj"), owns=("qkv", "proj"))
MERGER_MLP = Part("the patch merger's MLP Sequential(Linear, act, Linear) over k x k tokens side by side", _fits_merger_mlp,
                  plain_mlp("0", "2", "1"))
STACKED_MERGER = Part("Qwen3-VL's patch merger linear_fc2(act_fn(linear_fc1(x))) over k x k tokens side by side", _fits_stacked_merger,
                      _stacked_merger, owns=("linear_fc1", "linear_fc2"))
#: a patch merger's parts (path on the merger, "" for itself): Qwen2-VL's norm `ln_q`, then its MLP
MERGER = (("ln_q", (LAYER_NORM,)), ("mlp", (MERGER_MLP,)))


@dataclass(frozen=True)
class QwenVisionLayout(VisionLanguageLayout):
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's tower (`model.visual`): a Conv3d patch embedding, `blocks` of `block`
    parts, and the `merger` of `merger` parts (a norm, then an MLP on each k x k group of neighbouring tokens side by
    side), the projector; `deepstack`: the tower's list of further mergers of the same parts (Qwen3-VL's
    `deepstack_merger_list`: some blocks' outputs merged, their norm over the k x k tokens side by side, and added to
    the decoder's hidden states at the image's tokens in its first layers, a sum in the residual stream, which the
    model computes and no rule needs); the decoder at `model.language_model`. The image's token count comes from
    `image_grid_thw`."""

    block: tuple[tuple[str, tuple[Part, ...]], ...] = ()
    merger: tuple[tuple[str, tuple[Part, ...]], ...] = MERGER
    deepstack: str | None = None

    def transformer(self, model: nn.Module) -> nn.Module:
        return getattr(model.model, self.tower)

    def tower_prefix(self, model: nn.Module) -> int:
        return 0

    def width(self, model: nn.Module) -> int:
        """The tower's width (Qwen2-VL's `embed_dim`; Qwen2.5-VL's `hidden_size`, `out_hidden_size` the decoder's)."""
        config = model.config.vision_config
        return int(getattr(config, "embed_dim", None) or config.hidden_size)

    def mergers(self, model: nn.Module) -> list[tuple[str, nn.Module, int]]:
        """Every merger of the tower `(path, merger, the width its parts are checked at)`: the merger at the tower's
        width, DeepStack's at the k x k tokens' side by side (their norm's)."""
        tower, width = self.transformer(model), self.width(model)
        stacked = list(getattr(tower, self.deepstack)) if self.deepstack else []
        wide = width * int(model.config.vision_config.spatial_merge_size) ** 2
        return [("merger", tower.merger, width), *((f"{self.deepstack}.{index}", merger, wide) for index, merger in enumerate(stacked))]

    def misfit(self, model: nn.Module) -> str | None:
        tower = self.transformer(model)
        width = self.width(model)
        blocks = getattr(tower, "blocks", None)
        stacked = getattr(tower, self.deepstack, None) if self.deepstack else nn.ModuleList()
        if not isinstance(blocks, nn.ModuleList) or not isinstance(getattr(tower, "merger", None), nn.Module) or not isinstance(stacked, nn.ModuleList):
            return f"model.{self.tower} has no blocks (a list of layers) and merger{' and ' + self.deepstack if self.deepstack else ''}"
        for index, block in enumerate(blocks):
            problem = layer_misfit(block, self.block, width, f"model.{self.tower}.blocks.{index}", f"{self.name} vision tower")
            if problem is not None:
                return problem
        return next((problem for path, merger, at in self.mergers(model)
                     if (problem := layer_misfit(merger, self.merger, at, f"model.{self.tower}.{path}", f"{self.name} patch merger")) is not None), None)

    def ruled(self, model: nn.Module) -> list[tuple[nn.Module, RuleForward]]:
        tower, width = self.transformer(model), self.width(model)
        ruled = rule_forwards([(getattr(block, path), kinds) for block in tower.blocks for path, kinds in self.block], width)
        for _, merger, at in self.mergers(model):
            ruled += rule_forwards([(getattr(merger, path) if path else merger, kinds) for path, kinds in self.merger], at)
        return ruled


#: Qwen2-VL's vision MLP (Qwen2.5-VL's is SwiGLU, the decoders' `GATED_MLP`)
QWEN2_VL_MLP = Part("an MLP fc2(act(fc1(x)))", fits_plain_mlp("fc1", "fc2", "act"), plain_mlp("fc1", "fc2", "act"))
QWEN2_VL = QwenVisionLayout("qwen2_vl", ("Qwen2VLForConditionalGeneration",), "visual", "visual", "language_model", None, image_span=QWEN_SPAN,
                            block=(("norm1", (LAYER_NORM,)), ("attn", (FUSED_VISION_ATTENTION,)), ("norm2", (LAYER_NORM,)), ("mlp", (QWEN2_VL_MLP,))))
QWEN2_5_VL = QwenVisionLayout("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), "visual", "visual", "language_model", None, image_span=QWEN_SPAN,
                              block=(("norm1", (RMS_NORM,)), ("attn", (FUSED_VISION_ATTENTION,)), ("norm2", (RMS_NORM,)), ("mlp", (GATED_MLP,))),
                              merger=(("ln_q", (RMS_NORM,)), ("mlp", (MERGER_MLP,))))
#: Qwen3-VL's vision MLP `linear_fc2(act_fn(linear_fc1(x)))` (a tanh GELU)
QWEN3_VL_MLP = Part("an MLP linear_fc2(act_fn(linear_fc1(x)))", fits_plain_mlp("linear_fc1", "linear_fc2", "act_fn"),
                    plain_mlp("linear_fc1", "linear_fc2", "act_fn"))
#: Qwen3-VL (a Qwen3 decoder) and Qwen3-VL-MoE (a Qwen3-MoE one): Qwen2-VL's blocks with their own MLP, the mergers
#: `STACKED_MERGER`, DeepStack's among them
QWEN3_VL = QwenVisionLayout("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"), "visual", "visual",
                            "language_model", None, image_span=QWEN_SPAN, block=(*QWEN2_VL.block[:3], ("mlp", (QWEN3_VL_MLP,))),
                            merger=(("norm", (LAYER_NORM,)), ("", (STACKED_MERGER,))), deepstack="deepstack_merger_list")
QWEN_LAYOUTS = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)


@dataclass(frozen=True)
class TiledLayout(VisionLanguageLayout):
    """LLaVA's tower and projector run on each tile of an "anyres" image (`tiled.py`; the image's token count comes
    from its `image_sizes`); `pack_settings`: the config's settings the model's `pack_image_features` takes by name
    besides the features, the sizes and the newline (LLaVA-NeXT's select strategy, LLaVA-OneVision's
    `vision_aspect_ratio`, whose "anyres_max_k" interpolates a grid of more than k tiles' patches down)."""

    pack_settings: tuple[str, ...] = ()


LLAVA_NEXT = TiledLayout("llava_next", ("LlavaNextForConditionalGeneration",), "vision_tower", "multi_modal_projector",
                         "language_model", None, (("", LLAVA_PROJECTOR),), pack_settings=("vision_feature_select_strategy",))
#: LLaVA-OneVision: a SigLIP tower, LLaVA's projector, a Qwen2 decoder
LLAVA_ONEVISION = TiledLayout("llava_onevision", ("LlavaOnevisionForConditionalGeneration",), "vision_tower", "multi_modal_projector",
                              "language_model", None, (("", LLAVA_PROJECTOR),), pack_settings=("vision_aspect_ratio",))
TILED_LAYOUTS = (LLAVA_NEXT, LLAVA_ONEVISION)
#: the layouts with an adapter of their own (`qwen.py`, `tiled.py`, `mistral3.py`, `internvl.py`): their inputs differ
#: from one square image per row
OWN_ADAPTER_LAYOUTS = (*QWEN_LAYOUTS, *TILED_LAYOUTS, MISTRAL3, PIXTRAL, INTERNVL)
#: the layouts of the Pixtral tower, images of any size (`mistral3.py`)
PIXTRAL_LAYOUTS = (MISTRAL3, PIXTRAL)
#: PIXTRAL before LLAVA: a class's layout of the model's tower type before the one of any (`layout_named`)
LAYOUTS = (PIXTRAL, LLAVA, GEMMA3, IDEFICS3, PALIGEMMA, INTERNVL, *QWEN_LAYOUTS, *TILED_LAYOUTS, MISTRAL3)
#: the vision-language classes relevancy maps, for messages
VISION_LANGUAGE_CLASSES = ", ".join(dict.fromkeys(name for layout in LAYOUTS for name in layout.classes))


def is_vision_language(model: nn.Module) -> bool:
    """Whether `model` is a transformers vision-language decoder (any: `layout_of` refuses the ones not mapped)."""
    config = getattr(model, "config", None)
    return (type(model).__name__.endswith("ForConditionalGeneration") and getattr(config, "vision_config", None) is not None
            and callable(getattr(model, "get_output_embeddings", None)))


def layout_named(model: nn.Module) -> VisionLanguageLayout | None:
    """The layout of the model's class and vision tower type, unchecked (None for a class relevancy does not map)."""
    tower = getattr(getattr(model.config, "vision_config", None), "model_type", None)
    return next((layout for layout in LAYOUTS if type(model).__name__ in layout.classes and layout.tower_type in (None, tower)), None)


def layout_of(model: nn.Module) -> VisionLanguageLayout:
    """The layout of the model's class, checked on its tower and projector; a one-line refusal naming the part that
    does not fit, or the classes relevancy maps."""
    layout = layout_named(model)
    if layout is None:
        raise UnsupportedModelError(f"cannot map {type(model).__name__}: vision-language decoders relevancy maps: {VISION_LANGUAGE_CLASSES}")
    problem = layout.misfit(model)
    if problem is not None:
        raise UnsupportedModelError(f"cannot map {type(model).__name__}: {problem}; vision-language decoders: {VISION_LANGUAGE_CLASSES}")
    return layout


class DecoderView(nn.Module):
    """The decoder of a vision-language model in the shape of a `...ForCausalLM` (`model`: the bare decoder,
    `lm_head`, `config`: the text config), for `causal_lm.layouts` to recognise; it holds the model's own modules and
    changes none."""

    def __init__(self, model: nn.Module, layout: VisionLanguageLayout) -> None:
        super().__init__()
        self.model = getattr(model.model, layout.decoder)
        self.lm_head = model.get_output_embeddings()
        self.config = model.config.get_text_config()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


#: one view per model (the decoder layouts keep their recognition per viewed model)
_VIEWS: weakref.WeakKeyDictionary[nn.Module, DecoderView] = weakref.WeakKeyDictionary()


def decoder_view(model: nn.Module, layout: VisionLanguageLayout) -> DecoderView:
    """The model's `DecoderView`, made once (a new one where the model's decoder or head was replaced)."""
    view = _VIEWS.get(model)
    if view is None or view.model is not getattr(model.model, layout.decoder) or view.lm_head is not model.get_output_embeddings():
        view = _VIEWS[model] = DecoderView(model, layout)
    return view


def pixel_patches(relevance: torch.Tensor, patch: int) -> torch.Tensor:
    """Per-pixel relevance `(B, H, W)` summed over each patch's pixels: `(B, H / patch, W / patch)`."""
    return relevance.unflatten(-1, (-1, patch)).unflatten(-3, (-1, patch)).sum((-3, -1))


def occluded(pixels: torch.Tensor, removed: torch.Tensor, patch: int) -> torch.Tensor:
    """A copy of `pixels` `(B, ..., C, H, W)` with the patches `removed` `(B, H / patch, W / patch)` (bool; `(B, tiles,
    H / patch, W / patch)`: each tile's own, for tiles `(B, tiles, C, H, W)`) set to 0: the processor's mean, in its
    normalised pixel space."""
    keep = ~removed.repeat_interleave(patch, -2).repeat_interleave(patch, -1)
    return pixels * keep.view(*keep.shape[:-2], *[1] * (pixels.ndim - keep.ndim), *keep.shape[-2:]).to(pixels.dtype)


def tiles_on_grid(patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-tile patch maps `(B, rows * cols, side, side)` (B any leading values per patch) of tiles cut row by row
    from one picture laid side by side as the picture holds them: `(B, rows * side, cols * side)`."""
    side = patches.shape[-1]
    return patches.reshape(len(patches), rows, cols, side, side).permute(0, 1, 3, 2, 4).reshape(len(patches), rows * side, cols * side)


def tokens_on_patches(scores: torch.Tensor, side: int, prefix: int = 0) -> torch.Tensor:
    """An image's token scores `(B, N)` laid back on the tower's `side x side` patch grid `(B, side, side)`, each
    token's score shared equally among the patches it is made from (the sums kept): the tokens after the `prefix`
    are a row-major grid of square blocks of patches (LLaVA: one patch each; Gemma 3's average pooling and Idefics3's
    pixel shuffle: a k x k block each); a prefix token (LLaVA's kept [CLS]) is made from every patch."""
    blocks = scores[:, prefix:]
    per_side = math.isqrt(blocks.shape[1])
    if per_side * per_side != blocks.shape[1] or side % per_side:
        raise ValueError(f"{blocks.shape[1]} image tokens are not a square grid of blocks of the tower's {side} x {side} patches")
    return blocks_on_patches(blocks, (per_side, per_side), side // per_side) + scores[:, :prefix].sum(1)[:, None, None] / side ** 2


def blocks_on_patches(scores: torch.Tensor, blocks: tuple[int, int], k: int) -> torch.Tensor:
    """Token scores `(B, rows * cols)`, a row-major grid of `blocks` `(rows, cols)` of k x k patches each, on the patch
    grid `(B, rows * k, cols * k)`: each token's score shared equally among its patches (the sums kept)."""
    return scores.unflatten(1, blocks).repeat_interleave(k, 1).repeat_interleave(k, 2) / k ** 2


def patch_pixels(relevance: torch.Tensor, grid: tuple[int, int], channels: int, patch: int, merge: int) -> torch.Tensor:
    """Qwen2-VL's flattened patches' relevance `(B, h * w, C * T * P * P)` back on the image's pixels
    `(B, h * P, w * P)`, summed over the colour channels and the temporal copies."""
    return patches_on_pixels(relevance.unflatten(-1, (channels, -1, patch, patch)).sum((2, 3)), grid, merge)


def patches_on_pixels(patches: torch.Tensor, grid: tuple[int, int], merge: int) -> torch.Tensor:
    """Per-patch values `(B, h * w, P, P)` in Qwen2-VL's processor order (each merge group of k x k neighbouring
    patches consecutive, groups row-major) laid on the image's pixels `(B, h * P, w * P)`."""
    (rows, cols), patch = grid, patches.shape[-1]
    laid = patches.reshape(len(patches), rows // merge, cols // merge, merge, merge, patch, patch)
    return laid.permute(0, 1, 3, 5, 2, 4, 6).reshape(len(patches), rows * patch, cols * patch)


__all__ = ["LAYOUTS", "VisionLanguageLayout", "DecoderView", "decoder_view", "layout_named", "layout_of", "is_vision_language"]
