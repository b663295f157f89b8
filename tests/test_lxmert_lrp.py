"""LXMERT's LRP-based maps (the ICCV'21 authors' `ours_with_lrp`, `ours_with_lrp_no_normalization`,
`transformer_att`, `partial_lrp`) on an unmodified `transformers.LxmertForQuestionAnswering`: exact with the authors'
arithmetic, one question at a time and in a padded batch, relevance accounted for, the model unchanged."""
from __future__ import annotations

import pytest
import torch
import transformers

import relevancy
from bimodal_golden import assert_same, bimodal_case, build, padded, snapshot
from golden import assert_map_close
from relevancy.methods import capture
from relevancy.lrp.engine import MissingRuleError
from test_lxmert_family import RTOL, AnswerHead

CASE = bimodal_case("lxmert")
MODEL = build(CASE)
INPUTS = CASE["inputs"]
RECORDS = CASE["records"]
# golden key -> (method, options); exact=True: the authors' 1e-9 stabilisers and Clone / IndexSelect factors. The
# [CLS] entry, the rules and the text rollout of transformer_att are the adapter's defaults.
LRP_KEYS = {
    "ours_with_lrp": ("generic_attention", {"weights": "relevance", "exact": True}),
    "ours_with_lrp_no_normalization": ("generic_attention", {"weights": "relevance", "exact": True, "residual_normalization": False}),
    "transformer_att": ("transformer_attribution", {"exact": True}),
    "partial_lrp": ("partial_lrp", {"exact": True}),
}


def assert_record(expl, row: int, record: dict, key: str) -> None:
    """Row `row` of the explanation equals the record's text and image maps; 0 at the question's padding."""
    length = INPUTS[record["input"]]["input_ids"].shape[1]
    text, image = expl.parts["text"].scores[row], expl.parts["image"].scores[row]
    assert_map_close(text[:length], record["maps"][key]["text"], rtol=RTOL)
    assert (text[length:] == 0).all()
    assert_map_close(image, record["maps"][key]["image"], rtol=RTOL)


@pytest.mark.parametrize("key", LRP_KEYS)
def test_every_record_one_question_at_a_time(key):
    method, options = LRP_KEYS[key]
    for record in RECORDS:
        expl = relevancy.explain(MODEL, INPUTS[record["input"]], method=method, target=record["target"], **options)
        assert expl.target.tolist() == [record["target"]]
        assert expl.parts["image"].scores.shape == (1, 9)
        assert_record(expl, 0, record, key)


@pytest.mark.parametrize("key", LRP_KEYS)
def test_every_record_in_a_padded_batch_with_mixed_targets(key):
    """Both questions (8 and 6 tokens) right-padded in one call, each with its own target; twice, to cover all four."""
    method, options = LRP_KEYS[key]
    batch = padded(INPUTS)
    for rank in (0, 1):
        chosen = [next(r for r in RECORDS if r["input"] == i and r["target_rank"] == (rank + i) % 2) for i in range(len(INPUTS))]
        expl = relevancy.explain(MODEL, batch, method=method, target=[r["target"] for r in chosen], **options)
        for row, record in enumerate(chosen):
            assert_record(expl, row, record, key)


@pytest.mark.parametrize("exact", [True, False])
def test_relevance_is_accounted_for(exact):
    """`relevance_total` (B, 2): the relevance reaching the embedded question and the encoded regions. The rules
    conserve, so the two add up to the explained logit's 1 (to the stabilisers' 1e-9 per division)."""
    expl = relevancy.explain(MODEL, padded(INPUTS), method="transformer_attribution", exact=exact)
    totals = expl.relevance_total
    assert totals.shape == (len(INPUTS), 2)
    assert (totals > 0.1).all()
    torch.testing.assert_close(totals.sum(1), torch.ones(len(INPUTS), dtype=totals.dtype), rtol=0, atol=1e-6)


def test_the_default_arithmetic_is_finite_and_not_the_authors():
    """Without `exact` the rules divide stably (`relevancy.lrp.rules`). The random weights of the reference make
    sums cancel, where the authors' quotient amplifies rounding and the held one does not: the maps differ."""
    record = RECORDS[0]
    for key, (method, options) in LRP_KEYS.items():
        options = {name: value for name, value in options.items() if name != "exact"}
        expl = relevancy.explain(MODEL, INPUTS[record["input"]], method=method, target=record["target"], **options)
        text, expected = expl.parts["text"].scores[0], record["maps"][key]["text"]
        assert torch.isfinite(text).all() and torch.isfinite(expl.parts["image"].scores).all()
        assert (text - expected).abs().max() > 0.01 * expected.abs().max()


def test_pretraining_head_and_frozen_weights_give_the_reference_maps():
    """LxmertForPreTraining's QA score (its other heads are off the answer's path) and a frozen model."""
    pretraining = build(CASE, transformers.LxmertForPreTraining)
    frozen = build(CASE).requires_grad_(False)
    record = RECORDS[1]
    for model in (pretraining, frozen):
        for key, (method, options) in LRP_KEYS.items():
            expl = relevancy.explain(model, INPUTS[record["input"]], method=method, target=record["target"], **options)
            assert_record(expl, 0, record, key)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_a_users_head_is_refused_naming_the_supported_models():
    model = AnswerHead(build(CASE))
    before = snapshot(model)
    with pytest.raises(MissingRuleError, match="AnswerHead: the LRP-based methods explain LxmertForQuestionAnswering"):
        relevancy.explain(model, INPUTS[0], method="partial_lrp")
    assert_same(before, snapshot(model))


def assert_no_patched_methods(model: torch.nn.Module) -> None:
    """The rule map also replaces the cross layers' `cross_att` and `output_fc`: none is left on any module."""
    assert not [name for m in model.modules() for name in ("forward", "cross_att", "output_fc") if name in vars(m)]


@pytest.mark.parametrize("key", LRP_KEYS)
def test_model_unchanged_after_success_and_after_a_failure(key, monkeypatch):
    method, options = LRP_KEYS[key]
    model = build(CASE).train()
    before = snapshot(model)
    relevancy.explain(model, padded(INPUTS), method=method, **options)
    assert_same(before, snapshot(model))
    assert_no_patched_methods(model)

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(capture, "target_score", fail)  # inside the call, with every rule in place
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, padded(INPUTS), method=method, **options)
    assert_same(before, snapshot(model))
    assert_no_patched_methods(model)
    assert all(m.training for m in model.modules())
