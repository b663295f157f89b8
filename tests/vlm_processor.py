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


def tokenizer(named: dict[int, str] | None = None) -> transformers.PreTrainedTokenizerFast:
    """Whole words and the special tokens, every id below the model's vocabulary; unknown words at id 3. `named`:
    special tokens of a processor by id and name (`qwen_processor`'s), in place of `<image>` at `IMAGE_TOKEN`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    named = named or {IMAGE_TOKEN: "<image>"}
    vocab = {token: k for k, token in enumerate([*SPECIAL, "<unk>", *WORDS])}
    vocab.update({f"w{k}": k for k in range(len(vocab), VOCAB) if k not in named})
    vocab.update({token: k for k, token in named.items()})
    assert len(vocab) == VOCAB
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()  # the special tokens are found before
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", additional_special_tokens=list(named.values()))


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


def qwen_processor(family: str = "qwen2_vl") -> transformers.ProcessorMixin:
    """The processor of the family's tiny model (`qwen_vl_models.py`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the word-level
    tokenizer with Qwen's image, video and vision start / end tokens at the model's ids, and Qwen2-VL's image processor
    at its 4-pixel patches merged 2 x 2, resizing to at most 32 x 32 pixels (a 32 x 32 picture: an 8 x 8 patch grid, 16
    image tokens)."""
    from qwen_vl_models import IMAGE_TOKEN as QWEN_IMAGE, MERGE, PATCH as QWEN_PATCH, TEMPORAL, VISION_END, VISION_START

    named = {VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>", 94: "<|video_pad|>", QWEN_IMAGE: "<|image_pad|>"}
    sizes = dict(patch_size=QWEN_PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, size={"shortest_edge": 256, "longest_edge": 32 * 32})
    processor, videos = {"qwen2_vl": (transformers.Qwen2VLProcessor, transformers.Qwen2VLVideoProcessor),
                         "qwen2_5_vl": (transformers.Qwen2_5_VLProcessor, transformers.Qwen2VLVideoProcessor),
                         "qwen3_vl": (transformers.Qwen3VLProcessor, transformers.Qwen3VLVideoProcessor)}[family]
    return processor(image_processor=transformers.Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer(named), video_processor=videos(**sizes))


def pixtral_processor(merge: int) -> transformers.PixtralProcessor:
    """The tiny Mistral 3's (merge 2) or Pixtral's (merge 1) processor: `[IMG]` at `IMAGE_TOKEN`, `[IMG_BREAK]` (93) after
    each row of placeholders and `[IMG_END]` (94) after the last, images up to 24 pixels a side cut to whole merged
    patches, a [-1, 1] normalisation."""
    images = transformers.PixtralImageProcessor(size={"longest_edge": 24}, patch_size={"height": PATCH * merge, "width": PATCH * merge},
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
    words = tokenizer({93: "[IMG_BREAK]", 94: "[IMG_END]", IMAGE_TOKEN: "[IMG]"})
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
