"""Hugging Face BERT-family sequence classifiers: BERT, RoBERTa (XLM-R, CamemBERT), DistilBERT.

The families differ only in where they keep their parts, so each is one row of `LAYOUTS`: attribute paths
from the classifier to the embeddings, the layer list and each layer's self-attention, plus how the last
hidden states become the pre-logits vector and the logits. Everything else (inputs, attention mask,
eager attention for the call, the reference's per-family conventions) is shared.

Inputs are what the tokenizer returns (`input_ids`, `attention_mask`, optional `token_type_ids`); scores
cover every token, [CLS] included (`num_prefix_tokens = 0`), and are 0 at padding.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn

from ...core.conventions import (
    Conventions, GenericAttentionConventions, GradCamConventions, LrpConventions, ReadoutConventions, RolloutConventions,
    TransformerAttributionConventions,
)
from ...core.guard import this_thread_only
from ...results.explanation import TextExplanation
from ...lrp.engine import ForwardFactory
from ...core.streams import AttentionSite, Hookable, Stream
from .._shared import OutputPart, transformers_configs
from ..base import INPUT_RELEVANCE_METHODS, SEED_METHODS, Adapter, EmbeddingLeaf, UnsupportedModelError
from ..hf_attention import EAGER, attention_probabilities, explaining_call
from ..text_batch import TextBatch, from_encoding, mask_from_padding, placeholder_tokens, token_tensor
from .rules import bert_rules, distilbert_rules, roberta_rules


@dataclass(frozen=True)
class Layout:
    """Where one family keeps its parts (attribute paths from the `*ForSequenceClassification` model)."""

    classes: tuple[str, ...]  # class names of the classifiers this row describes
    embeddings: str  # input ids -> tokens entering the first layer (position embedding added, normalised)
    layers: str  # the layer list; `layer(hidden, additive_mask)` -> hidden (or a tuple starting with it)
    self_attention: str  # inside a layer: the module returning `(context, attention probabilities)`
    head: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (model, last hidden) -> (logits, pre-logits)
    rules: Callable[[nn.Module], dict[type, ForwardFactory]]  # the classifier -> its relevance rule map
    token_types: bool = True  # the embeddings take `token_type_ids`


def _bert_head(model: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pre_logits = model.bert.pooler(hidden)  # dense + tanh on [CLS]
    return model.classifier(model.dropout(pre_logits)), pre_logits


def _roberta_head(model: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The classification head's own forward (dense + tanh on `<s>`, out_proj), so that a relevance session's
    replacement of it applies; the pre-logits are what enters out_proj."""
    entering: list[torch.Tensor] = []
    handle = model.classifier.out_proj.register_forward_pre_hook(this_thread_only(lambda _m, args: entering.append(args[0])))
    try:
        logits = model.classifier(hidden)
    finally:
        handle.remove()
    return logits, entering[0]


def _distilbert_head(model: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pre_logits = torch.relu(model.pre_classifier(hidden[:, 0]))  # ReLU's gradient passes relevance unchanged
    return model.classifier(model.dropout(pre_logits)), pre_logits


LAYOUTS: tuple[Layout, ...] = (
    Layout(
        classes=("BertForSequenceClassification",),
        embeddings="bert.embeddings",
        layers="bert.encoder.layer",
        self_attention="attention.self",
        head=_bert_head,
        rules=bert_rules,
    ),
    Layout(
        classes=("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification", "CamembertForSequenceClassification"),
        embeddings="roberta.embeddings",
        layers="roberta.encoder.layer",
        self_attention="attention.self",
        head=_roberta_head,
        rules=roberta_rules,
    ),
    Layout(
        classes=("DistilBertForSequenceClassification",),
        embeddings="distilbert.embeddings",
        layers="distilbert.transformer.layer",
        self_attention="attention",
        head=_distilbert_head,
        rules=distilbert_rules,
        token_types=False,
    ),
)


def _layout_of(model: nn.Module) -> Layout | None:
    names = {cls.__name__ for cls in type(model).__mro__}
    return next((layout for layout in LAYOUTS if names & set(layout.classes)), None)


def _get(root: nn.Module, path: str) -> nn.Module:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _first(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class HFBertAdapter(Adapter):
    """BERT-family classifiers from Hugging Face transformers (see `LAYOUTS`).

    `conventions` hold where the authors' BERT code differs from their ViT code; every entry is also a
    keyword option of the method, so `explain(..., cls_entry="keep")` overrides it:

    - `cls_entry` (`raw_attention`, `rollout`, `attention_gradcam`, `generic_attention`: "zero";
      `transformer_attribution`: "min"; `partial_lrp`, `lrp`: "zero"): the [CLS] token's own entry of the
      [CLS] row, which ViT maps never show. "keep" leaves the computed value.
    - `region` (`attention_gradcam`: "matrix"): the BERT reference averages the gradient over the whole
      attention matrix and min-max normalises over the whole matrix, not the [CLS] row.
    - `row_normalize` (`transformer_attribution`: True): the BERT reference row-normalises `I + E_h(G*R)^+`
      before chaining the layers.
    - `rules` (`partial_lrp`, `lrp`: "paper"): the BERT reference computes its LRP baselines with the paper's
      rules (`layers_ours`), the ViT reference with the vanilla ones (`layers_lrp`).

    Not changed: `start_layer` stays 0 for every family (the BERT reference's `generate_LRP` defaults to the
    last layer: pass `start_layer=L-1`); `cdam` and `token_ablation` keep the [CLS] token's score (no BERT
    reference; the [CLS] token is an input token like any other there). CDAM's X is the hidden states entering
    the last layer: BERT is post-LN, so these are the previous layer's (normalised) output, which feeds both
    the attention and the residual branch.
    """

    family = "Hugging Face BERT-family sequence classifier"
    methods = SEED_METHODS + INPUT_RELEVANCE_METHODS
    examples = "BertForSequenceClassification, RobertaForSequenceClassification, DistilBertForSequenceClassification"
    num_prefix_tokens = 0
    has_class_token = True
    explanation_class = TextExplanation
    conventions = Conventions(
        raw_attention=ReadoutConventions(cls_entry="zero"),
        rollout=RolloutConventions(cls_entry="zero"),
        attention_gradcam=GradCamConventions(cls_entry="zero", region="matrix"),
        # no BERT reference: as rollout, whose [CLS] entry holds the identity
        generic_attention=GenericAttentionConventions(cls_entry="zero"),
        transformer_attribution=TransformerAttributionConventions(cls_entry="min", row_normalize=True),
        partial_lrp=LrpConventions(cls_entry="zero", rules="paper"),
        lrp=LrpConventions(cls_entry="zero", rules="paper"),
    )

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        layout = _layout_of(model)
        if layout is None:
            return False
        try:
            layers = _get(model, layout.layers)
            _get(model, layout.embeddings)
            return len(layers) > 0 and all(hasattr(_get(layer, layout.self_attention), "forward") for layer in layers)
        except AttributeError:
            return False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        layout = _layout_of(model)
        if layout is None:
            raise UnsupportedModelError(f"{type(model).__name__} is not a BERT-family sequence classifier")
        self.layout = layout
        self.embeddings = _get(model, layout.embeddings)
        self.blocks = list(_get(model, layout.layers))
        self.self_attentions = [_get(layer, layout.self_attention) for layer in self.blocks]

    # -- layout -------------------------------------------------------------------------------------------
    def streams(self, inputs: TextBatch) -> dict[str, Stream]:
        readout = torch.zeros(len(inputs), dtype=torch.long, device=inputs.input_ids.device)
        return {"text": Stream("text", "text", 0, readout, valid=inputs.valid)}

    def attention_sites(self) -> list[AttentionSite]:
        # transformers applies dropout to the probabilities functionally (no module): the self-attention's
        # second output is the probabilities tensor that multiplies the values, so gradients reach it.
        return [AttentionSite("text", "text", OutputPart(attention, attention_probabilities)) for attention in self.self_attentions]

    def attention_inputs(self) -> dict[str, Hookable]:
        # post-LN: the last layer's attention reads the previous layer's (normalised) output directly
        source = self.blocks[-2] if len(self.blocks) > 1 else self.embeddings
        return {"text": OutputPart(source, _first)}

    def relevance_rule_map(self) -> dict:
        return self.layout.rules(self.model)

    def class_names(self) -> list[str] | None:
        id2label = getattr(getattr(self.model, "config", None), "id2label", None)
        if not id2label:
            return None
        return [str(id2label.get(i, id2label.get(str(i), f"class {i}"))) for i in range(len(id2label))]

    def describe_inputs(self, inputs: TextBatch) -> dict:
        return {
            "input_size": (inputs.input_ids.shape[1],),
            "tokens": inputs.tokens,
            "word_ids": inputs.word_ids,
            "attention_mask": inputs.attention_mask.detach().cpu(),
        }

    def check_inputs(self, inputs: object) -> TextBatch:
        """A `TextBatch` on the model's device from the tokenizer's output (or `input_ids` alone)."""
        if isinstance(inputs, TextBatch):
            batch = inputs
        elif isinstance(inputs, Mapping):
            batch = from_encoding(inputs, self._pad_id())
        elif isinstance(inputs, torch.Tensor):
            if inputs.is_floating_point():
                raise TypeError("inputs must be token ids (a LongTensor) or the tokenizer's output, not a float tensor")
            ids = token_tensor(inputs[None] if inputs.ndim == 1 else inputs, "input_ids")
            batch = TextBatch(ids, mask_from_padding(ids, self._pad_id()))
        elif isinstance(inputs, str) or isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str):
            raise TypeError(
                "inputs must be tokenised: pass the tokenizer's output, e.g. "
                "relevancy.zoo.text.encode(tokenizer, texts) or tokenizer(texts, padding=True, return_tensors='pt')"
            )
        else:
            raise TypeError(
                f"inputs must be the tokenizer's output (input_ids, attention_mask) or a LongTensor of token ids, "
                f"got {type(inputs).__name__}"
            )
        return self._validated(batch)

    def _pad_id(self) -> int | None:
        """The id that pads a batch (the config's `pad_token_id`), to find the padding of ids given without a mask."""
        return getattr(getattr(self.model, "config", None), "pad_token_id", None)

    def batches(self, inputs: TextBatch, size: int) -> Iterator[TextBatch]:
        return (inputs.rows(slice(start, start + size)) for start in range(0, len(inputs), size))

    def _validated(self, batch: TextBatch) -> TextBatch:
        ids, mask, types = batch.input_ids, batch.attention_mask, batch.token_type_ids
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(f"input_ids must be (B, T) with an attention_mask of the same shape, got {tuple(ids.shape)} and {tuple(mask.shape)}")
        if len(ids) == 0:
            raise ValueError(
                f"the batch holds no texts (input_ids of shape {tuple(ids.shape)}): explanations and concepts need at "
                "least one example, a tokenised text"
            )
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must hold 1 at real tokens and 0 at padding, nothing else")
        if ids.shape[1] == 0 or (mask.sum(1) == 0).any():
            empty = 0 if ids.shape[1] == 0 else int((mask.sum(1) == 0).nonzero()[0])
            raise ValueError(f"text {empty} of the batch is empty (no tokens): there is nothing to explain")
        config = getattr(self.model, "config", None)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] > limit:
            raise ValueError(
                f"the batch has {ids.shape[1]} tokens but the model reads at most {limit}: tokenise with "
                f"truncation (relevancy.zoo.text.encode truncates with a warning)"
            )
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(
                f"input_ids must be in the model's vocabulary, 0..{vocab - 1}, got {bad}: was the text tokenised with "
                "this model's tokenizer?"
            )
        kinds = getattr(config, "type_vocab_size", None)
        if types is not None and types.shape != ids.shape:
            raise ValueError(f"token_type_ids must have the shape of input_ids {tuple(ids.shape)}, got {tuple(types.shape)}")
        if types is not None and self.layout.token_types and kinds is not None and (types.min() < 0 or types.max() >= kinds):
            bad = int(types[(types < 0) | (types >= kinds)][0])
            raise ValueError(f"token_type_ids must be in 0..{kinds - 1} (the model's type_vocab_size is {kinds}), got {bad}")
        device = next(self.model.parameters()).device
        return replace(
            batch,
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            token_type_ids=batch.token_type_ids.to(device) if batch.token_type_ids is not None else None,
            tokens=batch.tokens or placeholder_tokens(batch.input_ids, batch.attention_mask),
        )

    # -- running ------------------------------------------------------------------------------------------
    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        """Eval mode and, if asked, transformers' eager attention (it returns the probabilities) for one call."""
        return explaining_call(self.model, EAGER if attention_probabilities else None)

    def shared_state(self) -> list[object]:
        """The configs whose attention implementation `explaining` switches: models built from one config share it."""
        return transformers_configs(self.model)

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """The word embeddings `(B, T, D)`, before the position and token type embeddings are added (lxt's)."""
        return {"text": EmbeddingLeaf(self.embeddings.word_embeddings)}

    def embed(self, inputs: TextBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": inputs.input_ids}
        if self.layout.token_types and inputs.token_type_ids is not None:
            kwargs["token_type_ids"] = inputs.token_type_ids
        handle = None
        if graph and torch.is_grad_enabled():
            # frozen weights leave the embeddings off the graph: make the word embeddings a leaf that is on it
            handle = self.embeddings.word_embeddings.register_forward_hook(this_thread_only(
                lambda _m, _i, out: out if out.requires_grad else out.detach().requires_grad_(True)
            ))
        try:
            return {"text": self.embeddings(**kwargs)}
        finally:
            if handle is not None:
                handle.remove()

    def forward_tokens(
        self, inputs: TextBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = tokens["text"]
        mask = inputs.attention_mask if rows is None else inputs.attention_mask[rows]
        if positions and "text" in positions:
            mask = mask.gather(1, positions["text"])
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        for layer in self.blocks:
            hidden = _first(layer(hidden, additive))
        return self.layout.head(self.model, hidden)
