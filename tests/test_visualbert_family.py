"""VisualBERT against the authors' rule code on HF attentions in float64 (tests/golden/bimodal_reference.pt) on an
unmodified `transformers.VisualBertForQuestionAnswering`: the recorded attention probabilities and their gradients,
every map one question at a time and both questions in one padded batch, the readout of other heads, the model
handed back unchanged, and the input errors."""
from __future__ import annotations

import pytest
import torch
import transformers

import relevancy
from bimodal_golden import assert_same, bimodal_case, build, padded, snapshot
from golden import assert_map_close
from relevancy.methods import capture
from relevancy.methods.capture import record_forward
from relevancy.families import adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.visual_bert.adapter import VisualBertAdapter
from relevancy.families.visual_bert.batch import VisualBertBatch

CASE = bimodal_case("visualbert")
MODEL = build(CASE)
INPUTS = CASE["inputs"]
RECORDS = CASE["records"]
# golden key -> (method, options); the VisualBERT conventions (pooled token's entry, raw rollout, min-max Grad-CAM
# over the whole matrix) are the adapter's defaults, so no option names them here
MAPS = {
    "ours_no_lrp": ("generic_attention", {}),
    "raw_attn": ("raw_attention", {}),
    "rollout": ("rollout", {}),
    "attn_gradcam": ("attention_gradcam", {}),
}
# VisualBERT's softmax runs in the model's dtype: the maps agree with the reference to ~1e-15
RTOL = 1e-8
REGIONS = 9


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"input{r['input']}-rank{r['target_rank']}")
def test_probabilities_and_their_gradients_equal_the_reference(record):
    adapter = VisualBertAdapter(MODEL)
    golden, grads = CASE["attentions"][record["input"]], record["attention_grads"]
    names = [f"visual_bert.encoder.layer.{i}.attention.self" for i in range(CASE["config"]["num_hidden_layers"])]
    assert names == list(golden)
    with adapter.explaining(attention_probabilities=True):
        fwd = record_forward(adapter, adapter.check_inputs(INPUTS[record["input"]]), record["target"], attentions=True, gradients=True)
    torch.testing.assert_close(fwd.logits[0], CASE["outputs"]["logits"][record["input"]][0], rtol=0, atol=1e-12)
    for name, attention, grad in zip(names, fwd.attentions, fwd.gradients(fwd.attentions), strict=True):
        assert_map_close(attention, golden[name], rtol=1e-12)
        assert_map_close(grad, grads[name], rtol=1e-12)


def test_readout_is_the_token_the_answer_head_gathers():
    """`attention_mask.sum(1) - 2` per question (the token before [SEP]), an index into question + regions."""
    adapter = VisualBertAdapter(MODEL)
    (stream,) = adapter.streams(adapter.check_inputs(padded(INPUTS))).values()
    assert stream.readout.tolist() == [6, 5] and stream.prefix_tokens == 0
    assert stream.valid.shape == (2, 8 + REGIONS) and stream.valid.sum(1).tolist() == [8 + REGIONS, 7 + REGIONS]
    assert not stream.valid[1, 7]  # the second question's padding, between its tokens and its regions


@pytest.mark.parametrize("key", list(MAPS))
def test_single_question_maps(key):
    method, options = MAPS[key]
    for record in RECORDS:
        length = INPUTS[record["input"]]["input_ids"].shape[1]
        expl = relevancy.explain(MODEL, INPUTS[record["input"]], method=method, target=record["target"], **options)
        assert expl.target.tolist() == [record["target"]]
        text, image = expl.parts["text"].scores, expl.parts["image"].scores
        assert text.shape == (1, length) and image.shape == (1, REGIONS)
        assert text[0, length - 2] == 0  # the pooled token's own entry
        assert_map_close(text[0], record["maps"][key]["text"], rtol=RTOL)
        assert_map_close(image[0], record["maps"][key]["image"], rtol=RTOL)


@pytest.mark.parametrize("key", list(MAPS))
def test_padded_batch_with_mixed_targets_equals_single_questions(key):
    """Both questions (8 and 7 tokens) in one right-padded batch, each with its own target: the padding sits between
    the shorter question and its regions; 0 there."""
    method, options = MAPS[key]
    batch = padded(INPUTS)
    for rank in (0, 1):
        chosen = [next(r for r in RECORDS if r["input"] == i and r["target_rank"] == (rank + i) % 2) for i in range(len(INPUTS))]
        expl = relevancy.explain(MODEL, batch, method=method, target=[r["target"] for r in chosen], **options)
        for row, record in enumerate(chosen):
            length = INPUTS[row]["input_ids"].shape[1]
            assert_map_close(expl.parts["text"].scores[row, :length], record["maps"][key]["text"], rtol=RTOL)
            assert (expl.parts["text"].scores[row, length:] == 0).all()
            assert_map_close(expl.parts["image"].scores[row], record["maps"][key]["image"], rtol=RTOL)


class Wrapped(torch.nn.Module):
    """A user's module around the question-answering model: its head still gathers the token before [SEP]."""

    def __init__(self, qa: torch.nn.Module) -> None:
        super().__init__()
        self.qa = qa

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.qa(**inputs).logits


class PooledHead(torch.nn.Module):
    """A user's head on a VisualBertModel's pooled [CLS] output."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = encoder, torch.nn.Linear(48, 3, dtype=torch.float64)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(**inputs).pooler_output)


def test_a_wrapped_question_answering_model_gives_the_reference_maps():
    record = RECORDS[3]
    for key, (method, options) in MAPS.items():
        expl = relevancy.explain(Wrapped(MODEL), INPUTS[record["input"]], method=method, target=record["target"], **options)
        assert_map_close(expl.parts["text"].scores[0], record["maps"][key]["text"], rtol=RTOL)
        assert_map_close(expl.parts["image"].scores[0], record["maps"][key]["image"], rtol=RTOL)


@pytest.mark.parametrize("head", ["visual_reasoning", "user_head"])
def test_a_head_on_the_pooled_output_is_read_at_cls(head):
    """Raw attention of a [CLS]-pooling head: the last layer's head-mean [CLS] row (as transformers outputs it),
    its own entry zeroed."""
    torch.manual_seed(0)
    if head == "visual_reasoning":
        model = build(CASE, transformers.VisualBertForVisualReasoning)
        encoder = model.visual_bert
    else:
        model = PooledHead(build(CASE).visual_bert)
        encoder = model.encoder
    batch = padded(INPUTS)
    expl = relevancy.explain(model, batch, method="raw_attention", target=0)
    with torch.no_grad():
        row = encoder(**batch, output_attentions=True).attentions[-1].mean(1)[:, 0]
    row[:, 0] = 0
    row[1, 7] = 0  # the second question's padding
    for b in range(2):
        assert_map_close(expl.parts["text"].scores[b], row[b, :8], rtol=1e-12)
        assert_map_close(expl.parts["image"].scores[b], row[b, 8:], rtol=1e-12)


def test_model_unchanged_after_success_and_after_a_failure(monkeypatch):
    """Also the attention implementation: a config set to sdpa gets the eager mask for the call and sdpa back."""
    model = build(CASE).train()
    model.config._attn_implementation = "sdpa"
    before = snapshot(model)
    record = RECORDS[0]
    for key, (method, options) in MAPS.items():
        expl = relevancy.explain(model, padded(INPUTS), method=method, target=[record["target"], 0], **options)
        assert_map_close(expl.parts["image"].scores[0], record["maps"][key]["image"], rtol=RTOL)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == "sdpa"

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(capture, "target_score", fail)  # inside the call, with every hook and switch in place
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, padded(INPUTS), method="generic_attention")
    assert_same(before, snapshot(model))
    assert all(m.training for m in model.modules())


def test_frozen_model_is_explained():
    model = build(CASE)
    model.requires_grad_(False)
    record = RECORDS[1]
    expl = relevancy.explain(model, INPUTS[record["input"]], method="generic_attention", target=record["target"])
    assert_map_close(expl.parts["text"].scores[0], record["maps"]["ours_no_lrp"]["text"], rtol=RTOL)
    assert not any(p.requires_grad for p in model.parameters())


def test_inputs_become_one_typed_batch():
    adapter = adapter_for(MODEL)
    assert isinstance(adapter, VisualBertAdapter)
    one = {name: value[0] for name, value in INPUTS[0].items()}  # one question without the batch dimension
    batch = adapter.check_inputs(one)
    assert isinstance(batch, VisualBertBatch) and len(batch) == 1 and batch.text_length == 8
    assert batch.visual_embeds.dtype == torch.float64 and batch.visual_embeds.shape == (1, REGIONS, 16)
    again = adapter.check_inputs(batch)  # a checked batch is taken as it is
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.visual_embeds, batch.visual_embeds)


@pytest.mark.parametrize("change, error, message", [
    (lambda x: {**x, "visual_feats": x["visual_embeds"]}, ValueError, "unknown: visual_feats"),
    (lambda x: {k: v for k, v in x.items() if k != "visual_embeds"}, ValueError, "need visual_embeds"),
    (lambda x: {**x, "input_ids": x["input_ids"].float()}, TypeError, "input_ids must hold integers"),
    (lambda x: {**x, "visual_embeds": x["visual_embeds"][..., :4]}, ValueError, "16 features per region"),
    (lambda x: {**x, "visual_embeds": x["visual_embeds"] * float("nan")}, ValueError, "NaN or infinite"),
    (lambda x: {**x, "visual_attention_mask": x["visual_attention_mask"][:, :3]}, ValueError, r"must be \(B, N\)"),
    (lambda x: {**x, "visual_token_type_ids": x["visual_token_type_ids"] + 5}, ValueError, "type_vocab_size"),
    (lambda x: {**x, "attention_mask": torch.tensor([[1] + [0] * 7])}, ValueError, "at least 2"),
    (lambda x: {**x, "token_type_ids": x["token_type_ids"][:, :3]}, ValueError, "shape of input_ids"),
    (lambda x: "what is on the table?", TypeError, "must be a dict of its keyword inputs"),
])
def test_bad_inputs_are_refused_naming_the_problem(change, error, message):
    with pytest.raises(error, match=message):
        relevancy.explain(MODEL, change(INPUTS[0]), method="raw_attention")


def test_unsupported_models_are_refused():
    config = transformers.VisualBertConfig(**CASE["config"])
    with pytest.raises(UnsupportedModelError, match="no answer logits"):
        relevancy.explain(MODEL.visual_bert, INPUTS[0], method="raw_attention")
    with pytest.raises(UnsupportedModelError, match="no answer logits"):
        relevancy.explain(transformers.VisualBertForPreTraining(config), INPUTS[0], method="raw_attention")
    config.bypass_transformer = True
    with pytest.raises(UnsupportedModelError, match="bypass_transformer"):
        relevancy.explain(transformers.VisualBertForQuestionAnswering(config), INPUTS[0], method="raw_attention")
    with pytest.raises(UnsupportedModelError, match="method 'transformer_attribution' does not apply to .*VisualBERT.*its methods: .*token_ablation"):
        relevancy.explain(MODEL, INPUTS[0], method="transformer_attribution")
