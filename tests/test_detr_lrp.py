"""DETR's LRP-based maps (the ICCV'21 authors' `ours_with_lrp`, `partial_lrp`, `transformer_att`): exact with the
authors' arithmetic, single and batched, relevance accounted for, the model unchanged."""
from __future__ import annotations

import pytest
import torch

import relevancy
from golden import assert_map_close
from models import tiny_vit
from test_detr_family import (  # noqa: F401 (case, model: the reference's fixtures)
    RTOL, build, case, check_records_batched, check_records_one_at_a_time, images, model, targets_per_image,
)
from test_model_unchanged import assert_same, snapshot

# reference key -> (method, options); exact=True: the authors' 1e-9 stabilisers and Clone / IndexSelect factors
DETR_LRP_KEYS = {
    "ours_with_lrp": ("generic_attention", {"weights": "relevance", "exact": True}),
    "partial_lrp": ("partial_lrp", {"exact": True}),
    "transformer_att": ("transformer_attribution", {"exact": True}),
}


@pytest.mark.parametrize("key", DETR_LRP_KEYS)
def test_every_record_one_object_at_a_time(case, model, key):
    check_records_one_at_a_time(case, model, key, *DETR_LRP_KEYS[key])


@pytest.mark.parametrize("key", DETR_LRP_KEYS)
def test_every_record_in_one_batched_call(case, model, key):
    check_records_batched(case, model, key, *DETR_LRP_KEYS[key])


@pytest.mark.parametrize("exact", [True, False])
def test_relevance_is_accounted_for(case, model, exact):
    """`relevance_total` (rows, 2): the relevance reaching the encoder's input tokens and the decoder's zero queries.
    The first decoder self-attention's values are those zero queries: the values' half of its relevance stays
    there, an amount equal to what its queries and keys pass on. So image + 2 x queries = 1 (the explained logit's
    relevance), to the stabilisers' 1e-9 per step when exact."""
    expl = relevancy.explain(model, images(case), method="transformer_attribution", target=targets_per_image(case), exact=exact)
    totals = expl.relevance_total
    assert totals.shape == (len(case["records"]), 2)
    assert (totals > 0.05).all()
    assert torch.allclose(totals[:, 0] + 2 * totals[:, 1], torch.ones(len(totals), dtype=totals.dtype), atol=1e-6)


def test_the_default_arithmetic_holds_sums_that_cancel(case, model):
    """Without `exact` the rules divide stably (`relevancy.lrp.rules`): where no sum cancels below the floor the map
    is the exact one (image 0, query 2: to 5e-9), where sums cancel it is not (image 1, query 3: 38 % of its
    maximum); both are finite and non-negative."""
    records = {(r["image"], r["query"]): r for r in case["records"]}
    for (image, query), close in (((0, 2), True), ((1, 3), False)):
        target = (query, records[image, query]["target_class"])
        scores = relevancy.explain(model, images(case, image), method="transformer_attribution", target=target).parts["image"].scores
        expected = records[image, query]["transformer_att"]
        assert torch.isfinite(scores).all() and (scores >= 0).all()
        error = (scores.flatten() - expected).abs().max() / expected.abs().max()
        assert error < 1e-7 if close else error > 0.1


def test_frozen_weights_are_explained(case):
    model = build(case)
    model.requires_grad_(False)
    record = case["records"][1]
    for key, (method, options) in DETR_LRP_KEYS.items():
        expl = relevancy.explain(model, images(case, record["image"]), method=method,
                                 target=(record["query"], record["target_class"]), **options)
        assert_map_close(expl.parts["image"].scores[0].flatten(), record[key], RTOL)


@pytest.mark.parametrize("key", DETR_LRP_KEYS)
def test_model_unchanged_after_success_and_failure(case, key, monkeypatch):
    method, options = DETR_LRP_KEYS[key]
    model = build(case)
    implementation = model.config._attn_implementation
    before = snapshot(model)
    relevancy.explain(model, images(case), method=method, target=(2, 1), **options)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == implementation

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr("relevancy.methods.capture.target_score", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, images(case), method=method, target=(2, 1), **options)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("generic_attention", {"weights": "lrp"}, "weights must be one of attention, relevance"),
        ("generic_attention", {"exact": True}, "exact applies to weights='relevance'"),
        ("transformer_attribution", {"blocks": "last"}, "blocks apply to self-attention models"),
        ("transformer_attribution", {"start_layer": 1, "row_normalize": True}, "start_layer, row_normalize apply"),
    ],
)
def test_options_that_do_not_apply_are_refused(case, model, method, options, message):
    with pytest.raises(ValueError, match=message):
        relevancy.explain(model, images(case, 0), method=method, target=(2, 1), **options)


def test_relevance_weights_are_refused_on_self_attention_models():
    with pytest.raises(ValueError, match="method='transformer_attribution'"):
        relevancy.explain(tiny_vit(), torch.randn(1, 3, 32, 32), method="generic_attention", weights="relevance")


@pytest.mark.parametrize("key", DETR_LRP_KEYS)
def test_every_kept_object_and_its_otsu_mask(case, model, key):
    """target=None: every query the authors' segmentation test keeps (5 + 4 objects), in one call; each map equals
    the one their `get_panoptic` thresholded, and gives the same Otsu mask."""
    from relevancy.evaluation.metrics.detection_masks import otsu_mask

    method, options = DETR_LRP_KEYS[key]
    expl = relevancy.explain(model, images(case), method=method, **options)
    rows = {(i, q): row for row, (i, q) in enumerate(zip(expl.image.tolist(), expl.query.tolist()))}
    compared = 0
    for entry in case["segmentation"]:
        stored = entry["methods"][key]
        for k, query in enumerate(entry["kept_queries"]):
            scores = expl.parts["image"].scores[rows[entry["image"], query]]
            assert_map_close(scores.flatten(), stored["maps"][k], RTOL)
            assert torch.equal(torch.as_tensor(otsu_mask(scores)), torch.as_tensor(stored["otsu_masks"][k]))
            compared += 1
    assert compared == 9
