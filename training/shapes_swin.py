"""Train (or evaluate) the benchmark shapes Swin: the shapes ViT's recipe (`training.shapes_vit`) on the hierarchical
architecture of `relevancy.worlds.shapes_swin`.

    python -m training.shapes_swin [--seed S] [--minutes M | --steps N] [--out DIR]
    python -m training.shapes_swin --evaluate-only [--weights PATH] [--n 2000]

Same scenes, seeds, curriculum, soft targets and schedule as the ViT. The auxiliary token-labelling head reads the
last stage's 4 x 4 tokens (each covers 16 x 16 pixels) and fades out as the ViT's does; it is not shipped.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from relevancy.worlds.scenes import CLASSES, IMAGE_SIZE
from relevancy.worlds.shapes_swin import SWIN_CONFIG, build_swin, load_swin
from relevancy.worlds.shapes_vit import EVAL_SEED_BASE, evaluate_accuracy
from training.shapes_vit import (VAL_SEED, Run, _batch, _log, _step_batch, adamw, aux_weight, fit, logged_evaluation,
                                 machine, run_classifier_command, save_weights, start_run, step_loader)

WEIGHTS_NAME = "shapes_swin.safetensors"


def _pooled(tok_target: torch.Tensor, side: int) -> torch.Tensor:
    """The per-patch soft targets (n, patches, C + 1) on the shapes ViT's 8 x 8 grid averaged onto a side x side grid."""
    n, tokens, c = tok_target.shape
    grid = int(round(tokens ** 0.5))
    maps = tok_target.transpose(1, 2).reshape(n, c, grid, grid)
    return F.adaptive_avg_pool2d(maps, side).flatten(2).transpose(1, 2)


def train(args) -> None:
    out, log, device = start_run(args, "shapes_swin_train.log")
    model = build_swin().to(device)
    model.train()
    aux = torch.nn.Linear(model.num_features, len(CLASSES) + 1).to(device)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in aux.named_parameters()]
    optimizer = adamw(named, lambda n, p: p.ndim >= 2 and "relative_position" not in n, args, betas=(0.9, 0.999))
    n_pair = int(round(args.batch_size * args.pair_fraction))
    n_single = args.batch_size - n_pair
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in SWIN_CONFIG.items()}
    _log(log, f"start training seed={args.seed} config={json.dumps(config)} "
              f"params={sum(p.numel() for p in model.parameters())} batch={n_single}+{n_pair} lr={args.lr} "
              f"wd={args.weight_decay} warmup={args.warmup} smoothing={args.smoothing} aux_weight={args.aux_weight} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} "
              f"threads={args.threads} {machine()}")
    meta = dict(model_config=config, seed=args.seed, class_names=list(CLASSES), batch_size=args.batch_size,
                pair_fraction=args.pair_fraction, lr=args.lr)
    loader = step_loader(args, partial(_step_batch, args, n_single, n_pair))

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        batch = next(loader) if loader is not None else _batch(args.seed, step, n_single, n_pair, args.smoothing, progress)
        x, target, tok_target = (t.to(device) for t in batch)
        feats = model.forward_features(x)  # (n, h, w, channels)
        logits = model.forward_head(feats)
        plain = torch.sum(-target * F.log_softmax(logits, 1), 1).mean()
        w = aux_weight(progress, args.aux_weight)
        total = plain
        if w > 0:
            tok = aux(feats.flatten(1, 2))
            total = plain + w * torch.sum(-_pooled(tok_target, feats.shape[1]) * F.log_softmax(tok, 2), 2).mean()
        return total, {"loss": plain.item()}

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        acc = evaluate_accuracy(model, n=args.val_n, seed=VAL_SEED)
        save_weights(model, out / WEIGHTS_NAME,
                     dict(meta, steps=step, train_seconds=round(seconds), val=acc, final=str(final).lower()))
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val single_top1 "
                  f"{acc['single_top1']:.4f} pair_top2 {acc['pair_top2']:.4f} (n={acc['n']}, seed {VAL_SEED})")

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size, "img"))


def evaluate(args) -> dict:
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / WEIGHTS_NAME
    started = time.time()
    acc = evaluate_accuracy(load_swin(weights), n=args.n, seed=EVAL_SEED_BASE)
    acc["seeds"] = [EVAL_SEED_BASE, EVAL_SEED_BASE + 1]
    return logged_evaluation(args, weights, "shapes_swin_train.log", started, acc,
                             f"single_top1 {acc['single_top1']:.4f} pair_top2 {acc['pair_top2']:.4f} "
                             f"(n={acc['n']} each, {IMAGE_SIZE} px scenes)")


def main(argv=None) -> None:
    run_classifier_command(__doc__, argv, train, evaluate, minutes=80.0,
                           threads_help="torch threads (the shipped run: 1, beside other jobs on a 2-core CPU)")


if __name__ == "__main__":
    main()
