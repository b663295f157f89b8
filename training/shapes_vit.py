"""Train (or evaluate) the benchmark shapes ViT.

    python -m training.shapes_vit [--seed S] [--minutes M | --steps N] [--out DIR]
    python -m training.shapes_vit --evaluate-only [--weights PATH] [--n 2000]

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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from relevancy.worlds.shapes_vit import EVAL_SEED_BASE, MODEL_CONFIG, WEIGHTS_DIR, build_model, evaluate_accuracy, load_model
from relevancy.worlds.scenes import CLASSES, PATCH_SIZE, make_scenes

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
    os.chmod(tmp, 0o644)  # safetensors writes owner-only files
    os.replace(tmp, path)


def save_with_json(model: torch.nn.Module, path: Path, info: dict) -> None:
    """The weights (`save_weights`) and, beside them, ``path.with_suffix('.json')`` holding ``info`` (the config, the
    vocabulary, the run's facts): the shipped models' files, each written atomically and readable by all."""
    save_weights(model, path, {"format": "pt"})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path.with_suffix(".json"))


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


def aux_weight(progress: float, w0: float, end: float = 0.8) -> float:
    """Weight of an auxiliary loss: ``w0``, fading linearly to 0 over the 25 % of
    the run before ``end``; after ``end`` the run trains its plain objective only."""
    return w0 * min(1.0, max(0.0, (end - progress) / 0.25))


def start_run(args: argparse.Namespace, log_name: str) -> tuple[Path, Path, torch.device]:
    """The output folder (made), its log file and the device, with ``args.threads``
    torch threads and the torch seed ``args.seed`` set: how every trainer starts."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return out, out / log_name, torch.device(args.device)


def machine() -> str:
    """The host and processor, as every training log's first line names them."""
    return f"host={platform.node()} cpu={platform.processor() or platform.machine()}"


def adamw(named: Iterable[tuple[str, torch.nn.Parameter]], decays: Callable[[str, torch.nn.Parameter], bool],
          args: argparse.Namespace, **options) -> torch.optim.AdamW:
    """AdamW over the parameters `named`, with `--weight-decay` on those `decays` picks and none on the others."""
    named = list(named)
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": args.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}], lr=args.lr, **options)


@dataclass
class Run:
    """One shipped model's training as `fit` runs it: `loss(step, progress)` draws step `step`'s batch and returns
    the loss to minimise and the numbers to log (smoothed over steps); `checkpoint(step, seconds, final)` validates,
    saves and logs; `after_step` runs after each optimiser step (CLIP clamps its logit scale)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[int, float], tuple[torch.Tensor, dict[str, float]]]
    checkpoint: Callable[[int, float, bool], None]
    items_per_step: int
    unit: str
    after_step: Callable[[], None] | None = None


def fit(args: argparse.Namespace, log: Path, run: Run) -> None:
    """The one training loop of the shipped models: the shared learning-rate schedule over wall-clock (`--minutes`)
    or step (`--steps`) progress, gradient clipping at `--clip`, a log line every `--log-every` steps, a checkpoint
    every `--ckpt-minutes` and a final one."""
    budget = args.minutes * 60.0 if args.steps is None else None
    t0 = last_checkpoint = time.time()
    step, smoothed = 0, None
    while True:
        progress = (time.time() - t0) / budget if budget else step / args.steps
        if progress >= 1.0:
            break
        lr = learning_rate(args, progress)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        total, logged = run.loss(step, progress)
        run.optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.clip)
        run.optimizer.step()
        if run.after_step is not None:
            run.after_step()
        step += 1
        smoothed = logged if smoothed is None else {k: 0.98 * smoothed[k] + 0.02 * v for k, v in logged.items()}
        if step % args.log_every == 0:
            elapsed = time.time() - t0
            _log(log, f"step {step} " + " ".join(f"{k} {v:.4f}" for k, v in smoothed.items())
                 + f" lr {lr:.2e} progress {progress:.3f} elapsed {elapsed / 60:.1f} min "
                   f"({step * run.items_per_step / elapsed:.0f} {run.unit}/s)")
        if time.time() - last_checkpoint > args.ckpt_minutes * 60:
            run.checkpoint(step, time.time() - t0, False)
            run.model.train()
            last_checkpoint = time.time()
    run.model.eval()
    run.checkpoint(step, time.time() - t0, True)


def step_loader(args: argparse.Namespace, make: Callable[[int], object]):
    """An iterator over the batches ``make(step)`` of the run's steps rendered by `--workers` DataLoader processes
    (`StepBatches`), or None without workers."""
    if args.workers <= 0:
        return None
    if args.steps is None:
        raise SystemExit("--workers needs --steps (workers cannot follow wall-clock progress)")
    return iter(torch.utils.data.DataLoader(StepBatches(args.steps, make), batch_size=None, num_workers=args.workers,
                                            prefetch_factor=4))


class StepBatches(torch.utils.data.IterableDataset):
    """The batches of a fixed-step run, ``make(step)`` for each of ``steps``, shared out over the DataLoader workers
    (one torch thread each); ``make`` is picklable (a module-level function or a partial of one)."""

    def __init__(self, steps: int, make: Callable[[int], object]) -> None:
        self.steps, self.make = steps, make

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        torch.set_num_threads(1)
        for step in range(wid, self.steps, nw):
            yield self.make(step)


def _step_batch(args: argparse.Namespace, n_single: int, n_pair: int, step: int):
    return _batch(args.seed, step, n_single, n_pair, args.smoothing, step / args.steps)


def train(args) -> None:
    out, log, device = start_run(args, "train.log")
    model = build_model().to(device)
    model.train()
    # auxiliary token-labelling head (training only, not shipped)
    aux = torch.nn.Linear(model.embed_dim, len(CLASSES) + 1).to(device)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in aux.named_parameters()]
    optimizer = adamw(named, lambda n, p: p.ndim >= 2 and "pos_embed" not in n, args, betas=(0.9, 0.999))
    n_pair = int(round(args.batch_size * args.pair_fraction))
    n_single = args.batch_size - n_pair
    _log(log, f"start training seed={args.seed} config={json.dumps(MODEL_CONFIG)} "
              f"params={sum(p.numel() for p in model.parameters())} batch={n_single}+{n_pair} "
              f"lr={args.lr} wd={args.weight_decay} warmup={args.warmup} smoothing={args.smoothing} "
              f"aux_weight={args.aux_weight} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} "
              f"threads={args.threads} {machine()}")
    meta = dict(model_config=MODEL_CONFIG, seed=args.seed, class_names=list(CLASSES),
                batch_size=args.batch_size, pair_fraction=args.pair_fraction, lr=args.lr)
    loader = step_loader(args, partial(_step_batch, args, n_single, n_pair))

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        if loader is not None:
            x, target, tok_target = next(loader)
        else:
            x, target, tok_target = _batch(args.seed, step, n_single, n_pair, args.smoothing, progress)
        x, target, tok_target = x.to(device), target.to(device), tok_target.to(device)
        feats = model.forward_features(x)
        logits = model.forward_head(feats)
        loss = torch.sum(-target * F.log_softmax(logits, 1), 1).mean()
        w = aux_weight(progress, args.aux_weight)
        total = loss
        if w > 0:
            tok = aux(feats[:, model.num_prefix_tokens:])
            total = loss + w * torch.sum(-tok_target * F.log_softmax(tok, 2), 2).mean()
        return total, {"loss": loss.item()}

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        acc = evaluate_accuracy(model, n=args.val_n, seed=VAL_SEED)
        save_weights(model, out / "shapes_vit.safetensors",
                     dict(meta, steps=step, train_seconds=round(seconds), val=acc, final=str(final).lower()))
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val single_top1 "
                  f"{acc['single_top1']:.4f} pair_top2 {acc['pair_top2']:.4f} (n={acc['n']}, seed {VAL_SEED})")

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size, "img"))


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


def logged_evaluation(args: argparse.Namespace, weights: Path, log_name: str, started: float, acc: dict,
                      summary: str) -> dict:
    """`acc` with the seconds since `started` and the weights file, its `summary` logged to the run's log (where
    `--out` exists) and printed as JSON: how `--evaluate-only` ends."""
    acc["seconds"] = round(time.time() - started, 1)
    acc["weights"] = str(weights)
    log = Path(args.out) / log_name
    _log(log if Path(args.out).exists() else None, f"evaluate {weights.name}: {summary}")
    print(json.dumps(acc))
    return acc


def learning_rate(args: argparse.Namespace, progress: float) -> float:
    """The shared schedule at `progress` (0..1) of a run: linear warm-up over `--warmup`, then cosine decay from
    `--lr` to `--min-lr`."""
    if progress < args.warmup:
        return args.lr * progress / args.warmup
    q = (progress - args.warmup) / (1 - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * q))


def training_parser(doc: str, minutes: float, pair_fraction: float, lr: float, weight_decay: float) -> argparse.ArgumentParser:
    """The options every shipped-model training script shares (seed, budget, batch, schedule); each adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="run seed, 0..9")
    ap.add_argument("--minutes", type=float, default=minutes, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps instead of --minutes")
    ap.add_argument("--out", default=str(WEIGHTS_DIR))
    ap.add_argument("--batch-size", type=int, default=64, help="scenes per step")
    ap.add_argument("--pair-fraction", type=float, default=pair_fraction)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=weight_decay)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    return ap


def run_training_command(ap: argparse.ArgumentParser, argv, train_fn, evaluate_fn, threads_help: str,
                         ckpt_minutes: float, n_help: str) -> None:
    """Adds the run options (device, workers, threads, logging, evaluation), parses, checks the seed and trains
    or, with --evaluate-only, evaluates."""
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader processes rendering scenes (needs --steps)")
    ap.add_argument("--threads", type=int, default=2, help=threads_help)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-minutes", type=float, default=ckpt_minutes)
    ap.add_argument("--val-n", type=int, default=300)
    ap.add_argument("--evaluate-only", action="store_true")
    ap.add_argument("--weights", default=None, help="weights for --evaluate-only")
    ap.add_argument("--n", type=int, default=2000, help=n_help)
    args = ap.parse_args(argv)
    if not 0 <= args.seed <= 9:
        ap.error("--seed must be in 0..9 (training seeds must stay below the evaluation seeds)")
    if args.evaluate_only:
        evaluate_fn(args)
    else:
        train_fn(args)


def run_classifier_command(doc: str, argv, train_fn, evaluate_fn, minutes: float, threads_help: str) -> None:
    """The command of a shapes classifier's trainer (the ViT's, the Swin's): the shared options, label smoothing and
    the auxiliary token-labelling loss's weight, then train or evaluate."""
    ap = training_parser(doc, minutes=minutes, pair_fraction=0.4, lr=1.5e-3, weight_decay=0.05)
    ap.add_argument("--smoothing", type=float, default=0.05)
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the auxiliary per-token (token labelling) loss early in training")
    run_training_command(ap, argv, train_fn, evaluate_fn, threads_help=threads_help, ckpt_minutes=5.0,
                         n_help="scenes per test set for --evaluate-only")


def main(argv=None) -> None:
    run_classifier_command(__doc__, argv, train, evaluate, minutes=88.0,
                           threads_help="torch threads (the shipped run: 2, alone on a 2-core CPU)")


if __name__ == "__main__":
    main()
