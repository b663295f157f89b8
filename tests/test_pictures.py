"""What the saved pictures show: titles that wrap instead of running into their neighbours, and image-text
explanations that name the words a tokenizer gave (cut at each text's end token)."""
from __future__ import annotations

import re

import torch

import relevancy
from relevancy.worlds import load_clip, make_scenes
from relevancy.results.viz import TITLE_CHARACTERS, overlay_figure, region_figure


def title_boxes(figure) -> list:
    renderer = figure.canvas.get_renderer()
    return [axis.title.get_window_extent(renderer) for axis in figure.axes if axis.get_title()]


def test_long_titles_wrap_and_never_overlap():
    titles = ['generic_attention: image 0 / "a small red star left of a blue ring" (12.34)',
              "transformer_attribution image 1, query 5: L-shape (11.03)", "x" * 90]
    for figure in (overlay_figure(torch.rand(3, 8, 8), None, False, titles),
                   region_figure(torch.rand(3, 4), None, None, False, titles)):
        for axis, title in zip(figure.axes, titles):
            lines = axis.get_title().splitlines()
            assert "".join(lines).replace(" ", "") == title.replace(" ", "") and max(map(len, lines)) <= TITLE_CHARACTERS
        boxes = title_boxes(figure)
        assert len(boxes) == 3
        assert all(left.x1 <= right.x0 for left, right in zip(boxes, boxes[1:])), "titles overlap"
        assert all(box.x0 >= 0 and box.x1 <= figure.bbox.width for box in boxes), "a title is clipped at the edge"


def test_image_text_explanations_name_the_tokenizers_words(tmp_path):
    model, tokenizer = load_clip()
    scenes = make_scenes(2, seed=3, objects=2)
    texts = tokenizer.encode(["a red star", "a blue ring"])
    rows = tokenizer.tokens(texts["input_ids"])  # every position, the padding included
    expl = relevancy.explain(model, relevancy.ImageTextBatch.of(scenes.images, texts, tokens=rows), method="generic_attention")
    ends = [row.index(tokenizer.vocab[tokenizer.end_id]) for row in rows]
    assert expl.tokens == [row[: end + 1] for row, end in zip(rows, ends)]
    assert [token for token in expl.tokens[0] if token in ("a", "red", "star")] == ["a", "red", "star"]
    assert expl.save(tmp_path / "pairs.png", scenes.images).read_bytes()[:4] == b"\x89PNG"
    html = expl.save(tmp_path / "pairs.html").read_text(encoding="utf-8")
    assert ">red<" in html and ">ring<" in html and not re.search(r">\[\d+\]<", html)
    unnamed = relevancy.explain(model, (scenes.images, texts), method="generic_attention")  # no strings given: ids
    assert unnamed.tokens == [[f"[{int(t)}]" for t in ids[: end + 1]] for ids, end in zip(texts["input_ids"], ends)]


def test_saved_html_pages_fit_a_phone(tmp_path):
    """Without a viewport tag a phone lays a page out 980 px wide and shrinks it: the coloured words become tiny."""
    from relevancy.zoo.text import encode, load_model

    model, tokenizer = load_model()
    expl = relevancy.explain(model, encode(tokenizer, ["It worked."]), method="raw_attention")
    expl.save(tmp_path / "text.html")
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in (tmp_path / "text.html").read_text(encoding="utf-8")
