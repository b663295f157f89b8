"""Every BERT map of the authors' code in float64 (tests/golden/bert_reference64.pt): one text at a time, and a
padded batch of all texts with mixed targets, on an unmodified `transformers.BertForSequenceClassification`."""
from __future__ import annotations

import pytest
import torch

import relevancy
from golden import HF_RTOL, assert_map_close, bert_cases, build_bert, exact_options, pad_ids

CASE = bert_cases()[0]
MODEL = build_bert(CASE)
LAST = CASE["config"]["num_hidden_layers"] - 1
# golden key -> (method, options); the BERT conventions ([CLS] entry, row normalisation, rules) are the
# adapter's defaults, so no option names them here
MAPS = {
    "raw_attention": ("raw_attention", {}),
    "rollout": ("rollout", {}),
    "attn_gradcam": ("attention_gradcam", {"normalize": True}),
    "transformer_attribution": ("transformer_attribution", {}),
    "transformer_attribution_last": ("transformer_attribution", {"start_layer": LAST}),
    "partial_lrp": ("partial_lrp", {}),
    "lrp": ("lrp", {}),
}
RECORDS = CASE["records"]
SEQUENCES = CASE["input_ids"]


def test_model_reproduces_reference_logits():
    with torch.no_grad():
        for record in RECORDS:
            logits = MODEL(input_ids=SEQUENCES[record["sequence"]][None]).logits[0]
            torch.testing.assert_close(logits, record["logits"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("key", list(MAPS))
def test_single_text_maps(key):
    method, options = MAPS[key]
    for record in RECORDS:
        ids = SEQUENCES[record["sequence"]][None]
        expl = relevancy.explain(MODEL, {"input_ids": ids}, method=method, target=record["target"], **exact_options(method, options))
        assert expl.target.tolist() == [record["target"]]
        assert expl.scores.shape == (1, ids.shape[1])
        assert_map_close(expl.scores[0], record[key], rtol=HF_RTOL)


@pytest.mark.parametrize("key", list(MAPS))
def test_padded_mixed_target_batch_equals_single_texts(key):
    """All texts (lengths 12, 9, 16) in one right-padded batch, each with its own target; 0 at padding."""
    method, options = MAPS[key]
    batch = pad_ids(list(SEQUENCES))
    for offset in (0, 1):
        chosen = [[r for r in RECORDS if r["sequence"] == i][(i + offset) % 2] for i in range(len(SEQUENCES))]
        expl = relevancy.explain(MODEL, batch, method=method, target=[r["target"] for r in chosen], **exact_options(method, options))
        for row, record in enumerate(chosen):
            length = len(SEQUENCES[row])
            assert_map_close(expl.scores[row, :length], record[key], rtol=HF_RTOL)
            assert (expl.scores[row, length:] == 0).all()


@pytest.mark.parametrize("method", ["generic_attention", "cdam", "token_ablation"])
def test_methods_without_a_bert_reference_are_padding_invariant(method):
    batch = pad_ids(list(SEQUENCES))
    together = relevancy.explain(MODEL, batch, method=method, target=[0, 1, 2])
    for row, ids in enumerate(SEQUENCES):
        alone = relevancy.explain(MODEL, {"input_ids": ids[None]}, method=method, target=[0, 1, 2][row])
        assert_map_close(together.scores[row, : len(ids)], alone.scores[0], rtol=HF_RTOL)
        assert (together.scores[row, len(ids):] == 0).all()


def test_token_ablation_in_small_chunks_equals_one_chunk():
    """Ablated sequences run in chunks; each chunk carries its own slice of the padded batch's attention mask."""
    batch = pad_ids(list(SEQUENCES))
    whole = relevancy.explain(MODEL, batch, method="token_ablation", target=[0, 1, 2])
    chunked = relevancy.explain(MODEL, batch, method="token_ablation", target=[0, 1, 2], chunk_size=5)
    assert_map_close(chunked.scores, whole.scores, rtol=HF_RTOL)


def test_token_ablation_is_the_score_drop_of_each_removed_token():
    ids = SEQUENCES[1][None]
    expl = relevancy.explain(MODEL, {"input_ids": ids}, method="token_ablation", target=2)
    full = expl.logits[0, 2]
    with torch.no_grad():
        for i in (0, 3, ids.shape[1] - 1):
            kept = torch.cat([ids[:, :i], ids[:, i + 1:]], dim=1)
            # the token is removed after the embeddings: positions of the others stay as they were
            positions = torch.cat([torch.arange(i), torch.arange(i + 1, ids.shape[1])])[None]
            tokens = MODEL.bert.embeddings(input_ids=kept, position_ids=positions)
            hidden = MODEL.bert.encoder(tokens).last_hidden_state
            ablated = MODEL.classifier(MODEL.bert.pooler(hidden))[0, 2]
            torch.testing.assert_close(expl.scores[0, i], full - ablated, atol=1e-5, rtol=1e-5)


def test_reference_conventions_are_options():
    """The BERT defaults are options: `cls_entry="keep"` gives back the raw [CLS] entry, ViT-style gradcam works."""
    ids = {"input_ids": SEQUENCES[0][None]}
    zero = relevancy.explain(MODEL, ids, method="rollout").scores[0]
    keep = relevancy.explain(MODEL, ids, method="rollout", cls_entry="keep").scores[0]
    assert zero[0] == 0 and keep[0] > keep[1:].max()
    assert torch.equal(zero[1:], keep[1:])
    low = relevancy.explain(MODEL, ids, method="transformer_attribution", cls_entry="min").scores[0]
    assert low[0] == low.min()
    relevancy.explain(MODEL, ids, method="attention_gradcam", region="class_row", normalize=True)
    vanilla = relevancy.explain(MODEL, ids, method="partial_lrp", rules="vanilla").scores[0]
    assert not torch.allclose(vanilla, relevancy.explain(MODEL, ids, method="partial_lrp").scores[0])
    with pytest.raises(ValueError, match="cls_entry"):
        relevancy.explain(MODEL, ids, method="rollout", cls_entry="first")
    with pytest.raises(ValueError, match="region"):
        relevancy.explain(MODEL, ids, method="attention_gradcam", region="row")
