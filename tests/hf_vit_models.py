"""Tiny Hugging Face vision transformers (random init) of every supported layout, and the same weights as timm models.

`timm_twin(kind)` builds a tiny timm model and the Hugging Face model holding the same weights (converted here),
so that both libraries can be compared map for map.
"""
from __future__ import annotations

import timm
import torch
from transformers import (
    DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher, DeiTModel, Dinov2Config,
    Dinov2ForImageClassification, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersForImageClassification,
    Dinov2WithRegistersModel, ViTConfig, ViTForImageClassification, ViTModel,
)

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, layer_norm_eps=1e-6)
TIMM = dict(embed_dim=32, depth=2, num_heads=2)


VIT = dict(**SIZES, intermediate_size=128, image_size=32, patch_size=8, num_labels=5)


def _dinov2_config(registers: bool = False, **overrides):
    config = Dinov2WithRegistersConfig if registers else Dinov2Config
    extra = {"num_register_tokens": 4} if registers else {}
    return config(**SIZES, mlp_ratio=4, image_size=42, patch_size=14, num_labels=5, layerscale_value=0.5, **extra, **overrides)


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Zero-initialised tokens and layer scales of 1 make too easy a test: random values everywhere."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if p.ndim > 1 else 0.1) + (0.5 if "lambda" in name else 0))
    return model.eval()


BUILDERS = {
    "vit": lambda: ViTForImageClassification(ViTConfig(**VIT)),
    "vit-model": lambda: ViTModel(ViTConfig(**VIT)),
    "deit": lambda: DeiTForImageClassification(DeiTConfig(**VIT)),
    "deit-teacher": lambda: DeiTForImageClassificationWithTeacher(DeiTConfig(**VIT)),
    "deit-model": lambda: DeiTModel(DeiTConfig(**VIT)),
    "dinov2": lambda: Dinov2ForImageClassification(_dinov2_config()),
    "dinov2-model": lambda: Dinov2Model(_dinov2_config()),
    "dinov2-reg": lambda: Dinov2WithRegistersForImageClassification(_dinov2_config(registers=True)),
    "dinov2-reg-model": lambda: Dinov2WithRegistersModel(_dinov2_config(registers=True)),
}
#: the image size each tiny model is built for, and its patch size
NATIVE = {kind: (42, 14) if kind.startswith("dinov2") else (32, 8) for kind in BUILDERS}


def tiny_dinov2_swiglu(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random DINOv2 classifier with SwiGLU feed-forwards (as DINOv2 giant), for 42 x 42 images."""
    torch.manual_seed(0)
    return _randomise(Dinov2ForImageClassification(_dinov2_config(use_swiglu_ffn=True))).to(dtype)


def tiny_hf(kind: str = "vit", dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A tiny random transformers model of `kind` (a key of BUILDERS), with the attention implementation a user
    would have (sdpa by default)."""
    torch.manual_seed(0)
    model = _randomise(BUILDERS[kind]())
    model.set_attn_implementation(attn_implementation)
    return model.to(dtype)


# -- the same weights in timm ---------------------------------------------------------------------------------
def _qkv(state: dict, prefix: str, target: dict, into: str) -> None:
    """timm's fused qkv Linear split into transformers' q_proj, k_proj, v_proj."""
    for part, name in zip(("weight", "bias"), ("weight", "bias")):
        q, k, v = state[f"{prefix}.attn.qkv.{part}"].chunk(3)
        target.update({f"{into}.q_proj.{name}": q, f"{into}.k_proj.{name}": k, f"{into}.v_proj.{name}": v})


def hf_state_from_timm(model: torch.nn.Module, kind: str, base: str) -> dict[str, torch.Tensor]:
    """The transformers state dict of a timm VisionTransformer (`base`: the prefix of the transformers *Model,
    e.g. "vit." inside a classifier, "" for the bare model)."""
    state = model.state_dict()
    dino = kind.startswith("dinov2")
    layers = f"{base}encoder.layer" if dino else f"{base}layers"
    out = {
        f"{base}embeddings.cls_token": state["cls_token"],
        f"{base}embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
        f"{base}embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
        f"{base}layernorm.weight": state["norm.weight"],
        f"{base}layernorm.bias": state["norm.bias"],
    }
    position = state["pos_embed"]
    if kind.startswith("dinov2-reg"):  # timm: no position for [CLS] (no_embed_class); transformers: one, here zero
        position = torch.cat([torch.zeros_like(position[:, :1]), position], dim=1)
        out[f"{base}embeddings.register_tokens"] = state["reg_token"]
    out[f"{base}embeddings.position_embeddings"] = position
    if "dist_token" in state:
        out[f"{base}embeddings.distillation_token"] = state["dist_token"]
    norms = ("norm1", "norm2") if dino else ("layernorm_before", "layernorm_after")
    for i in range(len(model.blocks)):
        src, dst = f"blocks.{i}", f"{layers}.{i}"
        _qkv(state, src, out, f"{dst}.attention")
        for part in ("weight", "bias"):
            out[f"{dst}.attention.o_proj.{part}"] = state[f"{src}.attn.proj.{part}"]
            out[f"{dst}.{norms[0]}.{part}"] = state[f"{src}.norm1.{part}"]
            out[f"{dst}.{norms[1]}.{part}"] = state[f"{src}.norm2.{part}"]
            out[f"{dst}.mlp.fc1.{part}"] = state[f"{src}.mlp.fc1.{part}"]
            out[f"{dst}.mlp.fc2.{part}"] = state[f"{src}.mlp.fc2.{part}"]
        if dino:
            out[f"{dst}.layer_scale1.lambda1"] = state[f"{src}.ls1.gamma"]
            out[f"{dst}.layer_scale2.lambda1"] = state[f"{src}.ls2.gamma"]
    heads = {"head": "classifier"} if "head_dist.weight" not in state else {"head": "cls_classifier", "head_dist": "distillation_classifier"}
    for source, target in heads.items():
        if f"{source}.weight" in state:
            out[f"{target}.weight"], out[f"{target}.bias"] = state[f"{source}.weight"], state[f"{source}.bias"]
    return out


TWINS = {
    # kind: (timm name and options, transformers model, prefix of its *Model)
    "vit": (("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, num_classes=5)), "vit", "vit."),
    "deit-teacher": (("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, num_classes=5)), "deit-teacher", "deit."),
    "dinov2-model": (("vit_small_patch14_dinov2", dict(img_size=42, num_classes=0)), "dinov2-model", ""),
    "dinov2-reg-model": (("vit_small_patch14_reg4_dinov2", dict(img_size=42, num_classes=0, dynamic_img_size=True)), "dinov2-reg-model", ""),
}


def timm_twin(kind: str, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`(timm model, transformers model)` holding the same random weights, in `dtype`."""
    (name, options), hf_kind, base = TWINS[kind]
    torch.manual_seed(0)
    reference = _randomise(timm.create_model(name, pretrained=False, **TIMM, **options))
    if "dinov2" not in name:  # timm's ViT and DeiT: the transformers layer-norm epsilon is 1e-6 here too
        assert reference.norm.eps == 1e-6
    model = tiny_hf(hf_kind)
    missing, unexpected = model.load_state_dict(hf_state_from_timm(reference, kind, base), strict=False)
    assert not unexpected and all("pooler" in key or "mask_token" in key for key in missing), (missing, unexpected)
    return reference.to(dtype).eval(), model.to(dtype).eval()
