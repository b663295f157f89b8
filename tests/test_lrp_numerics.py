"""LRP in floating point: stable float32 maps by default, the relevance total on every Explanation, half precision."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import relevancy
from relevancy.worlds import load_model as load_shapes_model, make_scenes
from relevancy.lrp import rules
from relevancy.methods import relevance
from models import tiny_vit

LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per input: largest difference over the second map's largest magnitude."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return (a - b).abs().amax(1) / b.abs().amax(1)


@pytest.mark.parametrize("method", LRP_METHODS)
def test_float32_maps_of_the_shipped_vit_agree_with_float64(method):
    """Default arithmetic: float32 is within 1e-3 of float64 (the authors' arithmetic is off by up to 1 here)."""
    model = load_shapes_model()
    images = torch.cat([make_scenes(4, seed=12345, objects=1).images, make_scenes(4, seed=54321, objects=2).images])
    single = relevancy.explain(model, images, method=method).scores
    double = relevancy.explain(copy.deepcopy(model).double(), images.double(), method=method).scores
    assert relative_error(single, double).max() < 1e-3


@pytest.mark.parametrize("method", LRP_METHODS)
def test_float32_maps_of_the_shipped_text_model_agree_with_float64(method):
    from relevancy.zoo.text import encode, load_model

    model, tokenizer = load_model()
    batch = dict(encode(tokenizer, ["Great.", "The side effects were awful at first, but it worked in the end."]))
    single = relevancy.explain(model, batch, method=method, target=1).scores
    double = relevancy.explain(copy.deepcopy(model).double(), batch, method=method, target=1).scores
    assert relative_error(single, double).max() < 1e-3


@pytest.mark.parametrize("method", LRP_METHODS)
def test_shipped_text_model_padding_does_not_move_float32_maps(method):
    """"Great." alone and in a padded batch beside a long review: the same map within 1e-3."""
    from relevancy.zoo.text import encode, load_model

    model, tokenizer = load_model()
    texts = ["Great.", "The side effects were awful at first, but after two weeks it worked and I sleep well now."]
    together = relevancy.explain(model, dict(encode(tokenizer, texts)), method=method, target=1)
    alone = relevancy.explain(model, dict(encode(tokenizer, texts[:1])), method=method, target=1)
    length = alone.scores.shape[1]
    assert relative_error(together.scores[:1, :length], alone.scores).item() < 1e-3
    assert (together.scores[0, length:] == 0).all()


@pytest.mark.parametrize("exact", [False, True])
def test_transformer_attribution_records_a_conserved_total(exact):
    model = tiny_vit(depth=3)
    expl = relevancy.explain(model, torch.randn(3, 3, 32, 32), method="transformer_attribution", target=[0, 1, 2], exact=exact)
    torch.testing.assert_close(expl.relevance_total, torch.ones(3), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", LRP_METHODS)
def test_every_lrp_map_records_its_relevance_total(method):
    model = tiny_vit()
    expl = relevancy.explain(model, torch.randn(2, 3, 32, 32), method=method)
    assert expl.relevance_total.shape == (2,) and torch.isfinite(expl.relevance_total).all()
    if method == "lrp":  # the map is the relevance itself: its sum is the total
        torch.testing.assert_close(expl.relevance_total, expl.scores.flatten(1).sum(1))
    assert relevancy.explain(model, torch.randn(2, 3, 32, 32), method="rollout").relevance_total is None


def test_a_total_the_paper_rules_did_not_conserve_is_warned(monkeypatch):
    monkeypatch.setattr(relevance, "CONSERVATION_TOLERANCE", -1.0)  # every total now counts as lost
    with pytest.warns(UserWarning, match="relevance total"):
        relevancy.explain(tiny_vit(), torch.randn(1, 3, 32, 32), method="transformer_attribution")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the vanilla rules do not conserve by design: no warning
        relevancy.explain(tiny_vit(), torch.randn(1, 3, 32, 32), method="lrp")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", LRP_METHODS)
def test_half_precision_models_are_explained_in_float32(method, dtype):
    model = tiny_vit().to(dtype)
    images = torch.randn(2, 3, 32, 32).to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    half = relevancy.explain(model, images, method=method, target=[1, 3])
    full = relevancy.explain(copy.deepcopy(model).float(), images.float(), method=method, target=[1, 3])
    torch.testing.assert_close(half.scores.float(), full.scores, rtol=1e-5, atol=1e-6 * full.scores.abs().max().item())
    assert all(v.dtype == dtype and torch.equal(v, before[k]) for k, v in model.state_dict().items())


def cancelling_linear(adversarial_columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positive inputs `(3, 10, 256)` and a weight `(200, 256)` whose first columns are negative but for one small
    positive entry: there `Z = sum max(x W, 0)` is about 1e-4 of `|x| |W|`, so `(x W + |x| |W|) / 2` cancels."""
    torch.manual_seed(0)
    x, weight, bias = torch.rand(3, 10, 256), torch.randn(200, 256), torch.randn(200)
    weight[:adversarial_columns] = -weight[:adversarial_columns].abs()
    weight[:adversarial_columns, 0] = 0.01
    return x, weight, bias


@pytest.mark.parametrize("adversarial_columns", [1, 100], ids=["few entries: term by term", "many: whole rows"])
def test_the_linear_sum_is_recomputed_where_it_cancels(adversarial_columns):
    """`positive_part_sum` keeps `(x W + |x| |W|) / 2` only within `CANCELLATION_RATIO` of the direct sum's bound."""
    x, weight, bias = cancelling_linear(adversarial_columns)
    output = F.linear(x, weight, bias)
    direct = F.linear(x.double(), weight.double().clamp(min=0))  # x >= 0: Z = x W+
    magnitude = F.linear(x.abs(), weight.abs())
    tolerance = rules.CANCELLATION_RATIO * (x.shape[-1] + 1) * torch.finfo(torch.float32).eps * direct
    corrected = rules.positive_part_sum(x, weight, output - bias, magnitude, bias.abs())
    assert ((corrected.double() - direct).abs() <= tolerance).all()
    shortcut = (output - bias + magnitude) / 2
    assert ((shortcut.double() - direct).abs() > tolerance).any()  # the inputs do cancel


@pytest.mark.parametrize("shared_denominator", [True, False])
def test_the_linear_rule_with_the_forward_output_is_the_rule(shared_denominator):
    """Taking `x W` from the forward's output (bias and all) changes nothing but rounding: float64 against the
    rule's definition, `x+ (S W+) + x- (S W-)` with `S = R / (Z + 1e-9)`."""
    torch.manual_seed(0)
    x, weight, bias, relevance = torch.randn(2, 5, 16).double(), torch.randn(8, 16).double(), torch.randn(8).double(), torch.randn(2, 5, 8).double()
    x_pos, x_neg, w_pos, w_neg = x.clamp(min=0), x.clamp(max=0), weight.clamp(min=0), weight.clamp(max=0)
    z_pos, z_neg = x_pos @ w_pos.T, x_neg @ w_neg.T
    shared = rules.safe_divide(relevance, z_pos + z_neg)
    s_pos, s_neg = (shared, shared) if shared_denominator else (rules.safe_divide(relevance, z_pos), rules.safe_divide(relevance, z_neg))
    expected = x_pos * (s_pos @ w_pos) + x_neg * (s_neg @ w_neg)
    for output, given_bias in [(None, None), (F.linear(x, weight, bias), bias), (F.linear(x, weight), None)]:
        found = rules.linear_alpha1_beta0(x, weight, relevance, shared_denominator, output, given_bias)
        torch.testing.assert_close(found, expected, rtol=0, atol=1e-14 * expected.abs().max().item())
