"""The authors' DETR segmentation protocol: Otsu masks and upsampling exact to their outputs; the COCO runner."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from golden import GOLDEN
from relevancy.evaluation.detection import evaluate_detection_segmentation, write_detection_report
from relevancy.evaluation.metrics.detection_masks import (
    IOU_THRESHOLDS, kept_queries, masks_at_size, otsu_mask, otsu_threshold, query_masks,
)
from test_detr_family import build


@pytest.fixture(scope="module")
def case() -> dict:
    return torch.load(GOLDEN / "detr_reference.pt", weights_only=True)[0]


def test_otsu_masks_equal_the_authors_for_every_method_and_object(case):
    h, w = case["feature_grid"]
    compared = 0
    for entry in case["segmentation"]:
        for key, stored in entry["methods"].items():
            for k, _query in enumerate(entry["kept_queries"]):
                assert np.array_equal(otsu_mask(stored["maps"][k].reshape(h, w)), stored["otsu_masks"][k].numpy()), key
                compared += 1
    assert compared == 90  # 10 methods x (5 + 4) kept objects


def test_masks_at_the_original_size_equal_the_authors(case):
    h, w = case["feature_grid"]
    queries = case["logits"].shape[1]
    for entry in case["segmentation"]:
        stored = entry["methods"]["ours_no_lrp"]
        masks = query_masks({q: stored["otsu_masks"][k].numpy() for k, q in enumerate(entry["kept_queries"])}, queries, (h, w))
        full = masks_at_size(masks, entry["size"], entry["orig_size"])
        assert torch.equal(full[entry["kept_queries"]], stored["masks_orig_size"])
        others = [q for q in range(queries) if q not in entry["kept_queries"]]
        assert not full[others].any()  # queries not kept stay empty


def test_kept_queries_follow_the_probability_rule(case):
    for entry in case["segmentation"]:
        kept = kept_queries(case["logits"][entry["image"]]).nonzero()[:, 0].tolist()
        assert kept == list(entry["kept_queries"])


def test_otsu_edge_cases():
    assert otsu_threshold(np.full(12, 7, dtype=np.uint8)) == 0  # one value: no threshold qualifies
    assert not otsu_mask(torch.zeros(3, 4)).any()  # a constant map casts to 0 and gives an empty mask
    assert otsu_threshold(np.array([0, 0, 255, 255], dtype=np.uint8)) == 0  # first maximum
    assert len(IOU_THRESHOLDS) == 16 and np.isclose(IOU_THRESHOLDS[0], 0.2) and np.isclose(IOU_THRESHOLDS[6], 0.5)


def coco_folder(case: dict, tmp_path: Path) -> Path:
    """A COCO-format folder: the reference images as PNGs, one box-shaped object each; returns the annotation file."""
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    images, annotations = [], []
    for i, picture in enumerate(case["images"]):
        pixels = ((picture.float() * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        height, width = pixels.shape[:2]
        images.append({"id": i + 1, "file_name": f"{i}.png", "height": height, "width": width})
        box = [16.0, 16.0, 48.0, 40.0]
        polygon = [16, 16, 64, 16, 64, 56, 16, 56]
        annotations.append({"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": box, "area": box[2] * box[3],
                            "iscrowd": 0, "segmentation": [polygon]})
    categories = [{"id": k, "name": f"class {k}"} for k in range(case["config"].get("num_labels", 6))]
    annotation_file = tmp_path / "annotations.json"
    annotation_file.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return annotation_file


def test_coco_runner_on_a_small_folder(case, tmp_path):
    model = build(case)
    annotation_file = coco_folder(case, tmp_path)
    results = evaluate_detection_segmentation(model, annotation_file, tmp_path, ("generic_attention", "raw_attention"))
    assert results["n"] == 2 and set(results["methods"]) == {"generic_attention", "raw_attention"}
    for scores in results["methods"].values():
        assert set(scores["segm"]) == {"AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large"}
        assert all(-1.0 <= v <= 1.0 for v in scores["segm"].values())
    written = write_detection_report(results, tmp_path / "out")
    assert [p.name for p in written] == ["results.json", "report.md"]
    assert "| `generic_attention` |" in (tmp_path / "out" / "report.md").read_text()


def test_the_command_line_runs_the_test_on_a_saved_model(case, tmp_path):
    from relevancy.apps.cli import main

    build(case).save_pretrained(tmp_path / "detr")
    annotation_file = coco_folder(case, tmp_path)
    assert main(["evaluate", "--benchmark", "coco-detr", "--data", str(annotation_file), "--model", str(tmp_path / "detr"),
                 "--methods", "raw_attention", "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["benchmark"] == "coco-detr" and results["n"] == 2 and list(results["methods"]) == ["raw_attention"]


def test_the_command_line_names_what_coco_detr_needs(tmp_path, capsys):
    from relevancy.apps.cli import main

    assert main(["evaluate", "--benchmark", "coco-detr", "--out", str(tmp_path / "out")]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_explain_detections_command_writes_a_panel_per_object(case, tmp_path, capsys):
    from relevancy.apps.cli import main

    build(case).save_pretrained(tmp_path / "detr")
    coco_folder(case, tmp_path)
    assert main(["explain-detections", str(tmp_path / "0.png"), "--model", str(tmp_path / "detr"),
                 "--threshold", "0.0", "--out", str(tmp_path / "out"), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)  # the image's DetectionExplanation.to_json()
    assert result["kind"] == "DetectionExplanation" and result["query"] and len(result["boxes"]) == len(result["query"])
    assert all(len(box) == 4 for box in result["boxes"]) and len(result["scores"]["image"]) == len(result["query"])
    assert (tmp_path / "out" / "0_detections.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["explain-detections", str(tmp_path / "0.png"), "--model", str(tmp_path / "detr"), "--method", "nope",
                 "--out", str(tmp_path / "out2")]) == 2
