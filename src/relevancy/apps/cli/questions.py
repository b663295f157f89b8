"""`relevancy explain-question`: the shapes LXMERT's answers explained, a PNG and an HTML page per question.

    relevancy explain-question [--model shapes|PATH.safetensors] [--n N] [--seed S] [--method M|all] [--out DIR] [--json]
    relevancy explain-question --question TEXT [--question TEXT ...] [--scene SEED] [--model ...] [--method ...] [--out DIR]

The first form asks N questions of the visual-question world about unseen scenes (``make_questions(N,
VQA_TEST_SEED + 3 S)``, the scenes of ``evaluate --benchmark shapes-vqa --seed S``; the true answers are known); the
second asks your questions about scene SEED (``make_questions(1, seed=SEED)``'s scene and regions). Each question's
predicted answer is explained; per question and method ``DIR/q<i>_<question>_<method>.png`` (the regions' boxes over
the scene, each filled by its relevance) and ``.html`` (the question's words coloured by theirs). Everything is checked
before the model loads and drawn before anything is written: a failure leaves no file behind.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ...core.files import check_folder
from ..catalogue import SHIPPED
from ..common import UsageError, check_inputs, resolve_methods, warn
from .common import DEFAULT_OUT, print_results

#: questions of the world per call, and the largest --scene seed
MAX_QUESTIONS = 1000
#: the longest question, characters (the world's questions have at most 10 words)
MAX_QUESTION_CHARS = 200
MAX_SCENE = 2**31 - 3
MAX_SEED = 999
DEFAULT_QUESTIONS = 4


def vqa_model_path(model: str) -> Path:
    """The weights file of ``--model``: 'shapes' (the shipped shapes LXMERT) or a .safetensors file with its .json
    beside it; a UsageError otherwise."""
    if SHIPPED["questions"].means(model):
        return SHIPPED["questions"].weights_path()
    path = Path(model)
    if path.suffix != ".safetensors" or not path.is_file() or not path.with_suffix(".json").is_file():
        raise UsageError("--model: 'shapes' (the shipped shapes LXMERT) or a shapes-LXMERT .safetensors file with its "
                         f".json (as training.shapes_lxmert writes them) beside it, got {model!r}")
    return path


def _check(args: argparse.Namespace) -> tuple[list[str], list[str] | None, Path | None, Path]:
    """Everything checked before the model loads: (methods, questions or None, output folder or None, weights)."""
    from ...families.lxmert.adapter import LxmertAdapter

    methods = resolve_methods(args.method, LxmertAdapter.methods, "LXMERT")
    if args.question is not None:
        if args.n is not None or args.seed != 0:
            raise UsageError("--n and --seed pick questions of the world; with --question give the scene with --scene")
        if args.scene is not None and not 0 <= args.scene <= MAX_SCENE:
            raise UsageError(f"--scene must be in 0..{MAX_SCENE}, got {args.scene}")
        from ...worlds.questions import MAX_LENGTH, question_tokenizer

        check_inputs("questions", args.question, MAX_QUESTIONS, MAX_QUESTION_CHARS)
        questions = [" ".join(q.replace("?", " ").split()) for q in args.question]
        if any(not q for q in questions):
            raise UsageError("--question is empty: give a question, e.g. --question 'what color is the star'")
        try:
            question_tokenizer().encode(questions, MAX_LENGTH)
        except ValueError as error:  # unknown words (the message lists the vocabulary) or too long
            raise UsageError(str(error)) from error
    else:
        questions = None
        if args.scene is not None:
            raise UsageError("--scene is the scene of your --question(s); without --question use --n and --seed")
        n = DEFAULT_QUESTIONS if args.n is None else args.n
        if not 1 <= n <= MAX_QUESTIONS:
            raise UsageError(f"--n must be in 1..{MAX_QUESTIONS}, got {n}")
        if not 0 <= args.seed <= MAX_SEED:
            raise UsageError(f"--seed must be in 0..{MAX_SEED}, got {args.seed}")
    out = None if args.out is None and args.json else Path(args.out or DEFAULT_OUT)
    if out is not None:
        check_folder(out)
    return methods, questions, out, vqa_model_path(args.model)


def _holds(batch) -> str:
    """What the scene of `batch` holds, e.g. "a blue heart, an orange square and a blue triangle"."""
    from ...worlds.scenes import CLASSES
    from ...worlds.questions import COLORS

    names = [f"{COLORS[int(c)]} {CLASSES[int(s)]}" for s, c in
             zip(batch.attributes["shape"][0, : int(batch.n_objects[0])], batch.attributes["color"][0, : int(batch.n_objects[0])])]
    names = [("an " if name[0] in "aeiou" else "a ") + name for name in names]
    return "it holds " + (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0])


def run_explain_question(args: argparse.Namespace) -> list[Path]:
    methods, questions, out, weights = _check(args)

    from ...worlds.questions import ANSWERS, make_questions
    from ...worlds.shapes_lxmert import VQA_TEST_SEED, load_vqa_lxmert
    from ..demos.questions import absent_objects, ask, explain_questions, file_stem, save_questions
    from ...evaluation.shapes_vqa import supported_methods

    try:
        model, tokenizer = load_vqa_lxmert(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise UsageError(f"cannot load a shapes LXMERT from {weights} and its .json: {type(error).__name__}: {error}") from error
    if questions is None:
        n = DEFAULT_QUESTIONS if args.n is None else args.n
        batch = make_questions(n, VQA_TEST_SEED + 3 * args.seed)
    else:
        scene = 0 if args.scene is None else args.scene
        batch = ask(questions, scene, tokenizer)
    absent = absent_objects(batch)  # the world's own questions are all answerable: None
    if questions is not None:
        for question, missing in zip(batch.questions, absent):
            if missing is not None:
                warn("explain-question", f"'{question}' asks about {missing}, which scene {scene} does not hold "
                                         f"({_holds(batch)}): the answer is a guess")
    supported = supported_methods(model)  # every method LXMERT offers
    if args.method == "all":
        methods = list(supported)
    elif methods[0] not in supported:
        raise UsageError(f"method {methods[0]} does not explain LXMERT; use one of {', '.join(supported)}")
    if out is not None:
        check_folder(out, [f"{file_stem(i, q, m)}{suffix}" for i, q in enumerate(batch.questions) for m in methods
                           for suffix in (".png", ".html")])
    explanations = {m: explain_questions(model, batch, method=m, tokenizer=tokenizer) for m in methods}
    written = save_questions(explanations, batch, out) if out is not None else []
    if args.json:
        print_results(explanations.values())
    else:
        first = next(iter(explanations.values()))
        for i, question in enumerate(batch.questions):
            truth = int(batch.answers[i])
            known = f" (true answer: {ANSWERS[truth]})" if truth >= 0 else ""
            print(f"q{i:03d} {question}? -> {ANSWERS[int(first.target[i])]}{known}")
    return written
