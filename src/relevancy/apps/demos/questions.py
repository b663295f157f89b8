"""Showing explanations of the shapes LXMERT: per question a PNG (the regions' boxes over the scene, each filled by
its relevance) and an HTML page (the question's words coloured by theirs).

>>> from relevancy.worlds.questions import make_questions
>>> from relevancy.worlds.shapes_lxmert import VQA_TEST_SEED, load_vqa_lxmert
>>> from relevancy.apps.demos.questions import explain_questions, save_questions
>>> model, tokenizer = load_vqa_lxmert()
>>> batch = make_questions(4, seed=VQA_TEST_SEED)             # unseen scenes, one question each
>>> expl = explain_questions(model, batch, method="generic_attention", tokenizer=tokenizer)  # predicted answers
>>> paths = save_questions(expl, batch, "questions")           # questions/q000_<question>_generic_attention.png/.html, ...

`ask` puts your own questions (words of :data:`~relevancy.worlds.questions.WORDS`) to a scene of the world.
"""
from __future__ import annotations

import dataclasses
import io
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ...worlds.captions import Tokenizer
from ...worlds.scenes import CLASSES
from ...worlds.questions import ANSWERS, COLORS, MAX_LENGTH, VqaBatch, make_questions, question_tokenizer

__all__ = ["absent_objects", "ask", "explain_questions", "file_stem", "question_row", "question_words", "render_question", "save_questions"]


def question_words(batch: VqaBatch, tokenizer: Tokenizer | None = None) -> list[list[str]]:
    """The strings of each question's real tokens (``<start>``, its words, ``<end>``)."""
    tokenizer = tokenizer or question_tokenizer()
    lengths = batch.attention_mask.sum(1).tolist()
    return [row[:length] for row, length in zip(tokenizer.tokens(batch.input_ids), lengths)]


def explain_questions(model: nn.Module, batch: VqaBatch, method: str = "generic_attention", target: Any = None,
                      tokenizer: Tokenizer | None = None, **options: Any):
    """`relevancy.explain` of every question of ``batch`` (one batched call; ``target=None``: each question's
    predicted answer, as the ICCV'21 authors explain it), with the questions' words as the text part's tokens."""
    from ...api import explain

    expl = explain(model, batch.model_inputs(), method=method, target=target, **options)
    return dataclasses.replace(expl, tokens=question_words(batch, tokenizer))


def question_row(explanation, index: int):
    """The explanation of question ``index`` alone (every per-question field cut to that row)."""
    count = len(explanation.target)
    fixed = {"class_names", "method", "signed"}

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and len(value) == count:
            return value[index : index + 1]
        if isinstance(value, list) and len(value) == count:
            return value[index : index + 1]
        return value

    return dataclasses.replace(explanation, **{f.name: cut(getattr(explanation, f.name))
                                               for f in dataclasses.fields(explanation) if f.name not in fixed and f.init})


def file_stem(index: int, question: str, method: str) -> str:
    """``q003_what_color_is_the_star_generic_attention``: the question's number, its words, the method."""
    words = re.sub(r"[^a-z0-9]+", "_", question.lower()).strip("_")[:60]
    return f"q{index:03d}_{words}_{method}"


def _caption(explanation, batch: VqaBatch, index: int) -> tuple[str, str]:
    """(title, caption): the question, the explained answer with its logit and, when known, the true answer."""
    k = int(explanation.target[index])
    answer = ANSWERS[k] if 0 <= k < len(ANSWERS) else f"answer {k}"
    logit = float(explanation.logits[index, k]) if k >= 0 else float("nan")
    truth = int(batch.answers[index])
    known = f", true answer {ANSWERS[truth]}" if 0 <= truth < len(ANSWERS) else ""
    explained = f"answer {answer} ({logit:.2f}){known}"
    return (f"{batch.questions[index]}?\n{explained}\n{explanation.method}",
            f"{batch.questions[index]}? {explained} ({explanation.method})")


def render_question(explanation, batch: VqaBatch, index: int) -> tuple[bytes, str]:
    """Question ``index`` as (PNG bytes, HTML page): the regions' boxes over the scene filled by their relevance
    (`relevancy.results.viz.region_figure`) and the coloured question (`relevancy.results.explanation.texts_html`)."""
    import matplotlib.pyplot as plt

    from ...results.explanation import html_page, texts_html
    from ...results.viz import region_figure

    row = question_row(explanation, index)
    title, caption = _caption(explanation, batch, index)
    part = row.parts["image"]
    boxes = part.boxes.detach().cpu() if part.boxes is not None else torch.as_tensor(batch.visual_pos[index : index + 1])
    figure = region_figure(part.scores.detach().float().cpu(), boxes, [batch.pixels[index]], row.signed, [title])
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(figure)
    page = html_page(f"{batch.questions[index]}? ({explanation.method})", texts_html(row.parts["text"], [caption]))
    return buffer.getvalue(), page


def save_questions(explanations, batch: VqaBatch, folder: str | Path, indices: Sequence[int] | None = None) -> list[Path]:
    """One PNG and one HTML page per question (and method) in ``folder``, named by :func:`file_stem`.

    ``explanations``: one explanation of ``batch`` or ``{method: explanation}``. Everything is drawn first, then
    written; a failure leaves none of this call's files behind."""
    from ...core.files import write_atomic

    if not isinstance(explanations, Mapping):
        explanations = {explanations.method: explanations}
    indices = range(len(batch)) if indices is None else indices
    rendered: list[tuple[Path, bytes | str]] = []
    folder = Path(folder)
    for i in indices:
        for method, expl in explanations.items():
            png, page = render_question(expl, batch, i)
            stem = file_stem(i, batch.questions[i], method)
            rendered += [(folder / f"{stem}.png", png), (folder / f"{stem}.html", page)]
    written: list[Path] = []
    try:
        for path, content in rendered:
            written.append(write_atomic(path, content))
    except BaseException:
        for path in written:
            if path.exists():
                os.remove(path)
        raise
    return written


def ask(questions: Sequence[str], scene: int, tokenizer: Tokenizer | None = None) -> VqaBatch:
    """Your questions about scene ``scene`` of the world (the scene and regions of ``make_questions(1, scene)``),
    one item per question; words outside the vocabulary are a ValueError naming them. Unknown ground truth:
    ``answers`` and ``qtype`` are -1, no target regions or tokens."""
    tokenizer = tokenizer or question_tokenizer()
    questions = [" ".join(q.replace("?", " ").split()) for q in questions]
    if not questions or any(not q for q in questions):
        raise ValueError("give at least one non-empty question, e.g. 'what color is the star'")
    encoded = tokenizer.encode(questions, MAX_LENGTH)  # ValueError for unknown words or too long questions
    base = make_questions(1, seed=scene)
    m = len(questions)
    rep = lambda x: x.repeat_interleave(m, 0) if isinstance(x, torch.Tensor) else np.repeat(x, m, 0)  # noqa: E731
    return dataclasses.replace(
        base, questions=[" ".join(tokenizer.words(q)) for q in questions], qtype=np.full(m, -1, np.int64),
        answers=torch.full((m,), -1, dtype=torch.long), input_ids=encoded["input_ids"],
        attention_mask=encoded["attention_mask"], token_type_ids=torch.zeros_like(encoded["input_ids"]),
        visual_feats=rep(base.visual_feats), visual_pos=rep(base.visual_pos), boxes=rep(base.boxes),
        object_region=rep(base.object_region), target_regions=torch.zeros(m, base.target_regions.shape[1], dtype=torch.bool),
        target_tokens=torch.zeros(m, MAX_LENGTH, dtype=torch.bool), has_target=np.zeros(m, bool),
        n_objects=rep(base.n_objects), pixels=rep(base.pixels), masks=rep(base.masks),
        attributes={k: rep(v) for k, v in base.attributes.items()}, seed=scene,
    )


def absent_objects(batch: VqaBatch) -> list[str | None]:
    """Per question, the object it asks about that its scene does not hold ("a star", "a red object"), else None.
    Such a question has no right answer (the model answers anyway); existence and count questions ("is there",
    "how many") are answerable either way and are never named."""
    found: list[str | None] = []
    for i, question in enumerate(batch.questions):
        words = question.split()
        objects = range(int(batch.n_objects[i]))
        present = {(CLASSES[int(batch.attributes["shape"][i, j])], COLORS[int(batch.attributes["color"][i, j])]) for j in objects}
        shapes = [w for w in words if w in CLASSES]
        colours = [w for w in words if w in COLORS]
        missing = None
        if question.startswith(("is there", "how many")):
            pass
        elif shapes and (absent := [s for s in shapes if all(s != shape for shape, _ in present)]):
            missing = f"a {absent[0]}"
        elif colours and not shapes and all(colours[0] != colour for _, colour in present):
            missing = f"a {colours[0]} object"
        elif colours and shapes and (shapes[-1], colours[0]) not in present:
            missing = f"a {colours[0]} {shapes[-1]}"
        found.append(missing)
    return found
