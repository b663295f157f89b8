"""The relevance rule map of a vision-language decoder under an explicit rule set (the seeds' LRP pass: the CVPR'21
paper's rules for `transformer_attribution`), over the whole model: decoder, projector and vision tower.

- the decoder: the decoder layout's map (`causal_lm.layouts.rule_map` on the model's `DecoderView`), its parts'
  rule forwards, residual adds and attention as for a text decoder;
- the image's features put at the image's placeholder tokens (`masked_scatter` in the model's own forward), the
  select strategy's crop of [CLS] and a list of `vision_feature_layer`s put side by side: selections, whose
  gradient routes each position's relevance to where it came from (no rule needed);
- the projector: its ruled part's forward (LLaVA's `linear_2(act(linear_1(x)))`: the Linear rule at both Linears,
  alpha1-beta0 under the paper's rules, the activation rule at the GELU, which passes relevance); Idefics3's pixel
  shuffle (reshapes and a permutation, whose gradient routes relevance) and its Linear (the Linear rule); Gemma 3's
  average pooling sharing each pooled value's relevance equally among its patches, its RMSNorm the normalisation
  rule, its product with a bare matrix the Linear rule (`_pooled_projection`);
- the tower's layers: the pre-norm residual adds under the add rule (the layout's `residual`, the decoders' `Residual`;
  InternViT's layer scale a constant factor on each branch, passing relevance),
  their norms and MLPs the layout's rule forwards, their attention relevancy's one attention (`attend`, through the
  configs as for the decoder) under the session, so that it records the tower's probabilities first, in the order
  of the adapter's `Feed` sites, then the decoder's;
- the tower's embeddings (patch convolution, however nested, [CLS], position embedding): relevance stops at their output, the
  tower's input tokens, recorded as the image stream's input (`Session.stream_input`), as the seeds' transformer
  attribution needs the relevance at the attentions only.
"""
from __future__ import annotations

import torch
from torch import nn

from ...lrp.engine import ForwardFactory, Replacements, Session, by_type, linear, unchanged
from ..causal_lm.layouts import Layout, RuleForward, rule_map as decoder_rule_map, session_attribute
from .layouts import GEMMA3, VisionLanguageLayout, decoder_view

#: the name of the tower's stream (the adapter's `Feed` source), under which the session records its input tokens
IMAGE = "image"


def _tower_input(embeddings: nn.Module, session: Session) -> Replacements:
    """The tower's embeddings as they are, their output a leaf of the session's graph recorded as the image stream's
    input: relevance is measured there and goes no further (into the patch convolution and the position table)."""
    own = embeddings.forward
    return {"forward": lambda *args, **kwargs: session.stream_input(IMAGE, own(*args, **kwargs))}


def _pooled_projection(projector: nn.Module, session: Session) -> Replacements:
    """Gemma 3's projector `norm(avg_pool(x)) @ W` with the model's own numbers: the average pooling as the model runs
    it, whose gradient shares each pooled value's relevance equally among its k x k patches (the w^2 rule of a layer of
    equal weights; conserving, where alpha1-beta0 would lose a channel whose block is all negative), the RMSNorm its
    rule forward (the normalisation rule), the product with `mm_input_projection_weight` (a bare matrix, which no
    Linear holds) under the Linear rule."""
    side, weight = projector.patches_per_image, projector.mm_input_projection_weight

    def forward(vision_outputs: torch.Tensor) -> torch.Tensor:
        batch, _, width = vision_outputs.shape
        pooled = projector.avg_pool(vision_outputs.transpose(1, 2).reshape(batch, width, side, side)).flatten(2).transpose(1, 2)
        normed = projector.mm_soft_emb_norm(pooled)
        return linear(session, lambda t: torch.matmul(t, weight), normed, weight.t()).type_as(vision_outputs)

    return {"forward": forward}


def rule_map(model: nn.Module, vision: VisionLanguageLayout, layout: Layout, ruled: list[tuple[nn.Module, RuleForward]]
             ) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of a vision-language decoder (`ruled`: the decoder's, tower's and
    projector's parts with their rule forwards)."""
    transformer = vision.transformer(model)
    layers = list(vision.tower_layers(model))
    embeddings = transformer.embeddings
    return {
        # first, so that the entries after them win where a type is shared (the map is keyed by type): the projector's
        # containers and reshapes (Idefics3's pixel shuffle), whose gradient routes relevance, its Linears and ruled
        # parts (LLaVA's MLP) ruled by the decoder map's leaves and rule forwards below; SigLIP's pooling head, whose
        # output the decoder does not read (no relevance reaches it)
        **by_type([*getattr(model.model, vision.projector).modules(), *getattr(transformer, "head", nn.Identity()).modules()], unchanged),
        **decoder_rule_map(layout, decoder_view(model, vision), ruled),
        **by_type([model.model, getattr(model.model, vision.tower), transformer, transformer.encoder, *embeddings.modules()], unchanged),
        type(embeddings): _tower_input,
        **by_type(layers, vision.residual.rule),
        **by_type([getattr(layer, vision.residual.attention) for layer in layers], session_attribute),
        **({type(model.model.multi_modal_projector): _pooled_projection} if vision is GEMMA3 else {}),
    }
