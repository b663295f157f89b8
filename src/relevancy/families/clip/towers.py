"""A library-neutral view of a CLIP model's two towers, for explanation methods that never touch library code.

Supported: `transformers.CLIPModel` and open_clip's `CLIP` / `CustomTextCLIP` with a `VisionTransformer` image
tower and plain `ResidualAttentionBlock`s, used unmodified. `towers_of(model)` gives both towers' features, the
scaled pair logits, the tokens that enter the blocks (for token ablation) and `explaining()`, a context in which
every forward records each block's attention probabilities on the autograd path:

* transformers: the configs' attention implementation is switched to an eager attention registered under
  `EXACT_ATTENTION` whose softmax runs in the model's dtype (float32 for half precision), so float64 models are
  exact (stock eager attention computes it in float32; sdpa returns no probabilities). Its mask function is
  registered under the same name, otherwise transformers gives the text tower no causal mask.
* open_clip: `nn.MultiheadAttention` is called with `need_weights=False`, and the weights it can return are off
  the autograd path; each block's `attention` is replaced (an instance attribute) by the same attention
  recomputed from `attn.in_proj_*` and `attn.out_proj`, with the mask open_clip passes (causal for text).

Everything is restored when the context ends, also after an exception; the parameters are never changed.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...core.guard import exclusive, this_thread_only
from ...lrp.attention import SCALED_QUERIES, attend
from .._shared import UnsupportedModelError, eval_mode, transformers_configs
from ..hf_attention import EXACT_ATTENTION, on_graph, register_exact_attention, switch_attention

IMAGE, TEXT = "image", "text"
TOWERS = (IMAGE, TEXT)


def clip_library(model: nn.Module) -> str | None:
    """"open_clip" or "transformers" for a supported CLIP model, None for anything else; raises for a CLIP model
    whose image tower is not a vision transformer (a ResNet or timm tower)."""
    oc = sys.modules.get("open_clip.model")  # only loaded if the model can be an open_clip model
    if oc is not None and isinstance(model, (oc.CLIP, oc.CustomTextCLIP)):
        from open_clip.transformer import VisionTransformer

        if not isinstance(model.visual, VisionTransformer):
            raise UnsupportedModelError(
                f"this open_clip CLIP model has a {type(model.visual).__name__} image tower; relevancy explains CLIP "
                "models with a vision transformer (ViT) image tower only (ModifiedResNet towers are not supported)"
            )
        return "open_clip"
    hf = sys.modules.get("transformers.models.clip.modeling_clip")
    if hf is not None and isinstance(model, hf.CLIPModel):
        return "transformers"
    return None


@dataclass
class Recorder:
    """What the latest forward pass of each tower ("image", "text") inside `ClipTowers.explaining` saw."""

    # per tower, per block: the attention probabilities (B, heads, N, N) that multiply the values, on the graph
    attentions: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {t: [] for t in TOWERS})
    # per tower: the normalised tokens entering the last block's attention (its first LayerNorm's output), (B, N, D)
    last_inputs: dict[str, torch.Tensor | None] = field(default_factory=lambda: {t: None for t in TOWERS})
    # per tower: how many forward passes ran inside the context
    passes: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TOWERS})
    # hooks called as a tensor is recorded: ("attention", tower, block) or ("input", tower) -> hooks
    listeners: dict[tuple, list[Callable]] = field(default_factory=dict)

    def listen(self, key: tuple, hook: Callable) -> "Listening":
        """Call `hook(None, (), tensor)` (a forward hook's signature) whenever the tensor named by `key` is recorded."""
        self.listeners.setdefault(key, []).append(hook)
        return Listening(self.listeners[key], hook)

    def _notify(self, key: tuple, tensor: torch.Tensor) -> None:
        for hook in list(self.listeners.get(key, ())):
            hook(None, (), tensor)

    def _attention(self, tower: str, block: int, probs: torch.Tensor) -> None:
        """Store block `block`'s probabilities; block 0 starts a new pass of `tower`."""
        if block == 0:
            self.attentions[tower] = []
            self.passes[tower] += 1
        self.attentions[tower].append(probs)
        self._notify(("attention", tower, block), probs)

    def _last_input(self, tower: str, tokens: torch.Tensor) -> None:
        self.last_inputs[tower] = tokens
        self._notify(("input", tower), tokens)


@dataclass
class Listening:
    """A registered recorder hook; `remove()` unregisters it (as a torch hook handle)."""

    hooks: list
    hook: Callable

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class ClipTowers:
    """The image and text towers of a CLIP model (open_clip or transformers), seen the same way."""

    library: str
    image_depth: int
    text_depth: int
    image_heads: int
    text_heads: int
    patch_size: tuple[int, int]
    context_length: int

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def grid_size(self, images: torch.Tensor) -> tuple[int, int]:
        """The patch grid (rows, columns) of `images` (B, 3, H, W)."""
        return images.shape[-2] // self.patch_size[0], images.shape[-1] // self.patch_size[1]

    def pair_logits(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """(P,) the model's logit of each pair (row i of both): exp(logit_scale) * cosine (+ logit_bias if any)."""
        if image_features.shape != text_features.shape:
            shapes = f"{tuple(image_features.shape)} and {tuple(text_features.shape)}"
            raise ValueError(f"pair_logits pairs row i of both: the features must have one shape, got {shapes}")
        return self.scaled_logits((F.normalize(image_features, dim=-1) * F.normalize(text_features, dim=-1)).sum(-1))

    def scaled_logits(self, cosine: torch.Tensor) -> torch.Tensor:
        """The logits of cosines as the model makes them: exp(logit_scale) * cosine (+ logit_bias if any)."""
        logits = self.logit_scale() * cosine
        bias = getattr(self.model, "logit_bias", None)
        return logits if bias is None else logits + bias.reshape(())

    def logit_scale(self) -> torch.Tensor:
        """The scalar that multiplies the cosine, exp(logit_scale), as the model applies it."""
        return self.model.logit_scale.exp().reshape(())

    @contextmanager
    def explaining(self) -> Iterator[Recorder]:
        """Eval mode and recording attention for the block; everything switched is restored on exit."""
        recorder = Recorder()
        with exclusive(self.model, *self._shared_state()):
            undo: list[Callable[[], None]] = []
            with eval_mode(self.model):
                try:
                    self._install(recorder, undo)
                    yield recorder
                finally:
                    for step in reversed(undo):
                        step()

    # implemented per library
    def _shared_state(self) -> list[object]:
        return []

    def _install(self, recorder: Recorder, undo: list[Callable[[], None]]) -> None:
        raise NotImplementedError

    def readout_index(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B,) the position whose output the text tower pools (the end-of-text token), as the model chooses it."""
        raise NotImplementedError

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, E) projected image features, not normalised."""
        raise NotImplementedError

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, E) projected text features, not normalised; `attention_mask` (B, T), 0 at padding, is optional."""
        raise NotImplementedError

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 + h*w, D) the tokens entering the first block: CLS and patches plus positions, after the
        pre-LayerNorm both libraries apply before the blocks (transformers `pre_layrnorm`, open_clip `ln_pre`)."""
        raise NotImplementedError

    def image_features_from_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, E) image features from tokens as `image_tokens` returns them (tokens may be left out; CLS first)."""
        raise NotImplementedError

    def text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, D) the tokens entering the first text block: token plus position embeddings."""
        raise NotImplementedError

    def text_features_from_tokens(
        self, tokens: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, E) text features from `text_tokens` output; `keep` (B, T) bool: a False token is masked out of every
        attention as a key (its own row keeps only itself, so no row is empty), the causal mask stays."""
        raise NotImplementedError

    def embedding_modules(self) -> dict[str, nn.Module]:
        """Per tower, the module whose output is its input embeddings (where input relevance is read): the patch
        convolution `(B, D, h, w)` and the token embedding `(B, T, D)`, before [CLS] and positions are added."""
        raise NotImplementedError


def _keep_mask(keep: torch.Tensor, causal: bool, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool, True where a query may attend to a key: kept keys (always itself), causal if asked."""
    n = tokens.shape[1]
    if keep.shape != tokens.shape[:2]:
        raise ValueError(f"keep must be (B, T) = {tuple(tokens.shape[:2])}, got {tuple(keep.shape)}")
    eye = torch.eye(n, dtype=torch.bool, device=tokens.device)
    allowed = keep.to(device=tokens.device, dtype=torch.bool)[:, None, :] | eye
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    return allowed


# ------------------------------------------------------------------------------------------------ transformers
class _TransformersTowers(ClipTowers):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.library = "transformers"
        vision, text = model.config.vision_config, model.config.text_config
        self._vision, self._text = model.vision_model, model.text_model
        self._blocks = {IMAGE: list(self._vision.encoder.layers), TEXT: list(self._text.encoder.layers)}
        self.image_depth, self.text_depth = len(self._blocks[IMAGE]), len(self._blocks[TEXT])
        self.image_heads, self.text_heads = vision.num_attention_heads, text.num_attention_heads
        self.patch_size = (vision.patch_size, vision.patch_size)
        self.context_length = text.max_position_embeddings
        self._image_size = vision.image_size
        self._eos = text.eos_token_id

    def _shared_state(self) -> list[object]:
        return transformers_configs(self.model)

    def _install(self, recorder: Recorder, undo: list[Callable[[], None]]) -> None:
        register_exact_attention()
        undo.append(switch_attention(transformers_configs(self.model), EXACT_ATTENTION))
        for tower, blocks in self._blocks.items():
            for index, layer in enumerate(blocks):
                hook = layer.self_attn.register_forward_hook(this_thread_only(
                    lambda _m, _args, out, tower=tower, index=index: recorder._attention(tower, index, out[1])
                ))
                undo.append(hook.remove)
            hook = blocks[-1].layer_norm1.register_forward_hook(this_thread_only(
                lambda _m, _args, out, tower=tower: recorder._last_input(tower, out)
            ))
            undo.append(hook.remove)

    def readout_index(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.long()
        if self._eos == 2:  # legacy configs: transformers takes the largest id, as OpenAI's CLIP does
            return ids.argmax(-1)
        return (ids == self._eos).int().argmax(-1)

    def _interpolate(self, images: torch.Tensor) -> bool:
        return tuple(images.shape[-2:]) != (self._image_size, self._image_size)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        out = self._vision(pixel_values=images, interpolate_pos_encoding=self._interpolate(images))
        return self.model.visual_projection(out.pooler_output)

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self._text(input_ids=input_ids, attention_mask=attention_mask)
        return self.model.text_projection(out.pooler_output)

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self._vision.embeddings(images, interpolate_pos_encoding=self._interpolate(images))
        return self._vision.pre_layrnorm(tokens)

    def image_features_from_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self._vision.encoder(inputs_embeds=tokens).last_hidden_state
        return self.model.visual_projection(self._vision.post_layernorm(hidden[:, 0]))

    def text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._text.embeddings(input_ids=input_ids)

    def embedding_modules(self) -> dict[str, nn.Module]:
        return {IMAGE: self._vision.embeddings.patch_embedding, TEXT: self._text.embeddings.token_embedding}

    def text_features_from_tokens(
        self, tokens: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        if keep is None:
            keep = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        allowed = _keep_mask(keep, causal=True, tokens=tokens)
        mask = torch.zeros(allowed.shape, dtype=tokens.dtype, device=tokens.device)
        mask = mask.masked_fill(~allowed, torch.finfo(tokens.dtype).min)[:, None]  # (B, 1, T, T), as transformers
        hidden = self._text.encoder(inputs_embeds=tokens, attention_mask=mask).last_hidden_state
        return self.model.text_projection(_rows(self._text.final_layer_norm(hidden), self.readout_index(input_ids)))


# ------------------------------------------------------------------------------------------------ open_clip
class _OpenClipTowers(ClipTowers):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        from open_clip.transformer import ResidualAttentionBlock, TextTransformer

        self.library = "open_clip"
        visual = self._visual = model.visual
        if visual.attn_pool is not None or visual.pool_type != "tok":
            raise UnsupportedModelError(
                "relevancy explains open_clip image towers that pool the CLS token (pool_type 'tok', no attentional "
                f"pooler); this one has pool_type {visual.pool_type!r}"
                + (" and an attentional pooler" if visual.attn_pool is not None else "")
            )
        if hasattr(model, "text"):  # CustomTextCLIP: the text tower is a module of its own
            if not isinstance(model.text, TextTransformer):
                kind = type(model.text).__name__
                raise UnsupportedModelError(f"relevancy explains open_clip TextTransformer text towers, not {kind}")
            text = self._text_tower = model.text
            self._pool, self._eos = text.pool_type, getattr(text, "eos_id", None)
            self._pad_mask = text.pad_id if text.use_pad_mask else None  # bidirectional towers that mask padding
            if text.cls_emb is not None:
                raise UnsupportedModelError("relevancy does not explain open_clip text towers with an appended CLS")
        else:
            text = self._text_tower = model  # open_clip's CLIP keeps the text tower's parts on the model itself
            self._pool, self._eos, self._pad_mask = model.text_pool_type, getattr(model, "text_eos_id", None), None
        if self._pool not in ("argmax", "eos", "first", "last"):
            raise UnsupportedModelError(f"open_clip text pool_type {self._pool!r} does not pool one token")
        self._blocks = {IMAGE: list(visual.transformer.resblocks), TEXT: list(text.transformer.resblocks)}
        for tower, blocks in self._blocks.items():
            for block in blocks:
                attn = getattr(block, "attn", None)
                if type(block) is not ResidualAttentionBlock or hasattr(block, "ln_1_kv") or not (
                    isinstance(attn, nn.MultiheadAttention) and attn._qkv_same_embed_dim and attn.bias_k is None
                    and not attn.add_zero_attn
                ):
                    raise UnsupportedModelError(
                        f"relevancy explains open_clip towers of plain ResidualAttentionBlocks; the {tower} tower "
                        f"has a {type(block).__name__} whose attention it cannot recompute"
                    )
        self.image_depth, self.text_depth = len(self._blocks[IMAGE]), len(self._blocks[TEXT])
        self.image_heads = self._blocks[IMAGE][0].attn.num_heads
        self.text_heads = self._blocks[TEXT][0].attn.num_heads
        self.patch_size = tuple(visual.patch_size)
        self.context_length = text.context_length

    def _install(self, recorder: Recorder, undo: list[Callable[[], None]]) -> None:
        for tower, blocks in self._blocks.items():
            for index, block in enumerate(blocks):
                last = index == len(blocks) - 1
                previous = block.__dict__.get("attention")

                def attention(q_x, k_x=None, v_x=None, attn_mask=None, block=block, tower=tower, index=index,
                              last=last):
                    if k_x is not None or v_x is not None:
                        raise UnsupportedModelError("relevancy records self-attention only, not cross-attention")
                    return _recomputed_attention(block.attn, q_x, attn_mask, recorder, tower, index, last)

                block.attention = attention
                undo.append(lambda block=block, previous=previous: _restore_attribute(block, "attention", previous))

    def readout_index(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.long()
        if self._pool == "argmax":
            return ids.argmax(-1)
        if self._pool == "eos":
            return (ids == self._eos).int().argmax(-1)
        position = 0 if self._pool == "first" else ids.shape[-1] - 1
        return torch.full(ids.shape[:1], position, dtype=torch.long, device=ids.device)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        out = self._visual(images)
        return out[0] if isinstance(out, tuple) else out

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:  # open_clip takes no padding mask: mask padded keys as transformers does
            return self.text_features_from_tokens(self.text_tokens(input_ids), input_ids, attention_mask.bool())
        out = self._text_tower(input_ids) if self._text_tower is not self.model else self.model.encode_text(input_ids)
        return out[0] if isinstance(out, tuple) else out

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        return self._visual._embeds(images)

    def image_features_from_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        pooled, _ = self._visual._pool(self._visual.transformer(tokens))
        return pooled @ self._visual.proj if self._visual.proj is not None else pooled

    def embedding_modules(self) -> dict[str, nn.Module]:
        return {IMAGE: self._visual.conv1, TEXT: self._text_tower.token_embedding}

    def text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        text = self._text_tower
        dtype = text.transformer.get_cast_dtype()
        return text.token_embedding(input_ids).to(dtype) + text.positional_embedding[: input_ids.shape[-1]].to(dtype)

    def text_features_from_tokens(
        self, tokens: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        text = self._text_tower
        n = tokens.shape[1]
        causal = text.attn_mask[:n, :n] if text.attn_mask is not None else None
        if self._pad_mask is not None:
            real = input_ids != self._pad_mask
            keep = real if keep is None else keep.bool() & real
        if keep is None:
            mask = causal  # exactly what open_clip passes
        else:
            allowed = _keep_mask(keep, causal=causal is not None, tokens=tokens)
            mask = torch.zeros(allowed.shape, dtype=tokens.dtype, device=tokens.device)
            mask = mask.masked_fill(~allowed, float("-inf")).repeat_interleave(self.text_heads, 0)  # (B*H, T, T)
        hidden = text.ln_final(text.transformer(tokens, attn_mask=mask))
        pooled = _rows(hidden, self.readout_index(input_ids))
        projection = text.text_projection
        if projection is None:
            return pooled
        return projection(pooled) if isinstance(projection, nn.Linear) else pooled @ projection


def _recomputed_attention(
    attn: nn.MultiheadAttention, x: torch.Tensor, attn_mask: torch.Tensor | None, recorder: Recorder, tower: str,
    index: int, last: bool,
) -> torch.Tensor:
    """open_clip's self-attention, computed from the MultiheadAttention's weights with the probabilities recorded."""
    if not attn.batch_first:
        x = x.transpose(0, 1)
    batch, n, width = x.shape
    heads = attn.num_heads
    if last:
        recorder._last_input(tower, x)
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(batch, n, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    mask = None
    if attn_mask is not None:
        mask = attn_mask.to(x.dtype)  # as open_clip's block casts it before nn.MultiheadAttention adds it
        mask = mask.reshape(batch, heads, n, n) if mask.ndim == 3 else mask
    if attn.dropout > 0.0 and attn.training:
        drop = lambda p: F.dropout(on_graph(p), p=attn.dropout, training=True)  # noqa: E731
    else:
        drop = on_graph
    context, probs = attend(None, q, k, v, (width // heads) ** -0.5, mask, style=SCALED_QUERIES, dropout=drop)
    recorder._attention(tower, index, probs)
    out = context.transpose(1, 2).reshape(batch, n, width)
    out = F.linear(out, attn.out_proj.weight, attn.out_proj.bias)
    return out if attn.batch_first else out.transpose(0, 1)


def _rows(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, D) `hidden[b, positions[b]]`."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), positions.to(hidden.device)]


def _restore_attribute(owner: object, name: str, previous: object) -> None:
    """Put back the instance attribute `name` as it was (`previous`), or delete it if there was none."""
    if previous is None:
        owner.__dict__.pop(name, None)
    else:
        owner.__dict__[name] = previous


def towers_of(model: nn.Module) -> ClipTowers:
    """The towers of a CLIP model, seen through its library's `ClipTowers`; a clear error for any other model."""
    library = clip_library(model)
    if library is None:
        raise UnsupportedModelError(
            f"{type(model).__module__}.{type(model).__name__} is not a CLIP model relevancy knows "
            "(transformers.CLIPModel, open_clip.model.CLIP or CustomTextCLIP)"
        )
    return _OpenClipTowers(model) if library == "open_clip" else _TransformersTowers(model)
