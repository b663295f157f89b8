"""`cdam` and `token_ablation` on the question-and-regions families (LXMERT, VisualBERT), float64 tiny models.

token_ablation is checked against removing the token or region by hand and running the model's own public forward
on what is left (the other question tokens keep their positions, as every family's token ablation does: LXMERT's
forward takes no position ids, so its position embedding's input is set by a hook; VisualBERT's takes
`position_ids`); cdam against gradient x input at the hooked tensors computed by hand.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import relevancy
from bimodal_golden import assert_same, bimodal_case, build, padded, snapshot
from relevancy.methods import capture
from relevancy.families.base import UnsupportedModelError
from relevancy.families.regions import METHODS

LXMERT, VISUALBERT = bimodal_case("lxmert"), bimodal_case("visualbert")
TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids")
REGION_FIELDS = {
    "lxmert": ("visual_feats", "visual_pos", "visual_attention_mask"),
    "visualbert": ("visual_embeds", "visual_attention_mask", "visual_token_type_ids"),
}
# per family: the explained answer of each question (the reference's records)
TARGETS = {"lxmert": [1, 5], "visualbert": [6, 3]}
ATOL = 1e-10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch_with_region_padding(case: dict) -> dict[str, torch.Tensor]:
    """Both questions right-padded (8 and 6 or 7 real tokens); the second image has 7 real regions of 9."""
    batch = padded(case["inputs"])
    regions = torch.ones(2, 9, dtype=torch.long)
    regions[1, 7:] = 0
    batch["visual_attention_mask"] = regions
    return batch


def real_row(case: dict, batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """Row `row` of a padded batch as one question alone: its real tokens and its real regions only."""
    tokens = int(batch["attention_mask"][row].sum())
    regions = batch["visual_attention_mask"][row].bool() if "visual_attention_mask" in batch else None
    single = {}
    for name, value in batch.items():
        value = value[row:row + 1]
        if name in TEXT_FIELDS:
            value = value[:, :tokens]
        elif regions is not None:
            value = value[:, regions]
        single[name] = value
    return single


def score_without(model: torch.nn.Module, family: str, inputs: dict, target: int, token: int | None = None,
                  region: int | None = None, keep_positions: bool = True) -> float:
    """The target's logit of one question (batch of one, no padding), `token` removed from the question's fields
    and `region` from the region fields, through the model's public forward. `keep_positions`: the question's other
    tokens keep their position embeddings."""
    length, count = inputs["input_ids"].shape[1], inputs[REGION_FIELDS[family][0]].shape[1]
    words = [k for k in range(length) if k != token]
    boxes = [k for k in range(count) if k != region]
    fields = {
        name: value[:, words] if name in TEXT_FIELDS else value[:, boxes] if name in REGION_FIELDS[family] else value
        for name, value in inputs.items()
    }
    positions = torch.tensor([words])
    handle = None
    if family == "visualbert" and keep_positions:
        fields["position_ids"] = positions
    elif keep_positions:
        handle = model.lxmert.embeddings.position_embeddings.register_forward_pre_hook(lambda _m, _a: (positions,))
    try:
        with torch.no_grad():
            out = model(**fields)
    finally:
        if handle is not None:
            handle.remove()
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "question_answering_score", None)
    logits = out.logits if logits is None else logits
    return float(logits[0, target])


def readout_of(family: str, model: torch.nn.Module, length: int) -> int:
    """The position of the question that the model's head reads its answer from."""
    gathers = any(isinstance(m, transformers.VisualBertForQuestionAnswering) for m in model.modules())
    return length - 2 if family == "visualbert" and gathers else 0


def check_against_removal(model, family, case, batch, targets, expl, cls_entry="zero"):
    """Every real token's and region's entry of every row equals the drop of removing it by hand; padding and the
    readout token (with `cls_entry="zero"`) are 0."""
    text, image = expl.parts["text"].scores, expl.parts["image"].scores
    for row, target in enumerate(targets):
        single = real_row(case, batch, row)
        length, count = single["input_ids"].shape[1], single[REGION_FIELDS[family][0]].shape[1]
        full = score_without(model, family, single, target)
        assert float(expl.logits[row, target]) == pytest.approx(full, abs=1e-12)
        readout = readout_of(family, model, length)
        for token in range(length):
            if token == readout and cls_entry == "zero":
                assert text[row, token] == 0
                continue
            expected = full - score_without(model, family, single, target, token=token)
            assert float(text[row, token]) == pytest.approx(expected, abs=ATOL), (row, token)
        for region in range(count):
            expected = full - score_without(model, family, single, target, region=region)
            assert float(image[row, region]) == pytest.approx(expected, abs=ATOL), (row, region)
        assert (text[row, length:] == 0).all() and (image[row, count:] == 0).all()


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_token_ablation_of_one_question_equals_removing_each_token_and_region_by_hand(family):
    case = LXMERT if family == "lxmert" else VISUALBERT
    model = build(case)
    inputs = case["inputs"][0]
    expl = relevancy.explain(model, inputs, method="token_ablation", target=TARGETS[family][0])
    assert expl.signed and expl.parts["text"].scores.shape == (1, 8) and expl.parts["image"].scores.shape == (1, 9)
    check_against_removal(model, family, case, inputs, TARGETS[family][:1], expl)
    # removing the question's last token shifts no other token: the plain public forward, no position kept by hand
    full = score_without(model, family, inputs, TARGETS[family][0])
    plain = score_without(model, family, inputs, TARGETS[family][0], token=7, keep_positions=False)
    assert float(expl.parts["text"].scores[0, 7]) == pytest.approx(full - plain, abs=ATOL)


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_token_ablation_of_a_padded_batch_equals_each_question_alone(family):
    """Questions of different lengths (right-padded) and images of 9 and 7 real regions; small chunks mix sequences
    that lose a token with sequences that lose a region."""
    case = LXMERT if family == "lxmert" else VISUALBERT
    model = build(case)
    batch = batch_with_region_padding(case)
    expl = relevancy.explain(model, batch, method="token_ablation", target=TARGETS[family])
    check_against_removal(model, family, case, batch, TARGETS[family], expl)
    for chunk in (1, 5):
        again = relevancy.explain(model, batch, method="token_ablation", target=TARGETS[family], chunk_size=chunk)
        torch.testing.assert_close(again.parts["text"].scores, expl.parts["text"].scores, rtol=0, atol=1e-12)
        torch.testing.assert_close(again.parts["image"].scores, expl.parts["image"].scores, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_cls_entry_keep_gives_the_drop_of_removing_the_readout_token(family):
    case = LXMERT if family == "lxmert" else VISUALBERT
    model = build(case)
    batch = batch_with_region_padding(case)
    expl = relevancy.explain(model, batch, method="token_ablation", target=TARGETS[family], cls_entry="keep")
    check_against_removal(model, family, case, batch, TARGETS[family], expl, cls_entry="keep")
    with pytest.raises(ValueError, match="cls_entry must be one of"):
        relevancy.explain(model, batch, method="token_ablation", cls_entry="drop")


class AnswerHead(torch.nn.Module):
    """A user's model: an LxmertModel and an answer head of its own, returning the logits as a tensor."""

    def __init__(self, qa: torch.nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = qa.lxmert, qa.answer_head

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(**inputs).pooled_output)


class PooledHead(torch.nn.Module):
    """A user's head on a VisualBertModel's pooled [CLS] output."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = encoder, torch.nn.Linear(48, 3, dtype=torch.float64)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(**inputs).pooler_output)


@pytest.mark.parametrize("wrap", ["pretraining", "user_head"])
def test_other_lxmert_heads_give_the_question_answering_maps(wrap):
    model = build(LXMERT, transformers.LxmertForPreTraining) if wrap == "pretraining" else AnswerHead(build(LXMERT))
    batch = batch_with_region_padding(LXMERT)
    for method in ("cdam", "token_ablation"):
        expected = relevancy.explain(build(LXMERT), batch, method=method, target=TARGETS["lxmert"])
        expl = relevancy.explain(model, batch, method=method, target=TARGETS["lxmert"])
        for part in ("text", "image"):
            torch.testing.assert_close(expl.parts[part].scores, expected.parts[part].scores, rtol=0, atol=1e-12)


def test_a_user_head_on_visualbert_pooled_output_keeps_its_cls_readout():
    torch.manual_seed(0)
    model = PooledHead(build(VISUALBERT).visual_bert)
    batch = batch_with_region_padding(VISUALBERT)
    expl = relevancy.explain(model, batch, method="token_ablation", target=[0, 2])
    check_against_removal(model, "visualbert", VISUALBERT, batch, [0, 2], expl)
    assert (expl.parts["text"].scores[:, 0] == 0).all()


def hand_cdam(model: torch.nn.Module, family: str, batch: dict[str, torch.Tensor], targets: list[int]) -> list[torch.Tensor]:
    """sum_d X * d logit / d X at the tensors entering LXMERT's last cross-modality layer (language, visual) or
    VisualBERT's last layer, computed with a hook of our own."""
    if family == "lxmert":
        layer, names = model.lxmert.encoder.x_layers[-1], [(0, "lang_feats"), (2, "visual_feats")]
    else:
        layer, names = model.visual_bert.encoder.layer[-1], [(0, "hidden_states")]
    seen: list[torch.Tensor] = []

    def keep(_module, args, kwargs):
        seen.extend(args[k] if len(args) > k else kwargs[name] for k, name in names)

    handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        out = model(**batch)
    finally:
        handle.remove()
    logits = out.question_answering_score if family == "lxmert" else out.logits
    score = logits[torch.arange(len(targets)), torch.tensor(targets)].sum()
    grads = torch.autograd.grad(score, seen)
    return [(x * g).sum(-1).detach() for x, g in zip(seen, grads)]


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_cdam_is_gradient_times_input_at_the_last_layers_inputs(family):
    case = LXMERT if family == "lxmert" else VISUALBERT
    model = build(case)
    batch = batch_with_region_padding(case)
    expl = relevancy.explain(model, batch, method="cdam", target=TARGETS[family])
    text, image = expl.parts["text"].scores, expl.parts["image"].scores
    assert expl.signed and text.shape == (2, 8) and image.shape == (2, 9)
    assert (text < 0).any() and (text > 0).any() and (image < 0).any() and (image > 0).any()
    expected = hand_cdam(model, family, batch, TARGETS[family])
    if family == "lxmert":
        expected_text, expected_image = expected
    else:
        expected_text, expected_image = expected[0][:, :8], expected[0][:, 8:]
    expected_text = expected_text * batch["attention_mask"]
    expected_image = expected_image * batch["visual_attention_mask"]
    torch.testing.assert_close(text, expected_text, rtol=0, atol=1e-12)
    torch.testing.assert_close(image, expected_image, rtol=0, atol=1e-12)
    assert text[0].abs().min() > 0 and (text[1, 6 if family == "lxmert" else 7:] == 0).all() and (image[1, 7:] == 0).all()
    # one question alone gives its row of the batch
    alone = relevancy.explain(model, real_row(case, batch, 1), method="cdam", target=TARGETS[family][1])
    length = int(batch["attention_mask"][1].sum())
    torch.testing.assert_close(alone.parts["text"].scores[0], text[1, :length], rtol=0, atol=1e-12)
    torch.testing.assert_close(alone.parts["image"].scores[0], image[1, :7], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["lxmert", "visualbert"])
def test_model_unchanged_after_success_and_after_a_failure(family, monkeypatch):
    case = LXMERT if family == "lxmert" else VISUALBERT
    model = build(case).train()
    if family == "visualbert":
        model.config._attn_implementation = "sdpa"  # switched to eager for the call, handed back after
    before = snapshot(model)
    batch = batch_with_region_padding(case)
    for method in ("cdam", "token_ablation"):
        relevancy.explain(model, batch, method=method)
    assert_same(before, snapshot(model))

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    adapter_module = f"relevancy.families.{'lxmert' if family == 'lxmert' else 'visual_bert'}.adapter"
    failures = [
        ("cdam", lambda: monkeypatch.setattr(capture, "target_score", fail)),
        ("token_ablation", lambda: monkeypatch.setattr("relevancy.methods.ablation.target_score", fail)),
        # inside the model's forward on the ablated tokens, with the adapter's replacing hooks in place
        ("token_ablation", lambda: monkeypatch.setattr(f"{adapter_module}.answer_logits", fail)),
    ]
    for method, inject in failures:
        inject()
        with pytest.raises(RuntimeError, match="injected failure"):
            relevancy.explain(model, batch, method=method)
        monkeypatch.undo()
        assert_same(before, snapshot(model))
        assert all(m.training for m in model.modules())


def test_the_methods_are_listed_and_the_edges_are_refused():
    assert {"cdam", "token_ablation"} <= set(METHODS)
    with pytest.raises(UnsupportedModelError, match="its methods: .*cdam, token_ablation"):
        relevancy.explain(build(VISUALBERT), VISUALBERT["inputs"][0], method="transformer_attribution")
    one_region = {name: value[:, :1] if name in REGION_FIELDS["lxmert"] else value for name, value in LXMERT["inputs"][0].items()}
    with pytest.raises(ValueError, match="only token of an image of one region"):
        relevancy.explain(build(LXMERT), one_region, method="token_ablation")
    assert relevancy.explain(build(LXMERT), one_region, method="cdam").parts["image"].scores.shape == (1, 1)
    short = {name: value[:, [0, 7]] if name in TEXT_FIELDS else value for name, value in VISUALBERT["inputs"][0].items()}
    with pytest.raises(ValueError, match="at least 3 real tokens"):
        relevancy.explain(build(VISUALBERT), short, method="token_ablation")
