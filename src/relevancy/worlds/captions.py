"""Captions for the shapes world and a tiny word-level tokenizer.

Every object of a scene gets four attributes, computed deterministically from
its rendering parameters (:func:`describe`):

* **shape**: its class name from :data:`~relevancy.worlds.scenes.CLASSES`
  (``"L-shape"`` and friends are single words).
* **colour**: a name for its RGB colour from HSV bins (:data:`COLOR_BINS`).
  Objects are drawn with saturation and value >= 0.45, so in practice only the
  eight hue names occur; ``white``/``gray``/``black`` are defined for low
  saturation / value so that every colour has a name.
* **size**: ``"small"`` / ``"large"`` for the lower / upper third of the scale
  range of the scene type (one object: 9-15 px, two objects: 8.5-12 px); the
  middle third has no size word (a caption never calls it small or large).
* **position**: the cell of a 3x3 grid over the image holding the centre,
  phrased ``"at the top left"``, ``"on the left"``, ``"in the center"`` ...

Two objects are related by the dominant axis of the difference of their
centres: ``"left of"``, ``"right of"``, ``"above"``, ``"below"``.

Captions (:func:`sample_captions`) carry their meaning as constraints
(:class:`Caption`), so :func:`caption_truth` can tell for any scene whether a
caption is true of it; training uses this to treat every true scene/caption
pair of a batch as a positive.  Grammar (articles ``a``/``an`` as in English)::

    a photo of a {shape}                       zero-shot prompt
    a {colour} {shape}                         one object (alone or of a pair)
    a {size} {colour} {shape}
    a {colour} {shape} {position}
    a photo of a {size} {colour} {shape} {position}
    a {colour} {shape} {relation} a {colour} {shape}
    a {colour} {shape} and a {colour} {shape}
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
import torch

from ..core.messages import quoted
from .scenes import CLASSES, IMAGE_SIZE, PAIR_SCALE, SINGLE_SCALE, Scenes

__all__ = [
    "COLORS",
    "COLOR_BINS",
    "SIZES",
    "POSITIONS",
    "RELATIONS",
    "VOCAB",
    "ObjectAttributes",
    "Caption",
    "Tokenizer",
    "color_name",
    "describe",
    "relation",
    "attribute_arrays",
    "object_phrase",
    "zero_shot_prompt",
    "sample_captions",
    "confusable_captions",
    "caption_truth",
]

#: hue bins in degrees, [start, end), for saturated colours (red wraps around 0)
COLOR_BINS = (
    ("red", 345.0, 15.0),
    ("orange", 15.0, 40.0),
    ("yellow", 40.0, 70.0),
    ("green", 70.0, 160.0),
    ("cyan", 160.0, 200.0),
    ("blue", 200.0, 255.0),
    ("purple", 255.0, 290.0),
    ("pink", 290.0, 345.0),
)
#: value below which a colour is "black", saturation below which it is
#: "white" (value >= WHITE_VALUE) or "gray"
BLACK_VALUE = 0.2
GRAY_SATURATION = 0.2
WHITE_VALUE = 0.8

COLORS = tuple(b[0] for b in COLOR_BINS) + ("white", "gray", "black")
SIZES = ("small", "large")
#: 3x3 grid cells, row-major from the top left
POSITIONS = (
    "at the top left", "at the top", "at the top right",
    "on the left", "in the center", "on the right",
    "at the bottom left", "at the bottom", "at the bottom right",
)
#: relation of object a to object b; RELATIONS[r ^ 1] is the inverse of r
RELATIONS = ("left of", "right of", "above", "below")

_FUNCTION_WORDS = ("a", "an", "photo", "of", "and", "at", "on", "in", "the")
_SPATIAL_WORDS = ("top", "bottom", "left", "right", "center", "above", "below")
#: every word the caption generator can emit
VOCAB = tuple(dict.fromkeys(_FUNCTION_WORDS + _SPATIAL_WORDS + SIZES + COLORS + CLASSES))

PAD, START, END = "<pad>", "<start>", "<end>"


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" or word in ("L-shape", "H-shape") else "a"


def color_name(rgb) -> str:
    """Name of an RGB colour (0..255 floats) from the HSV bins of :data:`COLOR_BINS`."""
    r, g, b = (float(c) / 255.0 for c in rgb)
    h, s, v = colorsys.rgb_to_hsv(r, g, b)
    if v < BLACK_VALUE:
        return "black"
    if s < GRAY_SATURATION:
        return "white" if v >= WHITE_VALUE else "gray"
    deg = h * 360.0
    for name, lo, hi in COLOR_BINS:
        if (lo <= deg < hi) if lo < hi else (deg >= lo or deg < hi):
            return name
    raise AssertionError(deg)  # the bins cover the circle


@dataclass(frozen=True)
class ObjectAttributes:
    """What a caption can say about one object; ``size`` is None in the middle
    third of the scale range (neither small nor large)."""

    shape: str
    color: str
    size: str | None
    position: str

    def phrase(self, size: bool = False, position: bool = False) -> str:
        """``"a small red star at the top"`` (size and position optional)."""
        return object_phrase(self.shape, self.color, self.size if size else None,
                             self.position if position else None)


def object_phrase(shape: str, color: str | None = None, size: str | None = None,
                  position: str | None = None) -> str:
    """Noun phrase with the right article, e.g. ``"an orange L-shape on the left"``."""
    words = [w for w in (size, color, shape) if w]
    text = f"{_article(words[0])} {' '.join(words)}"
    return f"{text} {position}" if position else text


def zero_shot_prompt(shape: str) -> str:
    """The zero-shot classification prompt ``"a photo of a {shape}"`` (``an`` before vowels)."""
    return f"a photo of {object_phrase(shape)}"


def _size_index(scale: np.ndarray, objects: int) -> np.ndarray:
    lo, hi = SINGLE_SCALE if objects == 1 else PAIR_SCALE
    t = (np.asarray(scale) - lo) / (hi - lo)
    return np.where(t < 1 / 3, 0, np.where(t >= 2 / 3, 1, -1))


def _position_index(cx: np.ndarray, cy: np.ndarray) -> np.ndarray:
    col = np.clip((np.asarray(cx) * 3 // IMAGE_SIZE).astype(np.int64), 0, 2)
    row = np.clip((np.asarray(cy) * 3 // IMAGE_SIZE).astype(np.int64), 0, 2)
    return row * 3 + col


def _relation_index(dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Relation of a to b from ``(dx, dy) = centre(b) - centre(a)`` (y down)."""
    horiz = np.abs(dx) >= np.abs(dy)
    return np.where(horiz, np.where(dx > 0, 0, 1), np.where(dy > 0, 2, 3))


def attribute_arrays(scenes: Scenes) -> dict[str, np.ndarray]:
    """Integer attributes of every object, each (n, objects): ``shape`` (class
    index), ``color`` (index into :data:`COLORS`), ``size`` (index into
    :data:`SIZES`, -1 for neither), ``position`` (index into :data:`POSITIONS`);
    and ``relation`` (n,), the relation of object 0 to object 1 (-1 without a pair)."""
    p = scenes.params
    n, k = p["cls"].shape
    color = np.array([[COLORS.index(color_name(p["color"][i, j])) for j in range(k)]
                      for i in range(n)], np.int64).reshape(n, k)
    rel = (_relation_index(p["cx"][:, 1] - p["cx"][:, 0], p["cy"][:, 1] - p["cy"][:, 0])
           if k == 2 else np.full(n, -1))
    return dict(shape=np.asarray(p["cls"], np.int64), color=color, size=_size_index(p["scale"], k),
                position=_position_index(p["cx"], p["cy"]), relation=rel)


def describe(scenes: Scenes, i: int, j: int = 0) -> ObjectAttributes:
    """Attributes of object ``j`` of scene ``i`` (the object of ``scenes.masks[i, j]``)."""
    p = scenes.params
    size = int(_size_index(p["scale"][i, j], scenes.objects))
    return ObjectAttributes(
        shape=CLASSES[int(p["cls"][i, j])],
        color=color_name(p["color"][i, j]),
        size=SIZES[size] if size >= 0 else None,
        position=POSITIONS[int(_position_index(p["cx"][i, j], p["cy"][i, j]))],
    )


def relation(scenes: Scenes, i: int, a: int = 0, b: int = 1) -> str:
    """Spatial relation of object ``a`` to object ``b`` of scene ``i``, e.g. ``"left of"``."""
    p = scenes.params
    return RELATIONS[int(_relation_index(p["cx"][i, b] - p["cx"][i, a], p["cy"][i, b] - p["cy"][i, a]))]


# --------------------------------------------------------------------------
# captions with their meaning
# --------------------------------------------------------------------------
_ANY = -1
_FIELDS = ("shape", "color", "size", "position")


@dataclass(frozen=True)
class Caption:
    """A caption and what it claims: one or two objects, each a tuple of
    attribute indices (shape, color, size, position; -1 = not stated), and for
    two objects the relation index of the first to the second (-1 = "and")."""

    text: str
    objects: tuple[tuple[int, int, int, int], ...]
    relation: int = _ANY


def _phrase(c: tuple[int, int, int, int]) -> str:
    s, col, size, pos = c
    return object_phrase(CLASSES[s], COLORS[col] if col >= 0 else None,
                         SIZES[size] if size >= 0 else None, POSITIONS[pos] if pos >= 0 else None)


def _make_caption(objs: list[tuple[int, int, int, int]], rel: int = _ANY,
                  photo: bool = False) -> Caption:
    if len(objs) == 1:
        text = _phrase(objs[0])
        text = f"a photo of {text}" if photo else text
    else:
        link = RELATIONS[rel] if rel >= 0 else "and"
        text = f"{_phrase(objs[0])} {link} {_phrase(objs[1])}"
    return Caption(text, tuple(objs), rel)


#: caption kinds and their probabilities for one-object and two-object scenes
SINGLE_KINDS = {"photo": 0.25, "color": 0.2, "size_color": 0.15, "color_position": 0.15,
                "full": 0.25}
PAIR_KINDS = {"relation": 0.3, "and": 0.1, "one_color": 0.3, "one_photo": 0.15,
              "one_size_color": 0.15}


def sample_captions(scenes: Scenes, rng: np.random.Generator) -> list[Caption]:
    """One random caption per scene, true of that scene (deterministic for ``rng``).

    Kinds are drawn from :data:`SINGLE_KINDS` / :data:`PAIR_KINDS`; captions
    of a pair may name only one of its objects (then chosen at random).
    """
    att = attribute_arrays(scenes)
    n, k = att["shape"].shape
    kinds = SINGLE_KINDS if k == 1 else PAIR_KINDS
    names = list(kinds)
    probs = np.array([kinds[x] for x in names])
    draw = rng.choice(len(names), size=n, p=probs / probs.sum())
    pick = rng.integers(0, k, n)
    swap = rng.random(n) < 0.5
    out = []
    for i in range(n):
        kind = names[draw[i]]

        def obj(j: int, color=True, size=False, position=False) -> tuple[int, int, int, int]:
            return (int(att["shape"][i, j]), int(att["color"][i, j]) if color else _ANY,
                    int(att["size"][i, j]) if size else _ANY,
                    int(att["position"][i, j]) if position else _ANY)

        j = int(pick[i])
        if kind in ("photo", "one_photo"):
            out.append(_make_caption([obj(j, color=False)], photo=True))
        elif kind in ("color", "one_color"):
            out.append(_make_caption([obj(j)]))
        elif kind in ("size_color", "one_size_color"):
            out.append(_make_caption([obj(j, size=True)]))
        elif kind == "color_position":
            out.append(_make_caption([obj(j, position=True)]))
        elif kind == "full":
            out.append(_make_caption([obj(j, size=True, position=True)], photo=True))
        else:
            a, b = (1, 0) if swap[i] else (0, 1)
            rel = int(att["relation"][i])
            rel = (rel if a == 0 else rel ^ 1) if kind == "relation" else _ANY
            out.append(_make_caption([obj(a), obj(b)], rel))
    return out


def confusable_captions(scenes: Scenes, rng: np.random.Generator) -> list[Caption]:
    """One "{colour} {shape}" caption per scene that is (almost always) false of
    it but shares its words: the hard negatives that teach a CLIP to bind a
    colour to its shape and to tell neighbouring hues apart.

    For a pair with two shapes and two colours, half of the time the colour of
    one object goes with the shape of the other ("a red ring" for a red star and
    a blue ring); otherwise one object keeps its shape and takes the
    neighbouring hue bin, or keeps its colour and takes another shape.  The few
    that happen to be true are scored as true by :func:`caption_truth`.
    """
    att = attribute_arrays(scenes)
    n, k = att["shape"].shape
    hues = len(COLOR_BINS)
    pick = rng.integers(0, k, n)
    mode = rng.random((n, 2))
    step = np.where(rng.random(n) < 0.5, -1, 1)
    other_shape = rng.integers(1, len(CLASSES), n)
    out = []
    for i in range(n):
        j = int(pick[i])
        shape, color = int(att["shape"][i, j]), int(att["color"][i, j])
        if k == 2 and mode[i, 0] < 0.5 and att["shape"][i, 0] != att["shape"][i, 1] \
                and att["color"][i, 0] != att["color"][i, 1]:
            color = int(att["color"][i, 1 - j])
        elif mode[i, 1] < 0.5 and color < hues:
            color = (color + int(step[i])) % hues
        else:
            shape = (shape + int(other_shape[i])) % len(CLASSES)
        out.append(_make_caption([(shape, color, _ANY, _ANY)]))
    return out


def caption_truth(captions: list[Caption], attributes: list[dict[str, np.ndarray]]) -> np.ndarray:
    """Boolean matrix (scenes, captions): is caption ``c`` true of scene ``s``?

    ``attributes`` are :func:`attribute_arrays` of one or more scene batches,
    taken in order.  An object matches a caption's object when every stated
    attribute is equal; a two-object caption needs two different objects
    matching in the stated relation.
    """
    rows = []
    cons = np.array([c.objects[0] for c in captions], np.int64)  # (C, 4)
    cons2 = np.array([c.objects[1] if len(c.objects) > 1 else (_ANY,) * 4 for c in captions],
                     np.int64)
    two = np.array([len(c.objects) == 2 for c in captions])
    rel = np.array([c.relation for c in captions])
    for att in attributes:
        obj = np.stack([att[f] for f in _FIELDS], -1)  # (S, K, 4)

        def match(c: np.ndarray) -> np.ndarray:  # (S, K, C)
            eq = (c[None, None] == _ANY) | (obj[:, :, None] == c[None, None])
            return eq.all(-1)

        m1, m2 = match(cons), match(cons2)
        truth = m1.any(1) & ~two[None]
        if obj.shape[1] == 2:
            r01 = att["relation"][:, None]
            ok01 = (rel[None] == _ANY) | (rel[None] == r01)
            ok10 = (rel[None] == _ANY) | (rel[None] == (r01 ^ 1))
            pair = (m1[:, 0] & m2[:, 1] & ok01) | (m1[:, 1] & m2[:, 0] & ok10)
            truth |= pair & two[None]
        rows.append(truth)
    return np.concatenate(rows, 0)


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
class Tokenizer:
    """Word-level tokenizer over a fixed vocabulary.

    Ids: 0 = padding, then the words, then the start token and, as the largest
    id, the end token, so ``input_ids.argmax(-1)`` is the end position (the
    pooling position of OpenAI CLIP and of HF ``CLIPTextTransformer``).
    Words are matched case-insensitively; ``.`` and ``,`` are dropped.
    """

    def __init__(self, words: tuple[str, ...] = VOCAB):
        self.vocab = (PAD,) + tuple(words) + (START, END)
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self._lower = {w.lower(): i for i, w in enumerate(words, start=1)}
        self.pad_id, self.start_id, self.end_id = 0, len(self.vocab) - 2, len(self.vocab) - 1

    def __len__(self) -> int:
        return len(self.vocab)

    def words(self, text: str) -> list[str]:
        """The vocabulary words of ``text``; ValueError naming unknown words."""
        toks = text.replace(",", " ").replace(".", " ").split()
        unknown = [t for t in toks if t.lower() not in self._lower]
        if unknown:
            distinct = list(dict.fromkeys(unknown))
            named = ", ".join(quoted(w, 30) for w in distinct[:5]) + (f" and {len(distinct) - 5} more" if len(distinct) > 5 else "")
            raise ValueError(f"unknown words {named} in {quoted(text)}; the vocabulary is {', '.join(self.vocab[1:-2])}")
        return [self.vocab[self._lower[t.lower()]] for t in toks]

    def encode(self, texts: str | list[str], context_length: int = 16) -> dict[str, torch.Tensor]:
        """``{"input_ids": (B, L) int64, "attention_mask": (B, L) int64}``:
        start, words, end, then padding 0."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        ids = torch.zeros(len(texts), context_length, dtype=torch.int64)
        for b, t in enumerate(texts):
            seq = [self.start_id] + [self.ids[w] for w in self.words(t)] + [self.end_id]
            if len(seq) > context_length:
                raise ValueError(f"{quoted(t)} needs {len(seq)} tokens, context_length is {context_length}")
            ids[b, :len(seq)] = torch.tensor(seq)
        return {"input_ids": ids, "attention_mask": (ids != self.pad_id).long()}

    __call__ = encode

    def tokens(self, ids) -> list[list[str]]:
        """Token strings per position (padding included) of a (B, L) or (L,) id array."""
        ids = torch.as_tensor(ids)
        rows = ids.view(1, -1) if ids.ndim == 1 else ids
        return [[self.vocab[int(i)] for i in row] for row in rows]

    def decode(self, ids) -> list[str]:
        """Caption text per row, without special tokens and padding."""
        special = {PAD, START, END}
        return [" ".join(w for w in row if w not in special) for row in self.tokens(ids)]
