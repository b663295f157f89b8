"""Text and generation results aggregated and shown as the text they stand for: byte-level markers decoded, words at
white space, sentences and given character spans (a token across a boundary counted by its share), the explain page
of a decoder titled by the explained token, with a colour scale under every line."""
from __future__ import annotations

import pytest
import torch
import transformers
from language_models import tiny_tokenizer

import relevancy
from relevancy.results.parts import TextPart
from relevancy.results.token_text import token_texts

#: byte-level BPE pieces as a fast tokenizer gives them (no word ids): "Question: Where does Mia\nAnswer"
PIECES = ["Question", ":", "\u0120Where", "\u0120does", "\u0120Mi", "a", "\u010a", "Answer"]
SCORES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]


def part() -> TextPart:
    return TextPart(torch.tensor([SCORES], dtype=torch.float64), True, [PIECES])


def test_tokens_read_as_the_text_they_stand_for():
    assert token_texts(["\u0120Paris", "\u010a", "\u010a\u010a", "\u0109x", "\u0120caf\u00c3\u00a9"]) == [
        " Paris", "\n", "\n\n", "\tx", " caf\u00e9"]  # byte-level BPE
    assert token_texts(["\u2581Paris", "caf\u00e9", "[CLS]"]) == [" Paris", "caf\u00e9", "[CLS]"]  # SentencePiece, text
    # a character cut in two: written at the token that completes it, U+FFFD where the row stops inside it
    assert token_texts(["\u0120\u00e2\u0122", "\u00a6"]) == ["", " \u2026"]
    assert token_texts(["\u0120a", "\u0120\u00e2\u0122"]) == [" a", " \ufffd"]
    assert part().text(0) == "Question: Where does Mia\nAnswer"


def test_words_merge_at_white_space_and_keep_line_breaks_apart():
    assert part().words(0) == [("Question:", 3.0), ("Where", 4.0), ("does", 8.0), ("Mia", 48.0), ("\n", 64.0), ("Answer", 128.0)]
    wordpiece = TextPart(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), True, [["[CLS]", "un", "##believ", "##able"]])
    assert wordpiece.words(0) == [("unbelievable", 9.0)]  # WordPiece: ## continuations, as before


def test_sentences_and_given_spans_sum_their_tokens():
    text = part().text(0)
    assert part().spans(0) == [("Question: Where does Mia", 63.0), ("Answer", 128.0)]
    mia = text.index("Mia")
    assert part().spans(0, [(mia, mia + 3)]) == [("Mia", 48.0)]
    # " Mi" straddles the span "ia": one of its two letters lies inside, so half its score counts
    assert part().spans(0, [(mia + 1, mia + 3)]) == [("ia", 8.0 + 32.0)]
    # spans that cut the text in pieces share each token out once: they sum to the row
    cuts = [0, 5, mia + 1, len(text)]
    pieces = part().spans(0, list(zip(cuts, cuts[1:])))
    assert "".join(piece for piece, _ in pieces) == text and sum(s for _, s in pieces) == pytest.approx(sum(SCORES))
    # a token of no text (the first bytes of a character the next token completes) counts with that token
    split = TextPart(torch.tensor([[1.0, 2.0, 4.0, 8.0]]), True, [["a", "", "\u00e9", " b"]])
    assert split.spans(0, [(0, 1), (1, 2), (2, 4)]) == [("a", 1.0), ("\u00e9", 6.0), (" b", 8.0)]
    for bad in ([(3, 3)], [(0, len(text) + 1)], [(-1, 2)], [(0.5, 2)], "paragraphs"):
        with pytest.raises(ValueError, match="spans must be 'sentences'|each span is \\(start, end\\)"):
            part().spans(0, bad)


def test_the_html_shows_line_breaks_and_a_colour_scale():
    line = part().html_line(0, by_word=False)
    assert "\u010a" not in line and "\u0120" not in line and "\u21b5<br>" in line and ">Answer<" in line
    scale = part().scale_html(0)
    assert 'class="relevancy-scale"' in scale and ">-128<" in scale and ">128<" in scale and "linear-gradient" in scale


@pytest.fixture(scope="module")
def decoder():
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval(), tokenizer


def test_the_explain_page_of_a_decoder_names_the_explained_token(decoder, tmp_path):
    model, tokenizer = decoder
    text = "the cat sat.\nwhere does the cat live?"
    inputs = tokenizer([text], return_tensors="pt")
    expl = relevancy.explain(model, inputs, method="attnlrp", tokenizer=tokenizer)
    token = tokenizer.decode([int(expl.target[0])])
    assert expl.target_tokens == [token] and expl.labels() == [f"{token!r} ({float(expl.logits[0, expl.target[0]]):.2f})"]
    page = expl.save(tmp_path / "prompt.html").read_text()
    assert f"<title>relevancy: attnlrp: {token!r}" in page.replace("&#x27;", "'") and "class " not in page
    assert "\u010a" not in page and "\u21b5<br>" in page and page.count('class="relevancy-scale"') == 1
    assert expl.text(0) == text and [s for s, _ in expl.spans(0)] == ["the cat sat.", "where does the cat live?"]
    assert sum(score for _, score in expl.words(0)) == pytest.approx(float(expl.scores[0].sum()))
    assert relevancy.load(expl.save(tmp_path / "prompt.json")).labels() == expl.labels()


def test_a_generations_tokens_spell_its_text_and_aggregate(decoder):
    model, tokenizer = decoder
    result = relevancy.explain_generation(model, tokenizer, "the cat sat.\nwhere does", max_new_tokens=4)
    ids = tokenizer("the cat sat.\nwhere does")["input_ids"] + result.generated_ids.tolist()
    assert "".join(result.tokens) == tokenizer.decode(ids)
    last = len(result.generated_ids) - 1
    before = "".join(result.tokens[: result.prompt_length + last])
    assert result.spans(last)[0] == ("the cat sat.", pytest.approx(sum(s for _, s in result.spans(last, [(0, 12)]))))
    assert sum(s for _, s in result.spans(last, [(0, len(before))])) == pytest.approx(float(result.scores[last].sum()))
    assert [w for w, _ in result.words(0)][:3] == ["the", "cat", "sat."]
