"""`token_ablation` on vision-language decoders (tiny random float64 LLaVA with a Llama and with a Qwen2 decoder,
Gemma 3, Idefics3 of `vlm_models.py`): each patch of the tower's grid set to 0 at the pixels and each text token
deleted, equal to a hand loop of the model's own forwards; padded batches equal each row alone; the vlm-shapes
benchmark's patch ablation is this method on the word's log-probability, equal to its former hand loop."""
from __future__ import annotations

import pytest
import torch
from test_model_unchanged import assert_same, snapshot
from test_vision_language_tower import model_of
from vlm_models import FAMILIES, IMAGE_TOKEN, PATCH, SIDE, alone, inputs, own_types

import relevancy

#: transformers runs Gemma 2's attention eager, its softmax in float32: the hand loop's forwards hold 3e-7 of that
TOLERANCE = {"paligemma2": 1e-6}


def own_logits(model: torch.nn.Module, family: str, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own forward on one unpadded row (its token types where it has them): the next token's logits."""
    ids = row["input_ids"]
    with torch.no_grad():
        return model(**{**row, "attention_mask": torch.ones_like(ids), **own_types(family, ids, row)}).logits[0, -1]


def by_hand(model: torch.nn.Module, family: str, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(text drops (T,), patch drops (4, 4))` of one unpadded row: each text token deleted from the sequence, each
    patch's pixels set to 0, one forward each."""
    ids, pixels = row["input_ids"], row["pixel_values"]
    full = own_logits(model, family, row)[target]
    text = torch.zeros(ids.shape[1], dtype=torch.float64)
    for j in range(ids.shape[1]):
        if ids[0, j] != IMAGE_TOKEN:
            kept = {name: torch.cat([value[:, :j], value[:, j + 1:]], 1) for name, value in row.items() if name != "pixel_values"}
            text[j] = full - own_logits(model, family, {**kept, "pixel_values": pixels})[target]
    side = SIDE // PATCH
    image = torch.zeros(side, side, dtype=torch.float64)
    for r in range(side):
        for c in range(side):
            occluded = pixels.clone()
            occluded[..., r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 0
            image[r, c] = full - own_logits(model, family, {**row, "pixel_values": occluded})[target]
    return text, image


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand(family):
    """A batch padded right and left, in chunks of 5 sequences: each row's image_scores and text scores equal the
    hand loop on the row alone (0 at the image's placeholders and at padding); through_tower; the model unchanged."""
    model = model_of(family)
    targets = [5, 7]
    before = snapshot(model)
    for side in ("right", "left"):
        batch = inputs(family, side)
        explanation = relevancy.explain(model, batch, method="token_ablation", target=targets, chunk_size=5)
        assert explanation.image_scores.shape == (2, 4, 4) and explanation.scores.shape == batch["input_ids"].shape
        assert explanation.through_tower is True and explanation.pixel_scores is None and explanation.signed
        assert explanation.heatmap().shape == (2, SIDE, SIDE) and explanation.to_json()["through_tower"] is True
        for row in range(2):
            text, image = by_hand(model, family, alone(batch, row), targets[row])
            keep = batch["attention_mask"][row].bool()
            tolerance = TOLERANCE.get(family, 1e-10)
            assert torch.allclose(explanation.image_scores[row], image, atol=tolerance), f"{side} row {row}"
            assert torch.allclose(explanation.scores[row, keep], text, atol=tolerance), f"{side} row {row}"
            assert bool((explanation.scores[row, ~keep] == 0).all())
    assert_same(before, snapshot(model))


def test_token_ablation_options_and_failures_leave_the_model_unchanged(monkeypatch):
    """`ablate="image"` scores the patches only (the text's left at 0) with the same patch scores; rows_at_once and
    chunk sizes give the same maps; a bad `ablate` is named; an error inside the ablated forwards leaves the model
    as it was."""
    model, batch = model_of("gemma3"), inputs("gemma3", "left")
    before = snapshot(model)
    whole = relevancy.explain(model, batch, method="token_ablation")
    image = relevancy.explain(model, batch, method="token_ablation", ablate="image", chunk_size=3)
    assert torch.allclose(image.image_scores, whole.image_scores, atol=1e-12) and bool((image.scores == 0).all())
    rows = relevancy.explain(model, batch, method="token_ablation", rows_at_once=1, chunk_size=64)
    assert torch.allclose(rows.image_scores, whole.image_scores, atol=1e-12) and torch.allclose(rows.scores, whole.scores, atol=1e-12)
    with pytest.raises(ValueError, match="ablate must be one of text, image"):
        relevancy.explain(model, batch, method="token_ablation", ablate="patches")
    with pytest.raises(ValueError, match="score must be one of logit, log_prob"):
        relevancy.explain(model, batch, method="token_ablation", score="prob")
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("stop")
        return real(*args, **kwargs)

    real = type(relevancy.families.adapter_for(model)).hidden_of
    monkeypatch.setattr(type(relevancy.families.adapter_for(model)), "hidden_of", fail)
    with pytest.raises(RuntimeError, match="stop"):
        relevancy.explain(model, batch, method="token_ablation")
    assert_same(before, snapshot(model))


def test_the_benchmarks_patch_ablation_is_token_ablation_on_the_log_probability():
    """vlm-shapes' patch ablation (now `token_ablation`, `score="log_prob"`, the patches only) equals its former hand
    loop: the word's log-probability by the model's own forward (left-padded, read at the last position), minus
    that with each patch set to 0."""
    from relevancy.evaluation import vlm_shapes as VS

    model, batch = model_of("llava"), inputs("llava", "left")
    targets = torch.tensor([5, 7])
    clean = VS.word_log_probabilities(model, batch, targets)
    side = SIDE // PATCH
    single = torch.eye(side * side, dtype=torch.bool).view(-1, side, side)
    expected = torch.stack([clean[row] - torch.stack([
        VS.word_log_probabilities(model, {k: v[row:row + 1] for k, v in batch.items()}, targets[row:row + 1],
                                  VS.delete_patches(batch["pixel_values"][row:row + 1], removed[None], PATCH))[0]
        for removed in single]).view(side, side) for row in range(2)])
    found = VS.patch_ablation(model, batch, targets, batch_size=7)
    assert found.dtype == torch.float64 and torch.allclose(found, expected, atol=1e-10)
