"""How a `GenerationExplanation` is shown: an HTML fragment whose plain inline script colours, for the generated
token chosen, the tokens it read (`serve/static/generation.js`, also the web page's text-generation tab), and rows
of coloured tokens in a terminal."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..core.files import strict_json
from .parts import TextPart

#: the script that draws a generation (shared with the web page)
SCRIPT = Path(__file__).resolve().parents[1] / "apps" / "serve" / "static" / "generation.js"
#: colour steps on each side of 0: a score is drawn on the palette entry nearest its share of its row's maximum
PALETTE_STEPS = 50


def palette(signed: bool) -> list[list[str]]:
    """`[background, text colour]` for `2 * PALETTE_STEPS + 1` values from -1 to 1 (signed) or `PALETTE_STEPS + 1`
    from 0 to 1: the colours of the text views (`TextPart.colours`), sampled."""
    values = [k / PALETTE_STEPS for k in range(-PALETTE_STEPS if signed else 0, PALETTE_STEPS + 1)]
    return [list(pair) for pair in TextPart(None, signed).colours(values)]


def generation_html(numbers: dict[str, Any]) -> str:
    """An HTML fragment that draws a generation (`GenerationExplanation.to_json()`, as the web API answers it) with
    its own inline script (no file loaded, no internet)."""
    data = json.dumps(strict_json(numbers)).replace("</", "<\\/")  # no early end of the script element
    colours = json.dumps(palette(numbers["signed"]))
    title = html.escape(f"{numbers['method']}: what each generated token read")
    return (
        f'<div style="font-family:sans-serif"><div style="font-weight:bold">{title}</div>'
        '<div class="relevancy-generation"></div>'
        f"<script>{SCRIPT.read_text(encoding='utf-8')}\n"
        "(function () { var boxes = document.querySelectorAll('.relevancy-generation');\n"
        f"  relevancyGeneration(boxes[boxes.length - 1], {data}, {colours}); }})();</script></div>"
    )


def show_rows(part: TextPart, captions: list[str]) -> None:
    """Each generated token under its caption, the tokens before it on their colours (rich, the `text` extra; a
    character's byte tokens on the colour of their sum, see `TextPart.units`)."""
    from ..core.extras import require

    Text = require("rich.text", extra="text").Text
    console = require("rich.console", extra="text").Console()
    for g, caption in enumerate(captions):
        pairs = part.units(g, by_word=False, special=True)
        line = Text(f"{g + 1}. {caption}\n", style="bold")
        for (text, _), (background, colour) in zip(pairs, part.colours([score for _, score in pairs])):
            line.append(text, style=f"{colour} on {background}")
        console.print(line)
