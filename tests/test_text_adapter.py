"""The BERT-family adapter on tiny random models: exact forward, padding, restoring the model, bad input."""
from __future__ import annotations

import pytest
import torch

import relevancy
from golden import assert_map_close, pad_ids
from relevancy.families import adapter_for
from relevancy.families.hf_bert.adapter import HFBertAdapter, TextBatch
from relevancy.methods.capture import record_forward
from relevancy.lrp import PAPER, RELEVANCE, relevance_session
from relevancy.zoo.text import TextExplanation

import transformers

ATTENTION_METHODS = ["raw_attention", "rollout", "attention_gradcam", "generic_attention"]
ALL_METHODS = ATTENTION_METHODS + ["cdam", "token_ablation", "transformer_attribution", "partial_lrp", "lrp"]


def tiny(family: str = "bert", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=60, max_position_embeddings=40, num_labels=3)
    if family == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **common)
        return transformers.BertForSequenceClassification(config).eval()
    roberta_like = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}
    if family in roberta_like:
        config = getattr(transformers, roberta_like[family] + "Config")(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, pad_token_id=1, **common)
        return getattr(transformers, roberta_like[family] + "ForSequenceClassification")(config).eval()
    config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common)
    return transformers.DistilBertForSequenceClassification(config).eval()


SEQUENCES = [torch.tensor([2, 11, 12, 13, 14, 15, 3]), torch.tensor([2, 21, 22, 3]), torch.tensor([2, 31, 32, 33, 34, 35, 36, 37, 38, 3])]


def batch(pad_id: int = 0) -> dict:
    return pad_ids(SEQUENCES, pad_id)


def model_state(model: torch.nn.Module) -> tuple:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    patched = sum("forward" in m.__dict__ for m in model.modules())
    training = tuple(m.training for m in model.modules())
    implementations = tuple(getattr(m.config, "_attn_implementation", None) for m in model.modules() if hasattr(m, "config"))
    grads = tuple(p.requires_grad for p in model.parameters())
    return hooks, patched, training, implementations, grads


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_adapter_reproduces_the_model_on_a_padded_batch(family):
    model = tiny(family)
    adapter = adapter_for(model)
    assert isinstance(adapter, HFBertAdapter)
    inputs = adapter.check_inputs(batch(1 if family == "roberta" else 0))
    with torch.no_grad():
        expected = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits
        with adapter.explaining(attention_probabilities=True):
            logits, pre_logits = adapter.forward(inputs)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert pre_logits.shape == (3, 32)


@pytest.mark.parametrize("family", ["roberta", "distilbert"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_other_families_are_padding_invariant(family, method):
    model = tiny(family)
    pad = 1 if family == "roberta" else 0
    together = relevancy.explain(model, pad_ids(SEQUENCES, pad), method=method, target=[0, 1, 2])
    for row, ids in enumerate(SEQUENCES):
        alone = relevancy.explain(model, {"input_ids": ids[None]}, method=method, target=row)
        assert_map_close(together.scores[row, : len(ids)], alone.scores[0], rtol=1e-4)
        assert (together.scores[row, len(ids):] == 0).all()


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "camembert", "distilbert"])
def test_paper_rules_conserve_relevance_through_every_layer(family):
    """One-hot relevance at the logits reaches every layer's input with its total intact, per text."""
    model = tiny(family)
    adapter = adapter_for(model)
    inputs = adapter.check_inputs({"input_ids": torch.stack([SEQUENCES[0], SEQUENCES[0].flip(0)])})
    recorded = []
    handles = [layer.register_forward_pre_hook(lambda _m, args: recorded.append(args[0])) for layer in adapter.blocks]
    try:
        with adapter.explaining(True), relevance_session(model, adapter.relevance_rule_map(), PAPER) as session:
            forward = record_forward(adapter, inputs, [0, 2], gradients=True)
            relevance = session.backward(RELEVANCE, forward.score.sum(), recorded, torch.ones(()))
    finally:
        for handle in handles:
            handle.remove()
    sums = torch.stack([r.sum(dim=(1, 2)) for r in relevance], 1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_model_is_handed_back_unchanged(family, method):
    model = tiny(family)
    model.train()  # the user's flag, restored after the call
    adapter_for(model).blocks[0].training = False  # ... down to single modules
    before = model_state(model)
    assert model.config._attn_implementation == "sdpa"
    expl = relevancy.explain(model, batch(1 if family == "roberta" else 0), method=method, target=1)
    assert isinstance(expl, TextExplanation)
    assert model_state(model) == before


@pytest.mark.parametrize("method", ["raw_attention", "cdam", "token_ablation", "transformer_attribution", "lrp"])
def test_model_is_handed_back_unchanged_after_a_failure(method):
    model = tiny("bert")
    before = model_state(model)

    def fail(*_):
        raise RuntimeError("injected")

    handle = model.classifier.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        relevancy.explain(model, batch(), method=method)
    handle.remove()
    assert model_state(model) == before
    assert model.config._attn_implementation == "sdpa"


def test_frozen_weights_still_explain():
    model = tiny("bert")
    model.requires_grad_(False)
    for method in ("cdam", "generic_attention", "attention_gradcam", "transformer_attribution"):
        expl = relevancy.explain(model, batch(), method=method)
        assert expl.scores.abs().sum() > 0
    assert not any(p.requires_grad for p in model.parameters())


def test_bad_inputs_say_what_is_wrong():
    model = tiny("bert")
    with pytest.raises(TypeError, match="tokenised"):
        relevancy.explain(model, "a text", method="rollout")
    with pytest.raises(TypeError, match="tokenised"):
        relevancy.explain(model, ["a text"], method="rollout")
    with pytest.raises(TypeError, match="tokenizer's output"):
        relevancy.explain(model, 3.5, method="rollout")
    with pytest.raises(ValueError, match="empty"):
        relevancy.explain(model, {"input_ids": torch.zeros(1, 0, dtype=torch.long)}, method="rollout")
    with pytest.raises(ValueError, match="text 1 .*empty"):
        relevancy.explain(model, {"input_ids": torch.ones(2, 4, dtype=torch.long),
                                  "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])}, method="rollout")
    with pytest.raises(ValueError, match="vocabulary"):
        relevancy.explain(model, {"input_ids": torch.tensor([[2, 999, 3]])}, method="rollout")
    with pytest.raises(ValueError, match="at most 40"):
        relevancy.explain(model, {"input_ids": torch.ones(1, 41, dtype=torch.long)}, method="rollout")
    with pytest.raises(ValueError, match="out of range"):
        relevancy.explain(model, batch(), method="rollout", target=7)
    with pytest.raises(ValueError, match="one per image"):
        relevancy.explain(model, batch(), method="rollout", target=[0, 1])


def test_inputs_forms_agree():
    model = tiny("bert")
    ids = SEQUENCES[0]
    a = relevancy.explain(model, {"input_ids": ids[None]}, method="rollout").scores
    b = relevancy.explain(model, ids, method="rollout").scores
    c = relevancy.explain(model, {"input_ids": ids.tolist(), "attention_mask": [1] * len(ids)}, method="rollout").scores
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)


def test_text_batch_len_is_the_number_of_texts():
    inputs = adapter_for(tiny("bert")).check_inputs(batch())
    assert isinstance(inputs, TextBatch) and len(inputs) == 3
    assert inputs.tokens[1] == ["[2]", "[21]", "[22]", "[3]"]  # placeholders without a tokenizer


def test_explanation_words_show_and_save(tmp_path, capsys):
    scores = torch.tensor([[0.5, 1.0, 2.0, -1.0, 0.25, 0.0, 0.0]])
    expl = TextExplanation(
        scores=scores, target=torch.tensor([1]), logits=torch.tensor([[0.1, 0.9]]), method="cdam", signed=True,
        input_size=(7,), class_names=["negative", "positive"],
        tokens=[["[CLS]", "un", "##believ", "##able", "<b>", "[SEP]"]], attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]]),
    )
    assert expl.words(0) == [("unbelievable", 2.0), ("<b>", 0.25)]
    assert expl.words(0, special=True)[0] == ("[CLS]", 0.5)
    assert len(expl.token_scores(0)) == 6
    expl.show()
    printed = capsys.readouterr().out
    assert "unbelievable" in printed and "positive" in printed
    page = expl.save(tmp_path / "out" / "x.html")
    text = page.read_text()
    assert "unbelievable" in text and "&lt;b&gt;" in text and "<b>" not in text  # token text is escaped
    assert sorted(p.name for p in page.parent.iterdir()) == ["x.html"]  # no temporary file left
    assert expl._repr_html_().startswith("<div")


def test_words_follow_the_tokenizer_word_ids():
    expl = TextExplanation(
        scores=torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0]]), target=torch.tensor([0]), logits=torch.zeros(1, 2), method="rollout",
        signed=False, input_size=(5,), tokens=[["<s>", "\u0120great", "\u0120dr", "ug", "</s>"]], word_ids=[[None, 0, 1, 1, None]],
    )
    assert expl.words(0) == [("great", 1.0), ("drug", 5.0)]


def test_cdam_explains_a_concept_of_example_texts():
    model = tiny("bert")
    examples = relevancy.Concept(model, batch())
    assert torch.allclose(relevancy.Concept(model, batch(), batch_size=2).vector, examples.vector, atol=1e-6)
    together = relevancy.explain(model, batch(), method="cdam", target=examples)
    assert together.target.tolist() == [-1, -1, -1]
    alone = relevancy.explain(model, {"input_ids": SEQUENCES[2][None]}, method="cdam", target=examples)
    assert_map_close(together.scores[2], alone.scores[0], rtol=1e-4)

