"""Tiny timm models (random init) of every layout the ViT adapter supports."""
from __future__ import annotations

from typing import Callable

import timm
import torch

TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)


def tiny_vit(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, **{**TINY, **overrides}).eval()


def tiny_deit_distilled() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, **TINY).eval()


def tiny_registers() -> torch.nn.Module:
    """DINOv2 layout: register tokens, layer scale, patch 14, dynamic image size."""
    torch.manual_seed(0)
    return timm.create_model(
        "vit_small_patch14_reg4_dinov2", pretrained=False, img_size=42, **TINY, dynamic_img_size=True
    ).eval()


def tiny_global_pool() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, class_token=False, global_pool="avg", **TINY).eval()


def tiny_swin(seed: int = 0) -> torch.nn.Module:
    """Two stages (8 x 8 then 4 x 4 tokens), windows of 2 x 2, shifted in every second block; random weights with a
    random relative position bias, float64, eval mode."""
    torch.manual_seed(seed)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4, embed_dim=8,
                              depths=(2, 2), num_heads=(2, 2), window_size=2, num_classes=5, drop_path_rate=0.0)
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                block.attn.relative_position_bias_table.normal_(0, 0.5)
    return model.double().eval()


def _hf_swin_with(timm_swin: torch.nn.Module, version: str, layer_pairs: Callable) -> torch.nn.Module:
    """transformers' Swin `version` ("" or "v2") shaped like a timm Swin built like `tiny_swin` and with its weights:
    the embedding, final norm, head and merges (each stage's merge moved to the end of the stage before) here, each
    layer's by `layer_pairs(layer, block)` (its `(ours, theirs)` module pairs; it copies what no module pair holds);
    float64, eval mode."""
    import transformers

    stages = timm_swin.layers
    config = getattr(transformers, f"Swin{version}Config")(
        image_size=32, patch_size=4, embed_dim=8, depths=[len(s.blocks) for s in stages], num_heads=[s.blocks[0].attn.num_heads for s in stages],
        window_size=stages[0].blocks[0].window_size[0], num_labels=timm_swin.num_classes, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    model = getattr(transformers, f"Swin{version}ForImageClassification")(config).double().eval()
    swin = model.base_model
    pairs = [(swin.embeddings.patch_embeddings.projection, timm_swin.patch_embed.proj),
             (swin.embeddings.norm, timm_swin.patch_embed.norm), (swin.layernorm, timm_swin.norm), (model.classifier, timm_swin.head.fc)]
    for index, (stage, theirs) in enumerate(zip(swin.encoder.layers, stages)):
        if index + 1 < len(stages):
            pairs += [(stage.downsample.norm, stages[index + 1].downsample.norm), (stage.downsample.reduction, stages[index + 1].downsample.reduction)]
        for layer, block in zip(stage.blocks, theirs.blocks):
            pairs += [(layer.layernorm_before, block.norm1), (layer.layernorm_after, block.norm2)]
            with torch.no_grad():
                pairs += layer_pairs(layer, block)
    with torch.no_grad():
        for ours, theirs in pairs:
            ours.load_state_dict(theirs.state_dict())
    return model


def hf_swin_from(timm_swin: torch.nn.Module) -> torch.nn.Module:
    """transformers' `SwinForImageClassification` with the weights of a timm Swin built like `tiny_swin` (fused
    q/k/v split, each stage's merge moved to the end of the stage before), float64, eval mode."""

    def layer_pairs(layer: torch.nn.Module, block: torch.nn.Module) -> list:
        attention = layer.attention
        attention.relative_position_bias.relative_position_bias_table.copy_(block.attn.relative_position_bias_table)
        for proj, weight, bias in zip((attention.q_proj, attention.k_proj, attention.v_proj), block.attn.qkv.weight.chunk(3), block.attn.qkv.bias.chunk(3)):
            proj.weight.copy_(weight)
            proj.bias.copy_(bias)
        return [(attention.o_proj, block.attn.proj), (layer.mlp.fc1, block.mlp.fc1), (layer.mlp.fc2, block.mlp.fc2)]

    return _hf_swin_with(timm_swin, "", layer_pairs)


def tiny_swinv2(seed: int = 0) -> torch.nn.Module:
    """`tiny_swin`'s shape as a timm SwinTransformerV2 (cosine attention, continuous position bias, post-norm), with
    random logit scales, q and v biases and post-norm weights (timm starts them at 0), float64, eval mode."""
    torch.manual_seed(seed)
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=32, patch_size=4, embed_dim=8,
                              depths=(2, 2), num_heads=(2, 2), window_size=2, num_classes=5, drop_path_rate=0.0)
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                block.attn.logit_scale.uniform_(0.5, 5.0)  # some above log(100): the clamp
                block.attn.q_bias.normal_(0, 0.5)
                block.attn.v_bias.normal_(0, 0.5)
                for norm in (block.norm1, block.norm2):
                    norm.weight.normal_(1, 0.3)
                    norm.bias.normal_(0, 0.3)
    return model.double().eval()


def hf_swinv2_from(timm_v2: torch.nn.Module) -> torch.nn.Module:
    """transformers' `Swinv2ForImageClassification` with the weights of a timm Swin V2 built like `tiny_swinv2`
    (fused q/k/v split, with its q and v biases; the continuous position bias's MLP and the logit scales; each
    stage's merge moved to the end of the stage before), float64, eval mode."""

    def layer_pairs(layer: torch.nn.Module, block: torch.nn.Module) -> list:
        attention = layer.attention.self
        attention.logit_scale.copy_(block.attn.logit_scale)
        for proj, weight in zip((attention.query, attention.key, attention.value), block.attn.qkv.weight.chunk(3)):
            proj.weight.copy_(weight)
        attention.query.bias.copy_(block.attn.q_bias)
        attention.value.bias.copy_(block.attn.v_bias)
        return [(layer.attention.output.dense, block.attn.proj), (layer.intermediate.dense, block.mlp.fc1), (layer.output.dense, block.mlp.fc2),
                (attention.continuous_position_bias_mlp, block.attn.cpb_mlp)]

    return _hf_swin_with(timm_v2, "v2", layer_pairs)
