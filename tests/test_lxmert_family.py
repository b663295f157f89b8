"""LXMERT against the authors' float64 outputs (tests/golden/bimodal_reference.pt) on an unmodified
`transformers.LxmertForQuestionAnswering`: the recorded attention probabilities and their gradients, every non-LRP
map one question at a time and both questions in one padded batch, other heads on an LxmertModel, the model handed
back unchanged, and the input errors."""
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
from relevancy.families.lxmert.adapter import LxmertAdapter
from relevancy.families.lxmert.batch import LxmertBatch

CASE = bimodal_case("lxmert")
MODEL = build(CASE)
INPUTS = CASE["inputs"]
RECORDS = CASE["records"]
# golden key -> (method, options); the LXMERT conventions ([CLS] entry, Grad-CAM's region and no normalisation)
# are the adapter's defaults, so no option names them here
MAPS = {
    "ours_no_lrp": ("generic_attention", {}),
    "ours_no_lrp_no_norm": ("generic_attention", {"residual_normalization": False}),
    "ablation_no_self_in_10": ("generic_attention", {"bimodal_self_terms": False}),
    "ablation_no_aggregation": ("generic_attention", {"aggregate": False, "residual_normalization": False}),
    "raw_attn": ("raw_attention", {}),
    "rollout": ("rollout", {}),
    "attn_gradcam": ("attention_gradcam", {}),
}
# LXMERT's softmax runs in the model's dtype: the maps agree with the authors' to ~1e-14
RTOL = 1e-8


def expected_names() -> list[str]:
    """The golden's attention names in the forward order of the model's config."""
    config = CASE["config"]
    names = [f"lxmert.encoder.layer.{i}.attention.self" for i in range(config["l_layers"])]
    names += [f"lxmert.encoder.r_layers.{i}.attention.self" for i in range(config["r_layers"])]
    for i in range(config["x_layers"]):
        prefix = f"lxmert.encoder.x_layers.{i}"
        names += [
            f"{prefix}.visual_attention.att[text->image]", f"{prefix}.visual_attention.att[image->text]",
            f"{prefix}.lang_self_att.self", f"{prefix}.visn_self_att.self",
        ]
    return names


def test_sites_are_declared_in_forward_order_with_their_streams_and_groups():
    sites = LxmertAdapter(MODEL).attention_sites()
    names = expected_names()
    assert names == list(CASE["attentions"][0])
    for site, name in zip(sites, names, strict=True):
        if "[text->image]" in name or "[image->text]" in name:
            layer = int(name.split("x_layers.")[1].split(".")[0])
            assert (site.query, site.key, site.group) == (("text", "image", layer) if "[text->image]" in name else ("image", "text", layer))
        else:
            stream = "text" if ".layer." in name or "lang_self_att" in name else "image"
            assert (site.query, site.key, site.group) == (stream, stream, None)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"input{r['input']}-rank{r['target_rank']}")
def test_probabilities_and_their_gradients_equal_the_reference(record):
    """Both calls of each cross layer's visual_attention told apart; d score / d probabilities as the authors'."""
    adapter = LxmertAdapter(MODEL)
    golden, grads = CASE["attentions"][record["input"]], record["attention_grads"]
    names = list(golden)
    with adapter.explaining(attention_probabilities=True):
        fwd = record_forward(adapter, adapter.check_inputs(INPUTS[record["input"]]), record["target"], attentions=True, gradients=True)
    torch.testing.assert_close(fwd.logits[0], CASE["outputs"]["question_answering_score"][record["input"]][0], rtol=0, atol=1e-12)
    for name, attention in zip(names, fwd.attentions, strict=True):
        assert_map_close(attention, golden[name], rtol=1e-12)
    # the last cross layer's image queries and its visual self-attention never reach [CLS]: no gradient (0 in the
    # reference, off the score's graph here); every other site has one
    unreached = [n for n in names if not grads[n].any()]
    last = CASE["config"]["x_layers"] - 1
    assert unreached == [f"lxmert.encoder.x_layers.{last}.visual_attention.att[image->text]", f"lxmert.encoder.x_layers.{last}.visn_self_att.self"]
    reached = [k for k, n in enumerate(names) if n not in unreached]
    for k, grad in zip(reached, fwd.gradients([fwd.attentions[k] for k in reached]), strict=True):
        assert_map_close(grad, grads[names[k]], rtol=1e-12)


@pytest.mark.parametrize("key", list(MAPS))
def test_single_question_maps(key):
    method, options = MAPS[key]
    for record in RECORDS:
        expl = relevancy.explain(MODEL, INPUTS[record["input"]], method=method, target=record["target"], **options)
        assert expl.target.tolist() == [record["target"]]
        text, image = expl.parts["text"].scores, expl.parts["image"].scores
        assert text.shape == (1, INPUTS[record["input"]]["input_ids"].shape[1]) and image.shape == (1, 9)
        assert_map_close(text[0], record["maps"][key]["text"], rtol=RTOL)
        assert_map_close(image[0], record["maps"][key]["image"], rtol=RTOL)


@pytest.mark.parametrize("key", list(MAPS))
def test_padded_batch_with_mixed_targets_equals_single_questions(key):
    """Both questions (8 and 6 tokens) in one right-padded batch, each with its own target; 0 at padding."""
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


class AnswerHead(torch.nn.Module):
    """A user's model: an LxmertModel and an answer head of its own, returning the logits as a tensor."""

    def __init__(self, qa: torch.nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = qa.lxmert, qa.answer_head

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(**inputs).pooled_output)


@pytest.mark.parametrize("wrap", ["pretraining", "user_head"])
def test_other_heads_on_an_lxmert_model_give_the_reference_maps(wrap):
    """LxmertForPreTraining (its QA score) and a user's module holding an LxmertModel read the same [CLS] answer."""
    model = build(CASE, transformers.LxmertForPreTraining) if wrap == "pretraining" else AnswerHead(build(CASE))
    record = RECORDS[1]
    for key in ("ours_no_lrp", "attn_gradcam"):
        method, options = MAPS[key]
        expl = relevancy.explain(model, INPUTS[record["input"]], method=method, target=record["target"], **options)
        assert_map_close(expl.parts["text"].scores[0], record["maps"][key]["text"], rtol=RTOL)
        assert_map_close(expl.parts["image"].scores[0], record["maps"][key]["image"], rtol=RTOL)


def test_region_padding_is_masked_and_scored_zero():
    """Two padded regions appended to the first question's image: the real regions' maps are unchanged."""
    record = RECORDS[0]
    inputs = dict(INPUTS[0])
    inputs["visual_feats"] = torch.cat([inputs["visual_feats"], torch.randn(1, 2, 16, dtype=torch.float64)], 1)
    inputs["visual_pos"] = torch.cat([inputs["visual_pos"], torch.rand(1, 2, 4, dtype=torch.float64)], 1)
    inputs["visual_attention_mask"] = torch.tensor([[1] * 9 + [0, 0]])
    expl = relevancy.explain(MODEL, inputs, method="generic_attention", target=record["target"])
    assert_map_close(expl.parts["text"].scores[0], record["maps"]["ours_no_lrp"]["text"], rtol=RTOL)
    assert_map_close(expl.parts["image"].scores[0, :9], record["maps"]["ours_no_lrp"]["image"], rtol=RTOL)
    assert (expl.parts["image"].scores[0, 9:] == 0).all()
    assert [k for k, _ in expl.parts["image"].region_scores(0)] == list(range(9))
    assert expl.labels() == [f"answer {record['target']} ({expl.logits[0, record['target']]:.2f})"]
    assert "generic_attention: answer" in expl.to_html() and len(expl.parts["text"].token_scores(0)) == 8


def test_model_unchanged_after_success_and_after_a_failure(monkeypatch):
    model = build(CASE).train()
    before = snapshot(model)
    for method, options in MAPS.values():
        relevancy.explain(model, padded(INPUTS), method=method, **options)
    assert_same(before, snapshot(model))

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(capture, "target_score", fail)  # inside the call, with every hook in place
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, padded(INPUTS), method="generic_attention")
    assert_same(before, snapshot(model))
    assert all(m.training for m in model.modules())


def test_frozen_model_is_explained():
    model = build(CASE)
    model.requires_grad_(False)
    record = RECORDS[2]
    expl = relevancy.explain(model, INPUTS[record["input"]], method="generic_attention", target=record["target"])
    assert_map_close(expl.parts["image"].scores[0], record["maps"]["ours_no_lrp"]["image"], rtol=RTOL)
    assert not any(p.requires_grad for p in model.parameters())


def test_inputs_become_one_typed_batch():
    adapter = adapter_for(MODEL)
    assert isinstance(adapter, LxmertAdapter)
    one = {name: value[0] for name, value in INPUTS[1].items()}  # one question without the batch dimension
    batch = adapter.check_inputs(one)
    assert isinstance(batch, LxmertBatch) and len(batch) == 1 and batch.tokens == [[f"[{t}]" for t in INPUTS[1]["input_ids"][0].tolist()]]
    again = adapter.check_inputs(batch)  # a checked batch is taken as it is
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.visual_feats, batch.visual_feats)
    streams = adapter.streams(adapter.check_inputs(padded(INPUTS)))
    assert streams["text"].readout.tolist() == [0, 0] and streams["image"].readout is None
    assert streams["text"].valid.sum(1).tolist() == [8, 6] and streams["image"].valid is None


@pytest.mark.parametrize("change, error, message", [
    (lambda x: {**x, "pixel_values": x["visual_feats"]}, ValueError, "unknown: pixel_values"),
    (lambda x: {k: v for k, v in x.items() if k != "visual_pos"}, ValueError, "need visual_pos"),
    (lambda x: {**x, "input_ids": x["input_ids"].double()}, TypeError, "input_ids must hold integers"),
    (lambda x: {**x, "visual_feats": x["visual_feats"][..., :8]}, ValueError, "16 features per region"),
    (lambda x: {**x, "visual_feats": x["visual_feats"].long()}, TypeError, "visual_feats must be a float tensor"),
    (lambda x: {**x, "visual_pos": x["visual_pos"][:, :4]}, ValueError, "one box per region"),
    (lambda x: {**x, "attention_mask": x["attention_mask"] * 2}, ValueError, "1 at real tokens and 0 at padding"),
    (lambda x: {**x, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}, ValueError, "not right-padded"),
    (lambda x: {**x, "input_ids": x["input_ids"] + 200}, ValueError, "vocabulary"),
    (lambda x: {**x, "visual_attention_mask": torch.zeros(1, 9)}, ValueError, "no real region"),
    (lambda x: {**x, "visual_feats": x["visual_feats"].expand(2, -1, -1)}, ValueError, "one row per question"),
    (lambda x: [x["input_ids"]], TypeError, "must be a dict of its keyword inputs"),
])
def test_bad_inputs_are_refused_naming_the_problem(change, error, message):
    with pytest.raises(error, match=message):
        relevancy.explain(MODEL, change(INPUTS[1]), method="raw_attention")


def test_unsupported_models_and_methods_are_refused():
    with pytest.raises(UnsupportedModelError, match="bare LxmertModel"):
        relevancy.explain(MODEL.lxmert, INPUTS[0], method="raw_attention")
    with pytest.raises(UnsupportedModelError, match="method 'lrp' does not apply to .*LXMERT.*its methods: .*partial_lrp"):
        relevancy.explain(MODEL, INPUTS[0], method="lrp")


def test_save_draws_the_regions_and_writes_the_coloured_question(tmp_path):
    case = CASE
    model = build(case)
    expl = relevancy.explain(model, case["inputs"][0], method="generic_attention")
    picture = torch.rand(48, 64, 3).numpy()
    path = expl.save(tmp_path / "question.png", [picture])
    assert path.read_bytes()[:4] == b"\x89PNG"
    page = expl.save(tmp_path / "question.html").read_text()
    assert "generic_attention" in page and "<span" in page
