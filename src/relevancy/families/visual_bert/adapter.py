"""Hugging Face VisualBERT: one stream (`tokens`) over the question's tokens followed by the image regions.

Supported, used unmodified: `transformers.VisualBertForQuestionAnswering`, `VisualBertForVisualReasoning`, and any
module holding one `VisualBertModel` whose forward takes VisualBERT's keyword inputs and returns answer logits
`(B, K)` (a tensor, or an output with `logits`). The readout token is the one the model's head reads:
`VisualBertForQuestionAnswering` (also inside a user's module) gathers position `attention_mask.sum(1) - 2` of the
sequence (the token before the question's last [SEP]), every other head the [CLS] token (0) that
`VisualBertModel`'s pooler reads. `bypass_transformer` models (text-only encoder layers) are not supported.

The maps are the readout row over the whole sequence, split into the question's positions (`T`, padding
included) and the regions (`N`) by `explanation`. Each layer's probabilities are the output of its self-attention's
dropout module: the softmax output itself in eval mode, computed in the model's dtype (float64 models are exact).

`cdam` reads X at the last layer's input (the previous layer's LayerNorm-ed output: VisualBERT is post-LN), over
question and regions alike. `token_ablation` drops one position of the one sequence at a time, a question token
(its word, position and type embedding and its attention mask entry; the others keep their positions, as for every
family) or a region (its projected embedding and its `visual_attention_mask` entry), and re-runs the model's own
forward on what remains, so its head reads the answer as it would from that input (`VisualBertForQuestionAnswering`
gathers `attention_mask.sum(1) - 2` of the shortened question: dropping the question's last [SEP] moves that read
one token left, which is what the model does without it). The readout token's own entry is 0 (`cls_entry="zero"`).
With `VisualBertForQuestionAnswering` each question needs 3 real tokens for it (2 left after one is dropped).
"""
from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ...core.conventions import Conventions, GenericAttentionConventions, GradCamConventions, ReadoutConventions, RolloutConventions
from ...results.explanation import RegionTextExplanation
from ...core.streams import AttentionSite, Hookable, Stream
from ...core.guard import this_thread_only
from .._shared import transformers_configs
from ..base import UnsupportedModelError
from ..hf_attention import EAGER, explaining_call
from ..regions import (
    METHODS, InputPart, RegionAdapter, answer_logits, check_regions, class_names, feature_tensor, inner_model,
    integer_tensor, lift, on_graph, token_strings,
)
from .batch import VisualBertBatch

TOKENS = "tokens"
REQUIRED = ("input_ids", "visual_embeds")
OPTIONAL = ("attention_mask", "token_type_ids", "visual_attention_mask", "visual_token_type_ids")
# transformers' VisualBERT heads whose output is not one row of answer logits per input
OTHER_HEADS = ("VisualBertForPreTraining", "VisualBertForMultipleChoice", "VisualBertForRegionToPhraseAlignment")


def _modeling() -> Any:
    """transformers' VisualBERT module if it is loaded (a model of it exists only then), else None."""
    return sys.modules.get("transformers.models.visual_bert.modeling_visual_bert")


def visual_bert_model(model: nn.Module) -> nn.Module | None:
    """The one `VisualBertModel` inside `model` (itself included); None when there is none; an error for several."""
    return inner_model(model, "transformers.models.visual_bert.modeling_visual_bert", "VisualBertModel")


class VisualBertAdapter(RegionAdapter):
    """VisualBERT over a question and image regions (see the module docstring).

    `conventions`, where the authors' VisualBERT code differs from their ViT code (every entry is also a
    keyword option): the readout token's own entry is set to 0 for every method; `rollout` chains the raw
    `I + A` (no row normalisation); `attention_gradcam` averages the gradient over the whole attention matrix and
    min-max normalises over it (`normalize=True, region="matrix"`), before the readout entry is zeroed.
    `token_ablation` (no reference) zeroes the readout entry too; `cdam` (no reference, no such option) keeps it.
    """

    family = "Hugging Face VisualBERT (question answering over image regions)"
    examples = "VisualBertForQuestionAnswering, VisualBertForVisualReasoning, a module holding one VisualBertModel"
    methods = METHODS  # no relevance rules yet
    conventions = Conventions(
        raw_attention=ReadoutConventions(cls_entry="zero"),
        rollout=RolloutConventions(cls_entry="zero", row_normalize=False),
        attention_gradcam=GradCamConventions(cls_entry="zero", normalize=True, region="matrix"),
        generic_attention=GenericAttentionConventions(cls_entry="zero"),
        token_ablation=ReadoutConventions(cls_entry="zero"),
    )

    inner = staticmethod(visual_bert_model)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        visual_bert = visual_bert_model(model)
        if visual_bert is None:
            raise UnsupportedModelError(f"{type(model).__name__} holds no transformers VisualBertModel")
        if visual_bert is model or type(model).__name__ in OTHER_HEADS:
            raise UnsupportedModelError(
                f"{type(model).__name__} returns no answer logits (B, K) to explain: explain "
                "VisualBertForQuestionAnswering, VisualBertForVisualReasoning or your module that puts a head on a "
                "VisualBertModel and returns the logits"
            )
        if visual_bert.config.bypass_transformer:
            raise UnsupportedModelError(
                "VisualBERT models with bypass_transformer=True run their encoder on the text alone: relevancy "
                "explains the usual one-sequence VisualBERT only"
            )
        self.visual_bert = visual_bert
        self.config = visual_bert.config
        # the head gathers the token before the last [SEP] (VisualBertForQuestionAnswering) or pools [CLS]
        self.gathers = any(isinstance(m, _modeling().VisualBertForQuestionAnswering) for m in model.modules())

    # -- what the model is made of -------------------------------------------------------------------------
    def readout(self, inputs: VisualBertBatch) -> torch.Tensor:
        """`(B,)` the position of the sequence whose output the model's head reads."""
        if self.gathers:
            return inputs.attention_mask.sum(1) - 2  # what VisualBertForQuestionAnswering gathers
        return torch.zeros(len(inputs), dtype=torch.long, device=inputs.input_ids.device)

    def streams(self, inputs: VisualBertBatch) -> dict[str, Stream]:
        return {TOKENS: Stream(TOKENS, "text", 0, self.readout(inputs), valid=inputs.valid)}

    def attention_sites(self) -> list[AttentionSite]:
        return [AttentionSite(TOKENS, TOKENS, layer.attention.self.dropout) for layer in self.visual_bert.encoder.layer]

    def attention_inputs(self) -> dict[str, Hookable]:
        """CDAM's X: the question's and regions' tokens entering the last layer."""
        return {TOKENS: InputPart(self.visual_bert.encoder.layer[-1], 0, "hidden_states")}

    def class_names(self) -> list[str] | None:
        return class_names(self.config, getattr(self.config, "num_labels", None))

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> VisualBertBatch:
        """A `VisualBertBatch` from the model's keyword inputs (the tokenizer's output plus `visual_embeds` and
        optionally `visual_attention_mask`, `visual_token_type_ids`; one question without the batch dimension
        accepted)."""
        # the question-answering head reads position attention_mask.sum(1) - 2: a [CLS] ... [SEP] question of 2+ tokens
        fields, tokens, ids, mask, types = self.question(
            inputs, VisualBertBatch, REQUIRED, OPTIONAL, 2 if self.gathers else 1, "VisualBERT",
        )
        like = next(self.model.parameters())
        embeds = lift(feature_tensor(fields["visual_embeds"], "visual_embeds", like), 3)
        check_regions(embeds, "visual_embeds", len(ids), self.config.visual_embedding_dim)
        shape = tuple(embeds.shape[:2])
        regions, visual_types = self.region_mask(fields, shape, like), None
        if "visual_token_type_ids" in fields:
            visual_types = lift(integer_tensor(fields["visual_token_type_ids"], "visual_token_type_ids"), 2).to(like.device)
            kinds = self.config.type_vocab_size
            if tuple(visual_types.shape) != shape:
                raise ValueError(f"visual_token_type_ids must be (B, N) = {shape}, got {tuple(visual_types.shape)}")
            if visual_types.min() < 0 or visual_types.max() >= kinds:
                raise ValueError(f"visual_token_type_ids must be in 0..{kinds - 1} (the model's type_vocab_size is {kinds})")
        if tokens is None:
            tokens = token_strings(inputs, ids, mask)
        device = like.device
        return VisualBertBatch(
            ids.to(device), mask.to(device), embeds, None if types is None else types.to(device), regions, visual_types,
            tokens,
        )

    # -- running --------------------------------------------------------------------------------------------
    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        """Eval mode (dropout off: the dropout modules hand the softmax output on) and the eager attention mask (an
        additive float mask, what VisualBERT's attention adds to its scores) for the call; both restored after."""
        return explaining_call(self.model, EAGER)  # its mask is eager's, the one VisualBERT's attention adds

    def shared_state(self) -> list[object]:
        """The configs whose attention implementation `explaining` switches: models built from one config share it."""
        return transformers_configs(self.model)

    def forward(self, inputs: VisualBertBatch, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(answer logits (B, K), the readout token's last hidden state (B, D))`: the model's own forward.
        `graph`: the embeddings are on the graph even when every weight is frozen."""
        hidden: list[torch.Tensor] = []
        handles = [self.visual_bert.encoder.register_forward_hook(this_thread_only(lambda _m, _a, out: hidden.append(out[0])))]
        if graph and torch.is_grad_enabled():
            handles.append(self.visual_bert.embeddings.register_forward_hook(this_thread_only(on_graph)))
        try:
            logits = answer_logits(self.model(**inputs.model_inputs()), len(inputs))
        finally:
            for handle in handles:
                handle.remove()
        rows = torch.arange(len(inputs), device=logits.device)
        return logits, hidden[-1][rows, self.readout(inputs).to(logits.device)]

    def embed(self, inputs: VisualBertBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        """The one sequence leaving `embeddings` `(B, T + N, D)`: the question's tokens (word + position + type), then
        the regions (projection + visual position + visual type), each LayerNorm-ed: what the first layer reads."""
        kwargs = inputs.model_inputs()
        for name in ("attention_mask", "visual_attention_mask"):
            kwargs.pop(name, None)
        tokens = self.visual_bert.embeddings(**kwargs)
        if graph and torch.is_grad_enabled():
            tokens = on_graph(None, (), tokens)
        return {TOKENS: tokens}

    def forward_tokens(
        self, inputs: VisualBertBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward on the given first-layer tokens: on the inputs of `rows`, each keeping the positions
        `positions["tokens"][r]` of its question-then-regions sequence (masks and types alike), with what `embeddings`
        returns replaced by `tokens`. Sequences keeping different numbers of question tokens run as separate batches
        (the model takes a rectangular question). `(answer logits, the readout token's last hidden state)`."""
        sequences = tokens[TOKENS]
        rows = torch.arange(len(inputs), device=sequences.device) if rows is None else rows.to(sequences.device)
        kept = (positions or {}).get(TOKENS)
        if kept is None:
            return self._run(inputs.select(rows), sequences)
        kept = kept.to(sequences.device)
        length = inputs.text_length
        counts = (kept < length).sum(1)
        logits = pre_logits = None
        for count in counts.unique().tolist():
            group = (counts == count).nonzero().flatten()
            part = kept[group]
            batch = inputs.select(rows[group], part[:, :count], part[:, count:] - length)
            group_logits, group_pre = self._run(batch, sequences[group])
            if logits is None:
                logits = group_logits.new_empty(len(rows), group_logits.shape[1])
                pre_logits = group_pre.new_empty(len(rows), group_pre.shape[1])
            logits[group], pre_logits[group] = group_logits, group_pre
        return logits, pre_logits

    def _run(self, batch: VisualBertBatch, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward on `batch` with `tokens` as the embeddings' output."""
        questions, regions = batch.input_ids.shape[1], batch.visual_embeds.shape[1]
        if regions == 0 or questions == 0:
            raise ValueError("token_ablation cannot remove the only region of an image or the only token of a question")
        if self.gathers and (batch.attention_mask.sum(1) < 2).any():
            raise ValueError(
                "token_ablation on VisualBertForQuestionAnswering needs questions of at least 3 real tokens: its head "
                "reads the token before the last [SEP] (attention_mask.sum(1) - 2), which a shorter question loses"
            )
        if tuple(tokens.shape[:2]) != (len(batch), questions + regions):
            raise ValueError(f"the tokens must be (R, {questions + regions}, D) for the selected inputs, got {tuple(tokens.shape)}")
        hidden: list[torch.Tensor] = []
        handles = [
            self.visual_bert.embeddings.register_forward_hook(this_thread_only(lambda _m, _a, _out: tokens)),
            self.visual_bert.encoder.register_forward_hook(this_thread_only(lambda _m, _a, out: hidden.append(out[0]))),
        ]
        try:
            logits = answer_logits(self.model(**batch.model_inputs()), len(batch))
        finally:
            for handle in handles:
                handle.remove()
        rows = torch.arange(len(batch), device=logits.device)
        return logits, hidden[-1][rows, self.readout(batch).to(logits.device)]

    def explanation(self, scores: dict[str, torch.Tensor], inputs: VisualBertBatch, **fields: Any) -> RegionTextExplanation:
        """The one stream's row split into the question's positions and the regions."""
        fields.pop("concept", None)
        (row,) = scores.values()
        length = inputs.text_length
        valid = inputs.valid.cpu()
        return RegionTextExplanation(
            text_scores=row[:, :length],
            region_scores=row[:, length:],
            tokens=inputs.tokens,
            attention_mask=inputs.attention_mask.cpu(),
            region_mask=None if inputs.visual_attention_mask is None else valid[:, length:],
            class_names=self.class_names(),
            **fields,
        )
