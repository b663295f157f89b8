"""Decoder targets over answer spans, latent relevance and attention sinks, on the tiny float64 Llama and GPT-2 of
tests/golden/llm_lxt_reference.pt: spans (logit and log-probability) and the latent maps equal input x gradient
of the same score under lxt's own rules (tests/golden/llm_lxt_spans.pt, made by benchmarks/llm_lxt_spans.py with
lxt 2.1; the models' weights checked by checksum), batched equal to single, contrasts, callables, sinks, exclusion,
the model unchanged after every call."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from language_models import GOLDEN, build, weights_checksum
from test_causal_lm import Characters, assert_close_to, batch

import relevancy

REFERENCE = torch.load(Path(__file__).parent / "golden" / "llm_lxt_spans.pt", weights_only=False)
METHODS = ("attnlrp", "cp_lrp", "input_x_gradient")
SPAN = relevancy.Span(list(REFERENCE["span"]))
FOIL = relevancy.Span(list(REFERENCE["foil"]))


@pytest.fixture(scope="module", params=("llama", "gpt2"))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(arch):
    model = build(arch)
    assert weights_checksum(model) == REFERENCE["models"][arch]["checksum"], "not the models the reference was made with"
    return model


def read_columns(expl) -> torch.Tensor:
    """The prompt's scores and the span's read tokens (the span's last token is only predicted: 0, dropped)."""
    assert (expl.span.scores[:, -1] == 0).all()
    return torch.cat([expl.scores, expl.span.scores[:, :-1]], 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("score", ["logit", "log_prob"])
def test_a_span_equals_lxt(arch, model, method, score):
    reference = REFERENCE["models"][arch][method][f"span_{score}"]
    expl = relevancy.explain(model, batch("single0"), method=method, target=SPAN, score=score)
    assert expl.scores.shape == (1, 7) and expl.span.ids.tolist() == [list(REFERENCE["span"])]
    assert_close_to(read_columns(expl), reference["map"], f"{arch} {method} {score}")
    assert expl.target.tolist() == [REFERENCE["span"][0]]
    if method != "input_x_gradient":  # the share of the explained score reaching every token read
        assert torch.allclose(expl.relevance_total * reference["explained"], read_columns(expl).sum(1))


@pytest.mark.parametrize("method", METHODS)
def test_latent_relevance_equals_lxt_and_conserves(arch, model, method):
    reference = REFERENCE["models"][arch][method]
    for name, target in (("span_logit", SPAN), ("next_logit", None)):
        expl = relevancy.explain(model, batch("single0"), method=method, target=target, latent=True)
        latent, expected = expl.latent, reference[name]
        width = expected["layers"].shape[-1]
        assert latent.layers.shape == (3, 1, expl.scores.shape[1] + (0 if target is None else 3))
        assert latent.neurons.shape == (*latent.layers.shape, 32) and latent.heads.shape == (2, 1, 4)
        assert_close_to(latent.layers[..., :width], expected["layers"], f"{arch} {method} {name} layers")
        assert_close_to(latent.neurons[..., :width, :], expected["neurons"], f"{arch} {method} {name} neurons")
        assert_close_to(latent.heads, expected["heads"], f"{arch} {method} {name} heads")
        # layer 0 is the token embeddings: the input scores (and the span's)
        columns = expl.scores if target is None else torch.cat([expl.scores, expl.span.scores], 1)
        assert torch.allclose(latent.layers[0], columns, atol=1e-12)
        assert torch.allclose(latent.neurons.sum(-1), latent.layers, atol=1e-12)
        if method != "input_x_gradient":
            # the last layer's output carries the whole explained score (the final norm passes it, the head has no bias)
            assert torch.allclose(latent.layers[-1].sum(-1), expected["explained"].reshape(1), rtol=1e-6)
        if method == "cp_lrp" and arch == "llama":
            # CP-LRP conserves through every layer of a bias-free Llama (the softmax is a constant weighting)
            assert torch.allclose(latent.layers.sum(-1), expected["explained"].expand(3, 1), rtol=1e-6)


def test_attnlrp_layer_totals_are_reported_as_they_are(model, arch):
    """AttnLRP's softmax rule (its gradient x input) does not conserve on these random models: the layer totals
    differ from the explained logit (lxt's numbers alike), and every layer's total is reported, not rescaled."""
    expected = REFERENCE["models"][arch]["attnlrp"]["span_logit"]["layers"].sum(-1)[:, 0]
    found = relevancy.explain(model, batch("single0"), method="attnlrp", target=SPAN, latent="layers").latent.layers.sum(-1)[:, 0]
    assert_close_to(found, expected, "attnlrp layer totals")


def test_latent_parts_on_request(model):
    only_heads = relevancy.explain(model, batch("single0"), method="attnlrp", latent="heads").latent
    assert only_heads.layers is None and only_heads.neurons is None and only_heads.heads.shape == (2, 1, 4)
    layers = relevancy.explain(model, batch("single0"), method="attnlrp", latent=("layers",)).latent
    assert layers.neurons is None and layers.heads is None
    assert relevancy.explain(model, batch("single0"), method="attnlrp").latent is None
    with pytest.raises(ValueError, match="latent must be True, False or some of layers, neurons, heads"):
        relevancy.explain(model, batch("single0"), method="attnlrp", latent="attention")
    with pytest.raises(ValueError, match="ask for them without checkpoint"):
        relevancy.explain(model, batch("single0"), method="attnlrp", latent=True, checkpoint=True)
    recomputed = relevancy.explain(model, batch("single0"), method="attnlrp", latent="layers", checkpoint=True).latent
    assert_close_to(recomputed.layers, layers.layers, "checkpointed latent layers", 1e-12)


@pytest.mark.parametrize("side", ["right", "left"])
def test_batched_ragged_spans_equal_single(model, side):
    """Spans of different lengths per row of a padded batch: each row equals its prompt explained alone."""
    spans = [relevancy.Span([11, 22, 33]), relevancy.Span([44]), relevancy.Span([55, 66])]
    batched = relevancy.explain(model, batch(side), method="attnlrp", target=spans, score="log_prob", latent=True)
    mask = GOLDEN["inputs"][side][1].bool()
    assert batched.span.ids.tolist() == [[11, 22, 33], [44, -1, -1], [55, 66, -1]]
    for row, span in enumerate(spans):
        alone = relevancy.explain(model, batch(f"single{row}"), method="attnlrp", target=span, score="log_prob", latent=True)
        assert_close_to(batched.scores[row][mask[row]], alone.scores[0], f"row {row}", 1e-10)
        assert (batched.scores[row][~mask[row]] == 0).all()
        size = len(span.tokens)
        if alone.span is not None:
            assert_close_to(batched.span.scores[row, :size], alone.span.scores[0], f"row {row} span", 1e-10)
        assert_close_to(batched.latent.heads[:, row], alone.latent.heads[:, 0], f"row {row} heads", 1e-10)
        assert_close_to(batched.latent.layers[:, row, :batched.scores.shape[1]][:, mask[row]], alone.latent.layers[:, 0, :mask[row].sum()],
                        f"row {row} layers", 1e-10)


def test_contrast_spans_subtract_two_teacher_forced_reads(arch, model):
    """Contrast(A, B) of spans: A and B each read teacher-forced after the same prompt (B in a row of its own), the
    score A's minus B's: the prompt's map is A's minus B's (lxt's maps), each span's own tokens reported apart."""
    reference = REFERENCE["models"][arch]["attnlrp"]
    expl = relevancy.explain(model, batch("single0"), method="attnlrp", target=relevancy.Contrast(SPAN, FOIL), latent="layers")
    expected = reference["span_logit"]["map"][:, :7] - reference["foil_logit"]["map"][:, :7]
    assert_close_to(expl.scores, expected, "contrast prompt map")
    assert_close_to(expl.span.scores[:, :2], reference["span_logit"]["map"][:, 7:], "the span's own tokens")
    assert_close_to(expl.span.foil_scores[:, :1], -reference["foil_logit"]["map"][:, 7:], "the foil's own tokens")
    explained = reference["span_logit"]["explained"] - reference["foil_logit"]["explained"]
    everything = expl.scores.sum() + expl.span.scores.sum() + expl.span.foil_scores.sum()
    assert torch.allclose(expl.relevance_total[0] * explained, everything)
    assert expl.latent.layers.shape[-1] == 7 + 3 + 2


def test_texts_of_several_tokens_are_spans(model):
    inputs = batch("single0")
    by_text = relevancy.explain(model, inputs, method="attnlrp", target="+6A", tokenizer=Characters())
    by_ids = relevancy.explain(model, inputs, method="attnlrp", target=SPAN)
    assert torch.equal(by_text.scores, by_ids.scores) and by_text.span.tokens == [["+", "6", "A"]]
    per_row = relevancy.explain(model, batch("right"), method="attnlrp", target=[[11, 22, 33], 44, "+6"], tokenizer=Characters())
    assert per_row.span.ids.tolist() == [[11, 22, 33], [44, -1, -1], [11, 22, -1]]


def test_callables(model):
    """`target=f(next-token logits (B, V)) -> (B,)` and `score=f(logits (N, V), ids (N,)) -> (N,)` per span token."""
    inputs = batch("right")
    log_prob = relevancy.explain(model, inputs, method="attnlrp", target=SPAN, score="log_prob")
    custom = relevancy.explain(model, inputs, method="attnlrp", target=SPAN,
                               score=lambda logits, ids: logits.log_softmax(-1).gather(1, ids[:, None])[:, 0])
    assert torch.equal(custom.scores, log_prob.scores)
    entropy = relevancy.explain(model, inputs, method="input_x_gradient",
                                target=lambda logits: -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))
    assert entropy.target.tolist() == [-1, -1, -1] and entropy.scores.abs().sum() > 0
    with pytest.raises(ValueError, match=r"target=f\(logits\) must return one score per row, a tensor of shape \(3,\); got shape \(\)"):
        relevancy.explain(model, inputs, method="attnlrp", target=lambda logits: logits.sum())
    with pytest.raises(ValueError, match=r"score=f\(logits, ids\) must return one score per explained token"):
        relevancy.explain(model, inputs, method="attnlrp", target=SPAN, score=lambda logits, ids: logits.sum())
    with pytest.raises(ValueError, match="a callable target is its own score"):
        relevancy.explain(model, inputs, method="attnlrp", target=lambda logits: logits[:, 0], score="log_prob")
    with pytest.raises(ValueError, match="score must be one of logit, log_prob or a callable"):
        relevancy.explain(model, inputs, method="attnlrp", score="prob")


def test_bad_span_targets_are_named(model):
    inputs = batch("single0")
    with pytest.raises(ValueError, match=r"Contrast\(5, 5\) sets token 5 against itself: the score is 0 whatever the input; give a foil other than the token"):
        relevancy.explain(model, inputs, method="attnlrp", target=relevancy.Contrast(5, 5))
    with pytest.raises(ValueError, match=r"sets span \[11, 22\] against itself: .* give a foil other than the span"):
        relevancy.explain(model, inputs, method="attnlrp", target=relevancy.Contrast("+6", SPAN.__class__([11, 22])), tokenizer=Characters())
    with pytest.raises(ValueError, match="needs at least one token id"):
        relevancy.Span([])  # refused where it is made
    with pytest.raises(ValueError, match="outside the vocabulary"):
        relevancy.explain(model, inputs, method="attnlrp", target=relevancy.Span([1, 500]))
    with pytest.raises(ValueError, match="take 17 positions but the model's context window is 16 tokens"):
        relevancy.explain(model, torch.ones(1, 15, dtype=torch.long), method="attnlrp", target=relevancy.Span([1, 2, 3]))
    for method in ("rollout", "generic_attention", "transformer_attribution", "lrp"):
        with pytest.raises(TypeError, match=f"method '{method}' takes token ids.*answer spans and Contrast targets are taken by attnlrp, cp_lrp, input_x_gradient"):
            relevancy.explain(model, inputs, method=method, target=SPAN)
        with pytest.raises(ValueError, match=f"method '{method}' has no option 'latent'"):
            relevancy.explain(model, inputs, method=method, latent=True)


@pytest.mark.parametrize("method", METHODS)
def test_model_unchanged_after_latent_spans_and_errors(arch, method):
    model = build(arch, implementation="eager")
    before = snapshot(model)
    relevancy.explain(model, batch("left"), method=method, target=SPAN, latent=True)
    with pytest.raises(ValueError):
        relevancy.explain(model, batch("left"), method=method, target=SPAN, latent=True, score=lambda logits, ids: logits)
    assert_same(before, snapshot(model))
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())


def test_threads_get_the_serial_latent_maps(model):
    """Latent hooks act in the calling thread only: calls from several threads give the serial maps."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = ["left", "right", "single0", "single2"]
    serial = [relevancy.explain(model, batch(name), method="attnlrp", target=SPAN, latent=True).latent for name in jobs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda name: relevancy.explain(model, batch(name), method="attnlrp", target=SPAN, latent=True).latent, jobs))
    for one, other in zip(serial, threaded):
        assert torch.equal(one.layers, other.layers) and torch.equal(one.heads, other.heads)


def test_sink_shares_and_exclusion(model):
    """`sink_share`: the positive relevance's share on the first and last shown token; `exclude` zeroes and masks
    tokens (maps, colours, words and sink shares skip them) and reports the relevance total with and without."""
    expl = relevancy.explain(model, batch("left"), method="attnlrp", latent="layers")
    mask = GOLDEN["inputs"]["left"][1].bool()
    positive = expl.scores.clamp(min=0)
    first = mask.long().argmax(1)
    assert torch.allclose(expl.sink_share[:, 0], positive.gather(1, first[:, None])[:, 0] / positive.sum(1))
    assert torch.allclose(expl.sink_share[:, 1], positive[:, -1] / positive.sum(1))
    kept = relevancy.explain(model, batch("left"), method="attnlrp", latent="layers", exclude="first")
    assert (kept.scores.gather(1, first[:, None]) == 0).all() and kept.excluded.sum() == 3
    assert torch.equal(kept.scores[kept.attention_mask.bool()], expl.scores[mask & ~kept.excluded])
    assert [len(t) for t in kept.tokens] == [6, 4, 2] and len(kept.token_scores(0)) == 6
    assert torch.equal(kept.relevance_total, expl.relevance_total)
    dropped = expl.scores.gather(1, first[:, None])[:, 0]
    assert torch.allclose(kept.relevance_total_kept, expl.relevance_total * (expl.scores.sum(1) - dropped) / expl.scores.sum(1))
    assert (kept.latent.layers[:, torch.arange(3), first] == 0).all()
    # the second token is each row's first shown token now
    assert torch.allclose(kept.sink_share[:, 0], positive.gather(1, first[:, None] + 1)[:, 0] / kept.scores.clamp(min=0).sum(1))
    both = expl.excluding(("first", -1))
    assert both.excluded.sum() == 6 and [len(t) for t in both.tokens] == [5, 3, 1]
    with pytest.raises(ValueError, match="exclude takes first, last, bos, special, template"):
        expl.excluding("sinks")
    with pytest.raises(ValueError, match="outside row 1's 5 real tokens"):
        expl.excluding(5)
    generic = relevancy.explain(model, batch("left"), method="generic_attention")
    assert generic.sink_share.shape == (3, 2) and (generic.sink_share >= 0).all()


def test_special_and_template_tokens():
    from relevancy.results.parts import excluded_positions

    tokens = [["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"], ["<|endoftext|>", "The", "cat"]]
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 3:] = False
    special = excluded_positions(tokens, valid, "special")
    assert special[0].nonzero()[:, 0].tolist() == [0, 4, 6] and special[1].nonzero()[:, 0].tolist() == [0]
    template = excluded_positions(tokens, valid, "template")
    assert template[0].nonzero()[:, 0].tolist() == [0, 1, 2, 4, 5, 6, 7, 8] and template[1].nonzero()[:, 0].tolist() == [0]
    assert excluded_positions(tokens, valid, "bos")[:, 0].tolist() == [True, True]


def test_the_page_shows_the_span_and_the_heat_maps(model, tmp_path):
    expl = relevancy.explain(model, batch("single0"), method="attnlrp", target="+6A", tokenizer=Characters(), latent=True)
    page = expl.save(tmp_path / "span.html").read_text()
    assert "the answer span" in page and "residual stream, layer x token" in page and "attention heads, layer x head" in page
    assert page.count("<tr>") == (3 + 1) + (2 + 1)  # layers 0..2 and a header; 2 layers of heads and a header
    data = expl.to_json()
    assert data["span"]["ids"] == [[11, 22, 33]] and len(data["latent"]["layers"]) == 3 and len(data["sink_share"][0]) == 2


def test_rows_at_once_refuses_spans_and_latents(model):
    """Span and latent results are per batch: rows_at_once (which splits the batch) refuses them by name."""
    with pytest.raises(ValueError, match="rows_at_once cannot join a LatentRelevance"):
        relevancy.explain(model, batch("right"), method="attnlrp", latent=True, rows_at_once=1)
    with pytest.raises(ValueError, match="explain the batch at once"):
        relevancy.explain(model, batch("right"), method="attnlrp", target=[[11, 22, 33], 44, [55, 66]], rows_at_once=1)
    plain = relevancy.explain(model, batch("right"), method="attnlrp", target=[3, 4, 5], rows_at_once=1)
    assert_close_to(plain.scores, relevancy.explain(model, batch("right"), method="attnlrp", target=[3, 4, 5]).scores, "rows", 1e-10)


def test_a_generation_reports_its_sink_shares(model):
    """Each generated token's row: the share of its positive relevance on the first token and on the token just
    before it (the last it read)."""
    from test_generation import PROMPT, Characters as GenerationCharacters

    result = relevancy.explain_generation(model, GenerationCharacters(), PROMPT, method="attnlrp", continuation="abc")
    positive = result.scores.clamp(min=0)
    last = positive[torch.arange(3), result.prompt_length - 1 + torch.arange(3)]  # row g reads up to the token before g
    assert result.sink_share.shape == (3, 2)
    assert torch.allclose(result.sink_share[:, 0], positive[:, 0] / positive.sum(1))
    assert torch.allclose(result.sink_share[:, 1], last / positive.sum(1))


def test_exclude_is_refused_by_name_where_there_are_no_tokens():
    import transformers

    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        num_labels=3)).eval()
    with pytest.raises(ValueError, match="exclude= leaves tokens out of a decoder language model's explanation; this ImageExplanation"):
        relevancy.explain(vit, torch.randn(1, 3, 32, 32), method="rollout", exclude="first")


def test_the_latent_page_is_titled_by_the_whole_span_and_labels_tokens_as_read(tmp_path):
    """A byte-level tokenizer's span " cat sat": the page's title is the span's whole text, not its first token, and
    the heat map's column labels are the tokens' text (" cat"), not the tokenizer's ("Ġcat")."""
    import transformers
    from language_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    model, tokenizer = transformers.AutoModelForCausalLM.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer(["the dog ran to the"], return_tensors="pt")
    expl = relevancy.explain(model, inputs, method="attnlrp", target=relevancy.Span(" cat sat"), tokenizer=tokenizer, latent="layers")
    assert expl.page_title() == "' cat sat' (the answer span)"
    page = expl.to_html()
    assert "Ġ" not in page and ">&#x27;" not in page and "> cat</th>" in page
