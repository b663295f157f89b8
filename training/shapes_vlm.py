"""Train (or evaluate) the shapes LLaVA (descriptions and answers in words about the shapes world).

    python -m training.shapes_vlm [--seed S] [--minutes M | --steps N] [--out DIR] [--device cpu|cuda]
                                  [--init WEIGHTS] [--task-weights describe=2,relation=3] [--mirror]
    python -m training.shapes_vlm --evaluate-only [--weights PATH] [--n 1000]

Data: fresh scenes every step (infinite data, :func:`relevancy.worlds.vision_language.make_vlm`), ``--turns`` tasks about
each joined into one conversation (the image once, then prompt, answer, ``</s>``, prompt, ...: the image tokens, most
of a row, are read once for several answers, as LLaVA trains on multi-turn conversations; the first turn is exactly
a single prompt's input).  Step ``t`` of run seed
``S`` draws its items from ``make_vlm`` seed ``S * 10**8 + 32 t`` (scene seeds up to ``+ 23``), all below
``EVAL_SEED_BASE = 10**9``, so validation (``VLM_VAL_SEED``) and test (``VLM_TEST_SEED``) scenes are never trained on.
``--task-weights`` multiplies the training draw's weights of the named tasks (:data:`TASK_WEIGHTS`, renormalised), to
train more on what the model has learned least; validation and test items keep :data:`TASK_WEIGHTS`.  ``--mirror``
adds to each step the mirror image of every scene whose conversation says "left" or "right" and whose objects are
all mirror-symmetric (:data:`MIRROR_SYMMETRIC`: the mirror image is then a scene the world could have drawn), with
"left" and "right" swapped in its prompts and answers: pairs that differ only in the horizontal relation.

Model: :func:`relevancy.worlds.shapes_vlm.build_shapes_llava` with its vision tower the shipped shapes CLIP's (which
already tells shapes and colours apart patch by patch): frozen, as LLaVA-1.5 freezes its CLIP, while projector and
decoder learn, then (``--init`` the first stage's weights, ``--train-tower``) trained with them.
Loss: cross-entropy on the answer's tokens and ``</s>`` (the prompt and the image tokens are not scored).  AdamW,
linear warm-up then cosine decay, following wall-clock progress with ``--minutes`` or the step count with
``--steps`` (exactly reproducible; the shipped run).  Validation accuracy (exact answers, greedy), overall and per
task, is logged every ``--ckpt-minutes`` with a checkpoint; the log is ``shapes_llava_train.log`` beside the weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from relevancy.worlds.scenes import CLASSES
from relevancy.worlds.shapes_vit import EVAL_SEED_BASE
from .shapes_vit import (Run, _log, adamw, fit, logged_evaluation, machine, run_training_command, save_with_json, start_run,
                    step_loader, training_parser)
from relevancy.worlds.shapes_vlm import (SPECIAL_TOKENS, VLM_CONFIG, VLM_TEST_SEED, VLM_VAL_SEED, VLM_WEIGHTS_PATH, build_shapes_llava,
                        build_tokenizer, encode, evaluate_vlm, image_token_count, load_shapes_llava, model_inputs)
from relevancy.worlds.vision_language import TASK_WEIGHTS, TASKS, VOCABULARY, make_vlm


@dataclass(frozen=True)
class Recipe:
    """What one shapes vision-language model's training has of its own: its config (keyword arguments), weights file,
    log, the model it starts from (`start()`), its vision tower (what ``--train-tower`` trains), its loader
    (``(model, processor)`` from a weights path) and the words the log and the weights' facts name its tower by."""

    config: dict
    weights: Path
    log_name: str
    start: Callable[[], torch.nn.Module]
    tower: Callable[[torch.nn.Module], torch.nn.Module]
    load: Callable
    tower_origin: str


LLAVA = Recipe(VLM_CONFIG, VLM_WEIGHTS_PATH, "shapes_llava_train.log", partial(build_shapes_llava, vision_from_clip=True),
               lambda model: model.model.vision_tower, load_shapes_llava, "shapes_clip")
#: the classes whose upright shape is its own mirror image (the arrow, crescent, L-shape and the star, which
#: points sideways, are not: mirrored they would be shapes the world never draws)
MIRROR_SYMMETRIC = ("circle", "square", "triangle", "plus", "ring", "T-shape", "H-shape", "heart")
_SWAP = {"left": "right", "right": "left"}


def save_vlm(model, path: Path, meta: dict, config: dict = VLM_CONFIG) -> None:
    """Write ``path`` (safetensors weights, float32) and ``path.with_suffix('.json')`` (the config's keyword
    arguments, vocabulary and ``meta``), atomically."""
    save_with_json(model, path, dict(config=config, vocab=list(SPECIAL_TOKENS + VOCABULARY), **meta))


def step_seed(seed: int, step: int) -> int:
    s = seed * 10**8 + 32 * step
    assert s + 32 < EVAL_SEED_BASE
    return s


def _grown(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """``state`` of an earlier, smaller stage made to fit ``model`` so that the model starts where that stage ended:
    a projector that read fewer of the tower's layers gets zero columns in front (the layers added before the one it
    read, the last), and decoder layers the earlier stage lacks are added on top as identities (their fresh
    weights, with the attention's and the MLP's output projections zero, so each adds nothing to the residual
    stream until trained)."""
    fresh = model.state_dict()
    grown = dict(state)
    key = "model.multi_modal_projector.linear_1.weight"
    have, want = state.get(key), fresh[key].shape if key in fresh else None
    if have is not None and have.shape != want:
        if have.shape[0] != want[0] or want[1] % have.shape[1]:
            raise ValueError(f"--init projector {tuple(have.shape)} cannot widen to {tuple(want)}")
        grown[key] = torch.cat([have.new_zeros(want[0], want[1] - have.shape[1]), have], 1)
    for name, value in fresh.items():
        if name not in grown:
            if ".layers." not in name or "language_model" not in name:
                raise ValueError(f"--init lacks {name}, which only a decoder layer added on top may lack")
            silent = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
            grown[name] = torch.zeros_like(value) if silent else value
    return grown


def task_weights(spec: str | None) -> tuple[float, ...]:
    """Training's task weights: :data:`TASK_WEIGHTS` with the tasks named in ``spec`` (``"describe=2,relation=3"``)
    multiplied by their factors, renormalised to sum to 1."""
    factors = dict.fromkeys(TASKS, 1.0)
    for part in spec.split(",") if spec else ():
        name, _, value = part.partition("=")
        if name.strip() not in factors:
            raise ValueError(f"--task-weights: unknown task {name.strip()!r}; choose from {', '.join(TASKS)}")
        try:
            factors[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--task-weights: {part!r} is not TASK=FACTOR (a number)") from None
        if factors[name.strip()] < 0:
            raise ValueError(f"--task-weights: {part!r} has a negative factor")
    weights = [w * factors[t] for w, t in zip(TASK_WEIGHTS, TASKS)]
    if sum(weights) <= 0:
        raise ValueError(f"--task-weights {spec!r} leaves no task to draw")
    return tuple(w / sum(weights) for w in weights)


def _fmt(acc: dict) -> str:
    per = " ".join(f"{k} {v:.4f}" for k, v in acc["per_task"].items())
    return (f"overall {acc['overall']:.4f} object_words {acc['object_words']:.4f} ({per}; n={acc['n']}, "
            f"seed {acc['seed']})")


def _items(args, config, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s conversations: ``--batch-size`` scenes, ``--turns`` tasks each, as a model of ``config`` (a
    transformers config) takes them."""
    batch = make_vlm(args.batch_size, step_seed(args.seed, step), turns=args.turns,
                     task_weights=task_weights(args.task_weights))
    prompts, answers, images = batch.prompts, batch.answers, batch.images[::args.turns]
    if args.mirror:
        prompts, answers, images = _with_mirror_twins(batch, args.turns)
    enc = encode(build_tokenizer(), prompts, answers, turns=args.turns, image_tokens=image_token_count(config))
    return model_inputs(config, enc, images)


def _with_mirror_twins(batch, turns: int) -> tuple[list[str], list[str], torch.Tensor]:
    """``batch``'s conversations (``turns`` items a scene) and scene images, followed by the horizontal mirror image of
    each scene that mentions "left" or "right" and holds mirror-symmetric objects only (:data:`MIRROR_SYMMETRIC`),
    its prompts and answers with "left" and "right" swapped (what is left of an object is right of it mirrored)."""
    symmetric = [CLASSES.index(c) for c in MIRROR_SYMMETRIC]
    prompts, answers, images = list(batch.prompts), list(batch.answers), [batch.images[::turns]]
    for s in range(0, len(batch), turns):
        texts = batch.prompts[s:s + turns] + batch.answers[s:s + turns]
        objects = batch.shape[s][:batch.n_objects[s]]
        if np.isin(objects, symmetric).all() and any(w in _SWAP for t in texts for w in t.split()):
            prompts += [" ".join(_SWAP.get(w, w) for w in t.split()) for t in batch.prompts[s:s + turns]]
            answers += [" ".join(_SWAP.get(w, w) for w in t.split()) for t in batch.answers[s:s + turns]]
            images.append(batch.images[s:s + 1].flip(-1))
    return prompts, answers, torch.cat(images)


def train(args, recipe: Recipe = LLAVA) -> None:
    """Train ``recipe``'s model as ``args`` say (see the module's docstring)."""
    task_weights(args.task_weights)  # a bad --task-weights fails before anything is built
    out, log, device = start_run(args, recipe.log_name)
    tokenizer = build_tokenizer()
    model = recipe.start()
    if args.init:  # the weights of an earlier stage, into today's config
        from safetensors.torch import load_file

        model.load_state_dict(_grown(load_file(args.init), model))
    model = model.to(device)
    model.train()
    recipe.tower(model).requires_grad_(args.train_tower)
    optimizer = adamw([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                      lambda n, p: p.ndim >= 2 and "embed" not in n, args, betas=(0.9, 0.98), eps=1e-6)
    _log(log, f"start training seed={args.seed} config={json.dumps(recipe.config)} "
              f"params={sum(p.numel() for p in model.parameters())} (trained "
              f"{sum(p.numel() for p in model.parameters() if p.requires_grad)}) batch={args.batch_size}x{args.turns} turns "
              f"lr={args.lr} wd={args.weight_decay} warmup={args.warmup} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} device={args.device} "
              f"threads={args.threads} workers={args.workers} init={args.init} train_tower={args.train_tower} "
              f"task_weights={args.task_weights} mirror={args.mirror} {machine()}")
    meta = dict(seed=args.seed, batch_size=args.batch_size, turns=args.turns, lr=args.lr, init=args.init,
                task_weights=dict(zip(TASKS, task_weights(args.task_weights))), mirror=args.mirror,
                vision_tower=recipe.tower_origin + ", " + ("trained" if args.train_tower else "frozen"))
    val_batch = make_vlm(args.val_n, VLM_VAL_SEED)
    loader = step_loader(args, partial(_items, args, model.config))

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        items = next(loader) if loader is not None else _items(args, model.config, step)
        res = model(**{k: v.to(device) for k, v in items.items()})
        return res.loss, {"loss": res.loss.item()}

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        val = evaluate_vlm(model, tokenizer, seed=VLM_VAL_SEED, batch=val_batch)
        save_vlm(model, out / recipe.weights.name,
                 dict(meta, steps=step, train_seconds=round(seconds), val=val, final=final), recipe.config)
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val {_fmt(val)}")

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size * args.turns, "answers"))


def evaluate(args, recipe: Recipe = LLAVA) -> dict:
    """Measure the exact-answer accuracy of the weights on ``args.n`` unseen scenes (one task each) and log it."""
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / recipe.weights.name
    model, processor = recipe.load(weights, device=args.device)
    t = time.time()
    acc = evaluate_vlm(model, processor.tokenizer, n=args.n, seed=VLM_TEST_SEED)
    return logged_evaluation(args, weights, recipe.log_name, t, acc, _fmt(acc))


def main(argv=None, recipe: Recipe = LLAVA, doc: str = __doc__, lr: float = 1e-3) -> None:
    """The command of ``recipe``'s trainer (the shapes LLaVA's unless told), ``doc`` its help."""
    ap = training_parser(doc, minutes=22.0, pair_fraction=0.0, lr=lr, weight_decay=0.01)
    ap.set_defaults(batch_size=32, warmup=0.05)
    ap.add_argument("--turns", type=int, default=3, help="tasks about each scene, one conversation per scene")
    ap.add_argument("--train-tower", action="store_true", help="train the vision tower too (default: frozen)")
    ap.add_argument("--init", default=None, help="start from these weights (a .safetensors file with its .json) instead "
                                                  "of a new decoder: a further stage of training (give it another --seed); "
                                                  "a smaller earlier stage grows to today's config (see _grown)")
    ap.add_argument("--task-weights", default=None,
                    help="TASK=FACTOR,... multiplies these tasks' training weights (e.g. describe=2,relation=3; "
                         f"tasks: {', '.join(TASKS)}); validation and test keep TASK_WEIGHTS")
    ap.add_argument("--mirror", action="store_true",
                    help="add the mirror image of each scene that says left or right, left and right swapped "
                         "(mirror-symmetric shapes only): pairs that differ only in the horizontal relation")
    run_training_command(ap, argv, partial(train, recipe=recipe), partial(evaluate, recipe=recipe), ckpt_minutes=6.0, n_help="test scenes for --evaluate-only",
                         threads_help="torch threads (on a CPU shared with other jobs use 1)")


if __name__ == "__main__":
    main()
