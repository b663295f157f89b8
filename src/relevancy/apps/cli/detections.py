"""`relevancy explain-detections`: every object DETR detects in each image, one map per object.

    relevancy explain-detections IMAGE... --model FOLDER [--method M] [--threshold P] [--max-objects K] [--out DIR] [--json]

The pictures are preprocessed as the model folder says (its image-processor config), else as its family says
(the shapes detector saved with `save_pretrained`: the shapes world's size and statistics), else as COCO DETR
(with a warning). Writes `DIR/<image stem>_detections.png` per image (one panel per detected object: the map over
the image, the box, the class and its logit) and, with --json, a list of `to_json()` (docs/api.md), one per image
with an object above the threshold, in the images' order (each explained alone: its rows' `image` is 0; `boxes` holds
the objects' boxes). An image where nothing passes the threshold is named with its best probability.
"""
from __future__ import annotations

import argparse
from pathlib import Path
import dataclasses
from typing import TYPE_CHECKING, Callable

from ...core.files import check_folder, distinct_stems
from ..common import UsageError, at_most, check_inputs, resolve_methods, warn
from .common import DEFAULT_OUT, MAX_FILES, print_results, read_image

if TYPE_CHECKING:
    from PIL import Image
    from torch import nn

#: the most objects explained per image (each is one backward and one panel of the PNG)
MAX_OBJECTS = 30
#: the most image tokens (cells of the backbone's feature map) a picture may give: the encoder's attention and its
#: gradients grow with their square (COCO DETR's ResNet-50 at 800 x 1333 px gives about 1,000; its DC5 variant 4,200)
MAX_IMAGE_TOKENS = 8_192
#: the folder file that holds a transformers image processor's settings
PROCESSOR_CONFIG = "preprocessor_config.json"


def run_explain_detections(args: argparse.Namespace) -> list[Path]:
    """Checks the request, the model folder and every picture's size, then per image a PNG and/or the numbers."""
    import relevancy
    from ...families import adapter_for

    check_inputs("images", args.images, MAX_FILES)
    from ...families.detr.adapter import DetrAdapter

    methods = resolve_methods(args.method, DetrAdapter.methods, "DETR")
    if args.method == "all":
        raise UsageError("--method takes one method for explain-detections (each object is a panel), not 'all'")
    if not 0.0 <= args.threshold < 1.0:
        raise UsageError(f"--threshold must be a probability in [0, 1), got {args.threshold}")
    at_most("--max-objects", args.max_objects, 1, MAX_OBJECTS)
    folder = Path(args.model)
    if not folder.is_dir():
        raise UsageError(f"--model must be a local folder of a transformers DetrForObjectDetection (save_pretrained), got {args.model}")
    out = Path(args.out or DEFAULT_OUT)
    names = [f"{stem}_detections.png" for stem in distinct_stems(args.images)]
    if not args.json or args.out:
        check_folder(out, names)
    pictures = [read_image(image, "explain-detections") for image in args.images]
    model = load_detector_folder(folder)
    prepare = detector_preprocessing(folder, model)
    adapter = adapter_for(model)
    labels = adapter.class_names() or []
    for image, picture in zip(args.images, pictures):  # every picture checked before anything is written
        height, width = prepare(picture)["pixel_values"].shape[-2:]
        rows, columns = adapter.feature_grid(height, width)
        if rows * columns > MAX_IMAGE_TOKENS:
            raise UsageError(f"{image} preprocessed to {width}x{height} px gives {rows}x{columns} = {rows * columns:,} image "
                             f"tokens; the limit is {MAX_IMAGE_TOKENS:,}: save an image processor with a smaller size beside the model")
    written, report = [], []
    for image, picture, name in zip(args.images, pictures, names):
        inputs = prepare(picture)
        candidates = sorted(relevancy.detect(model, inputs, 0.0)[0], key=lambda d: -d.score)
        detections = [d for d in candidates if d.score > args.threshold]
        if not detections:
            best = candidates[0] if candidates else None
            warn("explain-detections", f"{image}: no object above --threshold {args.threshold}"
                 + (f"; the best is {_class(labels, best.label)} at probability {best.score:.3f}" if best else ""))
        if len(detections) > args.max_objects:
            warn("explain-detections", f"{image}: {len(detections)} objects above --threshold {args.threshold}; "
                                       f"explaining the {args.max_objects} most probable (--max-objects, at most {MAX_OBJECTS})")
            detections = detections[: args.max_objects]
        if detections:
            import torch

            expl = relevancy.explain(model, inputs, method=methods[0], target=[[(d.query, d.label) for d in detections]])
            expl = dataclasses.replace(expl, boxes=torch.tensor([d.box for d in detections]))
            if not args.json or args.out:
                written.append(expl.save(out / name, inputs["pixel_values"]))
            report.append(expl)
    if args.json:
        print_results(report)
    return written


def _class(labels: list[str], label: int) -> str:
    """The class name of `label`, or the index as text where the model names none."""
    return labels[label] if 0 <= label < len(labels) else str(label)


def load_detector_folder(folder: Path) -> nn.Module:
    """The `DetrForObjectDetection` saved in `folder`; a one-line error when it holds another model or none."""
    from ...core.extras import require

    transformers = require("transformers", "text")
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {folder} holds no transformers model (no readable config.json)") from error
    if config.model_type != "detr":
        raise UsageError(f"--model {folder} holds a '{config.model_type}' model; explain-detections takes a DetrForObjectDetection")
    try:
        return transformers.DetrForObjectDetection.from_pretrained(folder).eval()
    except (OSError, ValueError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(f"--model {folder}: could not load its DetrForObjectDetection ({first[:300]})") from error


def detector_preprocessing(folder: Path, model: nn.Module) -> Callable[[Image.Image], dict]:
    """How a picture becomes the model's inputs: the folder's image-processor config, else the shapes detector's
    own preprocessing where the model is one, else COCO DETR's (800 px, ImageNet statistics) with a warning."""
    from ...worlds.detection import detector_inputs, is_shapes_detector, picture_inputs

    if (folder / PROCESSOR_CONFIG).is_file():
        from ...core.extras import require

        processor = require("transformers", "text").DetrImageProcessor.from_pretrained(folder)
    elif is_shapes_detector(model.config):
        return lambda picture: picture_inputs([picture])
    else:
        from ...evaluation.detection import image_processor

        warn("explain-detections", f"{folder} has no {PROCESSOR_CONFIG}: preprocessing as COCO DETR (shorter side 800 px, "
                                   "ImageNet statistics); save the model's image processor beside it if it was trained otherwise")
        processor = image_processor()
    dtype = next(model.parameters()).dtype

    def prepare(picture: Image.Image) -> dict:
        pixels = processor(images=picture, return_tensors="pt")["pixel_values"].to(dtype)
        return detector_inputs(pixels)  # one picture: no padding, every pixel valid

    return prepare
