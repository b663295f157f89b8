"""`relevancy explain-detections`: every object DETR detects in each image, one map per object.

    relevancy explain-detections IMAGE... --model FOLDER [--method M] [--threshold P] [--out DIR] [--json]

Writes `DIR/<image stem>_detections.png` per image (one panel per detected object: the map over the image, the
box, the class and its logit) and, with --json, per image the objects with their boxes and score grids.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..files import check_folder
from .common import DEFAULT_OUT, UsageError, print_json, read_image


def run_explain_detections(args: argparse.Namespace) -> list[Path]:
    import torch

    import relevancy
    from ..evaluation.detection import image_processor
    from ..extras import require
    from ..methods import REGISTRY

    if args.method not in REGISTRY:
        raise UsageError(f"unknown method '{args.method}'; valid methods: {', '.join(REGISTRY)}")
    if not 0.0 <= args.threshold < 1.0:
        raise UsageError(f"--threshold must be a probability in [0, 1), got {args.threshold}")
    if not Path(args.model).is_dir():
        raise UsageError(f"--model must be a local folder of a transformers DetrForObjectDetection (save_pretrained), got {args.model}")
    out = Path(args.out or DEFAULT_OUT)
    names = [f"{Path(image).stem}_detections.png" for image in args.images]
    check_folder(out, names)
    pictures = [read_image(image) for image in args.images]
    model = require("transformers", "text").DetrForObjectDetection.from_pretrained(args.model).eval()
    processor = image_processor()
    written, report = [], []
    for image, picture, name in zip(args.images, pictures, names):
        batch = processor(images=picture, return_tensors="pt")
        inputs = {"pixel_values": batch["pixel_values"].to(next(model.parameters()).dtype), "pixel_mask": batch["pixel_mask"]}
        detections = relevancy.detect(model, inputs, args.threshold)[0]
        entry = {"image": image, "objects": []}
        if detections:
            expl = relevancy.explain(model, inputs, method=args.method, target=[[(d.query, d.label) for d in detections]])
            boxes = torch.tensor([d.box for d in detections])
            if not args.json or args.out:
                written.append(expl.save(out / name, inputs["pixel_values"], boxes))
            labels = expl.class_names or []
            entry["objects"] = [
                {"query": d.query, "label": d.label, "class": labels[d.label] if d.label < len(labels) else str(d.label),
                 "probability": d.score, "box_xyxy": list(d.box), "scores": expl.parts["image"].scores[k].tolist()}
                for k, d in enumerate(detections)
            ]
        report.append(entry)
    if args.json:
        print_json(report)
    return written
