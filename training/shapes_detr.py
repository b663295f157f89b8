"""Train (or evaluate) the shapes detector, a small `DetrForObjectDetection`.

    python -m training.shapes_detr [--seed S] [--minutes M | --steps N] [--threads T] [--device cpu|cuda]
    python -m training.shapes_detr --evaluate-only [--weights PATH] [--n 1000]

Data: fresh scenes every step (infinite data), one to three objects each (:func:`make_detection_scenes`); step
``t`` of run seed ``S`` draws from seed ``S * 10**8 + t``, below ``EVAL_SEED_BASE = 10**9``, so the evaluation
scenes are never trained on. The clutter of the scenes ramps up over the first 30 % of the run and the last 30 %
sees benchmark scenes only (as for the shapes ViT). Early on, an auxiliary linear head on the encoder's output is
also trained to say which class (or background) covers each image token (soft targets from the exact masks): DETR
alone learned to tell the shapes apart too slowly for the CPU budget. Its weight fades to zero between 55 % and
80 % of the run (``--aux-end``) and it is not shipped.

Loss: DETR's own (transformers): Hungarian matching, cross-entropy with the no-object class down-weighted
(``eos_coefficient`` 0.1), L1 and generalised-IoU box losses (weights 5 and 2), on every decoder layer
(auxiliary losses). AdamW, linear warm-up then cosine decay, following wall-clock progress with ``--minutes`` or
the step count with ``--steps`` (exactly reproducible); gradient norm clipped at 0.1 as DETR does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from relevancy.worlds.detection import (DETECTION_TEST_SEED, DETECTOR_CONFIG, build_detector, detector_inputs, evaluate_detector,
                        load_detector, make_detection_scenes)
from relevancy.worlds.shapes_vit import EVAL_SEED_BASE
from relevancy.worlds.scenes import CLASSES
from .shapes_vit import (Run, _log, adamw, aux_weight, curriculum, fit, machine, run_training_command, save_with_json,
                    start_run, training_parser)

STRIDE = 8  # the image tokens' cell size in pixels
VAL_SEED = EVAL_SEED_BASE + 31_000  # quick validation during training, disjoint from the test scenes
LOG_NAME = "shapes_detr_train.log"
WEIGHTS_NAME = "shapes_detr.safetensors"


def save_detector(model, path: Path, meta: dict) -> None:
    """Weights (safetensors) and ``path.with_suffix('.json')`` (the `DetrConfig` arguments and ``meta``), each
    written atomically."""
    save_with_json(model, path, dict(config=DETECTOR_CONFIG, **meta))


def token_targets(scenes, stride: int) -> torch.Tensor:
    """Soft per-token labels for the auxiliary loss: the share of each class (and, last, of background) in every
    ``stride`` x ``stride`` cell of the image, from the exact masks; ``(n, cells, classes + 1)``."""
    n, size = len(scenes), scenes.images.shape[-1]
    share = torch.zeros(n, len(CLASSES) + 1, size, size)
    for i, (labels, masks) in enumerate(zip(scenes.labels, scenes.masks)):
        share[i].index_add_(0, labels, masks.float())
    share[:, -1] = 1.0 - share[:, :-1].sum(1)
    return torch.nn.functional.avg_pool2d(share, stride).flatten(2).transpose(1, 2)


def train(args) -> None:
    out, log, device = start_run(args, LOG_NAME)
    model = build_detector().to(device).train()
    # auxiliary token labelling on the encoder's output (training only, not shipped)
    aux = torch.nn.Linear(model.config.d_model, len(CLASSES) + 1).to(device)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in aux.named_parameters()]
    optimizer = adamw(named, lambda n, p: p.ndim >= 2, args)
    _log(log, f"start training seed={args.seed} params={sum(p.numel() for p in model.parameters())} "
              f"batch={args.batch_size} lr={args.lr} wd={args.weight_decay} warmup={args.warmup} clip={args.clip} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} threads={args.threads} "
              f"device={args.device} {machine()}")
    meta = dict(seed=args.seed, batch_size=args.batch_size, lr=args.lr)
    rng = np.random.default_rng(args.seed)

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        clutter = float(curriculum(progress, 1, rng)[0])
        scenes = make_detection_scenes(args.batch_size, args.seed * 10**8 + step, clutter=clutter)
        targets = [{k: v.to(device) for k, v in t.items()} for t in scenes.hf_targets()]
        result = model(**{k: v.to(device) for k, v in detector_inputs(scenes.images).items()}, labels=targets)
        total = result.loss
        parts = {k: v.item() for k, v in result.loss_dict.items() if k in ("loss_ce", "loss_bbox", "loss_giou")}
        weight = aux_weight(progress, args.aux_weight, args.aux_end)
        parts["aux"] = 0.0
        if weight > 0:
            tokens = aux(result.encoder_last_hidden_state).log_softmax(-1)
            aux_loss = -(token_targets(scenes, STRIDE).to(device) * tokens).sum(-1).mean()
            total = total + weight * aux_loss
            parts["aux"] = aux_loss.item()
        return total, {**parts, "clutter": clutter}

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        """Validate on the CPU, save, log; the model goes back to its device to train on."""
        model.cpu()
        scores = evaluate_detector(model, n=args.val_n, seed=VAL_SEED)
        save_detector(model, out / WEIGHTS_NAME, dict(meta, steps=step, train_seconds=round(seconds), val=scores, final=final))
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val AP50 {scores['ap50']:.4f} "
                  f"AP {scores['ap']:.4f} recall50 {scores['recall50']:.4f} class accuracy {scores['class_accuracy']:.4f} "
                  f"(n={args.val_n}, seed {VAL_SEED})")
        if not final:
            model.to(device)

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size, "scenes"))


def evaluate(args) -> dict:
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / WEIGHTS_NAME
    start = time.time()
    scores = evaluate_detector(load_detector(weights), n=args.n, seed=DETECTION_TEST_SEED)
    scores.update(seconds=round(time.time() - start, 1), weights=str(weights))
    log = Path(args.out) / LOG_NAME
    _log(log if log.parent.exists() else None,
         f"evaluate {weights.name}: AP50 {scores['ap50']:.4f} AP {scores['ap']:.4f} recall50 {scores['recall50']:.4f} "
         f"class accuracy {scores['class_accuracy']:.4f} (n={args.n}, seed {DETECTION_TEST_SEED})")
    print(json.dumps(scores))
    return scores


def main(argv=None) -> None:
    ap = training_parser(__doc__, minutes=85.0, pair_fraction=0.0, lr=3e-4, weight_decay=1e-4)
    ap.set_defaults(batch_size=32, clip=0.1)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the auxiliary token-labelling loss")
    ap.add_argument("--aux-end", type=float, default=0.8, help="fraction of the run where the auxiliary loss is gone")
    run_training_command(ap, argv, train, evaluate, threads_help="torch threads (the shipped run: 1, beside another job)",
                         ckpt_minutes=10.0, n_help="scenes in the test set for --evaluate-only")


if __name__ == "__main__":
    main()
