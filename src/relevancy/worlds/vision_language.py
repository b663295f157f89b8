"""A vision-language world with ground truth: shapes scenes described and asked about in words.

Every item is a scene (one, two or three objects of distinct shapes, :func:`~relevancy.worlds.scenes.make_scenes`),
a prompt and the answer a vision-language decoder should write:

    describe the scene          a blue circle below a red star       (every object, colour and shape)
    what color is the star      red                                  (and the other questions of
    what shape is the red object  star                                relevancy.worlds.questions's grammar:
    what is above the circle    star                                  exist, color, shape, relation, count)
    is there a green heart      no
    how many objects are there  two

Descriptions name the objects in the order of :data:`~relevancy.worlds.scenes.CLASSES` (a fixed order, so the
description of a scene is one text); two objects are linked by the relation of the first to the second ("left of",
"right of", "above", "below"), three by "and".  Only unambiguous scenes are drawn: every object's hue is at least
:data:`~relevancy.worlds.questions.HUE_MARGIN` degrees from a colour-bin border and every pair of objects is clearly more
horizontal than vertical from each other or vice versa (:data:`~relevancy.worlds.questions.RELATION_RATIO`), so every
answer is one text and the model can be scored by exact match.

Ground truth per answer word (``VlmBatch.named``): the object whose mask it names, -1 for none.  In a description
every colour and shape word names its object; a colour answer names the asked object, a shape answer the object
it is (the one of that colour, or the one in the asked relation); yes, no and counts name none.

Seeds: ``make_vlm(n, seed)`` renders its one-, two- and three-object scenes from scene seeds ``seed``, ``seed + 1``,
``seed + 2`` (``+ 3 r`` in the rare round ``r`` that needs more unambiguous scenes, at most
:data:`MAX_ROUNDS`) and draws tasks and questions from ``numpy.random.default_rng([seed, 11])``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .captions import COLORS, RELATIONS, attribute_arrays, object_phrase
from .scenes import CLASSES, IMAGE_SIZE, Scenes, make_scenes
from .questions import (ANSWERS, HUE_MARGIN, MAX_OBJECTS, OBJECT_MIX, QUESTION_TYPES, TYPE_WEIGHTS, WORDS, _hue_margin,
                  _hues, _question, _relation_matrix)

__all__ = ["DESCRIBE", "TASKS", "TASK_WEIGHTS", "VOCABULARY", "MAX_ROUNDS", "VlmBatch", "make_vlm", "describe_scene"]

#: the prompt asking for a description
DESCRIBE = "describe the scene"
#: what an item asks: a description, or one of the question types of relevancy.worlds.questions
TASKS = ("describe",) + QUESTION_TYPES
#: probability of each task (descriptions, then the question types in the proportions of relevancy.worlds.questions)
TASK_WEIGHTS = (0.4,) + tuple(0.6 * w / sum(TYPE_WEIGHTS) for w in TYPE_WEIGHTS)
#: every word a prompt or an answer can hold
VOCABULARY = tuple(dict.fromkeys(WORDS + ANSWERS + tuple(DESCRIBE.split()) + ("and",)
                                 + tuple(w for r in RELATIONS for w in r.split())))
#: oversampling of candidate scenes per round, and the rounds at most
OVERSAMPLE = 3
MAX_ROUNDS = 8


@dataclass
class VlmBatch:
    """Prompts and answers about scenes (``n`` items, one per scene).

    prompts    : list of n prompt texts (without the image placeholder)
    answers    : list of n answer texts (words separated by single spaces)
    task       : numpy int64 (n,), index into :data:`TASKS`
    named      : list of n lists, per answer word the object (index into ``masks[i]``) it names, -1 for none
    images     : torch.float32 (n, 3, 64, 64), normalised as the shapes world's images
    pixels     : numpy uint8 (n, 64, 64, 3)
    masks      : torch.bool (n, 3, 64, 64), exactly each object's pixels, zero for absent objects
    n_objects  : numpy int64 (n,)
    shape, color : numpy int64 (n, 3): class index and index into COLORS per object, -1 for absent objects
    """

    prompts: list
    answers: list
    task: np.ndarray
    named: list
    images: torch.Tensor = field(repr=False)
    pixels: np.ndarray = field(repr=False)
    masks: torch.Tensor = field(repr=False)
    n_objects: np.ndarray
    shape: np.ndarray
    color: np.ndarray
    seed: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def task_names(self) -> list[str]:
        return [TASKS[int(t)] for t in self.task]


def _clear(scenes: Scenes) -> np.ndarray:
    """(n,) bool: every object's hue is clear of the colour-bin borders and every pair's relation is clear."""
    p = scenes.params
    ok = (_hue_margin(_hues(p["color"])) >= HUE_MARGIN).all(1)
    k = scenes.objects
    for i in np.flatnonzero(ok):
        rel = _relation_matrix(p["cx"][i], p["cy"][i], k)
        ok[i] = all(rel[a, b] >= 0 for a in range(k) for b in range(k) if a != b)
    return ok


def _clear_scenes(m: int, seed: int, objects: int) -> list[tuple[Scenes, np.ndarray]]:
    """``m`` unambiguous scenes of ``objects`` objects: per round, its candidate scenes and the indices kept."""
    kept: list[tuple[Scenes, np.ndarray]] = []
    have = 0
    for r in range(MAX_ROUNDS):
        if have >= m:
            break
        cand = make_scenes(OVERSAMPLE * (m - have) + 8, seed=seed + 3 * r, objects=objects)
        idx = np.flatnonzero(_clear(cand))[:m - have]
        kept.append((cand, idx))
        have += len(idx)
    if have < m:
        raise RuntimeError(f"only {have} of {m} unambiguous {objects}-object scenes after {MAX_ROUNDS} rounds (seed {seed})")
    return kept


def describe_scene(shape: np.ndarray, color: np.ndarray, cx: np.ndarray, cy: np.ndarray) -> tuple[str, list[int]]:
    """The description of one scene's objects (arrays over its objects) and the object each word names (-1: none)."""
    order = sorted(range(len(shape)), key=lambda j: int(shape[j]))
    phrases = [object_phrase(CLASSES[int(shape[j])], COLORS[int(color[j])]) for j in order]
    if len(order) == 2:
        rel = _relation_matrix(cx, cy, 2)[order[0], order[1]]
        links = [RELATIONS[int(rel)]]
    else:
        links = ["and"] * (len(order) - 1)
    words, named = [], []
    for n, (j, phrase) in enumerate(zip(order, phrases)):
        if n:
            words += links[n - 1].split()
            named += [-1] * len(links[n - 1].split())
        article, colour, shape_word = phrase.split()
        words += [article, colour, shape_word]
        named += [-1, j, j]
    return " ".join(words), named


def _answer_named(task: str, answer: str, objs: list[int]) -> list[int]:
    """The object each word of a question's answer names: a colour or shape answer names its object
    (a relation's answer is the second object the question lists), yes, no and counts name none."""
    if task in ("color", "shape"):
        return [objs[0]]
    if task == "relation":
        return [objs[1]]
    return [-1] * len(answer.split())


def make_vlm(n: int, seed: int = 0, turns: int = 1, task_weights: tuple[float, ...] = TASK_WEIGHTS) -> VlmBatch:
    """``n`` unambiguous scenes (one, two and three objects mixed as :data:`~relevancy.worlds.questions.OBJECT_MIX`), each
    with ``turns`` tasks drawn from ``task_weights`` (one per task of :data:`TASKS`, any scale; training may weight
    what the model has learned least) (distinct prompts where the scene offers them; consecutive items share a scene:
    training joins them into one conversation), their prompts, answers and ground truth; deterministic per seed."""
    if n < 0 or turns < 1:
        raise ValueError(f"n must be >= 0 and turns >= 1, got n={n}, turns={turns}")
    weights = np.asarray(task_weights, float)
    if weights.shape != (len(TASKS),) or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"task_weights must be {len(TASKS)} non-negative weights, not all zero, one per task of "
                         f"{TASKS}; got {tuple(task_weights)}")
    rng = np.random.default_rng([seed, 11])
    counts = rng.multinomial(n, OBJECT_MIX) if n else np.zeros(3, np.int64)
    order = rng.permutation(n)
    H = IMAGE_SIZE
    pixels = np.zeros((n, H, H, 3), np.uint8)
    images = torch.zeros(n, 3, H, H)
    masks = torch.zeros(n, MAX_OBJECTS, H, H, dtype=torch.bool)
    shape = np.full((n, MAX_OBJECTS), -1, np.int64)
    color = np.full((n, MAX_OBJECTS), -1, np.int64)
    cx = np.full((n, MAX_OBJECTS), np.nan)
    cy = np.full((n, MAX_OBJECTS), np.nan)
    n_obj = np.zeros(n, np.int64)
    s = 0
    for k, m in enumerate(counts):
        for cand, idx in _clear_scenes(int(m), seed + k, k + 1) if m else ():
            dest = order[s:s + len(idx)]
            s += len(idx)
            t = torch.from_numpy(idx)
            pixels[dest] = cand.pixels[idx]
            images[torch.from_numpy(dest)] = cand.images[t]
            masks[torch.from_numpy(dest), :k + 1] = cand.masks[t]
            att = attribute_arrays(cand)
            shape[dest, :k + 1] = att["shape"][idx]
            color[dest, :k + 1] = att["color"][idx]
            cx[dest, :k + 1] = cand.params["cx"][idx]
            cy[dest, :k + 1] = cand.params["cy"][idx]
            n_obj[dest] = k + 1
    prompts, answers, tasks, named = [], [], [], []
    for i in range(n):
        used: set[str] = set()
        for _ in range(turns):
            t, prompt, answer, words = _task(rng, weights, int(n_obj[i]), shape[i], color[i], cx[i], cy[i], used)
            used.add(prompt)
            prompts.append(prompt)
            answers.append(answer)
            tasks.append(t)
            named.append(words)
    scene = np.repeat(np.arange(n), turns)
    index = torch.from_numpy(scene)
    return VlmBatch(prompts=prompts, answers=answers, task=np.asarray(tasks, np.int64), named=named,
                    images=images[index], pixels=pixels[scene], masks=masks[index], n_objects=n_obj[scene],
                    shape=shape[scene], color=color[scene], seed=seed)


def _task(rng: np.random.Generator, weights: np.ndarray, k: int, shape: np.ndarray, color: np.ndarray, cx: np.ndarray,
          cy: np.ndarray, used: set[str]) -> tuple[int, str, str, list[int]]:
    """One task (drawn with ``weights``) about a scene of ``k`` objects, its prompt not in ``used`` where the scene
    offers another (20 draws): the task's index, the prompt, the answer and the object each answer word names."""
    for attempt in range(20):
        avail = weights
        while True:
            t = int(rng.choice(len(TASKS), p=avail / avail.sum()))
            if TASKS[t] == "describe":
                answer, words = describe_scene(shape[:k], color[:k], cx[:k], cy[:k])
                prompt = DESCRIBE
                break
            res = _question(rng, TASKS[t], k, shape, color, np.ones(MAX_OBJECTS, bool), _relation_matrix(cx, cy, k))
            if res is not None:
                prompt, answer, objs = res
                words = _answer_named(TASKS[t], answer, objs)
                break
            avail = np.where(np.arange(len(TASKS)) == t, 0.0, avail)
        if prompt not in used:
            break
    return t, prompt, answer, words
