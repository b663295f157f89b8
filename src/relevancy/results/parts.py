"""One part of an explanation per token stream: an image grid part and a text part.

A part holds the raw scores of one stream and knows how to show them (`ImagePart.heatmap()` upsamples to pixels;
`TextPart` merges word pieces and colours tokens). Explanations of one-stream models have one part, image-text
models one of each (`Explanation.parts`).
"""
from __future__ import annotations

import html
import re
import warnings
from numbers import Integral
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .token_text import token_texts

#: sentence ends: after `.`, `!` or `?` and white space, or at a line break
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


def shown(text: str) -> str:
    """HTML of a token's text with its line breaks visible: ↵ and a break."""
    return html.escape(text).replace("\n", "\u21b5<br>").replace("\t", "\u21e5")


def span_shares(positions: list[tuple[int, int]], texts: list[str], start: int, end: int) -> list[float]:
    """Each token's share in the characters `start..end`: the part of its non-white characters that lies inside
    (all its characters where it has only white space). A token across the span's boundary counts in part, so
    spans that cut a text in pieces share every token's relevance out exactly once."""
    shares = []
    for (first, last), text in zip(positions, texts):
        counted = [first + k for k, c in enumerate(text) if not c.isspace()] or list(range(first, last))
        shares.append(sum(start <= k < end for k in counted) / len(counted) if counted else 0.0)
    return shares


SPECIAL_TOKEN = re.compile(r"^(\[[A-Z]+\]|<s>|</s>|<pad>|<unk>|<mask>|<cls>|<sep>|<start_of_text>|<end_of_text>|<start>|<end>|<\|startoftext\|>|<\|endoftext\|>)$")
SIGNED_PALETTE = "RdBu_r"  # negative blue, positive red, white at zero (the image side's colormap)
UNSIGNED_PALETTE = "Reds"  # white to red: the text stays readable


@dataclass
class ImagePart:
    """Scores over an image: a patch grid `(B, h, w)` or pixels `(B, H, W)`, raw, for images of `input_size`."""

    scores: torch.Tensor
    signed: bool
    input_size: tuple[int, int]
    mean: Sequence[float] = (0.0, 0.0, 0.0)
    std: Sequence[float] = (1.0, 1.0, 1.0)

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the scores upsampled bilinearly to the input size (raw values)."""
        if tuple(self.scores.shape[-2:]) == tuple(self.input_size):
            return self.scores
        return F.interpolate(self.scores[:, None].float(), size=self.input_size, mode="bilinear", align_corners=False)[:, 0]

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised input images back to `[0, 1]` pictures `(B, H, W, 3)`."""
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return (images.detach().float().cpu() * std + mean).clamp(0, 1).permute(0, 2, 3, 1)


def checked_row(index: object, rows: int) -> int:
    """`index` as a row of a result of `rows` rows (an int or numpy's, negative from the end); a one-line error naming
    the rows there are otherwise (torch's own speaks of dimension 0)."""
    if isinstance(index, bool) or not isinstance(index, Integral):
        raise TypeError(f"index must be an int, a row of the result (0..{rows - 1}), got {index!r} ({type(index).__name__})")
    if not -rows <= index < rows:
        raise IndexError(f"index {index} is out of range: the result has {rows} row{'s' if rows != 1 else ''}, 0..{rows - 1} "
                         f"(or -{rows}..-1 from the end)")
    return int(index)


def attaches(unit: str) -> bool:
    """Punctuation that follows the previous word without a space (as written)."""
    return bool(unit) and unit in {".", ",", "!", "?", ";", ":", ")", "'", "%"}


def joins(before: str, unit: str) -> bool:
    """Whether `unit` follows `before` without a space between: punctuation, a unit that brings its own white space
    (a byte-level token), or one after a line break."""
    return attaches(unit) or unit[:1].isspace() or before.endswith("\n")


@dataclass
class TextPart:
    """Scores over the tokens of each text, `(B, T)` raw (0 at padding), with the token strings to show them.

    `tokens[i]` are the strings of text `i`'s real tokens in the order of `scores[i]`; `word_ids[i]` (when the
    tokenizer gave them) say which word each token belongs to; `attention_mask` marks the real tokens.
    """

    scores: torch.Tensor
    signed: bool
    tokens: list[list[str]] | None = None
    word_ids: list[list[int | None]] | None = field(default=None, repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)

    def token_scores(self, index: int = 0) -> list[tuple[str, float]]:
        """`(token, score)` for the real tokens of text `index`."""
        index = checked_row(index, len(self.scores))
        row = self.scores[index]
        if self.attention_mask is not None:
            row = row[self.attention_mask[index].bool().to(row.device)]
        tokens = self.tokens[index] if self.tokens else [f"[{k}]" for k in range(len(row))]
        return list(zip(tokens, row.tolist()))

    def texts(self, index: int = 0) -> list[str]:
        """The text each real token of text `index` stands for (`token_texts`: byte-level pieces and byte-fallback
        tokens decoded, a character whose bytes span tokens written at the token that completes it and "" before
        it, an unfinished one at the end as U+FFFD), special tokens as written."""
        return token_texts([token for token, _ in self.token_scores(index)])

    def text(self, index: int = 0) -> str:
        """The text the real tokens of text `index` spell, joined (the prompt itself for byte-level BPE and
        SentencePiece tokenizers; WordPiece tokens are joined without spaces): what `spans` counts characters in."""
        return "".join(self.texts(index))

    def whole_tokens(self, index: int = 0) -> list[tuple[int, str, str, float]]:
        """`(position, token, text, score)` of each real token of text `index` that has text: a token of none (the
        first bytes of a character that a later token completes) is left out and its score added to that token's,
        so every view that sums or shows scores counts it with its character."""
        out: list[tuple[int, str, str, float]] = []
        carried = 0.0
        for k, ((token, score), text) in enumerate(zip(self.token_scores(index), self.texts(index))):
            if not text:
                carried += score
                continue
            out.append((k, token, text, score + carried))
            carried = 0.0
        return out

    def words(self, index: int = 0, special: bool = False) -> list[tuple[str, float]]:
        """`(word, score)` of text `index`: word pieces merged, their scores summed: by the tokenizer's word ids where
        it gave them, else at white space where the tokens carry it (byte-level BPE, SentencePiece, decoded text: a
        token starting with a space starts a word, as does a token of spaces alone (SentencePiece's lone ▁ before
        byte-fallback tokens) with the token after it; a token of other white space, a line break, and a character
        left unfinished (U+FFFD: a generation's row that stops inside it) are units of their own), else by `##`
        continuations (WordPiece). Words show the text they stand for (`texts`: "😀", not "ðŁĺĢ"), a
        character's byte tokens counted in its word. Special tokens ([CLS], [SEP], ...) are left out unless
        `special=True`."""
        units = self.whole_tokens(index)
        ids = self.word_ids[index] if self.word_ids else None
        spaced = ids is None and any(text[:1].isspace() for _, _, text, _ in units)
        merged: list[list] = []
        previous = object()
        for k, token, text, score in units:
            is_special = ids[k] is None if ids is not None else bool(SPECIAL_TOKEN.match(token))
            if is_special:
                if special:
                    merged.append([token, score])
                previous = object()
                continue
            if spaced:  # previous: True in a word, " " after spaces alone, False after a unit nothing continues
                unfinished = text.lstrip(" ") == "\ufffd"
                continues = bool(merged) and (previous is True and not unfinished or previous == " ") and not text[:1].isspace()
                previous = " " if text.strip(" ") == "" else not (text.isspace() or unfinished)
            else:
                continues = ids[k] == previous if ids is not None else token.startswith("##") and bool(merged)
                previous = ids[k] if ids is not None else None
            piece = text[2:] if token.startswith("##") and not spaced else text
            if continues and merged:
                merged[-1][0] += piece
                merged[-1][1] += score
            else:
                merged.append([piece.removesuffix("</w>"), score])
        return [(word if word.isspace() else word.lstrip(" "), score) for word, score in merged]

    def spans(self, index: int = 0, spans: str | Sequence[tuple[int, int]] = "sentences") -> list[tuple[str, float]]:
        """`(text, score)` per span of text `index` (`text(index)`): "sentences" (split after `.`, `!`, `?` and at
        line breaks), or `(start, end)` character spans you give. A span's score sums its tokens' scores; a token
        across a span's boundary counts with the share of its non-white characters inside (`span_shares`), so
        spans that cut the text in pieces share the row's relevance out exactly once; a token of no text (bytes of a
        character that a later token completes) counts with that token (`whole_tokens`)."""
        units = self.whole_tokens(index)
        texts = [text for _, _, text, _ in units]
        text = "".join(texts)
        ends = [sum(len(t) for t in texts[: k + 1]) for k in range(len(texts))]
        positions = list(zip([0, *ends[:-1]], ends))
        if isinstance(spans, (torch.Tensor, np.ndarray)):
            spans = spans.tolist()  # an (S, 2) array of spans
        if isinstance(spans, str):
            if spans != "sentences":
                raise ValueError(f"spans must be 'sentences' or a list of (start, end) character spans, got {spans!r}")
            cuts = [0, *(k for m in SENTENCE_BREAK.finditer(text) for k in m.span()), len(text)]
            spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if text[a:b].strip()]
        checked = []
        for span in spans:
            if (not isinstance(span, (tuple, list)) or len(span) != 2 or not all(isinstance(v, Integral) and not isinstance(v, bool) for v in span)
                    or not 0 <= span[0] < span[1] <= len(text)):
                raise ValueError(f"each span is (start, end) with 0 <= start < end <= {len(text)} (the characters of text({index})), got {span!r}")
            checked.append((int(span[0]), int(span[1])))  # numpy's integers too
        scores = [score for _, _, _, score in units]
        return [(text[a:b], sum(share * score for share, score in zip(span_shares(positions, texts, a, b), scores)))
                for a, b in checked]

    def units(self, index: int, by_word: bool = True, special: bool = False) -> list[tuple[str, float]]:
        """What is shown of text `index`: words (or the tokens' texts, a character's byte tokens counted at the token
        that completes it), special tokens left out unless asked for."""
        if by_word:
            return self.words(index, special=special)
        return [(text, score) for _, token, text, score in self.whole_tokens(index) if special or not SPECIAL_TOKEN.match(token)]

    def colours(self, values: list[float]) -> list[tuple[str, str]]:
        """(background, text colour) per value: diverging around 0 for signed maps, sequential otherwise."""
        from matplotlib import colormaps
        from matplotlib.colors import to_hex

        palette = colormaps[SIGNED_PALETTE if self.signed else UNSIGNED_PALETTE]
        bound = max((abs(v) for v in values), default=0.0) or 1.0
        out = []
        for v in values:
            position = 0.5 + 0.5 * v / bound if self.signed else max(v, 0.0) / bound
            red, green, blue, _ = palette(min(max(position, 0.0), 1.0))
            light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.55
            out.append((to_hex((red, green, blue)), "#000000" if light else "#ffffff"))
        return out

    def html_line(self, index: int, by_word: bool = True, special: bool = False) -> str:
        """Text `index` as HTML spans, each word on its colour, its score in the tooltip."""
        units = self.units(index, by_word, special)
        text = ""
        for k, ((unit, score), (background, colour)) in enumerate(zip(units, self.colours([s for _, s in units]))):
            text += ("" if k == 0 or joins(units[k - 1][0], unit) else " ") + (
                f'<span title="{score:.4g}" style="background:{background};color:{colour};padding:1px 2px;'
                f'border-radius:3px">{shown(unit)}</span>'
            )
        return text

    def scale_html(self, index: int, by_word: bool = True, special: bool = False) -> str:
        """The colour scale of text `index`'s line (`html_line`): the palette from its lowest to its highest colour,
        labelled with the scores they stand for (each line is coloured to its own largest magnitude)."""
        values = [score for _, score in self.units(index, by_word, special)]
        bound = max((abs(v) for v in values), default=0.0) or 1.0
        low = -bound if self.signed else 0.0
        stops = [low + (bound - low) * k / 10 for k in range(11)]
        gradient = ", ".join(background for background, _ in self.colours([*stops, bound]))
        return (f'<div class="relevancy-scale" style="display:flex;align-items:center;gap:6px;font-size:small;color:#444">'
                f'<span>{low:.3g}</span><span style="display:inline-block;width:160px;height:10px;border:1px solid #ccc;'
                f'background:linear-gradient(to right, {gradient})"></span><span>{bound:.3g}</span>'
                f'<span>{html.escape(self.legend())}</span></div>')

    def rich_line(self, index: int, heading: str, by_word: bool = True, special: bool = False):
        """Text `index` as a `rich.text.Text` line under `heading` (needs the `text` extra)."""
        from ..core.extras import require

        Text = require("rich.text", extra="text").Text
        units = self.units(index, by_word, special)
        line = Text(f"{heading}\n", style="bold")
        for k, ((unit, _), (background, colour)) in enumerate(zip(units, self.colours([s for _, s in units]))):
            if k and not joins(units[k - 1][0], unit):
                line.append(" ")
            line.append(unit, style=f"{colour} on {background}")
        return line

    def legend(self) -> str:
        return "blue: against, red: for (white: 0)" if self.signed else "darker red: more relevant"


@dataclass
class RegionPart:
    """Scores over the image regions (detector boxes) of each input, `(B, N)` raw, 0 at padded regions.

    `valid` `(B, N)` marks the real regions (None: all); `boxes` `(B, N, 4)` are the boxes as the model read them,
    when it reads any (LXMERT's `visual_pos`), to draw the scores on the image.
    """

    scores: torch.Tensor
    signed: bool
    valid: torch.Tensor | None = None
    boxes: torch.Tensor | None = field(default=None, repr=False)

    def region_scores(self, index: int = 0) -> list[tuple[int, float]]:
        """`(region, score)` for the real regions of input `index`, in the model's order."""
        index = checked_row(index, len(self.scores))
        row = self.scores[index]
        keep = range(len(row)) if self.valid is None else self.valid[index].nonzero().flatten().tolist()
        return [(int(k), float(row[k])) for k in keep]


#: a token that a tokenizer adds or a chat template writes (`<|im_start|>`, `<s>`, `[CLS]`, ...), not text
MARKUP_TOKEN = re.compile(r"^(<\|[^|]*\|>|<[a-z_/]+>|\[[A-Z]+\])$")
#: a token shown as its id (`[17]`): the tokenizer did not say which string the id stands for
PLACEHOLDER = re.compile(r"^\[\d+\]$")
#: what `DecoderExplanation.excluding` takes by name
EXCLUDABLE = ("first", "last", "bos", "special", "template")


def excluded_positions(tokens: list[list[str]], valid: torch.Tensor, exclude: object) -> torch.Tensor:
    """`(B, T)` bool: the real tokens `exclude` names. `exclude`: a name of `EXCLUDABLE` or a tuple of them and of
    positions among each row's real tokens (ints, negative from the end), or a `(B, T)` bool tensor.
    "first" / "last": each row's first / last real token; "bos": the first real token where it is a special token
    (a BOS the tokenizer added); "special": every special token (`MARKUP_TOKEN`: BOS, EOS, `<|im_start|>`, ...);
    "template": the special tokens and each role header a chat template writes after one (the tokens up to and
    including the first newline after it, e.g. `<|im_start|>user\\n`)."""
    valid = valid.bool().cpu()
    if isinstance(exclude, torch.Tensor):
        if exclude.dtype != torch.bool or exclude.shape != valid.shape:
            raise ValueError(f"exclude as a tensor must be bool of the scores' shape {tuple(valid.shape)}, got {exclude.dtype} {tuple(exclude.shape)}")
        return exclude.cpu() & valid
    items = exclude if isinstance(exclude, (list, tuple)) else (exclude,)
    out = torch.zeros_like(valid)
    matched: set[object] = set()
    for row, (row_tokens, row_valid) in enumerate(zip(tokens, valid)):
        columns = row_valid.nonzero()[:, 0]
        special = [bool(MARKUP_TOKEN.match(t)) for t in row_tokens]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (Integral, str)) or isinstance(item, str) and item not in EXCLUDABLE:
                raise ValueError(f"exclude takes {', '.join(EXCLUDABLE)}, token positions (ints) or a (B, T) bool tensor, got {item!r}")
            if isinstance(item, Integral):
                item = int(item)  # numpy's integers too
                if not -len(columns) <= item < len(columns):
                    raise ValueError(f"exclude position {item} is outside row {row}'s {len(columns)} real tokens")
                picked = [item % len(columns)]
            elif item in ("first", "last"):
                picked = [0 if item == "first" else len(columns) - 1]
            elif item == "bos":
                picked = [0] if special[0] else []
            else:
                picked = [k for k, s in enumerate(special) if s]
                if item == "template":
                    picked += [k for k in _role_headers(row_tokens, special)]
            if picked:
                matched.add(item)
            out[row, columns[picked]] = True
    unmatched = [item for item in dict.fromkeys(items) if isinstance(item, str) and item not in matched]
    if unmatched:  # a name that picks nothing leaves the map as it was: said, not silent
        placeholders = any(PLACEHOLDER.match(token) for row in tokens for token in row)
        warnings.warn(f"exclude={', '.join(map(repr, unmatched))} matches no token of this explanation" + (
            " (its tokens are placeholders [id]: pass the tokenizer's output with tokenizer= so that special tokens are known)"
            if placeholders else ""), stacklevel=3)
    return out


def _role_headers(tokens: list[str], special: list[bool]) -> list[int]:
    """The tokens after each special token up to and including the first newline within `ROLE_HEADER` tokens (a chat
    role header, `user\\n`); none where no newline comes first (text after a BOS)."""
    picked: list[int] = []
    for k in (k for k, is_special in enumerate(special) if is_special):
        for j in range(k + 1, min(k + 1 + ROLE_HEADER, len(tokens))):
            if special[j]:
                break
            if "\n" in tokens[j] or "\u010a" in tokens[j]:
                picked += range(k + 1, j + 1)
                break
    return picked


#: the most tokens a chat role header takes (`<|start_header_id|>assistant<|end_header_id|>\n\n`: 3)
ROLE_HEADER = 4


def sink_shares(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`(B, 2)`: per row the share of the positive relevance on its first and on its last shown token (0 where a
    row has no positive relevance): where an attention sink draws relevance."""
    valid = valid.bool().to(scores.device)
    positive = scores.detach().clamp(min=0) * valid
    total = positive.sum(1)
    columns = torch.arange(scores.shape[1], device=scores.device)
    first = torch.where(valid, columns, scores.shape[1]).argmin(1)
    last = torch.where(valid, columns, -1).argmax(1)
    picked = torch.stack([positive.gather(1, first[:, None])[:, 0], positive.gather(1, last[:, None])[:, 0]], 1)
    return torch.where(total[:, None] > 0, picked / total.clamp(min=torch.finfo(positive.dtype).tiny)[:, None], torch.zeros_like(picked))


@dataclass
class SpanRelevance:
    """An answer span explained teacher-forced after the prompt: `ids` `(B, S)` its tokens (-1 past a row's end),
    `scores` `(B, S)` the relevance of each as an input (token `j` is read to predict token `j + 1`; the last is
    only predicted, so 0), and for a `Contrast` whose foil has several tokens the same for the foil (`foil_ids`,
    `foil_scores` `(B, F)`, read in a forward of its own; F = 0 otherwise); `tokens` the span's token texts."""

    ids: torch.Tensor
    scores: torch.Tensor
    foil_ids: torch.Tensor
    foil_scores: torch.Tensor
    tokens: list[list[str]] | None = None


@dataclass
class LatentRelevance:
    """Relevance inside the decoder, from the same backward pass as the input's: `layers` `(L + 1, B, W)` the
    residual stream's relevance per token (0: the token embeddings, equal to the input scores; l: the output of
    decoder layer l), `neurons` `(L + 1, B, W, D)` the same per hidden dimension, `heads` `(L, B, H)` each attention
    head's share (input x gradient at its output before the output projection, summed over tokens). `W` is the
    prompt's tokens, then the span's and the foil's (`SpanRelevance`). Parts not asked for are None."""

    layers: torch.Tensor | None = None
    neurons: torch.Tensor | None = None
    heads: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """`W`, the columns of the layer and neuron maps (0 where neither was asked for)."""
        found = self.layers if self.layers is not None else self.neurons
        return 0 if found is None else found.shape[2]

    def masked(self, keep: torch.Tensor) -> "LatentRelevance":
        """The maps with the columns where `keep` `(B, W)` is False set to 0 (tokens left out of an explanation)."""
        keep = keep.to(self.layers.device if self.layers is not None else self.neurons.device if self.neurons is not None else keep.device)
        return LatentRelevance(None if self.layers is None else self.layers * keep,
                               None if self.neurons is None else self.neurons * keep[..., None], self.heads)

    def html(self, index: int, tokens: list[str]) -> str:
        """HTML heat maps of row `index`: layers x tokens (rows: layer 0 = embeddings up to the last layer) and layers
        x heads, signed colours centred on 0, each cell's value in its tooltip."""
        tables = []
        if self.layers is not None:
            tables.append(("residual stream, layer x token", self.layers[:, index], tokens))
        if self.heads is not None:
            tables.append(("attention heads, layer x head", self.heads[:, index], [f"h{h}" for h in range(self.heads.shape[-1])]))
        return "".join(_heat_table(title, values, columns) for title, values, columns in tables)


#: what `latent=` asks for: the parts of `LatentRelevance`, in its order
LATENT_PARTS = tuple(part.name for part in fields(LatentRelevance))


def _heat_table(title: str, values: torch.Tensor, columns: list[str]) -> str:
    """A `(rows, columns)` table of coloured cells (the signed palette, bound by the table's largest |value|)."""
    values = values[:, :len(columns)]
    colours = TextPart(values, signed=True).colours(values.flatten().tolist())
    head = "".join(f'<th style="font-weight:normal;padding:0 2px">{html.escape(c)}</th>' for c in columns)
    body = ""
    for layer, row in enumerate(values.tolist()):
        cells = "".join(f'<td title="{v:.4g}" style="background:{colours[layer * len(columns) + k][0]};min-width:1.2em;height:1em"></td>'
                        for k, v in enumerate(row))
        body += f"<tr><th style=\"font-weight:normal;text-align:right;padding-right:4px\">{layer}</th>{cells}</tr>"
    return (f'<div style="margin:0.6em 0;font-family:sans-serif;font-size:small"><div style="font-weight:bold">{html.escape(title)}</div>'
            f'<table style="border-collapse:collapse"><tr><th></th>{head}</tr>{body}</table></div>')
