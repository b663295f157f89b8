"""The user's model is handed back exactly as it was: weights, modes, hooks, flags, forwards; also after errors."""
from __future__ import annotations

import pytest
import torch

import relevancy
from relevancy.families.base import SEED_METHODS
from hf_vit_models import tiny_hf
from models import tiny_deit_distilled, tiny_vit


def snapshot(model: torch.nn.Module) -> dict:
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(getattr(m, "_backward_pre_hooks", {})))
            for name, m in model.named_modules()
        },
        "fused": {name: m.fused_attn for name, m in model.named_modules() if hasattr(m, "fused_attn")},
        "own_attributes": {name: sorted(k for k in vars(m) if not k.startswith("_") and callable(vars(m)[k])) for name, m in model.named_modules()},
        "patched": {name: sorted(k for k in ("forward", "_pos_embed", "forward_head") if k in vars(m)) for name, m in model.named_modules()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "grads": {k: p.grad for k, p in model.named_parameters()},
    }


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "weights":
            for name in before[key]:
                assert torch.equal(before[key][name], after[key][name]), name
        else:
            assert before[key] == after[key], key


def assert_unchanged_by_a_failure(monkeypatch, model: torch.nn.Module, inputs, method: str, *failing: str,
                                  before: dict | None = None) -> None:
    """`relevancy.explain(model, inputs, method=method)` with each function named in `failing` (dotted names) raising
    inside it: the error reaches the caller and the model is as `before` (its snapshot now, by default)."""
    before = snapshot(model) if before is None else before

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    for name in failing:
        monkeypatch.setattr(name, fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, inputs, method=method)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("method", SEED_METHODS)
@pytest.mark.parametrize("build", [tiny_vit, tiny_deit_distilled, lambda: tiny_hf("vit"), lambda: tiny_hf("deit-teacher")],
                         ids=["vit", "deit-distilled", "hf-vit", "hf-deit-teacher"])
def test_model_unchanged_after_success(method, build):
    model = build()
    before = snapshot(model)
    relevancy.explain(model, torch.randn(2, 3, 32, 32), method=method)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("method", SEED_METHODS)
def test_model_unchanged_after_an_injected_failure(method, monkeypatch):
    # fails inside the method, after hooks, patched forwards and flags are in place
    assert_unchanged_by_a_failure(monkeypatch, tiny_vit(), torch.randn(2, 3, 32, 32), method,
                                  "relevancy.methods.capture.target_score", "relevancy.methods.ablation.target_score")


def test_model_unchanged_after_a_failure_in_the_relevance_pass(monkeypatch):
    assert_unchanged_by_a_failure(monkeypatch, tiny_vit(), torch.randn(1, 3, 32, 32), "transformer_attribution",
                                  "relevancy.lrp.rules.matmul_halved")


def test_train_mode_model_is_explained_in_eval_mode_and_handed_back_in_train_mode():
    model = tiny_vit(drop_rate=0.5, attn_drop_rate=0.5, proj_drop_rate=0.5)
    images = torch.randn(2, 3, 32, 32)
    expected = relevancy.explain(model.eval(), images, method="generic_attention").scores
    model.train()
    for _ in range(2):  # dropout would make these differ if it were active
        torch.testing.assert_close(relevancy.explain(model, images, method="generic_attention").scores, expected)
    assert all(m.training for m in model.modules())


def test_user_hooks_and_own_forward_patches_survive():
    model = tiny_vit()
    calls = []
    handle = model.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    relevancy.explain(model, torch.randn(1, 3, 32, 32), method="transformer_attribution")
    assert calls and len(model.blocks[0]._forward_hooks) == 1
    handle.remove()


def test_frozen_models_are_explained():
    model = tiny_vit()
    for p in model.parameters():
        p.requires_grad_(False)
    for method in SEED_METHODS:
        assert torch.isfinite(relevancy.explain(model, torch.randn(1, 3, 32, 32), method=method).scores).all()
    assert not any(p.requires_grad for p in model.parameters())
