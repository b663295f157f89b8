"""An offline processor for the tiny random LLaVA of `vlm_models.py` (and LLaVA-NeXT's and LLaVA-OneVision's,
`tiled_processor`; Mistral 3's, `pixtral_processor`): a
word-level tokenizer over a small vocabulary (its image placeholder `<image>` at `IMAGE_TOKEN`), CLIP's image
processor at the tower's size, and pictures of coloured squares; `saved_llava` writes model and processor to a folder as `save_pretrained` does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from vlm_models import IMAGE_TOKEN, PATCH, PINPOINTS, SIDE, VOCAB, build

SPECIAL = ["<pad>", "<s>", "</s>"]
WORDS = ["a", "an", "the", "red", "green", "blue", "star", "circle", "square", "above", "below", "left", "right", "of",
         "what", "is", "in", "image", "picture", "describe", "shape", "colour", "there", "and", "?", ".", ":", "USER",
         "ASSISTANT", "it", "this", "one", "two", "big", "small"]


def tokenizer(image_tokens: dict[str, int] | None = None) -> transformers.PreTrainedTokenizerFast:
    """Whole words and the special tokens, every id below the model's vocabulary; unknown words at id 3.
    `image_tokens`: the image's special tokens and their ids at the top of the vocabulary (`<image>` at `IMAGE_TOKEN`
    unless given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    image_tokens = image_tokens or {"<image>": IMAGE_TOKEN}
    vocab = {token: k for k, token in enumerate([*SPECIAL, "<unk>", *WORDS])}
    vocab.update({f"w{k}": k for k in range(len(vocab), min(image_tokens.values()))})
    vocab.update(image_tokens)
    assert len(vocab) == VOCAB
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()  # the image's tokens, special tokens, are found before
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", additional_special_tokens=list(image_tokens))


def processor() -> transformers.LlavaProcessor:
    """The tiny LLaVA's processor: 16 x 16 pictures, 4 x 4 patches, [CLS] cropped (16 image tokens)."""
    images = transformers.CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer(), patch_size=PATCH,
                                       vision_feature_select_strategy="default", image_token="<image>",
                                       num_additional_image_tokens=1)


def tiled_processor(family: str) -> transformers.ProcessorMixin:
    """The tiny LLaVA-NeXT's or LLaVA-OneVision's processor: tiles of 16 x 16 pixels at the models' `PINPOINTS`, 4 x 4
    patches (NeXT: [CLS] cropped; OneVision: SigLIP's 16 tokens a tile, "anyres_max_1")."""
    if family == "llava_next":
        images = transformers.LlavaNextImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE},
                                                      image_grid_pinpoints=PINPOINTS)
        return transformers.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer(), patch_size=PATCH, image_token="<image>",
                                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    square = {"height": SIDE, "width": SIDE}
    return transformers.LlavaOnevisionProcessor(
        image_processor=transformers.LlavaOnevisionImageProcessor(size=square, image_grid_pinpoints=PINPOINTS), tokenizer=tokenizer(),
        video_processor=transformers.LlavaOnevisionVideoProcessor(size=square), num_image_tokens=(SIDE // PATCH) ** 2,
        vision_feature_select_strategy="full", image_token="<image>", video_token="w90", vision_aspect_ratio="anyres_max_1")


def pixtral_processor(merge: int) -> transformers.PixtralProcessor:
    """The tiny Mistral 3's (merge 2) or Pixtral's (merge 1) processor: `[IMG]` at `IMAGE_TOKEN`, `[IMG_BREAK]` (93) after
    each row of placeholders and `[IMG_END]` (94) after the last, images up to 24 pixels a side cut to whole merged
    patches, a [-1, 1] normalisation."""
    images = transformers.PixtralImageProcessor(size={"longest_edge": 24}, patch_size={"height": PATCH * merge, "width": PATCH * merge},
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
    words = tokenizer({"[IMG_BREAK]": 93, "[IMG_END]": 94, "[IMG]": IMAGE_TOKEN})
    return transformers.PixtralProcessor(image_processor=images, tokenizer=words, patch_size=PATCH, spatial_merge_size=merge)


def picture(seed: int = 0) -> Image.Image:
    """A 32 x 32 picture: a grey ground with a coloured square."""
    generator = np.random.default_rng(seed)
    array = np.full((32, 32, 3), 128, dtype=np.uint8)
    x, y = generator.integers(0, 20, 2)
    array[y:y + 12, x:x + 12] = generator.integers(0, 256, 3)
    return Image.fromarray(array)


def saved_llava(folder: Path) -> Path:
    """The tiny LLaVA (float32) and its processor saved to `folder`."""
    build("llava", torch.float32).save_pretrained(folder)
    processor().save_pretrained(folder)
    return folder
