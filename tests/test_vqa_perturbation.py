"""The ICCV'21 perturbation test for question answering: what is removed at each step, and the curve."""
from __future__ import annotations

import pytest
import torch

from bimodal_golden import bimodal_case, build
from relevancy.evaluation.vqa_perturbation import (
    PROTOCOLS, STEPS, VISUALBERT_IMAGE_STEPS, kept_regions, kept_tokens, perturbation_test,
)


def test_lxmert_keeps_cls_and_sep_and_the_best_tokens_in_order():
    scores = torch.tensor([9.0, 0.1, 0.5, 0.3, 0.9, 9.0])
    assert kept_tokens(scores, 6, PROTOCOLS["lxmert"], 0.5).tolist() == [0, 2, 4, 5]  # int(0.5 * 4) = 2 best
    assert kept_tokens(scores, 6, PROTOCOLS["lxmert"], 1.0).tolist() == [0, 5]


def test_visualbert_also_keeps_the_pooled_token():
    scores = torch.tensor([9.0, 0.1, 0.5, 0.3, 0.9, 9.0, 9.0])
    # [CLS], the pooled token T - 2 and [SEP] are kept; int(0.5 * 4) = 2 of the rest
    assert kept_tokens(scores, 7, PROTOCOLS["visualbert"], 0.5).tolist() == [0, 2, 4, 5, 6]


def test_regions_are_kept_best_first():
    scores = torch.tensor([0.2, 0.9, 0.1, 0.5])
    assert kept_regions(scores, 0.5).tolist() == [1, 3]
    assert kept_regions(scores, 1.0).tolist() == []


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
@pytest.mark.parametrize("modality", ["text", "image"])
def test_curves_run_on_the_reference_models(family, modality):
    case = bimodal_case(family)
    model = build(case)
    # soft scores: the model's own first answer counts 1, so accuracy starts at 1 and can only fall
    samples = [(inputs, {int(case["records"][2 * i]["target"]): 1.0}) for i, inputs in enumerate(case["inputs"])]
    positive = perturbation_test(model, samples, "generic_attention", modality, positive=True)
    negative = perturbation_test(model, samples, "generic_attention", modality, positive=False)
    for result in (positive, negative):
        assert result["n"] == 2 and result["accuracy"][0] == 1.0
        assert all(0.0 <= a <= 1.0 for a in result["accuracy"]) and 0.0 <= result["auc"] <= 1.0
    steps = VISUALBERT_IMAGE_STEPS if (family, modality) == ("visualbert", "image") else STEPS
    if family == "lxmert" and modality == "image":
        steps = steps[:-1]  # transformers' LXMERT cannot run without regions
    assert positive["steps"] == list(steps)


def test_bad_requests_are_named():
    case = bimodal_case("lxmert")
    model = build(case)
    with pytest.raises(ValueError, match="modality must be one of"):
        perturbation_test(model, [], "generic_attention", "audio")
    batch = {k: torch.cat([v, v]) for k, v in case["inputs"][0].items()}
    with pytest.raises(ValueError, match="one question per sample"):
        perturbation_test(model, [(batch, {0: 1.0})], "generic_attention", "text")
