"""CLIP (transformers `CLIPModel`, open_clip `CLIP`): two streams, `image` and `text`, that meet only in the logit.

An explanation explains the *scaled* logit of each image-text pair (`exp(logit_scale) * cosine`), as the authors'
notebook does: image stream read at [CLS] over the patches, text stream read at the end-of-text token over every
position (causal attention: positions after it are 0). Every attention-based method runs on both towers.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...core.conventions import Conventions, GenericAttentionConventions
from ...results.explanation import Explanation, PairExplanation
from ...core.streams import AttentionSite, Stream
from .._shared import checked_images
from ..base import INPUT_RELEVANCE_METHODS, SEED_METHODS, Adapter, EmbeddingLeaf
from .batch import ImageTextBatch
from .towers import IMAGE, TEXT, Recorder, clip_library, towers_of


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class RecordedTensor:
    """A tensor the towers' recorder names (an attention or a last-attention input), hookable like a module."""

    def __init__(self, adapter: "ClipTowersAdapter", key: tuple) -> None:
        self.adapter, self.key = adapter, key

    def register_forward_hook(self, hook):
        recorder = self.adapter.recorder
        if recorder is None:
            raise RuntimeError("CLIP tensors are recorded only inside adapter.explaining()")
        return recorder.listen(self.key, hook)


#: CLIP's methods: the seeds' but full LRP to the pixels, which is not defined for CLIP's towers, and the input
#: relevance methods (AttnLRP, CP-LRP, input x gradient at each tower's embeddings)
CLIP_METHODS = tuple(m for m in SEED_METHODS if m != "lrp") + INPUT_RELEVANCE_METHODS


class ClipTowersAdapter(Adapter):
    """What the pair adapter and the zero-shot adapter share: the towers, their sites, eval mode and restoring."""

    methods = CLIP_METHODS

    conventions = Conventions(generic_attention=GenericAttentionConventions(start_layer=-1))
    towers_used: ClassVar[tuple[str, ...]] = (IMAGE, TEXT)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.towers = towers_of(self.clip)
        self.recorder: Recorder | None = None

    @property
    def clip(self) -> nn.Module:
        return self.model

    def attention_sites(self) -> list[AttentionSite]:
        depth = {IMAGE: self.towers.image_depth, TEXT: self.towers.text_depth}
        return [
            AttentionSite(tower, tower, RecordedTensor(self, ("attention", tower, block)))
            for tower in self.towers_used for block in range(depth[tower])
        ]

    def attention_inputs(self) -> dict[str, RecordedTensor]:
        return {tower: RecordedTensor(self, ("input", tower)) for tower in self.towers_used}

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """Per tower used, its input embeddings: the patch convolution's output `(B, D, h, w)` (width 1) and the
        token embeddings `(B, T, D)`, before the [CLS] and position embeddings are added (as for ViT and BERT)."""
        modules = self.towers.embedding_modules()
        return {tower: EmbeddingLeaf(modules[tower], 1 if tower == IMAGE else -1) for tower in self.towers_used}

    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """Eval mode and recorded attention (exact eager attention / recomputed open_clip attention) for the call."""
        with self.towers.explaining() as recorder:
            self.recorder = recorder
            try:
                yield
            finally:
                self.recorder = None

    def shared_state(self) -> list[object]:
        return self.towers._shared_state()

    def image_stream(self, images: torch.Tensor) -> Stream:
        readout = torch.zeros(len(images), dtype=torch.long, device=images.device)
        return Stream(IMAGE, "image", 1, readout, grid=self.towers.grid_size(images))

    def check_images(self, images: object) -> torch.Tensor:
        return checked_images(images, self.clip, lambda shape: None)

    def describe_images(self, images: torch.Tensor) -> dict:
        """Input size and the normalisation to undo for overlays: the model's `image_mean`/`image_std` if set,
        open_clip's `preprocess_cfg`, else OpenAI CLIP's statistics (what transformers' CLIP processors use)."""
        preprocess = getattr(getattr(self.clip, "visual", None), "preprocess_cfg", None) or {}
        mean = getattr(self.clip, "image_mean", None) or preprocess.get("mean") or OPENAI_CLIP_MEAN
        std = getattr(self.clip, "image_std", None) or preprocess.get("std") or OPENAI_CLIP_STD
        return {"input_size": tuple(images.shape[-2:]), "mean": tuple(mean), "std": tuple(std)}


class ClipAdapter(ClipTowersAdapter):
    """Image-text pairs of a CLIP model; inputs `(images, texts)` or an `ImageTextBatch`."""

    family = "CLIP (transformers CLIPModel, open_clip CLIP with a ViT image tower)"
    examples = "transformers.CLIPModel, open_clip.create_model('ViT-B-32'), relevancy.worlds.load_clip()"

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return clip_library(model) is not None

    def check_inputs(self, inputs: object) -> ImageTextBatch:
        if isinstance(inputs, ImageTextBatch):
            batch = inputs
        elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            batch = ImageTextBatch.of(inputs[0], inputs[1])
        else:
            raise TypeError(
                "inputs of a CLIP model must be (images, texts): images (n, 3, H, W) normalised as the model expects, "
                "texts the tokenizer's output or input_ids (m, T); or a relevancy ImageTextBatch"
            )
        images = self.check_images(batch.images)
        ids = batch.input_ids.to(images.device)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (m, T) with T >= 1, got shape {tuple(ids.shape)}")
        context = self.towers.context_length
        if ids.shape[1] > context:
            raise ValueError(f"the texts have {ids.shape[1]} positions but the model reads at most {context}: tokenise with its context length")
        vocab = self._vocab_size()
        if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"input_ids must be in the model's vocabulary, 0..{vocab - 1}, got {bad}")
        pairs = batch.pairs.to(images.device)
        if len(pairs) == 0:
            raise ValueError("the batch holds no image-text pairs: there is nothing to explain")
        bad_pairs = (pairs[:, 0] < 0) | (pairs[:, 0] >= len(images)) | (pairs[:, 1] < 0) | (pairs[:, 1] >= len(ids))
        if bad_pairs.any():
            raise ValueError(f"pairs must index images 0..{len(images) - 1} and texts 0..{len(ids) - 1}, got {pairs[bad_pairs][0].tolist()}")
        mask = None if batch.attention_mask is None else batch.attention_mask.to(images.device)
        return ImageTextBatch(images, ids, pairs, mask, batch.tokens)

    def relevance_rule_map(self) -> dict:
        """The relevance rules of the model's library, both towers and the pair logit (see `clip.rules`)."""
        from .rules import rule_map

        return rule_map(self.towers)

    def _vocab_size(self) -> int | None:
        config = getattr(getattr(self.clip, "config", None), "text_config", None)
        if config is not None:
            return config.vocab_size
        embedding = getattr(self.clip, "token_embedding", None)
        return None if embedding is None else embedding.num_embeddings

    def batches(self, inputs: ImageTextBatch, size: int) -> Iterator[ImageTextBatch]:
        return (inputs.rows(slice(start, start + size)) for start in range(0, len(inputs), size))

    def streams(self, inputs: ImageTextBatch) -> dict[str, Stream]:
        ids = inputs.pair_ids
        readout = self.towers.readout_index(ids)
        valid = torch.arange(ids.shape[1], device=ids.device) <= readout[:, None]
        return {IMAGE: self.image_stream(inputs.pair_images), TEXT: Stream(TEXT, "text", 0, readout, valid=valid)}

    def embed(self, inputs: ImageTextBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        images = inputs.pair_images
        if graph and torch.is_grad_enabled() and not images.requires_grad:
            images = images.detach().requires_grad_(True)
        text = self.towers.text_tokens(inputs.pair_ids)
        if graph and torch.is_grad_enabled() and not text.requires_grad:
            text = text.detach().requires_grad_(True)
        return {IMAGE: self.towers.image_tokens(images), TEXT: text}

    def forward_tokens(
        self, inputs: ImageTextBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits (P, 1), image features (P, E))`: the pair logits as the one "class" of each pair.

        The towers meet only in the logit: a tower whose tokens are whole (not a selection) runs once per batch row
        of `rows`, not once per sequence (token ablation of the other tower reuses it).
        """
        positions = positions or {}
        ids = inputs.pair_ids if rows is None else inputs.pair_ids[rows]
        text, keep = tokens[TEXT], None
        kept = positions.get(TEXT)
        if kept is not None:  # a selection of text positions: the others are masked out as keys, positions unchanged
            full = text.new_zeros(len(text), ids.shape[1], text.shape[-1])
            text = full.scatter(1, kept[:, :, None].expand(-1, -1, text.shape[-1]), text)
            keep = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device).scatter(1, kept, True)
        image_features = once_per_row(
            rows if IMAGE not in positions else None, self.towers.image_features_from_tokens, tokens[IMAGE])
        text_features = once_per_row(
            rows if kept is None else None, lambda t, i: self.towers.text_features_from_tokens(t, i, keep), text, ids)
        return self.towers.pair_logits(image_features, text_features)[:, None], image_features

    def describe_inputs(self, inputs: ImageTextBatch) -> dict:
        return self.describe_images(inputs.pair_images)

    def explanation(self, scores: dict[str, torch.Tensor], inputs: ImageTextBatch, **fields: Any) -> Explanation:
        fields.pop("concept", None)
        streams = self.streams(inputs)
        return PairExplanation(
            image_scores=scores[IMAGE],
            text_scores=scores[TEXT],
            pairs=inputs.pairs.cpu(),
            readout=streams[TEXT].readout.cpu(),
            tokens=_pair_tokens(inputs, streams[TEXT].readout),
            **self.describe_inputs(inputs),
            **fields,
        )


def once_per_row(rows: torch.Tensor | None, compute, *tensors: torch.Tensor) -> torch.Tensor:
    """`compute(*tensors)` where sequences repeat their batch row's values (`rows` given): computed on the first
    sequence of each row and spread to the others; `rows` None: on every sequence."""
    if rows is None:
        return compute(*tensors)
    unique, inverse = torch.unique(rows, return_inverse=True)
    order = torch.arange(len(rows), device=rows.device)
    first = torch.full((len(unique),), len(rows), device=rows.device).scatter_reduce(0, inverse, order, reduce="amin")
    return compute(*(t[first] for t in tensors))[inverse]


def _pair_tokens(inputs: ImageTextBatch, readout: torch.Tensor) -> list[list[str]]:
    """Each pair's token strings at positions 0..end of its text: the tokenizer's strings when the batch has them
    (rows may run on through the padding, e.g. `tokenizer.tokens(ids)`), else `[id]`."""
    named = inputs.pair_tokens()
    rows = named if named is not None else [[f"[{t}]" for t in row] for row in inputs.pair_ids.tolist()]
    return [row[: int(end) + 1] for row, end in zip(rows, readout.tolist())]


class ZeroShotAdapter(ClipTowersAdapter):
    """A `ZeroShotClassifier`: the image stream of its CLIP, explained like a ViT classifier (classes, Concepts)."""

    family = "CLIP zero-shot classifier (relevancy ZeroShotClassifier)"
    examples = "ZeroShotClassifier(clip_model, tokenizer(['a photo of a cat', 'a photo of a dog']))"
    towers_used = (IMAGE,)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        from .zero_shot import ZeroShotClassifier

        return isinstance(model, ZeroShotClassifier)

    @property
    def clip(self) -> nn.Module:
        return self.model.clip

    def class_names(self) -> list[str] | None:
        return self.model.class_names

    def relevance_rule_map(self) -> dict:
        """The CLIP model's rules and the zero-shot head's (see `clip.rules.zero_shot_rule_map`)."""
        from .rules import zero_shot_rule_map

        return zero_shot_rule_map(self.model)

    def check_inputs(self, inputs: object) -> torch.Tensor:
        return self.check_images(inputs)

    def batches(self, inputs: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
        return iter(inputs.split(size))

    def streams(self, inputs: torch.Tensor) -> dict[str, Stream]:
        return {IMAGE: self.image_stream(inputs)}

    def embed(self, inputs: torch.Tensor, graph: bool = False) -> dict[str, torch.Tensor]:
        if graph and torch.is_grad_enabled() and not inputs.requires_grad:
            inputs = inputs.detach().requires_grad_(True)
        return {IMAGE: self.towers.image_tokens(inputs)}

    def forward_tokens(
        self, inputs: torch.Tensor, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits (B, K), normalised image embedding (B, E))`: a Concept is a mean direction in CLIP's space."""
        features = self.towers.image_features_from_tokens(tokens[IMAGE])
        return self.model.logits_from_features(features), F.normalize(features, dim=-1)

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        return self.describe_images(inputs)
