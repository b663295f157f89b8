"""What the timm families (ViT, Swin) share below their adapters: the image sizes timm's patch embedding takes, the
class names and the preprocessing of a pretrained model, the switch of timm's fused attention for a call."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from ._shared import eval_mode


def check_timm_image_shape(model: nn.Module, shape: tuple[int, ...]) -> None:
    """Channels from the patch embedding; size as timm takes it: the model's own image size, or with
    `dynamic_img_size` multiples of the patch size (any size with `dynamic_img_pad`)."""
    _, channels, height, width = shape
    patch_embed = model.patch_embed
    proj = getattr(patch_embed, "proj", None)
    # a hybrid embedding's projection reads CNN features, not the image: its channels are not checked
    expected_channels = proj.in_channels if isinstance(proj, nn.Conv2d) and not hasattr(patch_embed, "backbone") else None
    channel_text = "C" if expected_channels is None else str(expected_channels)
    size = getattr(patch_embed, "img_size", None)
    patch = tuple(getattr(patch_embed, "patch_size", (1, 1)))
    dynamic = getattr(model, "dynamic_img_size", False)
    if size is not None and (getattr(patch_embed, "strict_img_size", True) or not dynamic):
        fits = (height, width) == tuple(size)
        takes = f"(B, {channel_text}, {size[0]}, {size[1]})"
    elif getattr(patch_embed, "dynamic_img_pad", False):
        fits = True
        takes = f"(B, {channel_text}, H, W) of any size"
    else:
        fits = height >= patch[0] and width >= patch[1] and height % patch[0] == 0 and width % patch[1] == 0
        takes = f"(B, {channel_text}, H, W) with H a multiple of {patch[0]} and W a multiple of {patch[1]} (its patch size)"
    if fits and expected_channels in (None, channels):
        return
    raise ValueError(f"this model takes images of shape {takes}, got {shape}")


def timm_class_names(model: nn.Module) -> list[str] | None:
    """The class names a timm model carries, or its ImageNet subset's; None where it has neither."""
    config = getattr(model, "pretrained_cfg", None) or {}
    names = getattr(model, "class_names", None) or config.get("label_names")
    if names:
        return list(names)
    if not config:
        return None
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(model)
    if subset is None:
        return None
    info = ImageNetInfo(subset)
    return [info.index_to_description(i).split(",")[0] for i in range(model.num_classes)]


def timm_input_fields(model: nn.Module, inputs: torch.Tensor) -> dict:
    """The Explanation's input fields: the image size, and a pretrained model's normalisation."""
    fields = {"input_size": tuple(inputs.shape[-2:])}
    if getattr(model, "pretrained_cfg", None):
        from timm.data import resolve_data_config

        config = resolve_data_config({}, model=model)
        fields.update(mean=tuple(config["mean"]), std=tuple(config["std"]))
    return fields


@contextmanager
def fused_attention_off(model: nn.Module, attentions: Sequence[nn.Module], attention_probabilities: bool) -> Iterator[None]:
    """`model` in eval mode and, where the probabilities are needed, the `fused_attn` flag of each of `attentions` off
    (timm's fused kernel computes none); every flag restored after, also after an exception."""
    fused = [a.fused_attn for a in attentions]
    with eval_mode(model):
        try:
            if attention_probabilities:
                for a in attentions:
                    a.fused_attn = False
            yield
        finally:
            for a, flag in zip(attentions, fused):
                a.fused_attn = flag
