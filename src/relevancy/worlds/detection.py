"""The shapes detection world and its detector: scenes of one to three objects with exact boxes and masks, and a
small `transformers.DetrForObjectDetection` trained on them (`training.shapes_detr`).

Scenes are the shapes world's (:func:`relevancy.worlds.scenes.make_scenes`), one, two or three objects of distinct
classes in equal shares, in an order drawn from the seed. A box is the tight box of the object's painted pixels
(``x0, y0, x1, y1`` in pixels, ``x1``/``y1`` exclusive), so boxes and masks agree exactly. The detector sees the
64 x 64 image through a small ResNet whose stride-8 stage is DETR's feature map: an 8 x 8 grid of image tokens.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .shapes_vit import EVAL_SEED_BASE, WEIGHTS_DIR
from .scenes import CLASSES, IMAGE_SIZE, make_scenes

__all__ = [
    "DETECTOR_CONFIG",
    "DETECTOR_WEIGHTS_PATH",
    "DetectionScenes",
    "make_detection_scenes",
    "build_detector",
    "load_detector",
    "detector_inputs",
    "is_shapes_detector",
    "picture_inputs",
    "evaluate_detector",
]

DETECTOR_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_detr.safetensors"
#: the evaluation stream of the detector: 1,000 scenes from this seed
DETECTION_TEST_SEED = EVAL_SEED_BASE + 30_000
#: sub-streams of a detection seed (one per object count) live far above every other stream of the world
_SUBSTREAM = 10**10

#: keyword arguments of `transformers.DetrConfig`
DETECTOR_CONFIG = dict(
    use_timm_backbone=False,
    use_pretrained_backbone=False,
    backbone_config=dict(model_type="convnext", num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[48, 96],
                         depths=[2, 2], layer_scale_init_value=1e-6, drop_path_rate=0.0,
                         out_features=["stage2"]),
    num_channels=3,
    d_model=128,
    encoder_layers=3,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=256,
    decoder_ffn_dim=256,
    num_queries=10,
    num_labels=len(CLASSES),
    id2label={i: name for i, name in enumerate(CLASSES)},
    label2id={name: i for i, name in enumerate(CLASSES)},
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    activation_function="relu",
    position_embedding_type="sine",
    auxiliary_loss=True,
    class_cost=1,
    bbox_cost=5,
    giou_cost=2,
    bbox_loss_coefficient=5,
    giou_loss_coefficient=2,
    eos_coefficient=0.1,
)


@dataclass
class DetectionScenes:
    """A batch of detection scenes.

    images : float32 (n, 3, H, W), normalised as the shapes world's
    pixels : uint8 (n, H, W, 3)
    labels : per scene, long (k,) class indices into :data:`CLASSES`
    boxes  : per scene, float (k, 4) ``x0, y0, x1, y1`` in pixels, tight around the mask
    masks  : per scene, bool (k, H, W), exactly the painted pixels of each object
    """

    images: torch.Tensor
    pixels: np.ndarray
    labels: list[torch.Tensor]
    boxes: list[torch.Tensor]
    masks: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.labels)

    def hf_targets(self) -> list[dict[str, torch.Tensor]]:
        """Targets as `DetrForObjectDetection` takes them: class labels and normalised (cx, cy, w, h) boxes."""
        size = float(self.images.shape[-1])
        out = []
        for labels, boxes in zip(self.labels, self.boxes):
            xyxy = boxes / size
            cxcywh = torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)
            out.append({"class_labels": labels, "boxes": cxcywh.float()})
        return out


def boxes_from_masks(masks: torch.Tensor) -> torch.Tensor:
    """Tight ``x0, y0, x1, y1`` boxes (exclusive ends) of boolean masks ``(k, H, W)``."""
    rows, cols = masks.any(2), masks.any(1)
    h, w = masks.shape[-2:]
    ar_h, ar_w = torch.arange(h), torch.arange(w)
    y0 = torch.where(rows, ar_h, h).amin(1)
    y1 = torch.where(rows, ar_h, -1).amax(1) + 1
    x0 = torch.where(cols, ar_w, w).amin(1)
    x1 = torch.where(cols, ar_w, -1).amax(1) + 1
    return torch.stack([x0, y0, x1, y1], 1).float()


def make_detection_scenes(n: int, seed: int, clutter=1.0) -> DetectionScenes:
    """``n`` scenes, a third each with one, two and three objects, shuffled; deterministic for ``(n, seed)``.

    ``clutter`` (a float in [0, 1]) is the shapes world's clutter level, lowered only in a training curriculum."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 4, n)
    pixels = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    images = torch.empty(n, 3, IMAGE_SIZE, IMAGE_SIZE)
    labels: list[torch.Tensor] = [torch.empty(0)] * n
    masks: list[torch.Tensor] = [torch.empty(0)] * n
    for k in (1, 2, 3):
        where = np.flatnonzero(counts == k)
        if where.size == 0:
            continue
        scenes = make_scenes(where.size, seed=seed + k * _SUBSTREAM, objects=k, clutter=clutter)
        pixels[where] = scenes.pixels
        images[torch.from_numpy(where)] = scenes.images
        for row, i in enumerate(where):
            labels[i] = scenes.labels[row]
            masks[i] = scenes.masks[row]
    return DetectionScenes(images=images, pixels=pixels, labels=labels,
                           boxes=[boxes_from_masks(m) for m in masks], masks=masks)


def detector_inputs(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's inputs for whole (unpadded) images."""
    return {"pixel_values": images, "pixel_mask": torch.ones(images.shape[0], *images.shape[-2:], dtype=torch.long)}


def picture_inputs(pictures: list) -> dict[str, torch.Tensor]:
    """RGB pictures (PIL) as the shapes detector takes them: resized to the world's size where they differ
    (bilinear), normalised as the world's scenes; a saved scene gives exactly the tensors it was made from."""
    from PIL import Image

    from .scenes import normalize

    side = (IMAGE_SIZE, IMAGE_SIZE)
    pixels = np.stack([np.asarray(p if p.size == side else p.resize(side, Image.Resampling.BILINEAR)) for p in pictures])
    return detector_inputs(normalize(pixels))


def is_shapes_detector(config) -> bool:
    """Whether a `DetrConfig` is the shapes detector's (its classes, width and query count), e.g. the shipped
    detector saved with `save_pretrained`: such a folder has no image-processor config of its own."""
    names = [(config.id2label or {}).get(i) for i in range(len(config.id2label or {}))]
    return (names == list(CLASSES) and config.d_model == DETECTOR_CONFIG["d_model"]
            and config.num_queries == DETECTOR_CONFIG["num_queries"])


def build_detector():
    """A freshly initialised shapes detector (every backbone parameter trainable: there are no pretrained ones)."""
    from transformers import DetrConfig, DetrForObjectDetection

    model = DetrForObjectDetection(DetrConfig(**DETECTOR_CONFIG))
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def load_detector(path: str | Path = DETECTOR_WEIGHTS_PATH):
    """The shipped shapes detector (or the one at ``path``), in eval mode."""
    from safetensors.torch import load_file
    from transformers import DetrConfig, DetrForObjectDetection

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no detector weights at {path}: train them with python -m training.shapes_detr")
    info = json.loads(path.with_suffix(".json").read_text())
    model = DetrForObjectDetection(DetrConfig(**info["config"]))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def _detections(model, images: torch.Tensor, batch_size: int = 250):
    """Per image: scores (Q,), classes (Q,), boxes (Q, 4) in pixels, from every query's best class."""
    out = []
    with torch.no_grad():
        for s in range(0, images.shape[0], batch_size):
            x = images[s:s + batch_size]
            result = model(**detector_inputs(x))
            probs = result.logits.softmax(-1)[..., :-1]
            scores, classes = probs.max(-1)
            cx, cy, w, h = (result.pred_boxes * x.shape[-1]).unbind(-1)
            boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
            out.extend(zip(scores, classes, boxes))
    return out


def evaluate_detector(model, n: int = 1000, seed: int = DETECTION_TEST_SEED, threshold: float = 0.5) -> dict:
    """COCO box AP (pycocotools) on ``n`` unseen scenes, and the class accuracy of detections (score >
    ``threshold``) matched to a ground-truth box at IoU >= 0.5 regardless of class."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from torchvision.ops import box_iou

    was_training = model.training
    model.eval()
    try:
        scenes = make_detection_scenes(n, seed)
        found = _detections(model, scenes.images)
    finally:
        model.train(was_training)
    images, annotations, results = [], [], []
    matched = correct = detected = 0
    for i, ((scores, classes, boxes), labels, gt) in enumerate(zip(found, scenes.labels, scenes.boxes)):
        images.append({"id": i, "width": IMAGE_SIZE, "height": IMAGE_SIZE})
        for label, box in zip(labels.tolist(), gt.tolist()):
            w, h = box[2] - box[0], box[3] - box[1]
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": label,
                                "bbox": [box[0], box[1], w, h], "area": w * h, "iscrowd": 0})
        for score, cls, box in zip(scores.tolist(), classes.tolist(), boxes.tolist()):
            results.append({"image_id": i, "category_id": cls, "score": score,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
        keep = scores > threshold
        detected += int(keep.sum())
        if keep.any():
            iou = box_iou(boxes[keep], gt)
            taken: set[int] = set()
            for d in torch.argsort(scores[keep], descending=True).tolist():
                best = [g for g in torch.argsort(iou[d], descending=True).tolist() if g not in taken]
                if best and iou[d, best[0]] >= 0.5:
                    taken.add(best[0])
                    matched += 1
                    correct += int(classes[keep][d] == labels[best[0]])
    coco = COCO()
    coco.dataset = {"images": images, "annotations": annotations,
                    "categories": [{"id": k, "name": name} for k, name in enumerate(CLASSES)]}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports on stdout
        coco.createIndex()
        evaluation = COCOeval(coco, coco.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    objects = sum(len(x) for x in scenes.labels)
    return {"n": n, "seed": seed, "objects": objects, "ap": float(evaluation.stats[0]),
            "ap50": float(evaluation.stats[1]), "ap75": float(evaluation.stats[2]),
            "detected": detected, "matched": matched, "recall50": matched / objects,
            "class_accuracy": correct / max(matched, 1), "threshold": threshold}
