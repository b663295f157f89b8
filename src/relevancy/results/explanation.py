"""The result of `explain()`: raw scores per token stream (`parts`) plus what is needed to show them, and the one
way every result is written out: `to_json()` (the schema `relevancy.explanation/1`, docs/api.md) and `save(path)`."""
from __future__ import annotations

import dataclasses
import html
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch

from ..core.files import TENSOR_DTYPES, checked_path, read_regular
from .parts import ImagePart, LatentRelevance, RegionPart, SpanRelevance, TextPart, excluded_positions, sink_shares
from .token_text import token_texts

#: the name and version of the JSON that `to_json()` writes and `relevancy.load` reads (the number rises when a field
#: changes meaning); documented in docs/api.md
SCHEMA = "relevancy.explanation/1"
#: a field `load` finds no value for (it takes the field's default)
_MISSING = object()
#: the parts of a result that are dataclasses of their own: `to_json` writes them with their name, `load` makes them again
NESTED = {kind.__name__: kind for kind in (SpanRelevance, LatentRelevance)}
#: what `save` writes by the path's suffix: every kind writes .json and .npz, kinds with an image part .png, kinds
#: with a text part an HTML page
DATA_SUFFIXES = (".json", ".npz")
PICTURE_SUFFIXES = (".png",)
PAGE_SUFFIXES = (".html", ".htm")
#: the tensor dtypes numpy holds as they are (`save(".npz")` writes others as float32)
NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint8, torch.bool)


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
    `save(path, images=None, by_word=True, special=False)` writes what the path's suffix names, whole or not at all;
    `to_json()` gives the whole result as plain JSON values (the schema of docs/api.md).
    """

    method: str
    signed: bool
    target: torch.Tensor
    logits: torch.Tensor
    relevance_total: torch.Tensor | None

    #: the dataclass fields that hold each part's scores, by part name (`to_json` writes them once, under "scores")
    part_fields: ClassVar[dict[str, str]] = {}
    #: the suffixes `save` writes besides DATA_SUFFIXES: PICTURE_SUFFIXES where `picture` draws, PAGE_SUFFIXES where
    #: `to_html` does
    suffixes: ClassVar[tuple[str, ...]] = ()

    @property
    def parts(self) -> dict[str, ImagePart | TextPart | RegionPart]:
        raise NotImplementedError

    def part_scores(self) -> dict[str, torch.Tensor]:
        """Each part's scores by stream name (what `scores` is for kinds with several parts)."""
        return {name: part.scores for name, part in self.parts.items()}

    def to_json(self) -> dict:
        """The explanation as plain JSON values, schema `SCHEMA` (docs/api.md): `schema`, `kind` (the class), method,
        signedness, targets, logits, each part's `scores` by stream name, `tokens` (None for a kind without text),
        the relevance totals of the LRP-based methods, then every other field of the kind (masks, sizes, ...; a
        `Concept` is not written: its vector lives on the concept) and `tensors`: the dtype and shape of each value
        that was a tensor, by its path (`scores/text`), so that `relevancy.load` gives back equal tensors."""
        numbers, tensors = self._contents()
        numbers["tensors"] = {path: {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
                              for path, value in tensors.items()}
        text = self.parts.get("text")
        if isinstance(text, TextPart) and callable(getattr(self, "words", None)):
            # the text as written, for a reader of the JSON: `words(i)` per row (derived; `load` ignores it)
            numbers["words"] = [[[word, score] for word, score in self.words(i)] for i in range(len(text.scores))]
        return numbers

    def _contents(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """`to_json()` without its `tensors` entry, and every tensor it holds by its path."""
        tensors: dict[str, torch.Tensor] = {}
        numbers = {
            "schema": SCHEMA, "kind": type(self).__name__, "method": self.method, "signed": self.signed,
            "target": _plain(self.target, "target", tensors), "logits": _plain(self.logits, "logits", tensors),
            "scores": {name: _plain(scores, f"scores/{name}", tensors) for name, scores in self.part_scores().items()},
            "tokens": _plain(getattr(self, "tokens", None), "tokens", tensors),
            "relevance_total": _plain(self.relevance_total, "relevance_total", tensors),
        }
        for item in dataclasses.fields(self):
            if item.name not in numbers and item.name not in self.part_fields.values() and item.name != "concept":
                numbers[item.name] = _plain(getattr(self, item.name), item.name, tensors)
        return numbers, tensors

    def save(self, path: str | Path, images: Any = None, by_word: bool = True, special: bool = False) -> Path:
        """Write the result in the format the path's suffix names, whole or not at all: `.json` (`to_json()`, what
        `relevancy.load` reads), `.npz` (every tensor of `to_json()` by its path, e.g. `scores/image`), `.png` (kinds
        with an image part: the maps drawn over `images`, the inputs as given to `explain` or pictures) and `.html`
        (kinds with a text part: the coloured texts, word pieces merged unless `by_word=False`, special tokens shown
        with `special=True`). The same arguments for every kind; an argument a format does not use is left aside."""
        from ..core.files import OutputError, output_path, write_atomic

        path = output_path(path)
        suffix = path.suffix.lower()
        valid = (*DATA_SUFFIXES, *self.suffixes)
        if suffix not in valid:
            raise OutputError(f"a {type(self).__name__} is saved as {', '.join(valid)} (chosen by the path's suffix), got '{path.name}'")
        if suffix == ".json":
            return write_atomic(path, json.dumps(self.to_json()))
        if suffix == ".npz":
            return write_atomic(path, self._npz())
        if suffix in PICTURE_SUFFIXES:
            return self.picture(path, images)
        return write_atomic(path, html_page(self.page_title(), self.page_body(by_word, special)))

    def _npz(self) -> bytes:
        """Every tensor of `to_json()` as a numpy `.npz` archive, named by its path (bfloat16 and other dtypes numpy
        lacks as float32)."""
        import numpy as np

        arrays = {}
        for path, value in self._contents()[1].items():
            value = value.detach().cpu()
            arrays[path] = (value if value.dtype in NUMPY_DTYPES else value.float()).numpy()
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    def picture(self, path: Path, images: Any) -> Path:
        """Kinds with an image part: the PNG `save` writes for `.png`."""
        raise NotImplementedError

    def page_title(self) -> str:
        """The title of the HTML page `save` writes."""
        return self.method

    def page_body(self, by_word: bool, special: bool) -> str:
        """Kinds with a text part: the body of the HTML page `save` writes (`to_html`)."""
        return self.to_html(by_word, special)


def _plain(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON values (None for what has none: a `Concept`); each tensor put in `tensors` under its path."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return value.detach().cpu().tolist()
    if isinstance(value, tuple(NESTED.values())):  # a part of a result (an answer span's, the latent relevance)
        return {"dataclass": type(value).__name__,
                **{item.name: _plain(getattr(value, item.name), f"{path}/{item.name}", tensors) for item in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{path}/{key}", tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{path}/{k}", tensors) for k, item in enumerate(value)]
    return value if isinstance(value, (bool, int, float, str)) else None


def load(source: str | Path | Mapping) -> Explanation:
    """The result that `save("....json")` wrote (a path) or `to_json()` gave (its dict): the same class, tensors
    equal to the saved ones (dtype and shape included), on the CPU; a `Concept` explained is not saved (`concept`
    None, `target` -1 as it was). A one-line error for a file that is not such a result."""
    if isinstance(source, Mapping):
        try:
            numbers = json.loads(json.dumps(source))  # a copy: the tensors are put in place below
        except (TypeError, ValueError, RecursionError) as error:  # values JSON has not, a cycle, too deep
            raise ValueError(f"relevancy.load takes what to_json() gives: this dict is not plain JSON data ({type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]})") from None
    else:
        numbers = json.loads(_result_file(source))
    kinds = {kind.__name__: kind for kind in _kinds(Explanation)}
    kind = numbers.get("kind") if isinstance(numbers, dict) else None
    schema = numbers.get("schema") if isinstance(numbers, dict) else None
    if not isinstance(kind, str) or kind not in kinds or not isinstance(schema, str) or not schema.startswith("relevancy.explanation/"):
        raise ValueError(f"not a saved relevancy result (its 'schema' {schema!r} and 'kind' {kind!r} are what to_json() writes); "
                         f"schema {SCHEMA}, kinds: {', '.join(sorted(kinds))}")
    if schema != SCHEMA:
        raise ValueError(f"the result was saved in schema {schema}; this relevancy reads {SCHEMA}: update relevancy")
    _check_tensors(numbers)
    try:
        result = _rebuilt(kinds[kind], numbers)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, RecursionError) as error:
        raise ValueError(f"the saved {kind} is damaged (not as to_json() wrote it): {type(error).__name__}: {error}") from None
    _check_tokens(result, kind)
    return result


#: the largest result file `load` reads (a batch of pixel maps as JSON numbers: hundreds of MB at most)
MAX_RESULT_BYTES = 2**30


def _result_file(source: str | Path) -> str:
    """The text of a saved result's file: a regular file (a pipe or a device is never read: it may never end; links
    followed) of at most `MAX_RESULT_BYTES`, UTF-8 JSON; one-line errors otherwise."""
    source = checked_path(source, "relevancy.load takes the dict to_json() gives or a path; the path", ValueError)
    said = "relevancy.load reads the JSON that save('....json') writes"
    try:
        text = read_regular(source, MAX_RESULT_BYTES, links=True).decode("utf-8")
        json.loads(text)  # checked here, so that the message names the file
        return text
    except (OSError, TypeError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{said}; {source} could not be read as JSON: {' '.join(str(error).split())[:200]}") from None
    except ValueError as error:  # not a regular file, or too large: the error names the path
        raise ValueError(f"{said}; {error}") from None


def _check_tensors(numbers: dict) -> None:
    """Refuse, naming the key, a saved result whose `tensors` entry is missing or describes a tensor that is not one:
    a dtype outside `TENSOR_DTYPES`, a shape that is not a list of non-negative whole numbers."""
    tensors = numbers.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("the saved result has no 'tensors' entry (the dtype and shape of each tensor, as to_json() writes them)")
    for path, meta in tensors.items():
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape"}:
            raise ValueError(f"tensors[{path!r}] must be {{'dtype': ..., 'shape': [...]}}, got {json.dumps(meta)[:100]}")
        if meta["dtype"] not in TENSOR_DTYPES:
            raise ValueError(f"tensors[{path!r}] has dtype {json.dumps(meta['dtype'])[:60]}; a saved tensor is one of {', '.join(TENSOR_DTYPES)}")
        shape = meta["shape"]
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"tensors[{path!r}] has shape {json.dumps(shape)[:60]}; a shape is a list of whole numbers >= 0")


def _check_tokens(result: Explanation, kind: str) -> None:
    """Refuse a text classifier's or a decoder's result whose rows hold more tokens than its scores have columns (a
    generation's tokens are its one sequence's: not rows)."""
    tokens, scores = getattr(result, "tokens", None), getattr(result, "scores", None)
    if not isinstance(result, TextExplanation) or not tokens or not isinstance(scores, torch.Tensor) or scores.ndim != 2:
        return
    row = next((k for k, row in enumerate(tokens) if len(row) > scores.shape[1]), None)
    if row is not None:
        raise ValueError(f"the saved {kind} is damaged: row {row} has {len(tokens[row])} tokens but its scores "
                         f"{scores.shape[1]} columns")


def _rebuilt(kind: type, numbers: dict) -> Explanation:
    """A result of `kind` from its `to_json()` values: each tensor made again from its dtype and shape, the parts'
    scores put back in their fields, lists back into tuples where the field is one."""
    for path, meta in numbers.get("tensors", {}).items():
        *parents, last = path.split("/")
        holder = numbers
        for key in parents:
            holder = holder[int(key) if isinstance(holder, list) else key]
        key = int(last) if isinstance(holder, list) else last
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{path} has no tensor dtype: {meta['dtype']!r}")
        holder[key] = torch.tensor(holder[key], dtype=dtype).reshape(meta["shape"])
    parts = {name: part for part, name in kind.part_fields.items()}
    values = {}
    for item in dataclasses.fields(kind):
        value = numbers["scores"][parts[item.name]] if item.name in parts else numbers.get(item.name, _MISSING)
        if not item.init or value is _MISSING:
            continue
        if isinstance(value, list) and str(item.type).startswith(("tuple", "Sequence")):
            value = tuple(value)
        values[item.name] = _revived(value)
    return kind(**values)


def _revived(value: Any) -> Any:
    """A part of a result written as `{"dataclass": name, ...}` (`NESTED`) made again; other values as they are."""
    if isinstance(value, dict) and value.get("dataclass") in NESTED:
        return NESTED[value["dataclass"]](**{key: _revived(item) for key, item in value.items() if key != "dataclass"})
    return value


def _kinds(kind: type) -> list[type]:
    """Every result class below `kind` that has parts (not a shared base such as `ClassExplanation`), those defined
    later (a family's own) included."""
    below = [sub for child in kind.__subclasses__() for sub in (child, *_kinds(child))]
    return list(dict.fromkeys(sub for sub in below if sub.part_fields))


@dataclass(kw_only=True)
class ClassExplanation(Explanation):
    """What an image's and a text's explanation share: one part of scores (`scores`) for a class, concept or
    callable target per input, the input's size and the model's class names."""

    scores: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    input_size: tuple[int, ...]
    class_names: list[str] | None = None
    concept: object | None = field(default=None, repr=False)  # the relevancy.Concept explained, if any
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    def labels(self) -> list[str]:
        """A caption per input: the concept, or the class name (or index) with its logit."""
        if self.concept is not None:
            return ["concept"] * len(self.target)
        return named_scores(self.target, self.logits, self.class_names, "class")


@dataclass(kw_only=True)
class ImageExplanation(ClassExplanation):
    """Relevance of each patch (`scores`, `(B, h, w)`) or pixel (`(B, H, W)`, method `lrp`) for `target`.

    `target` holds the explained class per image (-1 where a `concept` or a callable target was explained).
    `relevance_total` (LRP-based methods only, `(B,)`): see `Explanation`; the paper's rules conserve it (1),
    see docs/methods.md. `parts` maps each token stream's name to its part (here one, `"image"`).
    """

    input_size: tuple[int, int]
    mean: Sequence[float] = (0.0, 0.0, 0.0)
    std: Sequence[float] = (1.0, 1.0, 1.0)

    part_fields: ClassVar[dict[str, str]] = {"image": "scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES

    @property
    def parts(self) -> dict[str, ImagePart]:
        return {"image": ImagePart(self.scores, self.signed, self.input_size, self.mean, self.std)}

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the scores upsampled bilinearly to the input size (raw values)."""
        return self.parts["image"].heatmap()

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised input images back to `[0, 1]` pictures `(B, H, W, 3)`."""
        return self.parts["image"].pixels(images)

    def picture(self, path: Path, images: torch.Tensor | None) -> Path:
        """An overlay PNG, one panel per image (`images`: the normalised inputs, or None for the maps alone)."""
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.labels()])


def save_overlays(part: ImagePart, path: str | Path, images: torch.Tensor | None, captions: list[str]) -> Path:
    """An image part as an overlay PNG, one panel per row, written atomically."""
    from .viz import overlay_figure, save_figure

    pictures = part.pixels(images) if images is not None else None
    return save_figure(overlay_figure(part.heatmap().cpu(), pictures, part.signed, captions), path)


def texts_html(part: TextPart, captions: list[str], by_word: bool = True, special: bool = False) -> str:
    """An HTML fragment: one paragraph per text under its caption, each word on its colour."""
    blocks = [
        f'<div class="relevancy-text" style="margin:0.6em 0"><div style="font-weight:bold">{html.escape(caption)}</div>'
        f'<div style="line-height:1.9">{part.html_line(i, by_word, special)}</div>{part.scale_html(i, by_word, special)}</div>'
        for i, caption in enumerate(captions)
    ]
    return (
        '<div style="font-family:sans-serif">' + "".join(blocks)
        + '<div style="color:#666;font-size:small">each line coloured to its own largest score; hover a word for its score</div></div>'
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
    from ..core.extras import require

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


@dataclass(kw_only=True)
class TextExplanation(ColouredTexts, ClassExplanation):
    """Relevance of each token (`scores`, `(B, T)`, 0 at padding) for `target`.

    `tokens[i]` are the token strings of text `i` (its real tokens, [CLS] and [SEP] included), in the order of
    `scores[i]`; `words(i)` merges word pieces into words by summing their scores, `spans(i, ...)` sums them over
    sentences or character spans of `text(i)`. `target_tokens` (decoder language models explained with
    `tokenizer=`): the text of each row's explained token, which names it in `labels()` and on the page.
    """

    input_size: tuple[int, ...] = ()
    tokens: list[list[str]] | None = None
    word_ids: list[list[int | None]] | None = field(default=None, repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)
    target_tokens: list[str] | None = None

    part_fields: ClassVar[dict[str, str]] = {"text": "scores"}
    suffixes: ClassVar[tuple[str, ...]] = PAGE_SUFFIXES

    @property
    def parts(self) -> dict[str, TextPart]:
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

    def text(self, index: int = 0) -> str:
        """The text the tokens of text `index` spell (see `TextPart.text`): what `spans` counts characters in."""
        return self.parts["text"].text(index)

    def spans(self, index: int = 0, spans: str | Sequence[tuple[int, int]] = "sentences") -> list[tuple[str, float]]:
        """`(text, score)` per sentence or given `(start, end)` character span of `text(index)` (see `TextPart.spans`)."""
        return self.parts["text"].spans(index, spans)

    def labels(self) -> list[str]:
        """A caption per text: the explained token's text (decoders explained with `tokenizer=`) or class name, and
        its logit."""
        if self.target_tokens is None:
            return super().labels()
        return [f"{token!r} ({float(self.logits[i, k]):.2f})" if k >= 0 else "custom target"
                for i, (token, k) in enumerate(zip(self.target_tokens, self.target.tolist()))]

    def page_title(self) -> str:
        """The HTML page is titled by the first explained target."""
        return self.captions()[0]


@dataclass(kw_only=True)
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
        # an explanation that left tokens out already: its kept total is the base, and its scores (those tokens at 0)
        # the sum the new share is of, so that chained calls give what one call with every token gives
        total = self.relevance_total if self.relevance_total_kept is None else self.relevance_total_kept
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
        """The text of each column's token in row `row`'s latent maps, as the tokens read (" Statue", not the
        tokenizer's "ĠStatue"; a character whose bytes span tokens at the last of them, see `TextPart.texts`; "" at
        padding and excluded tokens)."""
        mask = self.attention_mask[row].bool().tolist() if self.attention_mask is not None else [True] * self.scores.shape[1]
        names = iter(self.parts["text"].texts(row) if self.tokens else [])
        labels = [next(names, "") if keep else "" for keep in mask]
        if self.span is not None:
            for ids, texts in ((self.span.ids, self.span.tokens), (self.span.foil_ids, None)):
                width = ids.shape[1]
                labels += ((token_texts(texts[row][:width]) if texts else []) + [""] * width)[:width]
        return labels

    def page_title(self) -> str:
        """The HTML page is titled by the first row's answer span, all of its text, where a span was explained (" New
        York", not its first token " New"); by the first explained token otherwise."""
        if self.span is None or not self.span.tokens:
            return super().page_title()
        length = int((self.span.ids[0] >= 0).sum())
        return f"{''.join(token_texts(self.span.tokens[0][:length]))!r} (the answer span)"

    def to_json(self) -> dict:
        """The protocol's JSON (the span, the latent relevance and the excluded tokens among the fields) plus the sink
        shares."""
        return {**super().to_json(), "sink_share": self.sink_share.tolist()}


@dataclass
class GenerationExplanation(Explanation):
    """What a decoder language model read to write each token of a generation (`relevancy.explain_generation`).

    `scores` `(G, T + G)`: row `g` is the relevance of every token before generated token `g` (the prompt's `T`
    and the `g` generated before it) for that token's logit, raw and signed, 0 at the token itself and after it.
    `tokens` are the `T + G` tokens' texts (joined, the decoded sequence; a character whose bytes span several tokens
    written at the token that completes it, the ones before it empty: `token_text.decoded_texts`; every view counts
    their scores with that character), `prompt_length` is `T`, `generated_ids` (= `target`) the `G` generated
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
    part_fields: ClassVar[dict[str, str]] = {"text": "scores"}
    suffixes: ClassVar[tuple[str, ...]] = PAGE_SUFFIXES

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

    def words(self, index: int = 0, special: bool = False) -> list[tuple[str, float]]:
        """`(word, score)` over the tokens before generated token `index`: tokens merged into words at white space
        (see `TextPart.words`), their scores summed."""
        return self.parts["text"].words(index, special)

    def text_before(self, index: int = 0) -> str:
        """The text read for generated token `index`: the prompt and the tokens generated before it,
        `"".join(tokens[:prompt_length + index])`, with U+FFFD at the end where it stops inside a character whose
        last bytes are still to come; what `spans(index, ...)` counts characters in."""
        return self.parts["text"].text(index)

    def spans(self, index: int = 0, spans: str | Sequence[tuple[int, int]] = "sentences") -> list[tuple[str, float]]:
        """`(text, score)` per sentence or given `(start, end)` character span of `text_before(index)` (a span of the
        prompt reads the same in every row), its tokens' scores summed (see `TextPart.spans`)."""
        return self.parts["text"].spans(index, spans)

    def labels(self) -> list[str]:
        """A caption per generated token: its text and its logit."""
        generated = self.tokens[self.prompt_length:]
        return [f"{token!r} ({float(logit):.2f})" for token, logit in zip(generated, self.logits[:, 0])]

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

    def page_title(self) -> str:
        return f"{self.method}: generation"

    def page_body(self, by_word: bool, special: bool) -> str:
        """The page draws the tokens as generated (plain inline script, nothing loaded from the internet): word
        pieces are not merged, so `by_word` and `special` do not apply."""
        return self.to_html()


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
    part_fields: ClassVar[dict[str, str]] = {"image": "image_scores", "text": "text_scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES + PAGE_SUFFIXES

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

    def picture(self, path: Path, images: torch.Tensor | None) -> Path:
        """The image part as an overlay PNG, one panel per pair (`images`: the batch's normalised images)."""
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.captions()])


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
    part_fields: ClassVar[dict[str, str]] = {"text": "text_scores", "image": "region_scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES + PAGE_SUFFIXES

    @property
    def parts(self) -> dict[str, TextPart | RegionPart]:
        return {
            "text": TextPart(self.text_scores, self.signed, self.tokens, None, self.attention_mask),
            "image": RegionPart(self.region_scores, self.signed, self.region_mask, self.boxes),
        }

    def labels(self) -> list[str]:
        """A caption per input: the explained answer's name (or index) with its score."""
        return named_scores(self.target, self.logits, self.class_names, "answer")

    def picture(self, path: Path, images: Sequence | None) -> Path:
        """A PNG of the regions: each box filled by its score over `images` (one picture per input as an (H, W, 3)
        array); without boxes, a bar per region."""
        from .viz import region_figure, save_figure

        part = self.parts["image"]
        return save_figure(region_figure(part.scores.cpu(), part.boxes, images, self.signed, self.captions()), path)


@dataclass(kw_only=True)
class DetectionExplanation(ImageExplanation):
    """`scores` (R, h, w): the relevance of every image token for row r's object, query `query[r]` of image
    `image[r]`, class `target[r]`; `logits` (R, C + 1) are that query's class logits (the last: "no object").
    `relevance_total` (LRP-based methods, `(R, 2)`): the relevance reaching the encoder's input tokens and the
    decoder's zero queries; image + 2 x queries = 1 (see `families.detr.rules`). `boxes` (R, 4), where known (e.g.
    `detect`'s, set with `dataclasses.replace`): each object's box, x0, y0, x1, y1 in pixels, drawn by `save`."""

    image: torch.Tensor = field(default=None, repr=False)
    query: torch.Tensor = field(default=None, repr=False)
    boxes: torch.Tensor | None = field(default=None, repr=False)

    def labels(self) -> list[str]:
        """A caption per object: image, query, class name and its logit."""
        names = self.class_names or []
        return [
            f"image {i}, query {q}: {names[k] if k < len(names) else f'class {k}'} ({self.logits[r, k]:.2f})"
            for r, (i, q, k) in enumerate(zip(self.image.tolist(), self.query.tolist(), self.target.tolist()))
        ]

    def picture(self, path: Path, images: Any) -> Path:
        """An overlay PNG, one panel per object with its box where `boxes` are known: `images` the explained images,
        normalised (B, 3, H, W) as given to explain or as pictures (B, H, W, 3) uint8 (each row is drawn over its
        own image)."""
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
        return save_figure(overlay_figure(part.heatmap().cpu(), pictures, part.signed, titles, self.boxes), path)
