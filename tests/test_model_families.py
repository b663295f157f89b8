"""Every method on every supported layout: DeiT distilled (two prefix tokens), register tokens, any image size."""
from __future__ import annotations

import pytest
import torch

import relevancy
from relevancy.families import UnsupportedModelError
from relevancy.families.base import SEED_METHODS
from hf_vit_models import tiny_hf
from models import tiny_deit_distilled, tiny_global_pool, tiny_registers, tiny_vit

PATCH_METHODS = [m for m in SEED_METHODS if m != "lrp"]


@pytest.mark.parametrize("method", SEED_METHODS)
@pytest.mark.parametrize(
    "build, size, grid",
    [(tiny_vit, 32, (4, 4)), (tiny_deit_distilled, 32, (4, 4)), (tiny_registers, 42, (3, 3)), (tiny_registers, 56, (4, 4)), (tiny_registers, (42, 70), (3, 5)),
     (lambda: tiny_hf("vit"), 32, (4, 4)), (lambda: tiny_hf("deit-teacher"), 32, (4, 4)), (lambda: tiny_hf("dinov2-reg"), 42, (3, 3)), (lambda: tiny_hf("dinov2-reg"), (42, 70), (3, 5))],
    ids=["vit", "deit-distilled", "dinov2-reg4", "dinov2-reg4-larger", "dinov2-reg4-wide", "hf-vit", "hf-deit-teacher", "hf-dinov2-reg4", "hf-dinov2-reg4-wide"],
)
def test_every_method_gives_the_model_grid(method, build, size, grid):
    model = build()
    height, width = (size, size) if isinstance(size, int) else size
    images = torch.randn(2, 3, height, width)
    expl = relevancy.explain(model, images, method=method, target=[0, 3])
    expected = (2, height, width) if method == "lrp" else (2, *grid)
    assert tuple(expl.scores.shape) == expected
    assert torch.isfinite(expl.scores).all()
    assert tuple(expl.heatmap().shape) == (2, height, width)
    assert expl.target.tolist() == [0, 3]


def test_prefix_tokens_come_from_the_model():
    from relevancy.families import adapter_for

    assert adapter_for(tiny_vit()).num_prefix_tokens == 1
    assert adapter_for(tiny_deit_distilled()).num_prefix_tokens == 2
    assert adapter_for(tiny_registers()).num_prefix_tokens == 5


@pytest.mark.parametrize("method", ["raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution", "partial_lrp"])
def test_class_token_methods_refuse_global_pool_models(method):
    with pytest.raises(UnsupportedModelError, match="no class token.*cdam"):
        relevancy.explain(tiny_global_pool(), torch.randn(1, 3, 32, 32), method=method)


@pytest.mark.parametrize("method", ["cdam", "token_ablation", "lrp"])
def test_global_pool_models_work_for_other_methods(method):
    expl = relevancy.explain(tiny_global_pool(), torch.randn(2, 3, 32, 32), method=method)
    assert torch.isfinite(expl.scores).all()


def test_token_ablation_chunking_does_not_change_scores():
    model, images = tiny_vit(), torch.randn(3, 3, 32, 32)
    whole = relevancy.explain(model, images, method="token_ablation", chunk_size=1000).scores
    for chunk in (1, 7, 16):
        torch.testing.assert_close(relevancy.explain(model, images, method="token_ablation", chunk_size=chunk).scores, whole)


def test_a_registered_family_is_asked_first_and_registering_again_moves_it_to_the_front(monkeypatch):
    from relevancy import families
    from relevancy.families.timm_vit.adapter import TimmViTAdapter

    monkeypatch.setattr(families, "_REGISTERED", [])

    class First(TimmViTAdapter):
        family = "first"

    class Second(TimmViTAdapter):
        family = "second"

    families.register_adapter(First)
    families.register_adapter(Second)
    model = tiny_vit()
    assert type(families.adapter_for(model)) is Second
    families.register_adapter(First)
    assert type(families.adapter_for(model)) is First
    assert families.adapters()[:2] == [First, Second] and families.adapters()[2:] == list(families.BUILT_IN)
