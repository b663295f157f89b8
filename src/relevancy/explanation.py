"""The result of `explain()`: raw scores per token stream (`parts`) plus what is needed to show them."""
from __future__ import annotations

import html
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from .parts import ImagePart, LatentRelevance, RegionPart, SpanRelevance, TextPart, excluded_positions, sink_shares



def named_scores(target: torch.Tensor, logits: torch.Tensor, class_names: Sequence[str] | None, kind: str) -> list[str]:
    """A caption per row: the explained class's name (or `kind` and its index) with its logit; "custom target" for a
    row whose target is not a class (index -1: a callable target)."""
    captions = []
    for i, k in enumerate(target.tolist()):
        if k < 0:
            captions.append("custom target")
            continue
        name = class_names[k] if class_names and k < len(class_names) else f"{kind} {k}"
        captions.append(f"{name} ({logits[i, k]:.2f})")
    return captions

class Explanation:
    """What every `explain()` result is, whatever the family: one **part** per token stream (`parts`), the explained
    targets and logits, and the same protocol (`scores`, `save`, `to_json`).

    Shape conventions, for every kind: a row per explained item (an input; CLIP: an image-text pair; DETR: an
    object), raw scores as the method defines them (`signed`: whether negative values carry meaning), 0 at padding.
    An image part's scores are `(rows, h, w)` over the patch grid (`(rows, H, W)` over the pixels for `lrp`), a text
    part's `(rows, T)` over the tokens, a region part's `(rows, N)` over the detector boxes. `scores` is the one
    part's tensor where there is one part, else the parts' tensors by stream name. `target` `(rows,)`: the explained
    class, answer or pair (-1 for a concept or a callable target); `relevance_total` (LRP-based methods): the
    relevance reaching the level each map is read at, for 1 at the explained score, `(rows,)` or `(rows, parts)`.
    `save(path, ...)` writes the family's picture (and HTML beside it where there is text), each file whole or not
    at all; `to_json()` gives the same content as plain JSON values.
    """

    method: str
    signed: bool
    target: torch.Tensor
    logits: torch.Tensor
    relevance_total: torch.Tensor | None

    @property
    def parts(self) -> dict[str, ImagePart | TextPart | RegionPart]:
        raise NotImplementedError

    def save(self, path: str | Path, images: object = None) -> Path:
        raise NotImplementedError

    def part_scores(self) -> dict[str, torch.Tensor]:
        """Each part's scores by stream name (what `scores` is for kinds with several parts)."""
        return {name: part.scores for name, part in self.parts.items()}

    def to_json(self) -> dict:
        """The explanation as plain JSON values: method, signedness, targets, logits, each part's scores (and the
        relevance totals of the LRP-based methods)."""
        total = self.relevance_total
        return {
            "kind": type(self).__name__,
            "method": self.method,
            "signed": self.signed,
            "target": self.target.tolist(),
            "logits": self.logits.tolist(),
            "parts": {name: scores.tolist() for name, scores in self.part_scores().items()},
            "relevance_total": None if total is None else total.tolist(),
        }


@dataclass
class ImageExplanation(Explanation):
    """Relevance of each patch (`scores`, `(B, h, w)`) or pixel (`(B, H, W)`, method `lrp`) for `target`.

    `target` holds the explained class per image (-1 where a `concept` or a callable target was explained).
    `relevance_total` (LRP-based methods only, `(B,)`): see `Explanation`; the paper's rules conserve it (1),
    see docs/methods.md. `parts` maps each token stream's name to its part (here one, `"image"`).
    """

    scores: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    input_size: tuple[int, int]
    class_names: list[str] | None = None
    mean: Sequence[float] = (0.0, 0.0, 0.0)
    std: Sequence[float] = (1.0, 1.0, 1.0)
    concept: object | None = field(default=None, repr=False)  # the relevancy.Concept explained, if any
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        return {"image": ImagePart(self.scores, self.signed, self.input_size, self.mean, self.std)}

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the scores upsampled bilinearly to the input size (raw values)."""
        return self.parts["image"].heatmap()

    def labels(self) -> list[str]:
        """A caption per input: the concept, or the class name (or index) with its logit."""
        if self.concept is not None:
            return ["concept"] * len(self.target)
        return named_scores(self.target, self.logits, self.class_names, "class")

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised input images back to `[0, 1]` pictures `(B, H, W, 3)`."""
        return self.parts["image"].pixels(images)

    def save(self, path: str | Path, images: torch.Tensor | None = None) -> Path:
        """Write an overlay PNG (one panel per image); the file appears whole or not at all."""
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.labels()])


def save_overlays(part: ImagePart, path: str | Path, images: torch.Tensor | None, captions: list[str]) -> Path:
    """An image part as an overlay PNG, one panel per row, written atomically."""
    from .viz import overlay_figure, save_figure

    pictures = part.pixels(images) if images is not None else None
    return save_figure(overlay_figure(part.heatmap().cpu(), pictures, part.signed, captions), path)


def texts_html(part: TextPart, captions: list[str], by_word: bool = True, special: bool = False) -> str:
    """An HTML fragment: one paragraph per text under its caption, each word on its colour."""
    blocks = [
        f'<div style="margin:0.6em 0"><div style="font-weight:bold">{html.escape(caption)}</div>'
        f'<div style="line-height:1.9">{part.html_line(i, by_word, special)}</div></div>'
        for i, caption in enumerate(captions)
    ]
    return (
        '<div style="font-family:sans-serif">' + "".join(blocks)
        + f'<div style="color:#666;font-size:small">{part.legend()}; hover a word for its score</div></div>'
    )


def html_page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<title>relevancy: {html.escape(title)}</title></head>'
        f"<body>{body}</body></html>\n"
    )


def show_texts(part: TextPart, captions: list[str], by_word: bool = True, special: bool = False) -> None:
    """Print each text as coloured words (a terminal through rich; HTML in a notebook)."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        from IPython.display import HTML, display

        display(HTML(texts_html(part, captions, by_word, special)))
        return
    from .extras import require

    console = require("rich.console", extra="text").Console()
    for i, caption in enumerate(captions):
        console.print(part.rich_line(i, caption, by_word, special))


class ColouredTexts:
    """The coloured-text views of an explanation with a text part: each text under its caption (the method and
    `labels()`), in a terminal or notebook (`show`) or as HTML (`to_html`)."""

    def captions(self) -> list[str]:
        return [f"{self.method}: {caption}" for caption in self.labels()]

    def show(self, by_word: bool = True, special: bool = False) -> None:
        """Print each text as coloured words (a terminal through rich; HTML in a notebook)."""
        show_texts(self.parts["text"], self.captions(), by_word, special)

    def to_html(self, by_word: bool = True, special: bool = False) -> str:
        """An HTML fragment: one paragraph per text, each word on its colour, its score in the tooltip."""
        return texts_html(self.parts["text"], self.captions(), by_word, special)

    def _repr_html_(self) -> str:
        return self.to_html()


@dataclass
class TextExplanation(ColouredTexts, ImageExplanation):
    """Relevance of each token (`scores`, `(B, T)`, 0 at padding) for `target`.

    `tokens[i]` are the token strings of text `i` (its real tokens, [CLS] and [SEP] included), in the order of
    `scores[i]`; `words(i)` merges word pieces into words by summing their scores.
    """

    input_size: tuple[int, ...] = ()
    tokens: list[list[str]] | None = None
    word_ids: list[list[int | None]] | None = field(default=None, repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        return {"text": TextPart(self.scores, self.signed, self.tokens, self.word_ids, self.attention_mask)}

    def heatmap(self) -> torch.Tensor:
        """The token scores themselves, `(B, T)` (nothing to upsample)."""
        return self.scores

    def token_scores(self, index: int = 0) -> list[tuple[str, float]]:
        """`(token, score)` for the real tokens of text `index`."""
        return self.parts["text"].token_scores(index)

    def words(self, index: int = 0, special: bool = False) -> list[tuple[str, float]]:
        """`(word, score)` of text `index`, word pieces merged (see `TextPart.words`)."""
        return self.parts["text"].words(index, special)

    def save(self, path: str | Path, images: object = None, by_word: bool = True, special: bool = False) -> Path:
        """Write an HTML page of the coloured texts; the file appears whole or not at all."""
        from .files import write_atomic

        return write_atomic(Path(path), html_page(self.method, self.to_html(by_word, special)))


@dataclass
class DecoderExplanation(TextExplanation):
    """A decoder language model's explanation: relevance of each prompt token (`scores` `(B, T)`) for the explained
    next token, answer span or function of the logits (`target`: its first token per row, -1 for a callable).

    `span` (a `SpanRelevance`, span targets only): the span's tokens and the relevance of its own earlier tokens,
    reported apart from the prompt's; `latent` (a `LatentRelevance`, `latent=` asked): relevance per layer, neuron
    and attention head; `sink_share` `(B, 2)`: the share of positive relevance on each row's first and last shown
    token. `excluding(...)` (or `explain(..., exclude=...)`) leaves tokens out of the map, its colour scale and its
    rendering: `excluded` marks them and `relevance_total_kept` is `relevance_total` without them.
    """

    span: SpanRelevance | None = field(default=None, repr=False)
    latent: LatentRelevance | None = field(default=None, repr=False)
    excluded: torch.Tensor | None = field(default=None, repr=False)
    relevance_total_kept: torch.Tensor | None = field(default=None, repr=False)

    @property
    def sink_share(self) -> torch.Tensor:
        """`(B, 2)`: per row the share of the positive relevance on its first and on its last shown token."""
        part = self.parts["text"]
        return sink_shares(part.scores, part.attention_mask if part.attention_mask is not None else torch.ones_like(part.scores))

    def excluding(self, exclude: object) -> "DecoderExplanation":
        """The same explanation with tokens left out (see `parts.excluded_positions`: "first", "last", "bos",
        "special", "template", positions among each row's real tokens, or a `(B, T)` bool tensor): their scores set
        to 0 and masked, so maps, colour scales, words and `sink_share` skip them; `relevance_total` stays the
        total with them and `relevance_total_kept` is the total without."""
        mask = self.attention_mask if self.attention_mask is not None else torch.ones(self.scores.shape, dtype=torch.long)
        dropped = excluded_positions(self.tokens or [[] for _ in range(len(mask))], mask, exclude)
        if self.excluded is not None:
            dropped = dropped | self.excluded
        kept = mask.bool().cpu() & ~dropped
        tokens = None if self.tokens is None else [[t for t, drop in zip(row, dropped[i][mask[i].bool().cpu()].tolist()) if not drop]
                                                   for i, row in enumerate(self.tokens)]
        word_ids = None if self.word_ids is None else [[w for w, drop in zip(row, dropped[i][mask[i].bool().cpu()].tolist()) if not drop]
                                                       for i, row in enumerate(self.word_ids)]
        scores = self.scores * kept.to(self.scores.device)
        total = self.relevance_total
        kept_total = None
        if total is not None:
            explained = self.scores.sum(1) + (0 if self.span is None else self.span.scores.sum(1) + self.span.foil_scores.sum(1))
            share = torch.where(explained != 0, (explained - (self.scores - scores).sum(1)) / explained, torch.zeros_like(explained))
            kept_total = total * share.to(total.device)
        latent = self.latent
        if latent is not None and latent.width:
            columns = torch.cat([kept, torch.ones(len(kept), latent.width - kept.shape[1], dtype=torch.bool)], 1)
            latent = latent.masked(columns)
        return replace(self, scores=scores, attention_mask=kept.long(), tokens=tokens, word_ids=word_ids, excluded=dropped,
                       relevance_total_kept=kept_total, latent=latent)

    def to_html(self, by_word: bool = True, special: bool = False) -> str:
        """The coloured prompts, then per row the span's tokens and the latent heat maps where there are."""
        out = super().to_html(by_word, special)
        for row in range(len(self.scores)):
            if self.span is not None:
                length = int((self.span.ids[row] >= 0).sum())
                shown = TextPart(self.span.scores[row:row + 1, :length], self.signed,
                                 None if self.span.tokens is None else [self.span.tokens[row][:length]])
                out += texts_html(shown, [f"row {row}: the answer span's own tokens (each read to predict the next)"], by_word=False)
            if self.latent is not None:
                out += self.latent.html(row, self._column_labels(row))
        return out

    def _column_labels(self, row: int) -> list[str]:
        """The token text of each column of row `row`'s latent maps ("" at padding and excluded tokens)."""
        mask = self.attention_mask[row].bool().tolist() if self.attention_mask is not None else [True] * self.scores.shape[1]
        names = iter(self.tokens[row] if self.tokens else [])
        labels = [next(names, "") if keep else "" for keep in mask]
        if self.span is not None:
            for ids, texts in ((self.span.ids, self.span.tokens), (self.span.foil_ids, None)):
                width = ids.shape[1]
                labels += ((texts[row] if texts else []) + [""] * width)[:width]
        return labels

    def to_json(self) -> dict:
        """The protocol's JSON plus the span, the latent relevance, the excluded tokens and the sink shares."""
        return {**super().to_json(), "tokens": self.tokens, "span": None if self.span is None else self.span.to_json(),
                "latent": None if self.latent is None else self.latent.to_json(),
                "excluded": None if self.excluded is None else self.excluded.tolist(),
                "relevance_total_kept": None if self.relevance_total_kept is None else self.relevance_total_kept.tolist(),
                "sink_share": self.sink_share.tolist()}


@dataclass
class GenerationExplanation(Explanation):
    """What a decoder language model read to write each token of a generation (`relevancy.explain_generation`).

    `scores` `(G, T + G)`: row `g` is the relevance of every token before generated token `g` (the prompt's `T`
    and the `g` generated before it) for that token's logit, raw and signed, 0 at the token itself and after it.
    `tokens` are the `T + G` tokens' texts (a character whose bytes span several tokens written at the token that
    completes it, the ones before it empty), `prompt_length` is `T`, `generated_ids` (= `target`) the `G` generated
    token ids, `text` the generated text, `logits` `(G, 1)` each explained logit, and
    `relevance_total` (LRP methods, `(G,)`) the share of each logit that reaches the token embeddings.
    """

    scores: torch.Tensor
    generated_ids: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    tokens: list[str]
    prompt_length: int
    text: str
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    target = property(lambda self: self.generated_ids)

    @property
    def parts(self) -> dict[str, TextPart]:
        """One text part, a row per generated token over the tokens before it (the rest masked)."""
        length = len(self.tokens)
        before = torch.arange(length)[None, :] < torch.arange(self.prompt_length, length)[:, None]
        return {"text": TextPart(self.scores, self.signed, [self.tokens] * len(self.generated_ids), None, before)}

    @property
    def sink_share(self) -> torch.Tensor:
        """`(G, 2)`: per generated token the share of its positive relevance on the first token and on the token
        just before it (the last it read)."""
        part = self.parts["text"]
        return sink_shares(part.scores, part.attention_mask)

    def token_scores(self, index: int = 0) -> list[tuple[str, float]]:
        """`(token, score)` of every token before generated token `index`."""
        return self.parts["text"].token_scores(index)

    def labels(self) -> list[str]:
        """A caption per generated token: its text and its logit."""
        generated = self.tokens[self.prompt_length:]
        return [f"{token!r} ({float(logit):.2f})" for token, logit in zip(generated, self.logits[:, 0])]

    def to_json(self) -> dict:
        """The protocol's JSON plus the tokens, the prompt length and the generated text."""
        return {**super().to_json(), "tokens": self.tokens, "prompt_length": self.prompt_length, "text": self.text}

    def show(self) -> None:
        """Print each generated token's row, the earlier tokens on their colours (a terminal, through rich)."""
        from .generation_page import show_rows

        show_rows(self.parts["text"], self.labels())

    def to_html(self) -> str:
        """An HTML fragment: the prompt and the generation; choosing a generated token colours what it read."""
        from .generation_page import generation_html

        return generation_html(self.to_json())

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str | Path, images: object = None) -> Path:
        """Write the HTML page (plain inline script, nothing loaded from the internet) to `path` (.html or .htm);
        whole or not at all."""
        from .files import check_html_path, write_atomic

        return write_atomic(check_html_path(path, "a generation"), html_page(f"{self.method}: generation", self.to_html()))


@dataclass
class PairExplanation(Explanation):
    """Relevance for the logit of each image-text pair: an image part and a text part (`parts`).

    `parts["image"].scores` `(P, h, w)`: the image's [CLS] row over the patches, raw; `parts["text"].scores`
    `(P, T)`: the end-of-text token's row over every position, raw (0 after it). `pairs[p]` = (image, text)
    indices; `logits` `(P, 1)` the explained logits; `readout[p]` the end-of-text position of pair `p`'s text.
    `relevance_total` (LRP-based methods, `(P, 2)`): per pair the relevance reaching each tower's input (image,
    text); each tower is explained with a relevance of 1 at the logit, which the rules conserve.
    """

    image_scores: torch.Tensor
    text_scores: torch.Tensor
    pairs: torch.Tensor
    readout: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    input_size: tuple[int, int]
    tokens: list[list[str]] | None = None
    mean: Sequence[float] = (0.0, 0.0, 0.0)
    std: Sequence[float] = (1.0, 1.0, 1.0)
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    scores = property(lambda self: self.part_scores())

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        valid = torch.arange(self.text_scores.shape[1]) <= self.readout[:, None]
        return {
            "image": ImagePart(self.image_scores, self.signed, self.input_size, self.mean, self.std),
            "text": TextPart(self.text_scores, self.signed, self.tokens, None, valid),
        }

    def heatmap(self) -> torch.Tensor:
        """`(P, H, W)`: the image part upsampled to the input size (raw values)."""
        return self.parts["image"].heatmap()

    def text_relevance(self) -> list[torch.Tensor]:
        """Per pair, the authors' normalised text view: the scores between the start and end tokens, divided by
        their sum (`show_heatmap_on_text`)."""
        views = []
        for row, end in zip(self.text_scores, self.readout.tolist()):
            inner = row[1:end]
            views.append(inner / inner.sum())
        return views

    def captions(self) -> list[str]:
        """A caption per pair: its text (the words when known) and the logit."""
        captions = []
        for p, (image, text) in enumerate(self.pairs.tolist()):
            words = " ".join(w for w, _ in self.parts["text"].words(p)) if self.tokens else f"text {text}"
            captions.append(f"image {image} / \"{words}\" ({self.logits[p, 0]:.2f})")
        return captions

    def show(self, by_word: bool = True, special: bool = False) -> None:
        """Print each pair's text as coloured words (a terminal through rich; HTML in a notebook)."""
        show_texts(self.parts["text"], [f"{self.method}: {c}" for c in self.captions()], by_word, special)

    def to_html(self, by_word: bool = True, special: bool = False) -> str:
        return texts_html(self.parts["text"], [f"{self.method}: {c}" for c in self.captions()], by_word, special)

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str | Path, images: torch.Tensor | None = None) -> Path:
        """Write the image part as an overlay PNG (one panel per pair; `images` are the pairs' images), and the
        text part as HTML beside it (same name, `.html`); each file appears whole or not at all."""
        from .files import write_atomic

        path = Path(path)
        written = save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.captions()])
        write_atomic(path.with_suffix(".html"), html_page(self.method, self.to_html()))
        return written


@dataclass
class RegionTextExplanation(ColouredTexts, Explanation):
    """Relevance of a question's tokens and an image's regions for `target` (LXMERT, VisualBERT).

    `parts["text"].scores` `(B, T)`: per token of the question, raw, 0 at padding; `parts["image"].scores` `(B, N)`:
    per region, raw, 0 at padded regions. `target` holds the explained answer per input (-1 for a callable target),
    `logits` `(B, K)` the model's answer scores. `relevance_total` (LRP-based methods, `(B, 2)`): the relevance
    reaching the question's and the regions' input tokens.
    """

    text_scores: torch.Tensor
    region_scores: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    tokens: list[list[str]] | None = None
    attention_mask: torch.Tensor | None = field(default=None, repr=False)
    region_mask: torch.Tensor | None = field(default=None, repr=False)
    boxes: torch.Tensor | None = field(default=None, repr=False)
    class_names: list[str] | None = None
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    scores = property(lambda self: self.part_scores())

    @property
    def parts(self) -> dict[str, TextPart | RegionPart]:
        return {
            "text": TextPart(self.text_scores, self.signed, self.tokens, None, self.attention_mask),
            "image": RegionPart(self.region_scores, self.signed, self.region_mask, self.boxes),
        }

    def labels(self) -> list[str]:
        """A caption per input: the explained answer's name (or index) with its score."""
        return named_scores(self.target, self.logits, self.class_names, "answer")

    def save(self, path: str | Path, images: Sequence | None = None) -> Path:
        """A PNG of the regions (each box filled by its score over `images`, one picture per input as an
        (H, W, 3) array; without boxes, a bar per region) and the coloured questions as HTML beside it (same name,
        `.html`); each file appears whole or not at all."""
        from .files import write_atomic
        from .viz import region_figure, save_figure

        path = Path(path)
        part = self.parts["image"]
        written = save_figure(region_figure(part.scores.cpu(), part.boxes, images, self.signed, self.captions()), path)
        write_atomic(path.with_suffix(".html"), html_page(self.method, self.to_html()))
        return written


@dataclass
class DetectionExplanation(ImageExplanation):
    """`scores` (R, h, w): the relevance of every image token for row r's object, query `query[r]` of image
    `image[r]`, class `target[r]`; `logits` (R, C + 1) are that query's class logits (the last: "no object").
    `relevance_total` (LRP-based methods, `(R, 2)`): the relevance reaching the encoder's input tokens and the
    decoder's zero queries; image + 2 x queries = 1 (see `families.detr.rules`)."""

    image: torch.Tensor = field(default=None, repr=False)
    query: torch.Tensor = field(default=None, repr=False)

    def labels(self) -> list[str]:
        """A caption per object: image, query, class name and its logit."""
        names = self.class_names or []
        return [
            f"image {i}, query {q}: {names[k] if k < len(names) else f'class {k}'} ({self.logits[r, k]:.2f})"
            for r, (i, q, k) in enumerate(zip(self.image.tolist(), self.query.tolist(), self.target.tolist()))
        ]

    def save(self, path: str | Path, images=None, boxes: torch.Tensor | None = None) -> Path:
        """An overlay PNG, one panel per object: `images` the explained images, normalised (B, 3, H, W) as given to
        explain or as pictures (B, H, W, 3) uint8 (each row is drawn over its own image); `boxes` (R, 4) x0, y0, x1,
        y1 in pixels (e.g. `detect`'s)."""
        from .viz import overlay_figure, save_figure

        part = self.parts["image"]
        pictures = None
        if images is not None:
            images = torch.as_tensor(images)
            if images.dtype == torch.uint8:
                pictures = images[self.image.cpu()].float() / 255
            else:
                pictures = part.pixels(images[self.image])
        titles = [f"{self.method}\n{label}" for label in self.labels()]
        return save_figure(overlay_figure(part.heatmap().cpu(), pictures, part.signed, titles, boxes), path)
