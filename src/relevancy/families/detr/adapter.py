"""DETR as relevancy sees it: an `image` stream (the backbone's feature grid, encoded by self-attention) and a
`queries` stream (the object queries: self-attention, then cross-attention into the image), read at the row of
the explained query.

Supported: transformers `DetrForObjectDetection` (any backbone from transformers or timm), unmodified. The
attention implementation is switched to relevancy's exact eager attention for the call (`families.hf_attention`:
sdpa returns no probabilities) and restored after, also after an exception.
"""
from __future__ import annotations

import numbers
import sys
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...core.conventions import Conventions, LrpConventions
from ...core.guard import exclusive, this_thread_only
from ...core.streams import AttentionSite, Hookable, Stream
from .._shared import OutputPart, eval_mode, transformers_configs
from ..base import SEED_METHODS, Adapter
from ..hf_attention import EXACT_ATTENTION, attention_probabilities, explaining_call
from .batch import DetectionBatch
from ...results.explanation import DetectionExplanation

# DETR's image processor normalises with ImageNet's statistics
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# the authors' mask_generator.py keeps the queries whose best class (not "no object") has probability > 0.5
DETECTION_THRESHOLD = 0.5

TARGETS = (
    "None (every query whose best class, not 'no object', has probability > 0.5, with that class), a pair "
    "(query, class) for every image, or a list with one entry per image: a pair or a list of pairs"
)


# per backbone module: input (height, width) -> its last feature map's (h, w)
_FEATURE_GRIDS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int], tuple[int, int]]]" = weakref.WeakKeyDictionary()


def _last_hidden(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.last_hidden_state


class DetrAdapter(Adapter):
    family = "DETR"
    # the seeds' methods but full LRP to the pixels (relevance stops at the encoder's input tokens)
    methods = tuple(m for m in SEED_METHODS if m != "lrp")
    examples = "transformers.DetrForObjectDetection"
    # the authors' DETR code has one set of LRP rules, the conserving ones
    conventions = Conventions(partial_lrp=LrpConventions(rules="paper"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        detr = model.model
        self.encoder_layers = list(detr.encoder.layers)
        self.decoder_layers = list(detr.decoder.layers)
        self.num_queries = model.config.num_queries

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        detr = sys.modules.get("transformers.models.detr.modeling_detr")
        return detr is not None and isinstance(model, detr.DetrForObjectDetection)

    def class_names(self) -> list[str] | None:
        labels = getattr(self.model.config, "id2label", None) or {}
        return [labels.get(k, f"class {k}") for k in range(self.model.config.num_labels)] + ["no object"]

    # -- what the model is made of -------------------------------------------------------------------------
    def feature_grid(self, height: int, width: int) -> tuple[int, int]:
        """The backbone's last feature map (h, w) for an input of `height` x `width`: measured once per backbone
        and input size on a blank image, so any backbone (ResNet, ConvNeXt, dilated or not, any stage) is right."""
        backbone = self.model.model.backbone
        sizes = _FEATURE_GRIDS.setdefault(backbone, {})
        if (height, width) not in sizes:
            parameter = next(backbone.parameters())
            blank = torch.zeros(1, 3, height, width, dtype=parameter.dtype, device=parameter.device)
            with torch.no_grad():
                features = backbone(blank, torch.ones(1, height, width, dtype=torch.long, device=parameter.device))
            sizes[(height, width)] = tuple(features[-1][0].shape[-2:])
        return sizes[(height, width)]

    def streams(self, inputs: DetectionBatch) -> dict[str, Stream]:
        if inputs.query is None:
            raise ValueError("no explained objects: bind a target first (relevancy.explain does)")
        grid = self.feature_grid(*inputs.pixel_values.shape[-2:])
        _, masks = inputs.row_images()
        valid = None
        if not bool(masks.all()):
            valid = F.interpolate(masks[:, None].to(inputs.pixel_values.dtype), size=grid).to(torch.bool).flatten(1)
        return {
            "image": Stream("image", "image", prefix_tokens=0, readout=None, valid=valid, grid=grid),
            "queries": Stream("queries", "queries", prefix_tokens=0, readout=inputs.query),
        }

    def attention_sites(self) -> list[AttentionSite]:
        sites = [AttentionSite("image", "image", OutputPart(layer.self_attn, attention_probabilities)) for layer in self.encoder_layers]
        for layer in self.decoder_layers:
            sites.append(AttentionSite("queries", "queries", OutputPart(layer.self_attn, attention_probabilities)))
            sites.append(AttentionSite("queries", "image", OutputPart(layer.encoder_attn, attention_probabilities)))
        return sites

    def attention_inputs(self) -> dict[str, Hookable]:
        """CDAM's tokens: the encoder's output (the memory every cross-attention reads) and the queries entering
        the last cross-attention."""
        return {
            "image": OutputPart(self.model.model.encoder, _last_hidden),
            "queries": self.decoder_layers[-1].self_attn_layer_norm,
        }

    def relevance_rule_map(self) -> dict:
        """The authors' DETR relevance rules on the transformer (see `detr.rules`)."""
        from .rules import rule_map

        return rule_map(self.model)

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> DetectionBatch:
        if isinstance(inputs, torch.Tensor):
            inputs = {"pixel_values": inputs}
        if not isinstance(inputs, Mapping) or "pixel_values" not in inputs:
            raise TypeError(
                "DETR inputs must be a dict with 'pixel_values' (B, 3, H, W) and optionally 'pixel_mask' (B, H, W), "
                f"as its image processor returns, or a tensor of images; got {type(inputs).__name__}"
            )
        unknown = sorted(set(inputs) - {"pixel_values", "pixel_mask", "labels"})
        if unknown:
            raise ValueError(f"unknown DETR inputs {unknown}; valid: pixel_values, pixel_mask")
        pixels = inputs["pixel_values"]
        if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[1] != 3 or not pixels.is_floating_point():
            got = f"{pixels.dtype} {tuple(pixels.shape)}" if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise ValueError(f"pixel_values must be a float tensor (B, 3, H, W), got {got}")
        if len(pixels) == 0:
            raise ValueError("pixel_values holds no images: (B, 3, H, W) with B >= 1")
        param = next(self.model.parameters())
        pixels = pixels.to(param.device, param.dtype)
        if not torch.isfinite(pixels).all():
            raise ValueError("pixel_values holds NaN or infinite values")
        mask = inputs.get("pixel_mask")
        if mask is None:
            mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.long, device=pixels.device)
        elif not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (pixels.shape[0], *pixels.shape[2:]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"pixel_mask must be (B, H, W) = {(pixels.shape[0], *pixels.shape[2:])}, got {got}")
        return DetectionBatch(pixels, mask.to(pixels.device).long())

    def named_target(self, target: Any) -> Any:
        """DETR's targets are (query, class) pairs, checked by `bind_target`; a class name alone names no query."""
        return target

    def bind_target(self, inputs: DetectionBatch, target: Any) -> tuple[DetectionBatch, torch.Tensor]:
        """One row per explained object, and the class explained in each row."""
        images = len(inputs.pixel_values)
        if target is None:
            pairs = [[(d.query, d.label) for d in per_image] for per_image in self.detections(inputs)]
        elif _is_pair(target):
            pairs = [[tuple(target)] for _ in range(images)]
        elif isinstance(target, (list, tuple)) and len(target) == images:
            pairs = [[tuple(t)] if _is_pair(t) else [tuple(p) for p in t] for t in target]
            if not all(all(_is_pair(p) for p in per_image) for per_image in pairs):
                raise TypeError(f"DETR targets must be {TARGETS}; got {target!r}")
        else:
            raise TypeError(f"DETR targets must be {TARGETS}; got {target!r}")
        classes = self.model.config.num_labels + 1
        for per_image in pairs:
            for query, label in per_image:
                if not 0 <= query < self.num_queries or not 0 <= label < classes:
                    raise ValueError(
                        f"target ({query}, {label}) is out of range: queries 0..{self.num_queries - 1}, classes "
                        f"0..{classes - 1} (the last is 'no object')"
                    )
        if not any(pairs):
            raise ValueError(
                f"no object detected above probability {DETECTION_THRESHOLD} in any image: give target=(query, class)"
            )
        device = inputs.pixel_values.device  # the rows index the model's outputs: on their device
        image = torch.tensor([i for i, per_image in enumerate(pairs) for _ in per_image], dtype=torch.long, device=device)
        query = torch.tensor([q for per_image in pairs for q, _ in per_image], dtype=torch.long, device=device)
        label = torch.tensor([c for per_image in pairs for _, c in per_image], dtype=torch.long, device=device)
        return inputs.rows(image, query), label

    def detections(self, inputs: DetectionBatch, threshold: float = DETECTION_THRESHOLD) -> list[list[Detection]]:
        """Per image, every query kept by the authors' rule (best class probability > `threshold`)."""
        with torch.no_grad():
            out = self.model(pixel_values=inputs.pixel_values, pixel_mask=inputs.pixel_mask)
        probabilities, classes = out.logits.softmax(-1)[..., :-1].max(-1)
        height, width = inputs.pixel_values.shape[-2:]
        cx, cy, w, h = out.pred_boxes.unbind(-1)
        corners = torch.stack([(cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height], -1)
        return [
            [Detection(q, int(classes[i, q]), float(probabilities[i, q]), tuple(corners[i, q].tolist()))
             for q in (probabilities[i] > threshold).nonzero()[:, 0].tolist()]
            for i in range(len(out.logits))
        ]

    def batches(self, inputs: DetectionBatch, size: int) -> Iterator[DetectionBatch]:
        """Images in consecutive batches; once a target has bound the explained objects, objects (rows) in
        consecutive batches, each with the images (only the images of its rows are run)."""
        if inputs.image is not None:
            for start in range(0, len(inputs), size):
                yield inputs.rows(inputs.image[start:start + size], inputs.query[start:start + size])
            return
        for start in range(0, len(inputs.pixel_values), size):
            yield DetectionBatch(inputs.pixel_values[start:start + size], inputs.pixel_mask[start:start + size])

    def describe_inputs(self, inputs: DetectionBatch) -> dict:
        return {"input_size": tuple(inputs.pixel_values.shape[-2:]), "mean": IMAGENET_MEAN, "std": IMAGENET_STD}

    def explanation(self, scores: dict[str, torch.Tensor], inputs: DetectionBatch, **fields: Any) -> DetectionExplanation:
        return DetectionExplanation(
            scores=scores["image"], image=inputs.image, query=inputs.query, class_names=self.class_names(),
            **self.describe_inputs(inputs), **fields,
        )

    # -- running --------------------------------------------------------------------------------------------
    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        return explaining_call(self.model, EXACT_ATTENTION if attention_probabilities else None)

    def shared_state(self) -> list[object]:
        return transformers_configs(self.model)

    def forward(self, inputs: DetectionBatch, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the explained query's class logits (R, C + 1) and its decoder output (R, D)."""
        pixels, masks = inputs.row_images()
        with self.backbone_once(inputs):
            out = self.model(pixel_values=pixels, pixel_mask=masks)
        rows = torch.arange(len(pixels), device=pixels.device)
        return out.logits[rows, inputs.query], out.last_hidden_state[rows, inputs.query]

    def independent_groups(self, inputs: DetectionBatch) -> list[tuple[torch.Tensor, DetectionBatch]] | None:
        """On a CPU, one image with its objects at a time: batching images adds no parallelism there, and at
        800x1066 each attention map of a batch of images (8 heads, 850 x 850 tokens) outgrows what the memory
        allocator reuses, so every one is fresh memory the kernel must clear (a batch of 4 images with 5 objects
        each: 3.9 forwards at once, 1.8 image by image; `benchmarks/detr_speed.py --whole-batch`). On a GPU,
        the whole batch at once."""
        if inputs.image is None or inputs.pixel_values.device.type != "cpu" or len(torch.unique(inputs.image)) < 2:
            return None
        groups = []
        for image in torch.unique(inputs.image).tolist():
            rows = (inputs.image == image).nonzero()[:, 0]
            one = slice(image, image + 1)
            groups.append((rows, DetectionBatch(inputs.pixel_values[one], inputs.pixel_mask[one],
                                                torch.zeros_like(rows), inputs.query[rows])))
        return groups

    def forward_shared(self, inputs: DetectionBatch, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The model once per image that has several explained objects: per row the query's class logits and
        decoder output, and the row's image among those run. None when every row has an image of its own."""
        if inputs.image is None or len(torch.unique(inputs.image)) == len(inputs.image):
            return None
        images, sources = torch.unique(inputs.image, return_inverse=True)
        with self.backbone_without_graph():
            out = self.model(pixel_values=inputs.pixel_values[images], pixel_mask=inputs.pixel_mask[images])
        return out.logits[sources, inputs.query], out.last_hidden_state[sources, inputs.query], sources

    @contextmanager
    def backbone_without_graph(self) -> Iterator[None]:
        """The backbone runs without recording an autograd graph: every method's relevance stops at the encoder's
        input tokens, and a ResNet-50's graph at 800x1066 holds gigabytes per image. The grad mode it found is
        restored after it, and after the call also when it raised."""
        backbone = self.model.model.backbone
        found: list[bool] = []

        def enter(_module: nn.Module, _args: tuple) -> None:
            found.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)

        def leave(_module: nn.Module, _args: tuple, _out: object) -> None:
            torch.set_grad_enabled(found.pop())

        pre, post = (backbone.register_forward_pre_hook(this_thread_only(enter)),
                     backbone.register_forward_hook(this_thread_only(leave)))
        try:
            yield
        finally:
            pre.remove()
            post.remove()
            if found:  # the backbone raised: its hook never restored the mode
                torch.set_grad_enabled(found[0])

    @contextmanager
    def backbone_once(self, inputs: DetectionBatch) -> Iterator[None]:
        """The backbone runs once per image, not once per row, and without a graph: its input is swapped for the
        distinct images and its last feature map, the only one DETR's transformer reads, is repeated for the rows
        (the transformer runs per row: each row explains its own score); the earlier stages stay one per image."""
        backbone = self.model.model.backbone

        def per_row(_module: nn.Module, _args: tuple, out: list) -> list:
            feature, mask = out[-1]
            return [*out[:-1], (feature[inputs.image], mask[inputs.image])]

        pre = backbone.register_forward_pre_hook(this_thread_only(lambda _m, _args: (inputs.pixel_values, inputs.pixel_mask)))
        post = backbone.register_forward_hook(this_thread_only(per_row))
        try:
            with self.backbone_without_graph():
                yield
        finally:
            pre.remove()
            post.remove()

    def embed(self, inputs: DetectionBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        """The image tokens entering the encoder, per row: the projected backbone features `(R, N, D)` (the
        object queries are the model's own, not content, so they are not a stream to ablate)."""
        return {"image": self._encoder_inputs(inputs)[0]}

    def _encoder_inputs(self, inputs: DetectionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: projected features `(R, N, D)`, sine position embeddings `(R, N, D)`, valid mask `(R, N)`."""
        detr = self.model.model
        pixels, masks = inputs.row_images()
        with self.backbone_once(inputs):
            feature_map, mask = detr.backbone(pixels, masks)[-1]
        features = detr.input_projection(feature_map).flatten(2).transpose(1, 2)
        positions = detr.position_embedding(shape=feature_map.shape, device=pixels.device, dtype=pixels.dtype, mask=mask)
        return features, positions.flatten(2).transpose(1, 2), mask.flatten(1)

    def forward_tokens(
        self, inputs: DetectionBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder and decoder on the given image tokens (a selection: `positions["image"]` per sequence, each
        keeping its own sine position embedding and mask entry), read at each row's explained query."""
        detr = self.model.model
        _, spatial, valid = self._encoder_inputs(inputs)
        rows = torch.arange(len(inputs), device=spatial.device) if rows is None else rows
        kept = (positions or {}).get("image")
        spatial, valid = spatial[rows], valid[rows]
        if kept is not None:
            spatial = spatial.gather(1, kept[..., None].expand(-1, -1, spatial.shape[-1]))
            valid = valid.gather(1, kept)
        encoded = detr.encoder(inputs_embeds=tokens["image"], attention_mask=valid, spatial_position_embeddings=spatial)
        query_positions = detr.query_position_embeddings.weight.unsqueeze(0).expand(len(rows), -1, -1)
        decoded = detr.decoder(
            inputs_embeds=torch.zeros_like(query_positions), spatial_position_embeddings=spatial,
            object_queries_position_embeddings=query_positions, encoder_hidden_states=_last_hidden(encoded),
            encoder_attention_mask=valid,
        )
        hidden = _last_hidden(decoded)
        picked = hidden[torch.arange(len(rows), device=hidden.device), inputs.query[rows]]
        return self.model.class_labels_classifier(picked), picked


@dataclass(frozen=True)
class Detection:
    """A detected object: its query, class, probability and box (x0, y0, x1, y1) in input pixels."""

    query: int
    label: int
    score: float
    box: tuple[float, float, float, float]


def detect(model: nn.Module, inputs: object, threshold: float = DETECTION_THRESHOLD) -> list[list[Detection]]:
    """The objects DETR detects in each image (best class probability > `threshold`, the authors' rule); their
    (query, label) pairs are `explain`'s targets, their boxes what `DetectionExplanation.save` draws."""
    if not DetrAdapter.supports(model):
        raise TypeError(f"detect takes a transformers DetrForObjectDetection, got {type(model).__name__}")
    if not isinstance(threshold, numbers.Real) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a probability in [0, 1), got {threshold!r}")
    adapter = DetrAdapter(model)
    with exclusive(model, *adapter.shared_state()):
        with eval_mode(model):
            return adapter.detections(adapter.check_inputs(inputs), threshold)


def _is_pair(value: object) -> bool:
    return (
        isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
