"""An offline processor for the tiny random LLaVA of `vlm_models.py` (and LLaVA-NeXT's and LLaVA-OneVision's,
`tiled_processor`): a
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


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whole words and the special tokens, every id below the model's vocabulary; unknown words at id 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: k for k, token in enumerate([*SPECIAL, "<unk>", *WORDS])}
    vocab.update({f"w{k}": k for k in range(len(vocab), IMAGE_TOKEN)})
    vocab["<image>"] = IMAGE_TOKEN
    assert len(vocab) == VOCAB
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()  # <image>, a special token, is found before
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", additional_special_tokens=["<image>"])


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
