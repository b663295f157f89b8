"""RoBERTa and DistilBERT layouts (tiny, random init): every attention, gradient and ablation method, padding-invariant."""
from __future__ import annotations

import pytest
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

import relevancy

METHODS = ["raw_attention", "rollout", "attention_gradcam", "generic_attention", "cdam", "token_ablation"]


def roberta():
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=40, num_labels=3)
    return RobertaForSequenceClassification(config).eval()


def distilbert():
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=40, num_labels=3)
    return DistilBertForSequenceClassification(config).eval()


@pytest.mark.parametrize("build", [roberta, distilbert])
@pytest.mark.parametrize("method", METHODS)
def test_padded_batch_equals_single_texts(build, method):
    model = build()
    batch = {"input_ids": torch.tensor([[0, 5, 6, 7, 2], [0, 8, 9, 2, 1]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])}
    together = relevancy.explain(model, batch, method=method, target=[0, 1]).scores
    assert together.shape == (2, 5) and torch.isfinite(together).all()
    assert together[1, 4] == 0  # padding
    alone = relevancy.explain(model, {"input_ids": torch.tensor([[0, 8, 9, 2]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}, method=method, target=1).scores
    torch.testing.assert_close(together[1, :4], alone[0], atol=1e-5, rtol=1e-4)


def test_lrp_methods_name_the_missing_rule_map():
    with pytest.raises(TypeError, match="(?i)rule"):
        relevancy.explain(roberta(), {"input_ids": torch.tensor([[0, 5, 2]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}, method="transformer_attribution")
