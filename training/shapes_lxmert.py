"""Train (or evaluate) the shapes LXMERT (visual question answering on the shapes world).

    python -m training.shapes_lxmert [--seed S] [--minutes M | --steps N] [--out DIR] [--device cpu|cuda]
    python -m training.shapes_lxmert --evaluate-only [--weights PATH] [--n 2000]

Data: fresh questions every step (infinite data, :func:`relevancy.worlds.questions.make_questions`).
Step ``t`` of run seed ``S`` renders ``batch_size / questions_per_scene`` scenes from
``make_questions`` seed ``S * 10**8 + 4 t`` (scene seeds ``+0``, ``+1``, ``+2``), all below
``EVAL_SEED_BASE = 10**9``, so validation (``VQA_VAL_SEED``) and test (``VQA_TEST_SEED``) scenes
are never trained on.  Region features come from the frozen shapes ViT (never trained here).

Loss: cross-entropy on the answer (the QA head of ``LxmertForQuestionAnswering``).  AdamW, linear
warm-up then cosine decay, following wall-clock progress with ``--minutes`` or the step count
with ``--steps`` (exactly reproducible).  Validation accuracy, overall and per question type, is
logged every ``--ckpt-minutes`` with a checkpoint; the log is ``shapes_vqa_train.log`` beside the
weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from relevancy.worlds.captions import Tokenizer
from relevancy.worlds.shapes_vit import EVAL_SEED_BASE
from .shapes_vit import (Run, _log, adamw, fit, logged_evaluation, machine, run_training_command, save_with_json, start_run,
                    training_parser)
from relevancy.worlds.questions import ANSWERS, MAX_LENGTH, QUESTION_TYPES, make_questions, question_tokenizer
from relevancy.worlds.shapes_lxmert import (VQA_CONFIG, VQA_TEST_SEED, VQA_VAL_SEED, VQA_WEIGHTS_PATH, build_vqa_lxmert,
                        evaluate_vqa, load_vqa_lxmert)

LOG_NAME = "shapes_vqa_train.log"


def save_vqa(model, tokenizer: Tokenizer, config: dict, path: Path, meta: dict) -> None:
    """Write ``path`` (safetensors weights) and ``path.with_suffix('.json')`` (``LxmertConfig`` keyword arguments,
    vocabulary, answers and ``meta``), atomically."""
    save_with_json(model, path, dict(config=config, vocab=list(tokenizer.vocab), answers=list(ANSWERS),
                                     question_types=list(QUESTION_TYPES), max_length=MAX_LENGTH, **meta))


def step_seed(seed: int, step: int) -> int:
    s = seed * 10**8 + 4 * step
    assert s + 2 < EVAL_SEED_BASE
    return s


def _fmt(acc: dict) -> str:
    per = " ".join(f"{k} {v:.4f}" for k, v in acc["per_type"].items())
    return f"overall {acc['overall']:.4f} ({per}; n={acc['n']}, seed {acc['seed']})"


def train(args) -> None:
    out, log, device = start_run(args, LOG_NAME)
    tokenizer = question_tokenizer()
    config = dict(VQA_CONFIG)
    if args.hidden:
        config.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    model = build_vqa_lxmert(config).to(device)
    model.train()
    from relevancy.worlds.questions import _vit

    vit = _vit().to(device)
    optimizer = adamw(model.named_parameters(), lambda n, p: p.ndim >= 2 and "embeddings" not in n, args,
                      betas=(0.9, 0.98), eps=1e-6)
    q = args.questions_per_scene
    scenes = max(1, args.batch_size // q)
    _log(log, f"start training seed={args.seed} config={json.dumps(config)} "
              f"params={sum(p.numel() for p in model.parameters())} batch={scenes}x{q} questions "
              f"lr={args.lr} wd={args.weight_decay} warmup={args.warmup} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} device={args.device} "
              f"threads={args.threads} {machine()}")
    meta = dict(seed=args.seed, batch_size=scenes * q, questions_per_scene=q, lr=args.lr)
    val_batch = make_questions(args.val_n, VQA_VAL_SEED, vit=vit)

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        batch = make_questions(scenes, step_seed(args.seed, step), questions_per_scene=q, vit=vit,
                               tokenizer=tokenizer)
        labels = batch.answers.to(device)
        res = model(**batch.model_inputs(device), labels=labels)
        acc = (res.question_answering_score.argmax(-1) == labels).float().mean().item()
        return res.loss, {"loss": res.loss.item(), "acc": acc}

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        val = evaluate_vqa(model, seed=VQA_VAL_SEED, batch=val_batch)
        save_vqa(model, tokenizer, config, out / VQA_WEIGHTS_PATH.name,
                 dict(meta, steps=step, train_seconds=round(seconds), val=val, final=final))
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val {_fmt(val)}")

    fit(args, log, Run(model, optimizer, loss, checkpoint, scenes * q, "questions"))


def evaluate(args) -> dict:
    """Measure the accuracy of the weights on ``args.n`` unseen scenes (one question each) and log it."""
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / VQA_WEIGHTS_PATH.name
    model, _ = load_vqa_lxmert(weights, device=args.device)
    from relevancy.worlds.questions import _vit

    t = time.time()
    batch = make_questions(args.n, VQA_TEST_SEED, vit=_vit().to(args.device))
    acc = evaluate_vqa(model, seed=VQA_TEST_SEED, batch=batch)
    return logged_evaluation(args, weights, LOG_NAME, t, acc, _fmt(acc))


def main(argv=None) -> None:
    ap = training_parser(__doc__, minutes=85.0, pair_fraction=0.0, lr=1e-3, weight_decay=0.01)
    ap.set_defaults(batch_size=128, warmup=0.05)
    ap.add_argument("--questions-per-scene", type=int, default=2,
                    help="questions per rendered scene (the ViT features are shared)")
    ap.add_argument("--hidden", type=int, default=None, help="override the hidden size (intermediate 2x)")
    run_training_command(
        ap, argv, train, evaluate, ckpt_minutes=10.0, n_help="test scenes for --evaluate-only",
        threads_help="torch threads (on a CPU shared with other jobs use 1)",
    )


if __name__ == "__main__":
    main()
