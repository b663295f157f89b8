"""`explain(..., rows_at_once=k)`: the batch explained k rows at a time gives the maps of the whole batch at once."""
from __future__ import annotations

import pytest
import torch
import transformers

import relevancy
from relevancy.families.base import SEED_METHODS
from models import tiny_vit
from test_detr_family import build as build_detr
from test_detr_family import case  # noqa: F401  (the golden DETR case, a fixture)
from test_detr_family import images as detr_images

TOLERANCE = 1e-10  # float64: the rows run apart differ from the batch by rounding only


def assert_same_explanation(split, whole) -> None:
    assert split.parts.keys() == whole.parts.keys()
    for name in whole.parts:
        reference = whole.parts[name].scores
        assert torch.allclose(split.parts[name].scores, reference, rtol=0, atol=TOLERANCE * max(reference.abs().max().item(), 1e-30))
    assert torch.equal(split.target, whole.target)
    assert torch.allclose(split.logits, whole.logits, rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def vit() -> torch.nn.Module:
    return tiny_vit().double()


@pytest.mark.parametrize("method", list(SEED_METHODS))
@pytest.mark.parametrize("rows_at_once", [1, 2])
def test_vit_maps_of_rows_run_apart_equal_the_whole_batch(vit, method, rows_at_once):
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    whole = relevancy.explain(vit, images, method=method)
    assert_same_explanation(relevancy.explain(vit, images, method=method, rows_at_once=rows_at_once), whole)


@pytest.mark.parametrize("target", [[0, 1, 2, 3, 4], torch.tensor([4, 3, 2, 1, 0]), 2, lambda logits: logits[:, 1] - logits[:, 0]],
                         ids=["list", "tensor", "int", "callable"])
def test_targets_are_split_with_their_rows(vit, target):
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = relevancy.explain(vit, images, method="generic_attention", target=target)
    assert_same_explanation(relevancy.explain(vit, images, method="generic_attention", target=target, rows_at_once=2), whole)


def test_clip_pairs_run_apart_equal_the_whole_batch():
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
                         max_position_embeddings=12, bos_token_id=98, eos_token_id=99),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                           patch_size=8),
        projection_dim=16,
    )
    model = transformers.CLIPModel(config).double().eval()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, 32, 32, generator=generator, dtype=torch.float64)
    ids = torch.randint(1, 98, (3, 12), generator=generator)
    ids[:, 0], ids[:, -1] = 98, 99
    for method in ("generic_attention", "transformer_attribution"):
        whole = relevancy.explain(model, (images, ids), method=method)
        assert_same_explanation(relevancy.explain(model, (images, ids), method=method, rows_at_once=1), whole)


@pytest.mark.parametrize("method", ["generic_attention", "transformer_attribution"])
def test_detr_objects_of_one_image_run_apart_equal_them_together(case, method):  # noqa: F811
    model = build_detr(case)
    objects = [(r["query"], r["target_class"]) for r in case["records"] if r["image"] == 0]
    assert len(objects) == 2
    whole = relevancy.explain(model, detr_images(case, 0), method=method, target=[objects])
    split = relevancy.explain(model, detr_images(case, 0), method=method, target=[objects], rows_at_once=1)
    assert_same_explanation(split, whole)
    assert torch.equal(split.query, whole.query)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_rows_at_once_must_be_a_positive_whole_number(vit, bad):
    with pytest.raises(ValueError, match="rows_at_once must be a positive whole number or None"):
        relevancy.explain(vit, torch.randn(2, 3, 32, 32, dtype=torch.float64), rows_at_once=bad)


def test_a_target_of_the_wrong_length_is_named_against_the_whole_batch(vit):
    images = torch.randn(5, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="target has 3 entries for a batch of 5 inputs"):
        relevancy.explain(vit, images, target=[0, 1, 2], rows_at_once=2)
