"""Train (or evaluate) the benchmark shapes ViT.

    python -m relevancy.bench.train [--seed S] [--minutes M | --steps N] [--out DIR]
    python -m relevancy.bench.train --evaluate-only [--weights PATH] [--n 2000]

Training draws fresh scenes every step (infinite data).  Step ``t`` of run
seed ``S`` uses scene seeds ``S * 10**8 + 2 t`` (one-object scenes) and
``S * 10**8 + 2 t + 1`` (two-object scenes, soft targets 0.5/0.5); all of them
are below ``EVAL_SEED_BASE = 10**9`` so evaluation scenes are never seen in
training.  Early on, an auxiliary linear head on the patch tokens is trained
to predict which object (or background) covers each patch (token labelling
from the exact masks); its weight fades to zero by 80 % of the run and the
head is not shipped, so the shipped model is a plain classifier.  A curriculum lowers the clutter (distractors, noise, texture
contrast) early on: it ramps to the benchmark setting over the first 30 % of
the run and the last 30 % is trained on benchmark scenes only.  With ``--minutes`` the cosine schedule follows wall-clock progress
(robust to a busy machine); with ``--steps`` it follows the step count and the
run is exactly reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .model import EVAL_SEED_BASE, MODEL_CONFIG, WEIGHTS_DIR, build_model, evaluate_accuracy, load_model
from .scenes import CLASSES, PATCH_SIZE, make_scenes

VAL_SEED = EVAL_SEED_BASE + 10_000  # quick validation during training, disjoint from test


def _log(path: Path | None, msg: str) -> None:
    line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}"
    print(line, flush=True)
    if path is not None:
        with open(path, "a") as f:
            f.write(line + "\n")


def save_weights(model: torch.nn.Module, path: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    md = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in meta.items()}
    tmp = path.with_suffix(".tmp")
    save_file(sd, str(tmp), metadata=md)
    os.replace(tmp, path)


def curriculum(progress: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-scene clutter level: ramps up over the first 30 % of the run, then
    mostly full clutter, and only full clutter for the last 30 %."""
    if progress >= 0.7:
        return np.ones(n)
    r = min(1.0, progress / 0.3)
    return np.clip(r * (0.5 + rng.random(n)), 0.0, 1.0)


def _batch(seed: int, step: int, n_single: int, n_pair: int, smoothing: float,
           progress: float = 1.0):
    C = len(CLASSES)
    base = seed * 10**8 + 2 * step
    assert base + 1 < EVAL_SEED_BASE
    crng = np.random.default_rng([seed, step, 7])
    s1 = make_scenes(n_single, seed=base, objects=1, clutter=curriculum(progress, n_single, crng))
    s2 = make_scenes(n_pair, seed=base + 1, objects=2, clutter=curriculum(progress, n_pair, crng))
    x = torch.cat([s1.images, s2.images])
    t1 = F.one_hot(s1.labels[:, 0], C).float() * (1 - smoothing) + smoothing / C
    t2 = (F.one_hot(s2.labels[:, 0], C).float() + F.one_hot(s2.labels[:, 1], C).float()) * 0.5
    return x, torch.cat([t1, t2]), torch.cat([_token_targets(s1), _token_targets(s2)])


def _token_targets(scenes) -> torch.Tensor:
    """Soft per-patch targets (n, tokens, C + 1): the fraction of each patch
    covered by each object, the rest is background (last index)."""
    C = len(CLASSES)
    frac = F.avg_pool2d(scenes.masks.float(), PATCH_SIZE).flatten(2)  # (n, objects, tokens)
    t = torch.zeros(frac.shape[0], frac.shape[2], C + 1)
    for j in range(scenes.objects):
        t.scatter_add_(2, scenes.labels[:, j].view(-1, 1, 1).expand(-1, frac.shape[2], 1),
                       frac[:, j].unsqueeze(2))
    t[:, :, C] = 1.0 - t[:, :, :C].sum(2)
    return t


def aux_weight(progress: float, w0: float) -> float:
    """Weight of the auxiliary token loss: w0, fading out between 55 % and 80 %
    of the run; the rest trains the plain classification objective only."""
    if progress < 0.55:
        return w0
    return w0 * max(0.0, (0.8 - progress) / 0.25)


def train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model()
    model.train()
    # auxiliary token-labelling head (training only, not shipped)
    aux = torch.nn.Linear(model.embed_dim, len(CLASSES) + 1)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in aux.named_parameters()]
    decay = [p for n, p in named if p.ndim >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in named if not (p.ndim >= 2 and "pos_embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999))
    n_pair = int(round(args.batch_size * args.pair_fraction))
    n_single = args.batch_size - n_pair
    budget = args.minutes * 60.0 if args.steps is None else None
    _log(log, f"start training seed={args.seed} config={json.dumps(MODEL_CONFIG)} "
              f"params={sum(p.numel() for p in model.parameters())} batch={n_single}+{n_pair} "
              f"lr={args.lr} wd={args.weight_decay} warmup={args.warmup} smoothing={args.smoothing} "
              f"aux_weight={args.aux_weight} "
              f"{'minutes=%s' % args.minutes if budget else 'steps=%d' % args.steps} "
              f"threads={args.threads} host={platform.node()} cpu={platform.processor() or platform.machine()}")
    meta = dict(model_config=MODEL_CONFIG, seed=args.seed, class_names=list(CLASSES),
                batch_size=args.batch_size, pair_fraction=args.pair_fraction, lr=args.lr)
    t0 = time.time()
    last_ckpt = t0
    step = 0
    ema_loss = None
    while True:
        elapsed = time.time() - t0
        progress = elapsed / budget if budget else step / args.steps
        if progress >= 1.0:
            break
        if progress < args.warmup:
            lr = args.lr * progress / args.warmup
        else:
            q = (progress - args.warmup) / (1 - args.warmup)
            lr = args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * q))
        for g in opt.param_groups:
            g["lr"] = lr
        x, target, tok_target = _batch(args.seed, step, n_single, n_pair, args.smoothing, progress)
        feats = model.forward_features(x)
        logits = model.forward_head(feats)
        loss = torch.sum(-target * F.log_softmax(logits, 1), 1).mean()
        w = aux_weight(progress, args.aux_weight)
        total = loss
        if w > 0:
            tok = aux(feats[:, model.num_prefix_tokens:])
            total = loss + w * torch.sum(-tok_target * F.log_softmax(tok, 2), 2).mean()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        if step % args.log_every == 0:
            el = time.time() - t0
            _log(log, f"step {step} loss {ema_loss:.4f} lr {lr:.2e} progress {progress:.3f} "
                      f"elapsed {el / 60:.1f} min ({step * args.batch_size / el:.0f} img/s)")
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            acc = evaluate_accuracy(model, n=args.val_n, seed=VAL_SEED)
            model.train()
            save_weights(model, out / "shapes_vit.safetensors",
                         dict(meta, steps=step, train_seconds=round(time.time() - t0),
                              val=acc, final="false"))
            _log(log, f"checkpoint step {step}: val single_top1 {acc['single_top1']:.4f} "
                      f"pair_top2 {acc['pair_top2']:.4f} (n={acc['n']}, seed {VAL_SEED})")
            last_ckpt = time.time()
    train_s = time.time() - t0
    model.eval()
    acc = evaluate_accuracy(model, n=args.val_n, seed=VAL_SEED)
    save_weights(model, out / "shapes_vit.safetensors",
                 dict(meta, steps=step, train_seconds=round(train_s), val=acc, final="true"))
    _log(log, f"done: {step} steps, {step * args.batch_size} images, {train_s / 60:.1f} min; "
              f"val single_top1 {acc['single_top1']:.4f} pair_top2 {acc['pair_top2']:.4f}")


def evaluate(args) -> dict:
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / "shapes_vit.safetensors"
    model = load_model(weights)
    t = time.time()
    acc = evaluate_accuracy(model, n=args.n, seed=EVAL_SEED_BASE)
    acc["seconds"] = round(time.time() - t, 1)
    acc["seeds"] = [EVAL_SEED_BASE, EVAL_SEED_BASE + 1]
    acc["weights"] = str(weights)
    log = Path(args.out) / "train.log"
    _log(log if Path(args.out).exists() else None,
         f"evaluate {weights.name}: single_top1 {acc['single_top1']:.4f} pair_top2 "
         f"{acc['pair_top2']:.4f} (n={acc['n']} each, seeds {EVAL_SEED_BASE}, {EVAL_SEED_BASE + 1})")
    print(json.dumps(acc))
    return acc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="run seed, 0..9")
    ap.add_argument("--minutes", type=float, default=64.0, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps instead of --minutes")
    ap.add_argument("--out", default=str(WEIGHTS_DIR))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--pair-fraction", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--smoothing", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the auxiliary per-patch (token labelling) loss early in training")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is far faster than 2 when the CPU is shared")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--val-n", type=int, default=300)
    ap.add_argument("--evaluate-only", action="store_true")
    ap.add_argument("--weights", default=None, help="weights for --evaluate-only")
    ap.add_argument("--n", type=int, default=2000, help="scenes per test set for --evaluate-only")
    args = ap.parse_args(argv)
    if not 0 <= args.seed <= 9:
        ap.error("--seed must be in 0..9 (training seeds must stay below the evaluation seeds)")
    if args.evaluate_only:
        evaluate(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
