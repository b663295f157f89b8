"""Hugging Face vision transformers: ViT, DeiT (distilled too), DINOv2 (layer scale) and DINOv2 with registers.

Supported, unmodified (transformers' own classes): `ViTModel`, `ViTForImageClassification`, `DeiTModel`,
`DeiTForImageClassification`, `DeiTForImageClassificationWithTeacher`, `Dinov2Model`,
`Dinov2ForImageClassification`, `Dinov2WithRegistersModel`, `Dinov2WithRegistersForImageClassification`.

What is explained (`HEADS`): a classifier's logits; a bare `*Model` has no classes, so its "logits" are its image
features, the [CLS] token of the last hidden state (after the final LayerNorm; DINOv2's `pooler_output`): a
`Concept` (or a feature index) is explained there. The pre-logits (a Concept's latent) are what enters the
classifier: [CLS] (ViT, DeiT), [CLS] and the mean patch token side by side (DINOv2 classifiers), the mean of [CLS]
and the distillation token (DeiT with teacher, as timm's distilled DeiT).

Images `(B, C, H, W)` of any size whose sides are multiples of the patch size: the position embeddings are
interpolated by the model's own `interpolate_pos_encoding` (ViT and DeiT are called with
`interpolate_pos_encoding=True`, which leaves the model's own size unchanged; DINOv2 always interpolates). The
content tokens follow `1 + registers (+ 1 distillation token for DeiT)` prefix tokens; [CLS] (token 0) is the
readout row.

For the call, the configs' attention implementation (sdpa, flash, ...) is switched to relevancy's exact eager
attention (the probabilities on the autograd path, the softmax in the model's dtype: stock eager attention of ViT
and DeiT computes it in float32) and restored after, with every module's train/eval flag, also after an exception.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable, Stream
from .._shared import OutputPart, config_class_names
from ..base import IMAGE_ENCODER_METHODS, EmbeddingLeaf, ImageAdapter, UnsupportedModelError
from ..hf_attention import TransformersImageCalls, attention_probabilities
from .heads import HEADS, PLAIN_OPS, supported_class

def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class HFViTAdapter(TransformersImageCalls, ImageAdapter):
    family = "Hugging Face vision transformer"
    methods = IMAGE_ENCODER_METHODS
    examples = ("ViTModel, ViTForImageClassification, DeiT* (with teacher too), Dinov2Model, Dinov2ForImageClassification, "
                "Dinov2WithRegisters*")

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return supported_class(model) is not None

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.head_kind = HEADS[supported_class(model).__name__]
        self.backbone = model.base_model  # the *Model inside a classifier, the model itself otherwise
        layers = getattr(self.backbone, "layers", None)
        if layers is None:
            layers = getattr(getattr(self.backbone, "encoder", None), "layer", None)
        attentions = [getattr(layer, "attention", None) for layer in layers or []]
        if not layers or not all(all(hasattr(a, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")) for a in attentions):
            import transformers

            raise UnsupportedModelError(
                f"{type(model).__name__} of transformers {transformers.__version__} is laid out differently from what "
                "relevancy knows (layers whose attention has q_proj, k_proj, v_proj, o_proj: transformers 5)"
            )
        self.blocks = list(layers)
        self.attentions = attentions
        self.embeddings = self.backbone.embeddings
        self.ops = PLAIN_OPS
        self.num_prefix_tokens = (
            1 + int(hasattr(self.embeddings, "distillation_token"))
            + (self.embeddings.register_tokens.shape[1] if hasattr(self.embeddings, "register_tokens") else 0)
        )
        patch_embeddings = self.embeddings.patch_embeddings
        self.patch_size = _pair(patch_embeddings.patch_size)
        self.image_size = _pair(patch_embeddings.image_size)
        self.channels = int(patch_embeddings.num_channels)
        accepts = inspect.signature(self.embeddings.forward).parameters
        self.embedding_options = {"interpolate_pos_encoding": True} if "interpolate_pos_encoding" in accepts else {}

    # -- what the model is made of -------------------------------------------------------------------------
    def streams(self, inputs: torch.Tensor) -> dict[str, Stream]:
        readout = torch.zeros(len(inputs), dtype=torch.long, device=inputs.device)
        return {"image": Stream("image", "image", self.num_prefix_tokens, readout, grid=self.grid_size(inputs))}

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """The patch embedding's tokens `(B, N, D)`."""
        return {"image": EmbeddingLeaf(self.embeddings.patch_embeddings)}

    def grid_size(self, inputs: torch.Tensor) -> tuple[int, int]:
        return inputs.shape[-2] // self.patch_size[0], inputs.shape[-1] // self.patch_size[1]

    def attention_sites(self) -> list[AttentionSite]:
        # the attention returns (output, probabilities): the probabilities are the tensor that multiplies the values
        return [AttentionSite("image", "image", OutputPart(attention, attention_probabilities)) for attention in self.attentions]

    def attention_inputs(self) -> dict[str, Hookable]:
        last = self.blocks[-1]
        return {"image": last.norm1 if hasattr(last, "norm1") else last.layernorm_before}

    def relevance_rule_map(self) -> dict:
        from .rules import rule_map

        return rule_map(self)

    def class_names(self) -> list[str] | None:
        return None if self.head_kind == "features" else config_class_names(self.model.config)

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """Channels from the config; height and width multiples of the patch size (position embeddings are
        interpolated for sizes other than the model's own)."""
        _, channels, height, width = shape
        (ph, pw), (h, w) = self.patch_size, self.image_size
        if channels == self.channels and height >= ph and width >= pw and height % ph == 0 and width % pw == 0:
            return
        raise ValueError(
            f"this model takes images of shape (B, {self.channels}, H, W) with H a multiple of {ph} and W a multiple of "
            f"{pw} (its patch size; {h}x{w} is its own size, others interpolate the position embeddings), got {shape}"
        )

    # -- running --------------------------------------------------------------------------------------------
    def embed(self, inputs: torch.Tensor, graph: bool = False) -> dict[str, torch.Tensor]:
        if graph and torch.is_grad_enabled() and not inputs.requires_grad:  # a graph even when every weight is frozen
            inputs = inputs.detach().requires_grad_(True)
        return {"image": self.embeddings(inputs, **self.embedding_options)}

    def forward_tokens(
        self, inputs: torch.Tensor, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = tokens["image"]
        for layer in self.blocks:
            hidden = layer(hidden, None)
        return self.head(self.backbone.layernorm(hidden))

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits, pre_logits)` from the final normalised hidden states, as the model's own forward computes them."""
        model, ops = self.model, self.ops
        if self.head_kind == "features":
            features = ops.class_token(hidden)
            return features, features
        if self.head_kind == "class_token":
            features = ops.class_token(hidden)
            return model.classifier(features), features
        if self.head_kind == "teacher":
            logits = ops.average(model.cls_classifier(hidden[:, 0]), model.distillation_classifier(hidden[:, 1]))
            return logits, (hidden[:, 0] + hidden[:, 1]) / 2
        features = torch.cat([ops.class_token(hidden), ops.mean_tokens(hidden[:, self.num_prefix_tokens:])], dim=1)
        return model.classifier(features), features
