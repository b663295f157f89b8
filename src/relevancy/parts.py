"""One part of an explanation per token stream: an image grid part and a text part.

A part holds the raw scores of one stream and knows how to show them (`ImagePart.heatmap()` upsamples to pixels;
`TextPart` merges word pieces and colours tokens). Explanations of one-stream models have one part, image-text
models one of each (`Explanation.parts`).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

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


def attaches(unit: str) -> bool:
    """Punctuation that follows the previous word without a space (as written)."""
    return bool(unit) and unit in {".", ",", "!", "?", ";", ":", ")", "'", "%"}


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
        row = self.scores[index]
        if self.attention_mask is not None:
            row = row[self.attention_mask[index].bool().to(row.device)]
        tokens = self.tokens[index] if self.tokens else [f"[{k}]" for k in range(len(row))]
        return list(zip(tokens, row.tolist()))

    def words(self, index: int = 0, special: bool = False) -> list[tuple[str, float]]:
        """`(word, score)` of text `index`: word pieces merged (`##` continuations, or the tokenizer's word ids),
        their scores summed. Special tokens ([CLS], [SEP], ...) are left out unless `special=True`."""
        pairs = self.token_scores(index)
        ids = self.word_ids[index] if self.word_ids else None
        merged: list[list] = []
        previous = object()
        for k, (token, score) in enumerate(pairs):
            is_special = ids[k] is None if ids is not None else bool(SPECIAL_TOKEN.match(token))
            if is_special:
                if special:
                    merged.append([token, score])
                previous = object()
                continue
            piece = token[2:] if token.startswith("##") else token
            continues = ids[k] == previous if ids is not None else token.startswith("##") and bool(merged)
            if continues and merged:
                merged[-1][0] += piece
                merged[-1][1] += score
            else:
                merged.append([piece.lstrip("\u0120\u2581").removesuffix("</w>"), score])
            previous = ids[k] if ids is not None else None
        return [(word, score) for word, score in merged]

    def units(self, index: int, by_word: bool = True, special: bool = False) -> list[tuple[str, float]]:
        """What is shown of text `index`: words (or tokens), special tokens left out unless asked for."""
        if by_word:
            return self.words(index, special=special)
        pairs = self.token_scores(index)
        return pairs if special else [p for p in pairs if not SPECIAL_TOKEN.match(p[0])]

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
            text += ("" if k == 0 or attaches(unit) else " ") + (
                f'<span title="{score:.4g}" style="background:{background};color:{colour};padding:1px 2px;'
                f'border-radius:3px">{html.escape(unit)}</span>'
            )
        return text

    def rich_line(self, index: int, heading: str, by_word: bool = True, special: bool = False):
        """Text `index` as a `rich.text.Text` line under `heading` (needs the `text` extra)."""
        from .extras import require

        Text = require("rich.text", extra="text").Text
        units = self.units(index, by_word, special)
        line = Text(f"{heading}\n", style="bold")
        for k, ((unit, _), (background, colour)) in enumerate(zip(units, self.colours([s for _, s in units]))):
            if k and not attaches(unit):
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
        row = self.scores[index]
        keep = range(len(row)) if self.valid is None else self.valid[index].nonzero().flatten().tolist()
        return [(int(k), float(row[k])) for k in keep]
