"""DETR (transformers DetrForObjectDetection): the authors' encoder-decoder rules, exact, batched, model unchanged."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import relevancy
from golden import GOLDEN, assert_map_close
from test_model_unchanged import assert_same, snapshot

# reference key -> (method, options), as the authors' mask_generator.py names them
DETR_KEYS = {
    "ours_no_lrp": ("generic_attention", {}),
    "ours_no_lrp_no_norm": ("generic_attention", {"residual_normalization": False}),
    "ablation_no_self_in_10": ("generic_attention", {"bimodal_self_terms": False}),
    "ablation_no_aggregation": ("generic_attention", {"aggregate": False, "residual_normalization": False}),
    "raw_attn": ("raw_attention", {}),
    "rollout": ("rollout", {}),
    "attn_gradcam": ("attention_gradcam", {}),
}
# 1e-8 of each map's largest magnitude: eager attention's softmax runs in float64 for a float64 DETR
RTOL = 1e-8


@pytest.fixture(scope="module")
def case() -> dict:
    return torch.load(GOLDEN / "detr_reference.pt", weights_only=True)[0]


def build(case: dict) -> torch.nn.Module:
    from transformers import DetrConfig, DetrForObjectDetection

    model = DetrForObjectDetection(DetrConfig(**case["config"])).double()
    model.load_state_dict(case["state_dict"], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def model(case) -> torch.nn.Module:
    return build(case)


def images(case: dict, index: slice | int = slice(None)) -> dict:
    index = slice(index, index + 1) if isinstance(index, int) else index
    return {"pixel_values": case["images"][index], "pixel_mask": case["pixel_mask"][index]}


def targets_per_image(case: dict) -> list[list[tuple[int, int]]]:
    """Every record's (query, class), grouped by image."""
    return [[(r["query"], r["target_class"]) for r in case["records"] if r["image"] == i] for i in range(len(case["images"]))]


def check_records_one_at_a_time(case: dict, model: torch.nn.Module, key: str, method: str, options: dict) -> None:
    for record in case["records"]:
        expl = relevancy.explain(model, images(case, record["image"]), method=method,
                                 target=(record["query"], record["target_class"]), **options)
        assert expl.parts["image"].scores.shape == (1, *case["feature_grid"])
        assert_map_close(expl.parts["image"].scores[0].flatten(), record[key], RTOL)


def check_records_batched(case: dict, model: torch.nn.Module, key: str, method: str, options: dict) -> None:
    """Both images and both objects of each in one call: four rows, each its own record."""
    records = case["records"]
    expl = relevancy.explain(model, images(case), method=method, target=targets_per_image(case), **options)
    assert expl.image.tolist() == [r["image"] for r in sorted(records, key=lambda r: r["image"])]
    rows = {(i, q): row for row, (i, q) in enumerate(zip(expl.image.tolist(), expl.query.tolist()))}
    assert len(rows) == len(records)
    for record in records:
        row = rows[record["image"], record["query"]]
        assert expl.target[row] == record["target_class"]
        assert_map_close(expl.parts["image"].scores[row].flatten(), record[key], RTOL)


@pytest.mark.parametrize("key", DETR_KEYS)
def test_every_record_one_object_at_a_time(case, model, key):
    check_records_one_at_a_time(case, model, key, *DETR_KEYS[key])


@pytest.mark.parametrize("key", DETR_KEYS)
def test_every_record_in_one_batched_call(case, model, key):
    check_records_batched(case, model, key, *DETR_KEYS[key])


@pytest.mark.parametrize("key", DETR_KEYS)
def test_every_record_with_the_images_batched_together(case, model, key, monkeypatch):
    """The path a GPU takes: both images in one forward, each object's gradient from its round's backward."""
    from relevancy.families.detr.adapter import DetrAdapter

    monkeypatch.setattr(DetrAdapter, "independent_groups", lambda self, inputs: None)
    check_records_batched(case, model, key, *DETR_KEYS[key])


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("method, rows_per_image", [("generic_attention", 1), ("transformer_attribution", 2)])
def test_each_image_runs_once_through_what_its_objects_share(case, model, method, rows_per_image, batched, monkeypatch):
    """Two objects of each of two images: the backbone runs once per image; the encoder-decoder once per image
    for the methods that read attentions and gradients (each object's gradient from a backward of its own), once
    per object for LRP (each object's relevance is a backward through its own rules). On a CPU one image at a
    time (`batched=False`); on a GPU both images in one call."""
    from relevancy.families.detr.adapter import DetrAdapter

    if batched:
        monkeypatch.setattr(DetrAdapter, "independent_groups", lambda self, inputs: None)
    seen: list[int] = []
    # the convolutional network inside DETR's backbone wrapper: what actually runs on the pixels
    backbone = model.model.backbone.model.register_forward_pre_hook(lambda _m, args: seen.append(len(args[0])))
    rows: list[int] = []
    encoder = model.model.encoder.register_forward_hook(lambda _m, _a, out: rows.append(len(out[0])))
    try:
        relevancy.explain(model, images(case), method=method, target=targets_per_image(case))
    finally:
        backbone.remove()
        encoder.remove()
    if batched:
        assert seen == [2] and rows == [2 * rows_per_image]
    else:
        assert seen == [1, 1] and rows == [rows_per_image, rows_per_image]


def test_the_nan_rule_fires_where_the_authors_drop_a_layer(case):
    """Records whose first decoder layer's rule-10 term is NaN in the authors' code (a zero row of R_qq - I)
    are reproduced: the term is dropped, not computed with a "safe" division."""
    flagged = [r for r in case["records"] if any(r["nan_zeroed_per_decoder_layer"]["ours_no_lrp"])]
    assert flagged, "the reference holds records where the NaN rule fires"


def test_default_target_explains_every_detected_object(case, model):
    """target=None: the queries whose best class has probability > 0.5 (the authors' keep rule), per image."""
    expl = relevancy.explain(model, images(case), method="generic_attention")
    for entry in case["segmentation"]:
        kept = [q for i, q in zip(expl.image.tolist(), expl.query.tolist()) if i == entry["image"]]
        assert kept == list(entry["kept_queries"])
        for q in kept:
            row = [r for r, (i, qq) in enumerate(zip(expl.image.tolist(), expl.query.tolist())) if (i, qq) == (entry["image"], q)][0]
            assert expl.target[row] == entry["labels"][q]
    assert len(expl.labels()) == len(expl.image)


def test_frozen_weights_are_explained(case):
    model = build(case)
    model.requires_grad_(False)
    record = case["records"][0]
    expl = relevancy.explain(model, images(case, record["image"]), method="generic_attention",
                             target=(record["query"], record["target_class"]))
    assert_map_close(expl.parts["image"].scores[0].flatten(), record["ours_no_lrp"], RTOL)


@pytest.mark.parametrize("objects", ["one per image", "two per image"])
@pytest.mark.parametrize("method", ["generic_attention", "raw_attention", "rollout", "attention_gradcam", "cdam"])
def test_model_unchanged_after_success_and_failure(case, method, objects, monkeypatch):
    """One object per image (a forward per row) and two (a forward shared by the objects of an image)."""
    model = build(case)
    target = (2, 1) if objects == "one per image" else targets_per_image(case)
    implementation = model.config._attn_implementation
    before = snapshot(model)
    relevancy.explain(model, images(case), method=method, target=target)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == implementation

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr("relevancy.methods.capture.target_score", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, images(case), method=method, target=target)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("grad_mode", [True, False])
def test_a_failing_backbone_leaves_grad_mode_and_hooks_as_they_were(case, grad_mode):
    """The backbone runs without a graph (its hooks switch grad mode off and back): a failure inside it leaves the
    caller's grad mode, the model's hooks and its weights as they were."""
    model = build(case)
    before = snapshot(model)

    def fail(*_args):
        raise RuntimeError("injected failure")

    handle = model.model.backbone.model.register_forward_hook(fail)
    try:
        with torch.set_grad_enabled(grad_mode), pytest.raises(RuntimeError, match="injected failure"):
            relevancy.explain(model, images(case), method="generic_attention", target=targets_per_image(case))
        assert torch.is_grad_enabled()
        with torch.set_grad_enabled(grad_mode):
            with pytest.raises(RuntimeError, match="injected failure"):
                relevancy.explain(model, images(case), method="transformer_attribution", target=(2, 1))
            assert torch.is_grad_enabled() == grad_mode
    finally:
        handle.remove()
    assert_same(before, snapshot(model))


def test_cdam_is_signed_per_image_token(case, model):
    expl = relevancy.explain(model, images(case, 0), method="cdam", target=(2, 1))
    scores = expl.parts["image"].scores
    assert scores.shape == (1, *case["feature_grid"]) and (scores < 0).any() and (scores > 0).any()


@pytest.mark.parametrize(
    "target, message",
    [
        ((99, 0), "out of range"),
        ((0, 99), "out of range"),
        ("car", "DETR targets must be"),
        ([(0, 1)], "DETR targets must be"),  # one entry for two images
    ],
)
def test_bad_targets_are_named(case, model, target, message):
    with pytest.raises((ValueError, TypeError), match=message):
        relevancy.explain(model, images(case), method="generic_attention", target=target)


def test_bad_inputs_are_named(case, model):
    with pytest.raises(ValueError, match="unknown DETR inputs"):
        relevancy.explain(model, {**images(case), "boxes": 1}, method="raw_attention", target=(0, 0))
    with pytest.raises(ValueError, match="pixel_mask must be"):
        relevancy.explain(model, {"pixel_values": case["images"], "pixel_mask": case["pixel_mask"][:1]}, target=(0, 0))
    with pytest.raises(ValueError, match="self-attention models"):
        relevancy.explain(model, images(case), method="generic_attention", target=(0, 0), start_layer=1)


def test_detect_then_explain_then_save(case, model, tmp_path):
    """The Python path end to end: detections (boxes in pixels), their maps, one panel per object with its box."""
    detections = relevancy.detect(model, images(case))
    assert [[d.query for d in per_image] for per_image in detections] == [list(e["kept_queries"]) for e in case["segmentation"]]
    height, width = case["images"].shape[-2:]
    for per_image, entry in zip(detections, case["segmentation"]):
        for d in per_image:
            assert d.label == entry["labels"][d.query] and abs(d.score - float(entry["scores"][d.query])) < 1e-9
            assert 0 <= d.box[0] < d.box[2] and 0 <= d.box[1] < d.box[3]
    targets = [[(d.query, d.label) for d in per_image] for per_image in detections]
    expl = relevancy.explain(model, images(case), method="generic_attention", target=targets)
    boxes = torch.tensor([d.box for per_image in detections for d in per_image])
    path = dataclasses.replace(expl, boxes=boxes).save(tmp_path / "objects.png", case["images"])
    assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"
    assert not model.training


def _score_without(model: torch.nn.Module, inputs: dict, image: int, query: int, label: int, dropped: int | None) -> float:
    """The (query, label) logit with the encoder and decoder run on every image token but `dropped`, by hand."""
    detr = model.model
    with torch.no_grad():
        pixels, mask = inputs["pixel_values"][image:image + 1], inputs["pixel_mask"][image:image + 1]
        feature_map, small_mask = detr.backbone(pixels, mask)[-1]
        features = detr.input_projection(feature_map).flatten(2).transpose(1, 2)
        spatial = detr.position_embedding(shape=feature_map.shape, device=pixels.device, dtype=pixels.dtype,
                                          mask=small_mask).flatten(2).transpose(1, 2)
        valid = small_mask.flatten(1)
        keep = [i for i in range(features.shape[1]) if i != dropped]
        encoded = detr.encoder(inputs_embeds=features[:, keep], attention_mask=valid[:, keep],
                               spatial_position_embeddings=spatial[:, keep])
        queries = detr.query_position_embeddings.weight[None]
        decoded = detr.decoder(inputs_embeds=torch.zeros_like(queries), spatial_position_embeddings=spatial[:, keep],
                               object_queries_position_embeddings=queries,
                               encoder_hidden_states=encoded.last_hidden_state, encoder_attention_mask=valid[:, keep])
        return float(model.class_labels_classifier(decoded.last_hidden_state)[0, query, label])


def test_token_ablation_drops_one_image_token_at_a_time(case, model):
    inputs = images(case)
    targets = targets_per_image(case)
    expl = relevancy.explain(model, inputs, method="token_ablation", target=targets)
    scores = expl.parts["image"].scores
    assert set(expl.parts) == {"image"} and scores.shape == (sum(map(len, targets)), *case["feature_grid"])
    with torch.no_grad():
        logits = model(**inputs).logits
    rows = [(i, q, c) for i, per_image in enumerate(targets) for q, c in per_image]
    for row, (image, query, label) in enumerate(rows):
        assert _score_without(model, inputs, image, query, label, None) == pytest.approx(float(logits[image, query, label]), abs=1e-12)
        for token in (0, 5, scores[row].numel() - 1):
            expected = float(logits[image, query, label]) - _score_without(model, inputs, image, query, label, token)
            assert float(scores[row].flatten()[token]) == pytest.approx(expected, abs=1e-10)


def test_token_ablation_leaves_the_model_unchanged(case, monkeypatch):
    model = build(case)
    before = snapshot(model)
    relevancy.explain(model, images(case), method="token_ablation", target=(2, 1))
    assert_same(before, snapshot(model))

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr("relevancy.methods.ablation.target_score", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, images(case), method="token_ablation", target=(2, 1))
    assert_same(before, snapshot(model))
