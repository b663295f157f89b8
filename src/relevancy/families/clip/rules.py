"""Relevance rule maps of CLIP (transformers `CLIPModel`, open_clip `CLIP` / `CustomTextCLIP`): both towers and
the explained pair logit.

No reference code exists for LRP on CLIP: these rules carry the ViT ones (`families/timm_vit/rules.py`) over,
module for module, in both libraries alike (docs/methods.md, "CLIP"):
- pre-LN residual blocks `x + attn(ln_1(x))`, `x + mlp(ln_2(x))`: both adds get the residual rule; the block's
  input feeds two branches, whose relevances add up;
- attention: the q/k/v projections (transformers: three Linears; open_clip: the fused in-projection of its
  `nn.MultiheadAttention`, recomputed from its weights) and the output projection get the Linear rule; both
  products, `(q k^T) * scale` and `A v`, the halved two-operand rule; scale, mask and softmax pass relevance
  unchanged (masked entries get none: their probability is 0). The probabilities are recorded for the methods;
- MLP: both Linears get the Linear rule, (Quick)GELU passes relevance unchanged; LayerNorms (`ln_pre`/`pre_layrnorm`,
  `ln_post`/`post_layernorm`, `ln_final`/`final_layer_norm`, the blocks') and layer scales pass it unchanged;
- embeddings: the patch convolution gets z^B (the pixel layer) and the position embedding's add the residual rule
  (the class embedding is one of the added tokens); text: token + position embedding under the add rule;
- readout: selecting [CLS] / the end-of-text token sends its relevance to that token; the feature projections
  (`visual_projection`, `text_projection`; open_clip's `proj` / `text_projection` parameters) get the Linear rule;
- the pair logit `s = scale * <u/|u|, v/|v|> (+ bias)`: the scale and the normalisations pass relevance (the ratio
  rule, as LayerNorm), the bias gets none (as a Linear's bias), and the cosine's term `k`, `û_k v̂_k`, gets its
  share `R û_k v̂_k / cos`, all of which goes to `u_k` and all to `v_k`. That is the halved two-operand rule with
  each tower's half rescaled to 1: each tower is explained on its own, as a one-tower model with relevance 1 at
  its output, and its map and its conservation (1 per tower) are read on their own, never summed.

Under the gradient rule sets (attnlrp, cp_lrp: `methods.embeddings`) the same map serves: the LayerNorms hold their
divisor constant, (Quick)GELU takes the identity rule, attention shares its backward (`attention.attend`), and the
pair logit's two L2 normalisations hold their divisor constant while the product of the unit vectors takes the
uniform rule (half of the logit to each tower); the zero-shot head's normalisation holds its divisor constant too.

`exact=True` divides with the reference's 1e-9 stabiliser; there is no CLIP reference whose branch (`Clone`) or
readout (`IndexSelect`) factors it would reproduce, so those are not applied.

The pair logit and open_clip's projections are computed outside any module (by the adapter's `ClipTowers`, and by
multiplying with a bare parameter), so the map also replaces `towers.pair_logits` and those parameters (with
`_Projection`) for the session; everything is restored when it ends.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...lrp import gradient, rules
from ...lrp.attention import attend
from ...lrp.engine import (
    ACTIVATION, PASSTHROUGH, PIXEL_CONV, ForwardFactory, MissingRuleError, Replacements, Session, add, default_leaves,
    linear, normalisation, passthrough, unchanged,
)
from ..hf_attention import transformers_leaves
from .towers import IMAGE, TEXT, ClipTowers, towers_of


# -- shared by both libraries ------------------------------------------------------------------------------------
def _dropout(rate: float, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The attention's dropout on its probabilities (active in training mode only, as the module's own)."""
    return lambda probabilities: F.dropout(probabilities, p=rate, training=module.training and rate > 0)


def _pair_rule(
    session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relevance `(P,)` at the pair logits to both features `(P, E)`: each term `û_k v̂_k` of the cosine gets its
    share of `R`, and passes all of it to `u_k` and all to `v_k` (each tower receives the whole `R`)."""
    image, text = inputs
    terms = F.normalize(image, dim=-1) * F.normalize(text, dim=-1)
    cosine, share = terms.sum(-1, keepdim=True), relevance[:, None]
    if session.exact:
        shares = terms * rules.safe_divide(share, cosine)
    else:
        signed, unsigned = rules.stable_quotients(share, cosine, terms.abs().sum(-1, keepdim=True))
        shares = torch.addcmul(terms * signed, terms.abs(), unsigned)
    return shares, shares.clone()


def _unit(session: Session, features: torch.Tensor) -> torch.Tensor:
    """`features / |features|` over the last dimension (`F.normalize`) under the normalisation rule: relevance
    passed unchanged in the explicit pass, the divisor (the L2 norm) constant in the gradient form."""
    return normalisation(session, lambda f: F.normalize(f, dim=-1),
                         lambda f: gradient.norm_identity(f, f.norm(dim=-1, keepdim=True).clamp_min(1e-12)), features)


def _pair_logits(towers: ClipTowers) -> ForwardFactory:
    """The model itself: its towers' pair logits (computed outside any module) under the pair rule."""

    def factory(model: nn.Module, session: Session) -> Replacements:
        if model is not towers.model:
            raise MissingRuleError(f"no relevance rule for a {type(model).__name__} inside the explained CLIP model")
        original = towers.pair_logits

        def pair_logits(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
            if session.rule_set.explicit:
                return session.apply(_pair_rule, original, image_features, text_features)
            # the gradient form: the uniform rule on the product of the two unit vectors (half to each)
            image, text = (gradient.share(_unit(session, f), 0.5) for f in (image_features, text_features))
            return towers.scaled_logits((image * text).sum(-1))

        return {(towers, "pair_logits"): pair_logits, **_projection(model, "text_projection", session)}

    return factory


class _Projection:
    """Stands in for a projection parameter `P` during a session: open_clip computes `pooled @ P` with the bare
    parameter, which no module wraps; `pooled @ _Projection(P)` computes the same product under the Linear rule."""

    def __init__(self, session: Session, weight: torch.Tensor) -> None:
        self.session, self.weight = session, weight

    def __rmatmul__(self, pooled: torch.Tensor) -> torch.Tensor:
        return linear(self.session, lambda x: x @ self.weight, pooled, self.weight.t())


def _projection(owner: nn.Module, name: str, session: Session) -> Replacements:
    """Replaces `owner.<name>` by a `_Projection` when it is a bare parameter (an nn.Linear has its own rule)."""
    weight = getattr(owner, name, None)
    return {name: _Projection(session, weight)} if isinstance(weight, torch.Tensor) else {}


def _blocks(blocks: dict[str, list[nn.Module]], make: Callable[[nn.Module, Session, str], Replacements]) -> ForwardFactory:
    """An entry for the residual blocks of both towers; `make(block, session, tower)` gives the block's forward."""
    tower_of = {block: tower for tower, members in blocks.items() for block in members}

    def factory(block: nn.Module, session: Session) -> Replacements:
        if block not in tower_of:
            raise MissingRuleError(f"no relevance rule for a {type(block).__name__} outside the two CLIP towers")
        return make(block, session, tower_of[block])

    return factory


def _record_input(session: Session, tower: str, tokens: torch.Tensor) -> None:
    session.block_inputs.setdefault(tower, []).append(tokens)


# -- transformers ------------------------------------------------------------------------------------------------
def _hf_layer(layer: nn.Module, session: Session, tower: str) -> Replacements:
    """`CLIPEncoderLayer`: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, both adds under the residual rule."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _record_input(session, tower, hidden_states)
        attended, _ = layer.self_attn(layer.layer_norm1(hidden_states), attention_mask=attention_mask, **kwargs)
        x = add(session, hidden_states, attended)
        return add(session, x, layer.mlp(layer.layer_norm2(x)))

    return {"forward": forward}


def _hf_attention(attention: nn.Module, session: Session) -> Replacements:
    """`CLIPAttention`: projections shaped into heads for the shared attention (whatever attention implementation
    the config names); returns `(output, probabilities)` as the eager implementation does."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> tuple:
        batch, tokens, _ = hidden_states.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, tokens, -1, attention.head_dim).transpose(1, 2)

        q, k, v = (heads(project(hidden_states)) for project in (attention.q_proj, attention.k_proj, attention.v_proj))
        output, probabilities = attend(session, q, k, v, attention.scale, attention_mask,
                                       causal=bool(kwargs.get("is_causal")), dropout=_dropout(attention.dropout, attention))
        return attention.out_proj(output.transpose(1, 2).reshape(batch, tokens, -1)), probabilities

    return {"forward": forward}


def _hf_vision_embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`CLIPVisionEmbeddings`: patch convolution (z^B), class embedding, position embedding under the add rule."""

    def forward(pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        if not interpolate_pos_encoding and (height != embeddings.image_size or width != embeddings.image_size):
            size = embeddings.image_size
            raise ValueError(f"Input image size ({height}*{width}) doesn't match model ({size}*{size}).")
        patches = embeddings.patch_embedding(pixel_values.to(embeddings.patch_embedding.weight.dtype))
        tokens = torch.cat([embeddings.class_embedding.expand(batch, 1, -1), patches.flatten(2).transpose(1, 2)], dim=1)
        if interpolate_pos_encoding:
            position = embeddings.interpolate_pos_encoding(tokens, height, width)
        else:
            position = embeddings.position_embedding(embeddings.position_ids)
        return add(session, tokens, position)

    return {"forward": forward}


def _hf_text_embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`CLIPTextEmbeddings`: token + position embedding under the add rule."""

    def forward(input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        length = input_ids.shape[-1] if input_ids is not None else inputs_embeds.shape[-2]
        if position_ids is None:
            position_ids = embeddings.position_ids[:, :length]
        if inputs_embeds is None:
            inputs_embeds = embeddings.token_embedding(input_ids)
        return add(session, inputs_embeds, embeddings.position_embedding(position_ids))

    return {"forward": forward}


def _transformers_map(towers: ClipTowers) -> dict[type, ForwardFactory]:
    from transformers.models.clip import modeling_clip as clip

    model = towers.model
    blocks = {IMAGE: list(model.vision_model.encoder.layers), TEXT: list(model.text_model.encoder.layers)}
    table: dict[type, ForwardFactory] = {
        clip.CLIPModel: _pair_logits(towers),
        clip.CLIPVisionModel: unchanged,
        clip.CLIPTextModel: unchanged,
        clip.CLIPVisionEmbeddings: _hf_vision_embeddings,
        clip.CLIPTextEmbeddings: _hf_text_embeddings,
        clip.CLIPEncoder: unchanged,
        clip.CLIPEncoderLayer: _blocks(blocks, _hf_layer),
        clip.CLIPAttention: _hf_attention,
        clip.CLIPMLP: unchanged,
        nn.Conv2d: PIXEL_CONV,
    }
    return {**transformers_leaves(), **table}


# -- open_clip ---------------------------------------------------------------------------------------------------
def _open_clip_block(block: nn.Module, session: Session, tower: str) -> Replacements:
    """`ResidualAttentionBlock`: `x + ls_1(attn(ln_1(x)))`, then `x + ls_2(mlp(ln_2(x)))`, both adds under the
    residual rule; the attention recomputed from its `nn.MultiheadAttention`'s weights (batch first inside)."""
    if hasattr(block, "ln_1_kv"):
        raise MissingRuleError("no relevance rule for open_clip cross-attention blocks")
    attn: nn.MultiheadAttention = block.attn

    def forward(q_x: torch.Tensor, k_x: torch.Tensor | None = None, v_x: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if k_x is not None or v_x is not None:
            raise MissingRuleError("no relevance rule for open_clip cross-attention")
        x = q_x if attn.batch_first else q_x.transpose(0, 1)
        _record_input(session, tower, x)
        x = add(session, x, block.ls_1(_open_clip_attention(session, attn, block.ln_1(x), attn_mask)))
        x = add(session, x, block.ls_2(block.mlp(block.ln_2(x))))
        return x if attn.batch_first else x.transpose(0, 1)

    return {"forward": forward}


def _open_clip_attention(
    session: Session, attn: nn.MultiheadAttention, x: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """Self-attention of `x` `(B, T, D)` from the module's in-projection and output projection; `attn_mask` as
    open_clip passes it: `(T, T)` or `(B * heads, T, T)`, additive once cast to the tokens' dtype (as its block does)."""
    batch, tokens, width = x.shape
    heads = attn.num_heads
    qkv = linear(session, lambda t: F.linear(t, attn.in_proj_weight, attn.in_proj_bias), x, attn.in_proj_weight)
    q, k, v = (t.reshape(batch, tokens, heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    mask = None
    if attn_mask is not None:
        mask = attn_mask.to(x.dtype)
        mask = mask.reshape(batch, heads, tokens, tokens) if mask.ndim == 3 else mask
    output, _ = attend(session, q, k, v, (width // heads) ** -0.5, mask, dropout=_dropout(attn.dropout, attn))
    return attn.out_proj(output.transpose(1, 2).reshape(batch, tokens, width))


def _refused(_module: nn.Module, _session: Session) -> Replacements:
    """`nn.MultiheadAttention` run as a module: its fused kernel has no rule (the blocks recompute it instead)."""

    def forward(*_args, **_kwargs) -> torch.Tensor:
        raise MissingRuleError("no relevance rule for nn.MultiheadAttention outside an open_clip ResidualAttentionBlock")

    return {"forward": forward}


def _open_clip_visual(visual: nn.Module, session: Session) -> Replacements:
    """open_clip `VisionTransformer`: its embedding (z^B at `conv1`, class token, the position add under the add rule,
    `ln_pre`) and its `proj` parameter under the Linear rule; pooling [CLS] and `ln_post` need no rule."""
    if visual.attn_pool is not None:
        raise MissingRuleError("no relevance rule for open_clip attentional pooling")

    def embeds(x: torch.Tensor) -> torch.Tensor:
        x = visual.conv1(x)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        cls = visual.class_embedding.view(1, 1, -1).expand(x.shape[0], -1, -1).to(x.dtype)
        x = add(session, torch.cat([cls, x], dim=1), visual.positional_embedding.to(x.dtype))
        return visual.ln_pre(visual.patch_dropout(x))

    return {"_embeds": embeds, **_projection(visual, "proj", session)}


def _open_clip_text(text: nn.Module, session: Session) -> Replacements:
    """open_clip `TextTransformer` (CustomTextCLIP's text tower): its `text_projection` parameter under the Linear rule."""
    return _projection(text, "text_projection", session)


def _open_clip_map(towers: ClipTowers) -> dict[type, ForwardFactory]:
    from open_clip import model as oc_model
    from open_clip import transformer as oc

    model = towers.model
    text = model.text if hasattr(model, "text") else model
    blocks = {IMAGE: list(model.visual.transformer.resblocks), TEXT: list(text.transformer.resblocks)}
    return {
        **default_leaves(),
        oc_model.CLIP: _pair_logits(towers),
        oc_model.CustomTextCLIP: _pair_logits(towers),
        oc.VisionTransformer: _open_clip_visual,
        oc.TextTransformer: _open_clip_text,
        oc.Transformer: unchanged,
        oc.ResidualAttentionBlock: _blocks(blocks, _open_clip_block),
        nn.MultiheadAttention: _refused,
        oc.LayerScale: PASSTHROUGH,
        oc.QuickGELU: ACTIVATION,
        oc.PatchDropout: unchanged,
        nn.Conv2d: PIXEL_CONV,
    }


def rule_map(towers: ClipTowers) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of the towers' CLIP model (its library's map)."""
    return _transformers_map(towers) if towers.library == "transformers" else _open_clip_map(towers)


def zero_shot_rule_map(classifier: nn.Module) -> dict[type, ForwardFactory]:
    """The rules of a `ZeroShotClassifier`: its CLIP's, plus the head `scale * normalise(u) @ C^T` (the class
    prompts' features `C` are constants): scale and normalisation pass relevance, the product with `C` gets the
    Linear rule, as a ViT's classifier head does."""
    from .zero_shot import ZeroShotClassifier

    def head(module: nn.Module, session: Session) -> Replacements:
        def logits_from_features(image_features: torch.Tensor) -> torch.Tensor:
            unit = _unit(session, image_features)
            classes = module.class_features.to(unit)
            cosines = linear(session, lambda x: x @ classes.T, unit, classes)
            return passthrough(session, lambda c: c * module.clip.logit_scale.exp(), cosines)

        return {"logits_from_features": logits_from_features}

    return {ZeroShotClassifier: head, **rule_map(towers_of(classifier.clip))}
