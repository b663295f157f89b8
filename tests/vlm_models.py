"""Tiny random float64 vision-language decoders (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Gemma 3, Idefics3, PaliGemma 1 and 2, InternVL with one tile and with several, Mistral 3, Pixtral-12B's LLaVA) and their inputs, built from fixed seeds
and configs (no relevancy import: `benchmarks/vlm_lxt_reference.py` builds the same models in lxt's venv)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers
from decoder_families import checksum  # noqa: F401  (the reference's and the tests' one checksum)

VOCAB = 96
IMAGE_TOKEN = 95
SIDE, PATCH = 16, 4  # a 4 x 4 patch grid
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0)
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE, patch_size=PATCH,
               initializer_range=0.2)
#: family -> (seed, image tokens per image)
FAMILIES = {"llava": (20, 16), "llava_full": (21, 17), "gemma3": (22, 4), "idefics3": (23, 4), "paligemma": (25, 16), "paligemma2": (26, 16),
            "internvl": (27, 4), "internvl_rms": (28, 4)}
#: the families whose processor writes token types: PaliGemma's prefix (0: image and prompt, 1: a suffix after it)
PREFIX_FAMILIES = ("paligemma", "paligemma2")
#: built like FAMILIES' models, checked by tests of their own only: a LLaVA with a SigLIP tower (no [CLS], a pooling head)
EXTRA = {"llava_siglip": (24, 16)}
#: LLaVA-NeXT's "anyres" images, their own tests (`test_llava_next.py`): the image's 16 x 16 tiles of its best
#: resolution among `PINPOINTS` after the base image (the image downscaled to one tile); a 24 x 32 image (H, W) takes
#: 32 x 32, 2 x 2 tiles, whose 8 x 8 patch grid is unpadded to the image's aspect, 6 x 8 (a row of patches cut above
#: and below), each of its rows followed by the newline embedding: 16 + 6 x 9 = 70 image tokens; LLaVA-OneVision's
#: "anyres_max_1" interpolates that grid of more than 1 tile's patches down to 3 x 4 (each token the mean of 2 x 2
#: patches): 16 + 3 x 5 = 31
TILED = {"llava_next": (40, 70), "llava_onevision": (41, 31)}
PINPOINTS = [[32, 32], [16, 32], [32, 16]]
IMAGE_SIZE, TILES = (24, 32), 5
#: images of their own size (`image_sizes`), their own tests (`test_mistral3.py`, `test_pixtral.py`): Mistral 3's 16 x
#: 24 image, a 4 x 6 patch grid merged 2 x 2 into 2 x 3 placeholders (Pixtral-12B's LLaVA: unmerged, 4 x 6), the
#: processor's [IMG_BREAK] (93) after each row of them and [IMG_END] (94) after the last
SIZED = {"mistral3": (42, 6), "pixtral": (43, 24)}
SIZED_IMAGE, MERGE = (16, 24), 2
#: each sized family's merge (k x k patches a placeholder)
MERGES = {"mistral3": MERGE, "pixtral": 1}
#: InternVL's processor tiles (`crop_to_patches=True`), their own tests (`test_internvl_tiles.py`): a 32 x 48 image
#: (H, W) on the grid of 6 tiles closest to its aspect, 2 rows x 3 columns of 16 x 16 tiles, then its thumbnail:
#: `pixel_values` `(B * 7, 3, 16, 16)`, 4 placeholders per tile, 28 in all; `image_sizes` beside them
INTERN_TILED = {"internvl_tiles": (29, 28)}
INTERN_IMAGE, INTERN_GRID, INTERN_TILES = (32, 48), (2, 3), 7


def _config(family: str, vocab: int = VOCAB, image_token: int = IMAGE_TOKEN, image_edges: tuple[int, int] = (93, 94)
            ) -> transformers.PretrainedConfig:
    text = {**_TEXT, "vocab_size": vocab}
    if family == "llava":  # the second-to-last layer's patch tokens, [CLS] cropped (LLaVA 1.5's setting)
        return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**_VISION), text_config=transformers.LlamaConfig(**text),
                                        image_token_id=image_token, projector_hidden_act="gelu", vision_feature_layer=-2,
                                        vision_feature_select_strategy="default")
    if family == "llava_full":  # two layers side by side, [CLS] kept; a Qwen2 decoder
        return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**_VISION), text_config=transformers.Qwen2Config(**text),
                                        image_token_id=image_token, projector_hidden_act="gelu", vision_feature_layer=[-2, -1],
                                        vision_feature_select_strategy="full")
    if family == "llava_next":  # LLaVA 1.6's setting: the second-to-last layer's patch tokens of each tile, [CLS] cropped
        text["max_position_embeddings"] = 128  # 70 image tokens
        return transformers.LlavaNextConfig(vision_config=transformers.CLIPVisionConfig(**_VISION), text_config=transformers.LlamaConfig(**text),
                                            image_token_id=image_token, projector_hidden_act="gelu", vision_feature_layer=-2,
                                            vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS)
    if family == "llava_onevision":  # SigLIP's last layer, all its patch tokens; a Qwen2 decoder
        return transformers.LlavaOnevisionConfig(vision_config=transformers.SiglipVisionConfig(**_VISION, vision_use_head=False),
                                                 text_config=transformers.Qwen2Config(**{**text, "max_position_embeddings": 128}),
                                                 image_token_id=image_token, projector_hidden_act="gelu", vision_feature_layer=-1,
                                                 vision_feature_select_strategy="full", image_grid_pinpoints=PINPOINTS,
                                                 vision_aspect_ratio="anyres_max_1")
    if family in SIZED:  # a Pixtral tower (RMSNorm, 2-D RoPE), the merged projector (Pixtral-12B: LLaVA's), a Mistral decoder
        vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                  image_size=SIDE * 2, patch_size=PATCH, head_dim=8, initializer_range=0.2)
        if family == "pixtral":  # Pixtral-12B's settings: the last layer's every patch token
            return transformers.LlavaConfig(vision_config=vision, text_config=transformers.MistralConfig(**text, head_dim=8),
                                            image_token_id=image_token, projector_hidden_act="gelu", vision_feature_layer=-1,
                                            vision_feature_select_strategy="full")
        return transformers.Mistral3Config(vision_config=vision, text_config=transformers.MistralConfig(**text, head_dim=8),
                                           image_token_index=image_token, spatial_merge_size=MERGE, vision_feature_layer=-1)
    if family == "llava_siglip":  # the last layer's patch tokens, all kept (there is no [CLS])
        return transformers.LlavaConfig(vision_config=transformers.SiglipVisionConfig(**_VISION, vision_use_head=True),
                                        text_config=transformers.LlamaConfig(**text), image_token_id=image_token, projector_hidden_act="gelu",
                                        vision_feature_layer=-1, vision_feature_select_strategy="full")
    if family == "gemma3":
        return transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text, head_dim=8, sliding_window=4,
                                                                                  layer_types=["sliding_attention", "full_attention"]),
                                         vision_config=transformers.SiglipVisionConfig(**_VISION, vision_use_head=False),
                                         mm_tokens_per_image=4, image_token_index=image_token, boi_token_index=image_edges[0],
                                         eoi_token_index=image_edges[1])
    if family in PREFIX_FAMILIES:  # SigLIP's patch tokens, one Linear; Gemma, or Gemma 2 with a sliding window and capped logits
        decoder = (transformers.GemmaConfig(**text, head_dim=8) if family == "paligemma" else
                   transformers.Gemma2Config(**text, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, attn_logit_softcapping=None,
                                             final_logit_softcapping=3.0))
        return transformers.PaliGemmaConfig(vision_config=transformers.SiglipVisionConfig(**_VISION, vision_use_head=False), text_config=decoder,
                                            image_token_index=image_token, projection_dim=text["hidden_size"])
    if family.startswith("internvl"):  # InternViT-300M's layout and a Qwen2 decoder; InternViT-6B's (RMSNorm, query and key norms) and a Llama
        rms = family == "internvl_rms"
        vision = transformers.InternVLVisionConfig(**_VISION, norm_type="rms_norm" if rms else "layer_norm", use_qk_norm=rms,
                                                   use_mean_pooling=rms)
        return transformers.InternVLConfig(vision_config=vision, text_config=(transformers.LlamaConfig if rms else transformers.Qwen2Config)(**text),
                                           image_token_id=image_token, downsample_ratio=0.5)
    return transformers.Idefics3Config(text_config=transformers.LlamaConfig(**text), vision_config=transformers.Idefics3VisionConfig(**_VISION),
                                       scale_factor=2, image_token_id=image_token)


def build(family: str, dtype: torch.dtype = torch.float64, vocab: int = VOCAB, image_token: int = IMAGE_TOKEN,
          image_edges: tuple[int, int] = (93, 94)) -> torch.nn.Module:
    """The family's tiny model from its seed, every norm's weight (and Gemma 3's projection) drawn at random too, in
    `dtype`, eval mode; `vocab`, `image_token` and Gemma 3's `image_edges` (its begin and end of image tokens) to fit
    a real tokenizer."""
    config = _config(family, vocab, image_token, image_edges)
    torch.manual_seed({**FAMILIES, **EXTRA, **TILED, **SIZED, **INTERN_TILED}[family][0])
    model = getattr(transformers, type(config).__name__.replace("Config", "ForConditionalGeneration"))(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ("norm" in name or "layernorm" in name) and parameter.ndim == 1 and name.endswith("weight"):
                gemma = family.startswith(("gemma3", "paligemma")) and ("language_model" in name or "mm_soft_emb_norm" in name)
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (0.0 if gemma else 1.0))
            elif name.endswith("mm_input_projection_weight"):  # Gemma 3 starts it at 0: no image would reach the decoder
                parameter.copy_(torch.randn_like(parameter) * 0.2)
            elif name.endswith(("lambda_1", "lambda_2", "cls_token", "position_embeddings")):  # InternViT's layer scale, [CLS], positions
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    return model.to(dtype).eval()


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of token rows padded on `side` (pad id 0)."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[r, span], mask[r, span] = row, 1
    return ids, mask


def inputs(family: str, side: str = "right", lengths: tuple[int, ...] = (5, 3), seed: int = 3) -> dict[str, torch.Tensor]:
    """A processor's output for rows of `lengths` text tokens after `[1] + the image's placeholders` (PaliGemma:
    the placeholders first, then 1, as its processor writes them, and token types: 0 on the prefix, 1 on the first
    row's last 2 tokens, a suffix), padded on `side` (pad id 0), one random image per row (LLaVA-NeXT: its `TILES`
    tiles `(B, tiles, 3, H, W)` and `image_sizes`)."""
    generator = torch.Generator().manual_seed(seed)
    images = {**FAMILIES, **EXTRA, **TILED, **SIZED, **INTERN_TILED}[family][1]
    start = [IMAGE_TOKEN] * images + [1] if family in PREFIX_FAMILIES else [1] + [IMAGE_TOKEN] * images
    if family in SIZED:  # each row of merged tokens closed by [IMG_BREAK], the last by [IMG_END]
        per_row = SIZED_IMAGE[1] // (PATCH * MERGES[family])
        start = [1] + [token for row in range(images // per_row) for token in [IMAGE_TOKEN] * per_row + [93 if row < images // per_row - 1 else 94]]
    rows = [torch.cat([torch.tensor(start), torch.randint(2, 90, (n,), generator=generator)]) for n in lengths]
    ids, mask = padded(rows, side)
    if family in TILED:
        return {"input_ids": ids, "attention_mask": mask, "image_sizes": torch.tensor([IMAGE_SIZE] * len(rows)),
                "pixel_values": torch.randn(len(rows), TILES, 3, SIDE, SIDE, generator=generator, dtype=torch.float64)}
    if family in INTERN_TILED:
        return {"input_ids": ids, "attention_mask": mask, "image_sizes": torch.tensor([INTERN_IMAGE] * len(rows)),
                "pixel_values": torch.randn(len(rows) * INTERN_TILES, 3, SIDE, SIDE, generator=generator, dtype=torch.float64)}
    if family in SIZED:
        return {"input_ids": ids, "attention_mask": mask, "image_sizes": torch.tensor([SIZED_IMAGE] * len(rows)),
                "pixel_values": torch.randn(len(rows), 3, *SIZED_IMAGE, generator=generator, dtype=torch.float64)}
    pixels = torch.randn(len(rows), 3, SIDE, SIDE, generator=generator, dtype=torch.float64)
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels[:, None] if family == "idefics3" else pixels}
    if family in PREFIX_FAMILIES:
        suffix = [torch.tensor([0] * (len(row) - 2) + [1, 1]) if r == 0 and len(lengths) > 1 else torch.zeros(len(row), dtype=torch.long)
                  for r, row in enumerate(rows)]
        batch["token_type_ids"] = padded(suffix, side)[0]
    return batch


def own_types(family: str, ids: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The token types the model's own forward takes with the rows `ids` of `batch`: Gemma 3's 1 at the image's
    tokens (they attend to each other), PaliGemma's the batch's own (its prefix); none for the others."""
    if family == "gemma3":
        return {"token_type_ids": (ids == IMAGE_TOKEN).long()}
    return {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}



@contextmanager
def embedding_leaf(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """For the model's own forwards inside: the token embeddings' output made a leaf of the graph, kept as
    `leaf["text"]` (a hook on the embedding, removed after)."""
    leaf: dict[str, torch.Tensor] = {}

    def hook(_module, _args, output):
        leaf["text"] = output.detach().requires_grad_(True)
        return leaf["text"]

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield leaf
    finally:
        handle.remove()


def alone(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """Row `row` of a batch on its own, without its padding (InternVL's tiles: the row's, `pixel_values` holding every
    row's one after the other)."""
    keep = batch["attention_mask"][row].bool()
    tiles = len(batch["pixel_values"]) // len(batch["input_ids"])
    return {"pixel_values": batch["pixel_values"][row * tiles:(row + 1) * tiles],
            **{name: batch[name][row:row + 1, keep] for name in ("input_ids", "attention_mask", "token_type_ids") if name in batch},
            **({"image_sizes": batch["image_sizes"][row:row + 1]} if "image_sizes" in batch else {})}
