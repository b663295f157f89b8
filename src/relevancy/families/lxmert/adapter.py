"""Hugging Face LXMERT: a question stream (`text`) and a regions stream (`image`) that attend to each other.

Supported, used unmodified: `transformers.LxmertForQuestionAnswering`, `LxmertForPreTraining` (with its QA head,
`task_qa`; its `question_answering_score` is explained) and any module holding one `LxmertModel` whose forward takes
LXMERT's keyword inputs and returns answer logits `(B, K)` (a tensor, or an output with `question_answering_score`
or `logits`). The maps are read at the question's [CLS] row, the token LXMERT's pooler reads. The LRP-based methods
(`generic_attention(weights="relevance")`, `transformer_attribution`, `partial_lrp`) run the authors' LXMERT rules
(`lxmert.rules`) and so explain the first two only, whose every module has a rule.

`cdam` reads X at the last cross-modality layer's two inputs, the language and the visual tokens its
cross-attention reads (`x_layers[-1]`'s `lang_feats` and `visual_feats`, LayerNorm-ed outputs of the layer before:
LXMERT is post-LN): the last place where both streams enter the [CLS] answer (the last layer's visual
self-attention never reaches [CLS], so "the tokens entering the image stream's last attention" would score
nothing). `token_ablation` drops one question token (its word, position and type embedding, and its attention
mask entry; the others keep their positions, as for every family) or one region (its feature and box embedding
and its `visual_attention_mask` entry) before the first block and re-runs the model's own forward on what
remains; the [CLS] token's entry is 0 (`cls_entry="zero"`: the answer is read from it, it is no content to
remove). A question of one token or an image of one region cannot lose it (transformers' LXMERT does not run on
an empty stream): an error names it.

Attention sites, in forward order: the language layers (text self), the relation layers `r_layers` (image self),
then per cross layer `g`: its `visual_attention` run twice, text queries over image keys first, image queries over
text keys second (one module, two calls; both in group `g`, one co-attention step), then `lang_self_att` (text
self) and `visn_self_att` (image self). Each site's probabilities are the output of the attention's dropout
module: the softmax output itself in eval mode (LXMERT computes its softmax in the model's dtype, so float64
models are exact, and switches no attention implementation).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ...core.conventions import (
    Conventions, GenericAttentionConventions, GradCamConventions, LrpConventions, ReadoutConventions, RolloutConventions,
    TransformerAttributionConventions,
)
from ...results.explanation import RegionTextExplanation
from ...core.streams import AttentionSite, Hookable, Stream
from ...core.guard import this_thread_only
from ..base import UnsupportedModelError
from ..hf_attention import explaining_call
from ..regions import (
    METHODS, InputPart, RegionAdapter, answer_logits, check_regions, class_names, feature_tensor, inner_model, lift,
    on_graph, token_strings,
)
from .batch import LxmertBatch

TEXT, IMAGE = "text", "image"
# the region families' methods and the LRP-based ones LXMERT's relevance rules add, in the registry's order
LXMERT_METHODS = (*METHODS[:4], "transformer_attribution", "partial_lrp", *METHODS[4:])
REQUIRED = ("input_ids", "visual_feats", "visual_pos")
OPTIONAL = ("attention_mask", "token_type_ids", "visual_attention_mask")


def lxmert_model(model: nn.Module) -> nn.Module | None:
    """The one `LxmertModel` inside `model` (itself included); None when there is none; an error for several."""
    return inner_model(model, "transformers.models.lxmert.modeling_lxmert", "LxmertModel")


@dataclass
class _Handles:
    """Several hook handles removed as one (what `register_forward_hook` of a `ModuleCall` returns)."""

    handles: list

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ModuleCall:
    """The `call`-th run (0-based) of `module` within each forward of `owner`, hookable like a module.

    LXMERT's cross layer runs its one `visual_attention` twice (text queries, then image queries): a hook on the
    module alone would see both. Each registration counts the runs itself (reset when `owner` starts), so nothing
    is kept on the adapter; a run beyond `calls` means the model is not the one this adapter knows, and is an error.
    """

    def __init__(self, module: nn.Module, owner: nn.Module, call: int, calls: int) -> None:
        self.module, self.owner, self.call, self.calls = module, owner, call, calls

    def register_forward_hook(self, hook: Callable) -> _Handles:
        count = [0]

        def reset(_module: nn.Module, _args: tuple) -> None:
            count[0] = 0

        def observe(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            index = count[0]
            count[0] += 1
            if index >= self.calls:
                raise RuntimeError(
                    f"{type(self.module).__name__} ran {index + 1} times in one {type(self.owner).__name__}; relevancy "
                    f"expects {self.calls} (the model differs from transformers' LXMERT)"
                )
            if index == self.call:
                hook(module, args, output)

        return _Handles([self.owner.register_forward_pre_hook(this_thread_only(reset)),
                         self.module.register_forward_hook(this_thread_only(observe))])

    def __repr__(self) -> str:
        return f"ModuleCall({type(self.module).__name__}, call {self.call} of {self.calls} per {type(self.owner).__name__})"


class LxmertAdapter(RegionAdapter):
    """LXMERT question answering over image regions (see the module docstring).

    `conventions`, where the authors' LXMERT code differs from their ViT code (every entry but `readout_rollout`
    is also a keyword option): the [CLS] entry of the text map is set to 0 for every method ("disregard the [CLS]
    token itself"); `attention_gradcam` averages the gradient over the whole attention matrix (`region="matrix"`)
    and is not normalised; the LRP-based methods use the conserving ("paper") rules of `lxmert.rules`, and
    `transformer_attribution`'s text map rolls out every text self-attention (`readout_rollout`, their
    `generate_transformer_attr`). `token_ablation` (no reference) also scores the [CLS] token 0: the pooler reads the
    answer from it, so removing it would read another token. `cdam` (no reference, no such option) keeps the [CLS]
    entry, gradient x input like every other token's.
    """

    family = "Hugging Face LXMERT (question answering over image regions)"
    examples = "LxmertForQuestionAnswering, LxmertForPreTraining, a module holding one LxmertModel"
    methods = LXMERT_METHODS
    conventions = Conventions(
        raw_attention=ReadoutConventions(cls_entry="zero"),
        rollout=RolloutConventions(cls_entry="zero"),
        attention_gradcam=GradCamConventions(cls_entry="zero", normalize=False, region="matrix"),
        generic_attention=GenericAttentionConventions(cls_entry="zero"),
        transformer_attribution=TransformerAttributionConventions(cls_entry="zero", readout_rollout=True),
        partial_lrp=LrpConventions(cls_entry="zero", rules="paper"),
        token_ablation=ReadoutConventions(cls_entry="zero"),
    )

    inner = staticmethod(lxmert_model)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        lxmert = lxmert_model(model)
        if lxmert is None:
            raise UnsupportedModelError(f"{type(model).__name__} holds no transformers LxmertModel")
        if lxmert is model:
            raise UnsupportedModelError(
                "a bare LxmertModel returns no answer scores to explain: explain LxmertForQuestionAnswering, "
                "LxmertForPreTraining or your module that puts a head on it and returns the logits"
            )
        if not getattr(model, "task_qa", True):
            raise UnsupportedModelError("this LxmertForPreTraining has no question answering head (config.task_qa is False): nothing to explain")
        self.lxmert = lxmert
        self.config = lxmert.config

    # -- what the model is made of -------------------------------------------------------------------------
    def streams(self, inputs: LxmertBatch) -> dict[str, Stream]:
        readout = torch.zeros(len(inputs), dtype=torch.long, device=inputs.input_ids.device)
        regions = None if inputs.visual_attention_mask is None else inputs.visual_attention_mask.bool()
        return {
            TEXT: Stream(TEXT, "text", 0, readout, valid=inputs.attention_mask.bool()),
            IMAGE: Stream(IMAGE, "image", 0, None, valid=regions),
        }

    def attention_sites(self) -> list[AttentionSite]:
        encoder = self.lxmert.encoder
        sites = [AttentionSite(TEXT, TEXT, layer.attention.self.dropout) for layer in encoder.layer]
        sites += [AttentionSite(IMAGE, IMAGE, layer.attention.self.dropout) for layer in encoder.r_layers]
        for group, layer in enumerate(encoder.x_layers):
            cross = layer.visual_attention.att.dropout
            sites += [
                AttentionSite(TEXT, IMAGE, ModuleCall(cross, layer, 0, 2), group=group),
                AttentionSite(IMAGE, TEXT, ModuleCall(cross, layer, 1, 2), group=group),
                AttentionSite(TEXT, TEXT, layer.lang_self_att.self.dropout),
                AttentionSite(IMAGE, IMAGE, layer.visn_self_att.self.dropout),
            ]
        return sites

    def relevance_rule_map(self) -> dict:
        """The authors' LXMERT relevance rules (see `lxmert.rules`)."""
        from .rules import rule_map

        return rule_map(self.model)

    def attention_inputs(self) -> dict[str, Hookable]:
        """CDAM's X: the language and visual tokens entering the last cross-modality layer, what its cross-attention
        reads (see the module docstring)."""
        last = self.lxmert.encoder.x_layers[-1]
        return {TEXT: InputPart(last, 0, "lang_feats"), IMAGE: InputPart(last, 2, "visual_feats")}

    def class_names(self) -> list[str] | None:
        return class_names(self.config, getattr(self.config, "num_qa_labels", None))

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> LxmertBatch:
        """An `LxmertBatch` from the model's keyword inputs (the tokenizer's output plus `visual_feats`,
        `visual_pos` and optionally `visual_attention_mask`; one question without the batch dimension accepted)."""
        fields, tokens, ids, mask, types = self.question(inputs, LxmertBatch, REQUIRED, OPTIONAL, 1, "LXMERT")
        like = next(self.model.parameters())
        feats = lift(feature_tensor(fields["visual_feats"], "visual_feats", like), 3)
        boxes = lift(feature_tensor(fields["visual_pos"], "visual_pos", like), 3)
        check_regions(feats, "visual_feats", len(ids), self.config.visual_feat_dim)
        check_regions(boxes, "visual_pos", len(ids), self.config.visual_pos_dim)
        if boxes.shape[1] != feats.shape[1]:
            raise ValueError(f"visual_pos must give one box per region of visual_feats ({feats.shape[1]}), got {boxes.shape[1]}")
        regions = self.region_mask(fields, tuple(feats.shape[:2]), like)
        if tokens is None:
            tokens = token_strings(inputs, ids, mask)
        device = like.device
        return LxmertBatch(
            ids.to(device), mask.to(device), feats, boxes, None if types is None else types.to(device), regions, tokens,
        )

    # -- running --------------------------------------------------------------------------------------------
    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        """Eval mode for the call (dropout off: the dropout modules hand the softmax output on), restored after;
        LXMERT's own attention computes its softmax in the model's dtype, so nothing else is switched."""
        return explaining_call(self.model, None)

    def forward(self, inputs: LxmertBatch, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(answer logits (B, K), pooled output (B, D))`: the model's own forward; the pooled [CLS] state is what
        its answer head reads. `graph`: the embeddings are on the graph even when every weight is frozen."""
        pooled: list[torch.Tensor] = []
        handles = [self.lxmert.pooler.register_forward_hook(this_thread_only(lambda _m, _a, out: pooled.append(out)))]
        kwargs = inputs.model_inputs()
        if graph and torch.is_grad_enabled():
            handles.append(self.lxmert.embeddings.word_embeddings.register_forward_hook(this_thread_only(on_graph)))
            if not kwargs["visual_feats"].requires_grad:
                kwargs["visual_feats"] = kwargs["visual_feats"].detach().requires_grad_(True)
        try:
            logits = answer_logits(self.model(**kwargs), len(inputs))
        finally:
            for handle in handles:
                handle.remove()
        return logits, pooled[-1]

    def embed(self, inputs: LxmertBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        """The question's tokens leaving `embeddings` (word + position + type, LayerNorm) `(B, T, D)` and the regions'
        leaving `visn_fc` (feature and box, each LayerNorm-ed, averaged) `(B, N, D)`: what the first blocks read."""
        types = inputs.token_type_ids if inputs.token_type_ids is not None else torch.zeros_like(inputs.input_ids)
        tokens = {
            TEXT: self.lxmert.embeddings(inputs.input_ids, types),
            IMAGE: self.lxmert.encoder.visn_fc(inputs.visual_feats, inputs.visual_pos),
        }
        if graph and torch.is_grad_enabled():
            tokens = {name: on_graph(None, (), value) for name, value in tokens.items()}
        return tokens

    def forward_tokens(
        self, inputs: LxmertBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward on the given first-block tokens: on the inputs of `rows`, each keeping the question
        tokens and regions at `positions` (their masks and types alike), with what `embeddings` and `visn_fc` return
        replaced by `tokens`. `(answer logits, pooled output)`, as `forward`."""
        rows = torch.arange(len(inputs), device=inputs.input_ids.device) if rows is None else rows
        positions = positions or {}
        batch = inputs.select(rows, positions.get(TEXT), positions.get(IMAGE))
        for name, count in ((TEXT, batch.input_ids.shape[1]), (IMAGE, batch.visual_feats.shape[1])):
            if count == 0:
                what = "a question of one token" if name == TEXT else "an image of one region"
                raise ValueError(f"token_ablation cannot remove the only token of {what}: transformers' LXMERT does not run on an empty stream")
            if tuple(tokens[name].shape[:2]) != (len(rows), count):
                raise ValueError(f"the {name} tokens must be (R, {count}, D) for the selected inputs, got {tuple(tokens[name].shape)}")
        pooled: list[torch.Tensor] = []
        handles = [
            self.lxmert.embeddings.register_forward_hook(this_thread_only(lambda _m, _a, _out: tokens[TEXT])),
            self.lxmert.encoder.visn_fc.register_forward_hook(this_thread_only(lambda _m, _a, _out: tokens[IMAGE])),
            self.lxmert.pooler.register_forward_hook(this_thread_only(lambda _m, _a, out: pooled.append(out))),
        ]
        try:
            logits = answer_logits(self.model(**batch.model_inputs()), len(batch))
        finally:
            for handle in handles:
                handle.remove()
        return logits, pooled[-1]

    def explanation(self, scores: dict[str, torch.Tensor], inputs: LxmertBatch, **fields: Any) -> RegionTextExplanation:
        fields.pop("concept", None)
        regions = None if inputs.visual_attention_mask is None else inputs.visual_attention_mask.bool().cpu()
        return RegionTextExplanation(
            text_scores=scores[TEXT],
            region_scores=scores[IMAGE],
            tokens=inputs.tokens,
            attention_mask=inputs.attention_mask.cpu(),
            region_mask=regions,
            boxes=inputs.visual_pos.detach().cpu(),
            class_names=self.class_names(),
            **fields,
        )
