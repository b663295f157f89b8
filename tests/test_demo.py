"""`relevancy demo` end to end on the shipped model, in a small setting; the page's panels, legend and notes."""
from __future__ import annotations

from html.parser import HTMLParser

import numpy as np
import torch

from relevancy.apps.demos import shapes as demo
from relevancy.apps.cli import main
from relevancy.results.viz import ALL_ZERO_NOTE, overlay_pixels
from relevancy.families.base import IMAGE_ENCODER_METHODS

METHODS = ["raw_attention", "cdam", "transformer_attribution"]


class Figures(HTMLParser):
    """The page's figures: image source, title (the caption's bold text), caption text, and whether a colour bar
    is drawn under it."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self.inside = False
        self.in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures.append({"src": None, "title": "", "text": "", "bar": False})
            self.inside = True
        elif self.inside and tag == "img":
            self.figures[-1]["src"] = attrs["src"]
        elif self.inside and tag == "div" and attrs.get("class") == "bar":
            self.figures[-1]["bar"] = True
        elif self.inside and tag == "b":
            self.in_title = True

    def handle_endtag(self, tag):
        if tag == "figure":
            self.inside = False
        elif tag == "b":
            self.in_title = False

    def handle_data(self, data):
        if self.inside:
            self.figures[-1]["text"] += data
            if self.in_title:
                self.figures[-1]["title"] += data


def read_figures(page: str) -> list[dict]:
    parser = Figures()
    parser.feed(page)
    return parser.figures


def test_demo_writes_page_and_panels(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--singles", "1", "--pairs", "1", "--methods", ",".join(METHODS)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["images", "index.html"]
    page = (out / "index.html").read_text()
    figures = read_figures(page)
    # one single-object row and two pair rows (one per object), each: scene, object mask, one map per method
    assert len(figures) == 3 * (2 + len(METHODS))
    for figure in figures:
        assert (out / figure["src"]).is_file() and (out / figure["src"]).stat().st_size > 0
    assert {p.name for p in (out / "images").iterdir()} == {f["src"].split("/")[1] for f in figures}
    for method in METHODS:
        panels = [f for f in figures if f["title"] == method]
        assert len(panels) == 3 and all(f["bar"] for f in panels)  # titled in HTML, each with its colour scale
    assert "red</span>: evidence for the class" in page and "blue</span>: evidence against" in page
    assert "Why blue on the explained object?" in page  # cdam is signed and on the page
    assert page.count("Explaining ") == 3 and "Two-object scene 0" in page
    assert ALL_ZERO_NOTE not in page
    assert "open" in capsys.readouterr().out


def test_demo_notes_all_zero_maps(tmp_path, monkeypatch):
    """A map without any relevance gets the note instead of a colour bar; the picture stays plain grey."""
    explain_all = demo._explain_all

    def zero_cdam(model, images, targets, methods):
        results = explain_all(model, images, targets, methods)
        results["cdam"].scores = torch.zeros_like(results["cdam"].scores)
        return results

    monkeypatch.setattr(demo, "_explain_all", zero_cdam)
    index = demo.run_demo(tmp_path / "demo", singles=1, pairs=0, methods=["rollout", "cdam"])
    figures = read_figures(index.read_text())
    (cdam,) = [f for f in figures if f["title"] == "cdam"]
    (rollout,) = [f for f in figures if f["title"] == "rollout"]
    assert ALL_ZERO_NOTE in cdam["text"] and not cdam["bar"]
    assert ALL_ZERO_NOTE not in rollout["text"] and rollout["bar"]
    assert "Why blue" in index.read_text()


def test_overlay_of_an_all_zero_map_is_the_grey_picture():
    picture = torch.rand(4, 4, 3)
    pixels = overlay_pixels(torch.zeros(4, 4), signed=True, picture=picture, scale=2)
    grey = (picture.mean(-1).numpy() * 255).round().astype(np.uint8)
    assert pixels.shape == (8, 8, 3)
    assert (pixels[::2, ::2, 0] == grey).all() and (pixels[..., 0] == pixels[..., 2]).all()
    coloured = overlay_pixels(torch.linspace(-1, 1, 16).view(4, 4), signed=True, picture=picture)
    assert (coloured[..., 0] != coloured[..., 2]).any()  # red and blue where the map is signed


def test_demo_rejects_unknown_methods(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--methods", "rollout,saliency"]) == 2
    assert "unknown method 'saliency'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_page_lists_every_method_by_default(tmp_path):
    """`relevancy demo` with all methods: every registered method has a titled panel per explained object."""
    index = demo.run_demo(tmp_path / "demo", singles=1, pairs=0)
    titles = [f["title"] for f in read_figures(index.read_text())]
    assert titles == ["scene", "object mask"] + list(IMAGE_ENCODER_METHODS)
