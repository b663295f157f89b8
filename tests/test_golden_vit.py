"""Every ViT map of the authors' code in float64 (tests/golden/vit_reference64.pt), one image at a time and batched."""
from __future__ import annotations

import pytest
import torch

import relevancy
from golden import assert_map_close, build_vit, exact_options, vit_cases

# golden key -> (method, options)
MAPS = {
    "raw_attention": ("raw_attention", {}),
    "rollout": ("rollout", {}),
    "rollout_start1": ("rollout", {"start_layer": 1}),
    "attn_gradcam": ("attention_gradcam", {"normalize": True}),
    "generic_attention": ("generic_attention", {}),
    "cdam": ("cdam", {}),
    "tam": ("token_ablation", {}),
    "transformer_attribution": ("transformer_attribution", {}),
    "transformer_attribution_start1": ("transformer_attribution", {"start_layer": 1}),
    "partial_lrp": ("partial_lrp", {}),
    "lrp": ("lrp", {}),
}
CASE = vit_cases()[0]
MODEL = build_vit(CASE)
RECORDS = [r for r in CASE["records"] if "target" in r]
CONCEPTS = [r for r in CASE["records"] if "concept" in r]


def test_model_reproduces_reference_logits():
    with torch.no_grad():
        torch.testing.assert_close(MODEL(CASE["inputs"]), CASE["logits"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("key", list(MAPS))
def test_single_image_maps(key):
    method, options = MAPS[key]
    for record in RECORDS:
        image = CASE["inputs"][record["image"]][None]
        expl = relevancy.explain(MODEL, image, method=method, target=record["target"], **exact_options(method, options))
        assert expl.target.tolist() == [record["target"]]
        assert_map_close(expl.scores[0], record[key])


@pytest.mark.parametrize("key", list(MAPS))
def test_mixed_target_batch_equals_single_images(key):
    """All three images in one batch, each with its own target (alternating predicted and second class)."""
    method, options = MAPS[key]
    for offset in (0, 1):
        chosen = [[r for r in RECORDS if r["image"] == i][(i + offset) % 2] for i in range(3)]
        images = CASE["inputs"][[r["image"] for r in chosen]]
        expl = relevancy.explain(MODEL, images, method=method, target=[r["target"] for r in chosen], **exact_options(method, options))
        for row, record in enumerate(chosen):
            assert_map_close(expl.scores[row], record[key])


def test_cdam_for_a_concept():
    for record in CONCEPTS:
        concept = relevancy.Concept(MODEL, CASE["inputs"][record["concept_images"]])
        torch.testing.assert_close(concept.vector, record["concept"], atol=1e-12, rtol=0)
        expl = relevancy.explain(MODEL, CASE["inputs"][record["image"]][None], method="cdam", target=concept)
        assert_map_close(expl.scores[0], record["cdam_concept"])
        assert expl.target.tolist() == [-1]


def test_concept_batch_equals_single_images():
    record = CONCEPTS[0]
    concept = relevancy.Concept(MODEL, CASE["inputs"][record["concept_images"]])
    batch = relevancy.explain(MODEL, CASE["inputs"], method="cdam", target=concept)
    for i in range(3):
        single = relevancy.explain(MODEL, CASE["inputs"][i][None], method="cdam", target=concept)
        assert_map_close(batch.scores[i], single.scores[0])


def test_predicted_class_is_the_default_target():
    expl = relevancy.explain(MODEL, CASE["inputs"], method="raw_attention")
    assert expl.target.tolist() == CASE["logits"].argmax(-1).tolist()
