"""The rule map of timm's VisionTransformer family: which rule each module and operation gets."""
from __future__ import annotations

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import PASSTHROUGH, ForwardFactory, Replacements, Session, add, branch, first_token, gate, passthrough, unchanged


def _attention(attn: nn.Module, session: Session) -> Replacements:
    """timm `Attention`: the fused q/k/v projection shaped into heads for the shared attention; a gated attention's
    sigmoid gate under the gate rule."""
    gate_layer = getattr(attn, "gate", None)

    def forward(x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise engine.MissingRuleError("relevance propagation does not support attention masks on ViT")
        batch, tokens, _ = x.shape
        qkv = attn.qkv(x).reshape(batch, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        context, _ = attend(session, q, k, v, attn.scale, dropout=attn.attn_drop)
        attended = attn.norm(context.transpose(1, 2).reshape(batch, tokens, -1))
        if gate_layer is not None:
            attended = gate(session, attended, gate_layer(x).sigmoid())
        return attn.proj_drop(attn.proj(attended))

    return {"forward": forward}


def _block(block: nn.Module, session: Session) -> Replacements:
    """timm `Block`: the two residual adds get the residual rule; the input of each feeds two branches."""

    def forward(x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = branch(session, x)
        x = add(session, x, block.drop_path1(block.ls1(block.attn(block.norm1(x), attn_mask=attn_mask, is_causal=is_causal))))
        x = branch(session, x)
        return add(session, x, block.drop_path2(block.ls2(block.mlp(block.norm2(x)))))

    return {"forward": forward}


def _vision_transformer(model: nn.Module, session: Session) -> Replacements:
    """The position-embedding add gets the residual rule; a distilled model's two heads are averaged by it."""
    def pos_embed(x: torch.Tensor) -> torch.Tensor:
        # timm's own _pos_embed (plain, distilled, registers, dynamic size), its addition under the add rule
        prefix = [t.expand(x.shape[0], -1, -1) for t in (model.cls_token, getattr(model, "dist_token", None), model.reg_token) if t is not None]
        if model.pos_embed is None:
            return torch.cat(prefix + [x.reshape(x.shape[0], -1, x.shape[-1])], dim=1)
        position = model.pos_embed
        if getattr(model, "dynamic_img_size", False):
            from timm.layers import resample_abs_pos_embed

            height, width = x.shape[1:3]
            position = resample_abs_pos_embed(
                position,
                new_size=(height, width),
                old_size=model.patch_embed.grid_size,
                num_prefix_tokens=0 if model.no_embed_class else model.num_prefix_tokens,
            )
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if model.no_embed_class:
            return model.pos_drop(torch.cat(prefix + [add(session, x, position)], dim=1))
        return model.pos_drop(add(session, torch.cat(prefix + [x], dim=1), position))

    original_pool = model.pool

    def pool(x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        if model.attn_pool is None and (pool_type or model.global_pool) == "token":
            return first_token(session, x)
        return original_pool(x, pool_type)

    replacements: Replacements = {"_pos_embed": pos_embed, "pool": pool}
    if hasattr(model, "head_dist"):  # DeiT distilled: logits = (head(cls) + head_dist(dist)) / 2

        def forward_head(x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
            if pre_logits:
                return (x[:, 0] + x[:, 1]) / 2
            half = lambda t: t / 2  # noqa: E731
            cls_logits = passthrough(session, half, model.head(model.head_drop(x[:, 0])))
            dist_logits = passthrough(session, half, model.head_dist(model.head_drop(x[:, 1])))
            return add(session, cls_logits, dist_logits)

        replacements["forward_head"] = forward_head
    return replacements


def _swiglu(mlp: nn.Module, session: Session) -> Replacements:
    """timm `SwiGLU`: `fc2(norm(act(fc1_g(x)) * fc1_x(x)))`, the gating product under the gate rule."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        gated = gate(session, mlp.fc1_x(x), mlp.act(mlp.fc1_g(x)))
        return mlp.drop2(mlp.fc2(mlp.norm(mlp.drop1(gated))))

    return {"forward": forward}


def rule_map() -> dict[type, ForwardFactory]:
    """Module type -> rule, for every module a timm VisionTransformer is built from."""
    from timm.layers import DropPath, LayerScale, Mlp, PatchEmbed, SwiGLU
    from timm.models.vision_transformer import Attention, Block, VisionTransformer

    return {
        **engine.default_leaves(),
        VisionTransformer: _vision_transformer,
        Block: _block,
        Attention: _attention,
        Mlp: unchanged,
        SwiGLU: _swiglu,
        PatchEmbed: unchanged,
        DropPath: unchanged,
        LayerScale: PASSTHROUGH,
        nn.Conv2d: engine.PIXEL_CONV,
    }
