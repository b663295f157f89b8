"""A visual-question world with ground truth, built on the shapes world.

Every item is a scene (one, two or three objects, :func:`~relevancy.worlds.scenes.make_scenes`),
a question about it from a fixed grammar, its answer (an index into :data:`ANSWERS`) and the
scene as *regions*, the way LXMERT takes an image: :data:`N_REGIONS` boxes, each with a feature
vector (``visual_feats``) and its normalised box ``(x1, y1, x2, y2)`` (``visual_pos``).

Question types (:data:`QUESTION_TYPES`) and grammar; ``{shape}`` is a class name of
:data:`~relevancy.worlds.scenes.CLASSES`, ``{colour}`` a colour name of
:data:`~relevancy.worlds.captions.COLORS` (:func:`~relevancy.worlds.captions.color_name`)::

    exist     is there a {shape}                     yes / no
              is there a {colour} {shape}            yes / no (negatives: absent shape, or a present
                                                     shape in another colour)
    color     what color is the {shape}              a colour name
    shape     what shape is the {colour} object      a shape name (only when one object has that colour)
    relation  what is {left of|right of|above|below} the {shape}
                                                     a shape name (exactly one object in that relation)
    count     how many objects are there             one / two / three
              how many {colour} objects are there    zero / one / two / three

Only answerable, unambiguous questions are asked: colour words are used only when every object's
hue is at least :data:`HUE_MARGIN` degrees from a colour-bin border, relations only when every
other object is clearly more horizontal than vertical from the referent or vice versa
(:data:`RELATION_RATIO`), and the relation's answer is the single object in that relation.

Regions: the box of every object (the bounding box of its mask, each side jittered by up to
:data:`BOX_JITTER` px as a detector would give), then background boxes (random sizes and places,
overlapping no object box by more than :data:`MAX_BACKGROUND_OVERLAP` of either box; they hold
the clutter), in a random order per scene.  A region's feature (:data:`FEATURE_DIM` numbers) is

* the frozen shapes ViT's (:func:`~relevancy.worlds.shapes_vit.load_model`) last-layer patch tokens
  (after the final norm), averaged over the 8x8 patches with weights = the area of the patch
  inside the box (96 numbers; the ViT was trained to label patches with their shape);
* the box's pixels area-averaged to a 4x4 RGB crop, normalised like the images (48 numbers);
* hue histograms of the box's pixels, 12 circular triangular bins of 30 degrees, each pixel
  weighted by saturation x value: averaged over the box (scaled by 4) and averaged with a tent
  weight peaking at the box centre, where the object is (scaled by 8) (2 x 12 numbers).

Ground truth per question: ``target_regions`` (the regions of the object(s) the question is
about: the named object; for relations the referent and the answer; for counts the counted
objects; nothing for an existence question answered "no", see ``has_target``) and
``target_tokens`` (the token positions of the words naming them: the shape and colour words,
``object``/``objects`` for the generic noun).

Scene seeds: ``make_questions(n, seed)`` renders its one-, two- and three-object scenes from
``seed``, ``seed + 1`` and ``seed + 2``, and draws questions and boxes from
``numpy.random.default_rng([seed, 7])``: deterministic per seed.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, field

import numpy as np
import torch

from .captions import COLOR_BINS, COLORS, Tokenizer, _relation_index, attribute_arrays, object_phrase
from .scenes import CLASSES, IMAGE_SIZE, PATCH_SIZE, make_scenes

__all__ = [
    "QUESTION_TYPES",
    "ANSWERS",
    "WORDS",
    "N_REGIONS",
    "MAX_LENGTH",
    "FEATURE_DIM",
    "VqaBatch",
    "make_questions",
    "question_tokenizer",
    "region_features",
]

QUESTION_TYPES = ("exist", "color", "shape", "relation", "count")
#: probability of each question type, renormalised over the types a scene can answer
TYPE_WEIGHTS = (0.2, 0.2, 0.2, 0.25, 0.15)
#: fraction of one-, two- and three-object scenes
OBJECT_MIX = (0.25, 0.4, 0.35)
COUNT_WORDS = ("zero", "one", "two", "three")
ANSWERS = ("no", "yes") + tuple(CLASSES) + tuple(COLORS) + COUNT_WORDS
RELATION_WORDS = ("left of", "right of", "above", "below")  # = captions.RELATIONS
_FUNCTION_WORDS = ("is", "there", "a", "an", "what", "color", "shape", "the", "object", "objects",
                   "left", "right", "of", "above", "below", "how", "many", "are")
#: every word a question can hold
WORDS = tuple(dict.fromkeys(_FUNCTION_WORDS + tuple(COLORS) + tuple(CLASSES)))
MAX_LENGTH = 12
N_REGIONS = 10
MAX_OBJECTS = 3
BOX_JITTER = 1
MAX_BACKGROUND_OVERLAP = 0.25
#: colour words only for objects whose hue is this far (degrees) from a colour-bin border
HUE_MARGIN = 5.0
#: a relation is clear when the dominant axis of the centre difference is this many times the other
RELATION_RATIO = 1.3
HUE_BINS = 12
CROP = 4
VIT_DIM = 96
#: scales of the whole-box and of the centre-weighted hue histograms
HUE_SCALE = (4.0, 8.0)
FEATURE_DIM = VIT_DIM + 3 * CROP * CROP + 2 * HUE_BINS

_HUE_BORDERS = np.array(sorted({b[1] for b in COLOR_BINS} | {b[2] for b in COLOR_BINS}))
_VIT = None


def question_tokenizer() -> Tokenizer:
    """The word-level question tokenizer: ``<pad>`` (0), the :data:`WORDS`, ``<start>`` (LXMERT's
    [CLS], first position, pooled by the QA head) and ``<end>`` ([SEP])."""
    return Tokenizer(WORDS)


def _vit():
    global _VIT
    if _VIT is None:
        from .shapes_vit import load_model

        _VIT = load_model()
    return _VIT


@dataclass
class VqaBatch:
    """Questions about scenes, with regions and ground truth (``n`` items, ``N`` regions, ``T`` tokens).

    questions      : list of n question texts (no question mark)
    qtype          : numpy int64 (n,), index into :data:`QUESTION_TYPES`
    answers        : torch.long (n,), index into :data:`ANSWERS`
    input_ids, attention_mask, token_type_ids : torch.long (n, T)
    visual_feats   : torch.float32 (n, N, FEATURE_DIM) (None when built without features)
    visual_pos     : torch.float32 (n, N, 4), boxes x1, y1, x2, y2 divided by the image size
    boxes          : numpy float32 (n, N, 4), the boxes in pixels
    object_region  : numpy int64 (n, 3), the region of each object (-1: no such object)
    target_regions : torch.bool (n, N), regions of the object(s) the question is about
    target_tokens  : torch.bool (n, T), token positions of the words naming them
    has_target     : numpy bool (n,), False for an existence question answered "no"
    n_objects      : numpy int64 (n,)
    pixels         : numpy uint8 (n, 64, 64, 3); masks torch.bool (n, 3, 64, 64), zero for absent objects
    attributes     : dict of numpy (n, 3) arrays ``shape``, ``color`` (index into COLORS), ``cx``, ``cy``,
                     ``hue`` (degrees) and ``rgb`` (n, 3, 3) (base colour 0..255), -1 / nan for absent objects
    """

    questions: list
    qtype: np.ndarray
    answers: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    visual_feats: torch.Tensor | None
    visual_pos: torch.Tensor
    boxes: np.ndarray
    object_region: np.ndarray
    target_regions: torch.Tensor
    target_tokens: torch.Tensor
    has_target: np.ndarray
    n_objects: np.ndarray
    pixels: np.ndarray = field(repr=False)
    masks: torch.Tensor = field(repr=False)
    attributes: dict = field(repr=False)
    seed: int = 0

    def __len__(self) -> int:
        return len(self.questions)

    def model_inputs(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """The keyword inputs of ``LxmertForQuestionAnswering`` (and of the library's LXMERT adapter)."""
        if self.visual_feats is None:
            raise ValueError("this batch was built with features=False")
        d = dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                 token_type_ids=self.token_type_ids, visual_feats=self.visual_feats,
                 visual_pos=self.visual_pos)
        return {k: v.to(device) for k, v in d.items()} if device is not None else d

    def answer_names(self) -> list[str]:
        return [ANSWERS[int(a)] for a in self.answers]

    def type_names(self) -> list[str]:
        return [QUESTION_TYPES[int(t)] for t in self.qtype]


# --------------------------------------------------------------------------
# scenes and attributes
# --------------------------------------------------------------------------
def _hues(colors: np.ndarray) -> np.ndarray:
    flat = colors.reshape(-1, 3) / 255.0
    return np.array([colorsys.rgb_to_hsv(*c)[0] * 360.0 for c in flat]).reshape(colors.shape[:-1])


def _hue_margin(hue: np.ndarray) -> np.ndarray:
    d = np.abs(hue[..., None] - _HUE_BORDERS)
    return np.minimum(d, 360.0 - d).min(-1)


def _mask_boxes(masks: np.ndarray) -> np.ndarray:
    """Bounding boxes (..., 4) in pixels (x1, y1, x2 exclusive, y2 exclusive) of masks (..., H, W)."""
    cols, rows = masks.any(-2), masks.any(-1)
    size = masks.shape[-1]
    idx = np.arange(size)
    x1 = np.where(cols, idx, size).min(-1)
    x2 = np.where(cols, idx + 1, 0).max(-1)
    y1 = np.where(rows, idx, size).min(-1)
    y2 = np.where(rows, idx + 1, 0).max(-1)
    return np.stack([x1, y1, x2, y2], -1).astype(np.float32)


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection area over the smaller box area, boxes (..., 4) broadcast."""
    iw = np.clip(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0, None)
    ih = np.clip(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0, None)
    area = lambda x: (x[..., 2] - x[..., 0]) * (x[..., 3] - x[..., 1])  # noqa: E731
    return iw * ih / np.maximum(np.minimum(area(a), area(b)), 1e-6)


def _regions(rng, obj_boxes: np.ndarray, present: np.ndarray):
    """Boxes (n, N, 4) in pixels and the region index of each object (n, 3)."""
    n = obj_boxes.shape[0]
    size = float(IMAGE_SIZE)
    jit = rng.integers(-BOX_JITTER, BOX_JITTER + 1, obj_boxes.shape).astype(np.float32)
    ob = np.clip(obj_boxes + jit, 0.0, size)
    ob[..., 2:] = np.maximum(ob[..., 2:], ob[..., :2] + 2.0)
    # background candidates
    M = 48
    w = rng.uniform(8.0, 30.0, (n, M))
    h = np.clip(w * np.exp(rng.uniform(-0.5, 0.5, (n, M))), 6.0, 34.0)
    x1 = rng.uniform(0.0, 1.0, (n, M)) * (size - w)
    y1 = rng.uniform(0.0, 1.0, (n, M)) * (size - h)
    cand = np.rint(np.stack([x1, y1, x1 + w, y1 + h], -1)).astype(np.float32)
    ov = _overlap(cand[:, :, None], ob[:, None])  # (n, M, 3)
    ok = ((ov <= MAX_BACKGROUND_OVERLAP) | ~present[:, None]).all(-1)
    order = np.argsort(~ok, axis=1, kind="stable")  # valid candidates first, in drawn order
    boxes = np.zeros((n, N_REGIONS, 4), np.float32)
    obj_region = np.full((n, MAX_OBJECTS), -1, np.int64)
    perm = rng.permuted(np.tile(np.arange(N_REGIONS), (n, 1)), axis=1)
    k = present.sum(1)
    for i in range(n):
        slots = list(ob[i, present[i]]) + list(cand[i, order[i, :N_REGIONS - k[i]]])
        boxes[i, perm[i]] = np.stack(slots)
        obj_region[i, :k[i]] = perm[i, :k[i]]
    return boxes, obj_region


# --------------------------------------------------------------------------
# region features
# --------------------------------------------------------------------------
def _interval_weights(lo: torch.Tensor, hi: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Length of [lo, hi] inside each cell [edges[c], edges[c + 1]]: (...,) -> (..., cells)."""
    a = torch.maximum(lo[..., None], edges[:-1])
    b = torch.minimum(hi[..., None], edges[1:])
    return (b - a).clamp(min=0.0)


def _cell_weights(boxes: torch.Tensor, cells: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Area-average weights (n, N, cells, size) along x and y of ``cells`` equal sub-intervals of each box."""
    pix = torch.arange(size + 1, dtype=torch.float32)
    out = []
    for lo, hi in ((boxes[..., 0], boxes[..., 2]), (boxes[..., 1], boxes[..., 3])):
        t = torch.arange(cells + 1, dtype=torch.float32) / cells
        edges = lo[..., None] + (hi - lo)[..., None] * t  # (n, N, cells + 1)
        w = _interval_weights(edges[..., :-1], edges[..., 1:], pix)
        out.append(w / w.sum(-1, keepdim=True).clamp(min=1e-6))
    return out[0], out[1]


def _hue_maps(pixels: np.ndarray) -> torch.Tensor:
    """(n, HUE_BINS, H, W): each pixel's hue spread linearly on the two nearest of HUE_BINS circular bin
    centres (triangular bins), weighted by saturation x value."""
    rgb = torch.from_numpy(pixels).float() / 255.0
    mx, _ = rgb.max(-1)
    mn, _ = rgb.min(-1)
    delta = mx - mn
    r, g, b = rgb.unbind(-1)
    safe = delta.clamp(min=1e-6)
    h = torch.where(mx == r, ((g - b) / safe) % 6.0,
                    torch.where(mx == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0)) * 60.0
    sat = torch.where(mx > 0, delta / mx.clamp(min=1e-6), torch.zeros_like(mx))
    weight = sat * mx
    pos = h / (360.0 / HUE_BINS)  # triangular bins centred on multiples of 30 degrees
    lo = pos.floor()
    frac = pos - lo
    lo = lo.long() % HUE_BINS
    out = torch.zeros(pixels.shape[0], HUE_BINS, pixels.shape[1], pixels.shape[2])
    out.scatter_add_(1, lo[:, None], ((1.0 - frac) * weight)[:, None])
    out.scatter_add_(1, ((lo + 1) % HUE_BINS)[:, None], (frac * weight)[:, None])
    return out


@torch.no_grad()
def region_features(images: torch.Tensor, pixels: np.ndarray, boxes: np.ndarray, vit=None,
                    batch_size: int = 256) -> torch.Tensor:
    """Features (n, N, FEATURE_DIM) of pixel boxes (n, N, 4) of scenes (images normalised, pixels uint8)."""
    vit = _vit() if vit is None else vit
    device = next(vit.parameters()).device
    toks = []
    for s in range(0, len(images), batch_size):
        f = vit.forward_features(images[s:s + batch_size].to(device))
        toks.append(f[:, vit.num_prefix_tokens:].float().cpu())
    tok = torch.cat(toks)  # (n, P, D)
    g = IMAGE_SIZE // PATCH_SIZE
    b = torch.from_numpy(boxes)
    edges = torch.arange(g + 1, dtype=torch.float32) * PATCH_SIZE
    wx = _interval_weights(b[..., 0], b[..., 2], edges)  # (n, N, g)
    wy = _interval_weights(b[..., 1], b[..., 3], edges)
    w = (wy[..., :, None] * wx[..., None, :]).flatten(2)  # (n, N, P)
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-6)
    vit_feat = torch.bmm(w, tok)
    cx, cy = _cell_weights(b, CROP, IMAGE_SIZE)  # (n, N, CROP, W)
    crop = torch.einsum("nriy,ncyx,nrjx->nrcij", cy, images.float(), cx).flatten(2)
    hmap = _hue_maps(pixels)
    px, py = _cell_weights(b, 1, IMAGE_SIZE)
    hue = torch.einsum("nry,nbyx,nrx->nrb", py[:, :, 0], hmap, px[:, :, 0]) * HUE_SCALE[0]
    # centre-weighted: a tent over the box, 1 at its centre, 0 at its border
    c = torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5
    tents = []
    for lo, hi in ((b[..., 0], b[..., 2]), (b[..., 1], b[..., 3])):
        mid, half = (lo + hi)[..., None] / 2, ((hi - lo)[..., None] / 2).clamp(min=0.5)
        t = (1.0 - (c - mid).abs() / half).clamp(min=0.0)
        tents.append(t / t.sum(-1, keepdim=True).clamp(min=1e-6))
    centre = torch.einsum("nry,nbyx,nrx->nrb", tents[1], hmap, tents[0]) * HUE_SCALE[1]
    return torch.cat([vit_feat, crop, hue, centre], -1)


# --------------------------------------------------------------------------
# questions
# --------------------------------------------------------------------------
def _relation_matrix(cx: np.ndarray, cy: np.ndarray, k: int) -> np.ndarray:
    """rel[a, b]: relation index of object a to object b (RELATION_WORDS), -1 when unclear or a == b."""
    rel = np.full((MAX_OBJECTS, MAX_OBJECTS), -1, np.int64)
    for a in range(k):
        for b in range(k):
            if a == b:
                continue
            dx, dy = cx[b] - cx[a], cy[b] - cy[a]
            big, small = max(abs(dx), abs(dy)), min(abs(dx), abs(dy))
            if big >= RELATION_RATIO * small:
                rel[a, b] = int(_relation_index(np.asarray(dx), np.asarray(dy)))
    return rel


def _question(rng, t: str, k: int, shape: np.ndarray, color: np.ndarray, ok: np.ndarray,
              rel: np.ndarray):
    """One question of type ``t`` or None: (text, answer, target objects).  ``ok[j]``: object j's
    colour name is safe to use (hue far from a bin border); colour words about one object need its
    flag, colour words that select among the objects need every flag."""
    C, S = len(COLORS), len(CLASSES)
    hue_colors = [c for c in range(C) if COLORS[c] not in ("white", "gray", "black")]
    all_ok = bool(ok[:k].all())
    safe = [j for j in range(k) if ok[j]]
    if t == "exist":
        with_color = bool(safe) and rng.random() < 0.5
        if rng.random() < 0.5:  # yes
            j = int(safe[rng.integers(len(safe))] if with_color else rng.integers(k))
            phrase = object_phrase(CLASSES[shape[j]], COLORS[color[j]] if with_color else None)
            return f"is there {phrase}", "yes", [j]
        if with_color and rng.random() < 0.5:  # a present shape in another colour
            j = safe[rng.integers(len(safe))]
            others = [c for c in hue_colors if c != color[j]]
            phrase = object_phrase(CLASSES[shape[j]], COLORS[others[rng.integers(len(others))]])
            return f"is there {phrase}", "no", []
        absent = [s for s in range(S) if s not in shape[:k]]
        s = absent[rng.integers(len(absent))]
        col = COLORS[hue_colors[rng.integers(len(hue_colors))]] if with_color else None
        return f"is there {object_phrase(CLASSES[s], col)}", "no", []
    if t == "color":
        if not safe:
            return None
        j = safe[rng.integers(len(safe))]
        return f"what color is the {CLASSES[shape[j]]}", COLORS[color[j]], [j]
    if t == "shape":
        if not all_ok:
            return None
        unique = [j for j in range(k) if (color[:k] == color[j]).sum() == 1]
        if not unique:
            return None
        j = unique[rng.integers(len(unique))]
        return f"what shape is the {COLORS[color[j]]} object", CLASSES[shape[j]], [j]
    if t == "relation":
        options = []
        for x in range(k):
            others = [a for a in range(k) if a != x]
            if not others or any(rel[a, x] < 0 for a in others):
                continue
            for r in range(4):
                hit = [a for a in others if rel[a, x] == r]
                if len(hit) == 1:
                    options.append((x, r, hit[0]))
        if not options:
            return None
        x, r, a = options[rng.integers(len(options))]
        return f"what is {RELATION_WORDS[r]} the {CLASSES[shape[x]]}", CLASSES[shape[a]], [x, a]
    if t == "count":
        if all_ok and rng.random() < 0.5:
            present = sorted(set(int(c) for c in color[:k]))
            if rng.random() < 0.7:
                c = present[rng.integers(len(present))]
            else:
                absent = [c for c in hue_colors if c not in present]
                c = absent[rng.integers(len(absent))]
            js = [j for j in range(k) if color[j] == c]
            return f"how many {COLORS[c]} objects are there", COUNT_WORDS[len(js)], js
        return "how many objects are there", COUNT_WORDS[k], list(range(k))
    raise ValueError(t)


def _naming_positions(words: list[str]) -> list[int]:
    """Word indices (0-based, without the start token) naming the question's objects."""
    names = set(CLASSES) | set(COLORS) | {"object", "objects"}
    return [i for i, w in enumerate(words) if w in names]


def _scenes_mixed(n: int, seed: int, rng):
    counts = rng.multinomial(n, OBJECT_MIX) if n > 0 else np.zeros(3, np.int64)
    parts = [make_scenes(int(m), seed=seed + k, objects=k + 1) for k, m in enumerate(counts)]
    order = rng.permutation(n)  # item order[i] <- i-th scene of the concatenation
    H = IMAGE_SIZE
    pixels = np.zeros((n, H, H, 3), np.uint8)
    images = torch.zeros(n, 3, H, H)
    masks = torch.zeros(n, MAX_OBJECTS, H, H, dtype=torch.bool)
    att = {k: np.full((n, MAX_OBJECTS), -1, np.int64) for k in ("shape", "color")}
    for k in ("cx", "cy", "hue"):
        att[k] = np.full((n, MAX_OBJECTS), np.nan)
    att["rgb"] = np.full((n, MAX_OBJECTS, 3), np.nan)
    n_obj = np.zeros(n, np.int64)
    s = 0
    for k, sc in enumerate(parts):
        m = len(sc)
        if m == 0:
            continue
        idx = order[s:s + m]
        s += m
        pixels[idx] = sc.pixels
        images[torch.from_numpy(idx)] = sc.images
        masks[torch.from_numpy(idx), :k + 1] = sc.masks
        a = attribute_arrays(sc)
        att["shape"][idx, :k + 1] = a["shape"]
        att["color"][idx, :k + 1] = a["color"]
        att["cx"][idx, :k + 1] = sc.params["cx"]
        att["cy"][idx, :k + 1] = sc.params["cy"]
        att["hue"][idx, :k + 1] = _hues(sc.params["color"])
        att["rgb"][idx, :k + 1] = sc.params["color"]
        n_obj[idx] = k + 1
    return pixels, images, masks, att, n_obj


def make_questions(n: int, seed: int = 0, questions_per_scene: int = 1, features: bool = True,
                   vit=None, tokenizer: Tokenizer | None = None) -> VqaBatch:
    """``n`` scenes (mixed one-, two-, three-object scenes, :data:`OBJECT_MIX`) with
    ``questions_per_scene`` questions each (consecutive items share a scene and its regions),
    regions, region features (``features=False`` skips the ViT) and ground truth."""
    rng = np.random.default_rng([seed, 7])
    tok = tokenizer or question_tokenizer()
    pixels, images, masks, att, n_obj = _scenes_mixed(n, seed, rng)
    present = np.arange(MAX_OBJECTS)[None] < n_obj[:, None]
    obj_boxes = _mask_boxes(masks.numpy())
    boxes, obj_region = _regions(rng, obj_boxes, present)
    feats = region_features(images, pixels, boxes, vit) if features else None

    q = questions_per_scene
    types = np.arange(len(QUESTION_TYPES))
    weights = np.asarray(TYPE_WEIGHTS)
    texts, qtype, answers, target_obj = [], [], [], []
    for i in range(n):
        k = int(n_obj[i])
        ok = _hue_margin(att["hue"][i]) >= HUE_MARGIN
        rel = _relation_matrix(att["cx"][i], att["cy"][i], k)
        shape, color = att["shape"][i], att["color"][i]
        used = set()
        for _ in range(q):
            avail = weights.copy()
            for _try in range(20):
                t = int(rng.choice(types, p=avail / avail.sum()))
                res = _question(rng, QUESTION_TYPES[t], k, shape, color, ok, rel)
                if res is None:
                    avail[t] = 0.0
                    continue
                if res[0] in used and _try < 19:
                    continue
                break
            text, ans, objs = res
            used.add(text)
            texts.append(text)
            qtype.append(t)
            answers.append(ANSWERS.index(ans))
            target_obj.append(objs)
    m = n * q
    enc = tok.encode(texts, MAX_LENGTH)
    target_tokens = torch.zeros(m, MAX_LENGTH, dtype=torch.bool)
    target_regions = torch.zeros(m, N_REGIONS, dtype=torch.bool)
    scene = np.repeat(np.arange(n), q)
    for b in range(m):
        words = tok.words(texts[b])
        for p in _naming_positions(words):
            target_tokens[b, p + 1] = True
        for j in target_obj[b]:
            target_regions[b, obj_region[scene[b], j]] = True
    has_target = np.array([len(o) > 0 for o in target_obj])
    rep = lambda x: x[scene] if q > 1 else x  # noqa: E731
    trep = lambda x: x[torch.from_numpy(scene)] if q > 1 else x  # noqa: E731
    return VqaBatch(
        questions=texts, qtype=np.asarray(qtype, np.int64), answers=torch.tensor(answers),
        input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
        token_type_ids=torch.zeros_like(enc["input_ids"]),
        visual_feats=trep(feats) if feats is not None else None,
        visual_pos=trep(torch.from_numpy(boxes / IMAGE_SIZE)),
        boxes=rep(boxes), object_region=rep(obj_region), target_regions=target_regions,
        target_tokens=target_tokens, has_target=has_target, n_objects=rep(n_obj),
        pixels=rep(pixels), masks=trep(masks), attributes={k: rep(v) for k, v in att.items()},
        seed=seed,
    )
