"""The result of `explain()` on a text classifier: one score per token, shown as coloured text."""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..explanation import Explanation
from ..extras import require
from ..files import write_atomic

_SPECIAL = re.compile(r"^(\[[A-Z]+\]|<s>|</s>|<pad>|<unk>|<mask>|<cls>|<sep>)$")
SIGNED_PALETTE = "RdBu_r"  # negative blue, positive red, white at zero (the image side's colormap)
UNSIGNED_PALETTE = "Reds"  # white to red: the text stays readable


def _attaches(unit: str) -> bool:
    """Punctuation that follows the previous word without a space (as written)."""
    return bool(unit) and unit in {".", ",", "!", "?", ";", ":", ")", "'", "%"}


@dataclass
class TextExplanation(Explanation):
    """Relevance of each token (`scores`, `(B, T)`, 0 at padding) for `target`.

    `tokens[i]` are the token strings of text `i` (its real tokens, [CLS] and [SEP] included), in the order of
    `scores[i]`; `words(i)` merges word pieces into words by summing their scores.
    """

    input_size: tuple[int, ...] = ()
    tokens: list[list[str]] | None = None
    word_ids: list[list[int | None]] | None = field(default=None, repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)

    def heatmap(self) -> torch.Tensor:
        """The token scores themselves, `(B, T)` (nothing to upsample)."""
        return self.scores

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
            is_special = ids[k] is None if ids is not None else bool(_SPECIAL.match(token))
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
                merged.append([piece.lstrip("\u0120\u2581"), score])
            previous = ids[k] if ids is not None else None
        return [(word, score) for word, score in merged]

    # -- showing --------------------------------------------------------------------------------------------
    def _colours(self, values: list[float]) -> list[tuple[str, str]]:
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

    def _units(self, index: int, by_word: bool, special: bool) -> list[tuple[str, float]]:
        if by_word:
            return self.words(index, special=special)
        pairs = self.token_scores(index)
        return pairs if special else [p for p in pairs if not _SPECIAL.match(p[0])]

    def show(self, by_word: bool = True, special: bool = False) -> None:
        """Print each text as coloured words (a terminal through rich; HTML in a notebook)."""
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
            from IPython.display import HTML, display

            display(HTML(self.to_html(by_word, special)))
            return
        Console = require("rich.console", extra="text").Console
        Text = require("rich.text", extra="text").Text

        console = Console()
        for i, caption in enumerate(self.labels()):
            units = self._units(i, by_word, special)
            line = Text(f"{self.method}: {caption}\n", style="bold")
            for k, ((unit, _), (background, colour)) in enumerate(zip(units, self._colours([s for _, s in units]))):
                if k and not _attaches(unit):
                    line.append(" ")
                line.append(unit, style=f"{colour} on {background}")
            console.print(line)

    def to_html(self, by_word: bool = True, special: bool = False) -> str:
        """An HTML fragment: one paragraph per text, each word on its colour, its score in the tooltip."""
        blocks = []
        for i, caption in enumerate(self.labels()):
            units = self._units(i, by_word, special)
            text = ""
            for k, ((unit, score), (background, colour)) in enumerate(zip(units, self._colours([s for _, s in units]))):
                text += ("" if k == 0 or _attaches(unit) else " ") + (
                    f'<span title="{score:.4g}" style="background:{background};color:{colour};padding:1px 2px;'
                    f'border-radius:3px">{html.escape(unit)}</span>'
                )
            blocks.append(
                f'<div style="margin:0.6em 0"><div style="font-weight:bold">{html.escape(self.method)}: '
                f'{html.escape(caption)}</div><div style="line-height:1.9">{text}</div></div>'
            )
        legend = "blue: against, red: for the class (white: 0)" if self.signed else "darker red: more relevant"
        return (
            '<div style="font-family:sans-serif">' + "".join(blocks)
            + f'<div style="color:#666;font-size:small">{legend}; hover a word for its score</div></div>'
        )

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str | Path, images: object = None, by_word: bool = True, special: bool = False) -> Path:
        """Write an HTML page of the coloured texts; the file appears whole or not at all."""
        path = Path(path)
        page = (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>relevancy: '
            f"{html.escape(self.method)}</title></head><body>{self.to_html(by_word, special)}</body></html>\n"
        )
        return write_atomic(path, page)
