"""Train (or evaluate) the shapes CLIP.

    python -m training.shapes_clip [--seed S] [--minutes M | --steps N] [--out DIR] [--device cpu|cuda]
    python -m training.shapes_clip --evaluate-only [--weights PATH] [--n 2000]

Data: fresh scenes every step (infinite data).  Step ``t`` of run seed ``S``
renders one-object scenes from seed ``S * 10**8 + 2 t`` and two-object scenes
from ``S * 10**8 + 2 t + 1``, all below ``EVAL_SEED_BASE = 10**9``, so the
evaluation scenes are never trained on.  Every scene gets ``--captions``
captions drawn by :func:`relevancy.worlds.captions.sample_captions` (zero-shot
prompts, colour/size/position phrases, one object of a pair, relations).

Loss: symmetric InfoNCE with CLIP's learned temperature (``logit_scale``,
clamped at 100), with *multi-positive* targets to handle false negatives: a
caption of one scene is often also true of other scenes of the batch ("a
photo of a star" of every scene with a star), so the target of an image is
uniform over all captions of the batch that are true of it, and the target
of a caption uniform over all images it is true of
(:func:`relevancy.worlds.captions.caption_truth`).  Hard negatives
(``--hard-negatives``, one per scene by default): captions that are false of
their scene but share its words (:func:`relevancy.worlds.captions.confusable_captions`:
one object's colour on the other's shape, the neighbouring hue, another shape)
join the image-to-text term; a caption true of no scene of the batch is left
out of the text-to-image term.

Extra terms (training only; their heads are not shipped): contrastive
learning alone learned shapes too slowly for the CPU budget, so early on two
linear heads on the vision tower are also trained, as the shapes ViT's token
labelling: one on the patch tokens predicts which shape and which colour name
(or background) covers each patch (soft targets from the exact masks), one on
the pooled image feature predicts the scene's shapes and (shape, colour)
pairs.  Their weight fades to zero between 55 % and 80 % of the run
(``--aux-end``), so the last 20 % is plain (multi-positive) CLIP training.
The clutter of the scenes
ramps up over the first 30 % of the run and the last 30 % sees benchmark
scenes only (as for the shapes ViT).  AdamW, linear warm-up then cosine decay,
following wall-clock progress with ``--minutes`` or the step count with
``--steps`` (exactly reproducible).
"""

from __future__ import annotations

import json
import math
import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from relevancy.worlds.captions import (COLORS, Tokenizer, attribute_arrays, caption_truth, confusable_captions,
                       sample_captions)
from relevancy.worlds.shapes_clip import (CLIP_CONFIG, CLIP_WEIGHTS_PATH, CONTEXT_LENGTH, build_clip, evaluate_clip,
                         load_clip)
from relevancy.worlds.shapes_vit import EVAL_SEED_BASE
from .shapes_vit import (Run, _log, adamw, aux_weight, fit, machine, run_training_command, save_with_json, start_run, step_loader,
                    training_parser)
from relevancy.worlds.scenes import CLASSES, PATCH_SIZE, make_scenes

VAL_SEED = EVAL_SEED_BASE + 10_000  # quick validation during training, disjoint from the test seeds
LOG_NAME = "shapes_clip_train.log"


def save_clip(model, tokenizer: Tokenizer, config: dict, path: Path, meta: dict) -> None:
    """Write ``path`` (safetensors weights) and ``path.with_suffix('.json')``
    (``CLIPConfig`` keyword arguments, vocabulary and ``meta``), atomically."""
    save_with_json(model, path, dict(config=config, vocab=list(tokenizer.vocab), context_length=CONTEXT_LENGTH, **meta))


def clip_config(vision_width: int | None = None, vision_layers: int | None = None,
                text_width: int | None = None, text_layers: int | None = None) -> dict:
    """:data:`CLIP_CONFIG` with another width (MLP 4x) or depth of either tower."""
    cfg = json.loads(json.dumps(CLIP_CONFIG))
    for tower, width, layers in (("vision_config", vision_width, vision_layers),
                                 ("text_config", text_width, text_layers)):
        if width:
            cfg[tower].update(hidden_size=width, intermediate_size=4 * width)
        if layers:
            cfg[tower]["num_hidden_layers"] = layers
    return cfg


def clutter_schedule(progress: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-scene clutter: ramps up over the first 30 % of the run, full for the last 30 %."""
    if progress >= 0.7:
        return np.ones(n)
    r = min(1.0, progress / 0.3)
    return np.clip(r * (0.5 + rng.random(n)), 0.0, 1.0)


def token_targets(scenes, attributes: dict[str, np.ndarray]) -> torch.Tensor:
    """Per-patch soft targets (n, patches, shapes + colours + 2): the fraction of
    each 8x8 patch covered by each object, spread on its shape (first block,
    background last) and on its colour name (second block, background last)."""
    S, C = len(CLASSES), len(COLORS)
    frac = F.avg_pool2d(scenes.masks.float(), PATCH_SIZE).flatten(2)  # (n, objects, patches)
    n, k, t = frac.shape
    shape = torch.zeros(n, t, S + 1)
    color = torch.zeros(n, t, C + 1)
    for j in range(k):
        sj = torch.from_numpy(attributes["shape"][:, j]).view(-1, 1, 1).expand(-1, t, 1)
        cj = torch.from_numpy(attributes["color"][:, j]).view(-1, 1, 1).expand(-1, t, 1)
        shape.scatter_add_(2, sj, frac[:, j].unsqueeze(2))
        color.scatter_add_(2, cj, frac[:, j].unsqueeze(2))
    shape[:, :, S] = 1.0 - shape[:, :, :S].sum(2)
    color[:, :, C] = 1.0 - color[:, :, :C].sum(2)
    return torch.cat([shape, color], 2)


def scene_targets(attributes: dict[str, np.ndarray]) -> torch.Tensor:
    """Per-scene soft targets (n, shapes + shapes * colours): the objects'
    shapes and their (shape, colour name) pairs, each object weighted 1 / objects."""
    S, C = len(CLASSES), len(COLORS)
    n, k = attributes["shape"].shape
    t = torch.zeros(n, S + S * C)
    rows = torch.arange(n)
    for j in range(k):
        sj = torch.from_numpy(attributes["shape"][:, j])
        t[rows, sj] += 1.0 / k
        t[rows, S + sj * C + torch.from_numpy(attributes["color"][:, j])] += 1.0 / k
    return t


def make_batch(seed: int, step: int, n_single: int, n_pair: int, captions: int,
               tokenizer: Tokenizer, progress: float = 1.0, hard_negatives: int = 0):
    """One training step: images (B, 3, 64, 64), token ids and mask
    ((captions + hard_negatives) * B, L), the truth matrix over all of them (float)
    and the targets of the auxiliary losses (:func:`token_targets`,
    :func:`scene_targets`).  The ``hard_negatives`` captions per scene come
    from :func:`confusable_captions`, drawn after the true ones so that a run
    without them sees the same true captions."""
    base = seed * 10**8 + 2 * step
    assert base + 1 < EVAL_SEED_BASE
    rng = np.random.default_rng([seed, step, 11])
    s1 = make_scenes(n_single, seed=base, objects=1, clutter=clutter_schedule(progress, n_single, rng))
    s2 = make_scenes(n_pair, seed=base + 1, objects=2, clutter=clutter_schedule(progress, n_pair, rng))
    a1, a2 = attribute_arrays(s1), attribute_arrays(s2)
    caps = [c for _ in range(captions) for s in (s1, s2) for c in sample_captions(s, rng)]
    caps += [c for _ in range(hard_negatives) for s in (s1, s2) for c in confusable_captions(s, rng)]
    truth = caption_truth(caps, [a1, a2])
    enc = tokenizer([c.text for c in caps], CONTEXT_LENGTH)
    return (torch.cat([s1.images, s2.images]), enc["input_ids"], enc["attention_mask"],
            torch.from_numpy(truth).float(), torch.cat([token_targets(s1, a1), token_targets(s2, a2)]),
            torch.cat([scene_targets(a1), scene_targets(a2)]))


def multi_positive_clip_loss(image_emb: torch.Tensor, text_emb: torch.Tensor,
                             logit_scale: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE whose targets spread uniformly over all true pairs.

    A caption true of no image of the batch (a hard negative) only competes in
    the image-to-text term; the text-to-image term averages over the others."""
    sim = F.normalize(image_emb, dim=-1) @ F.normalize(text_emb, dim=-1).T
    logits = logit_scale.exp().clamp(max=100.0) * sim
    i2t = -(truth / truth.sum(1, keepdim=True) * F.log_softmax(logits, 1)).sum(1).mean()
    true_of_some = truth.sum(0) > 0
    t2i_truth = truth[:, true_of_some]
    t2i = -(t2i_truth / t2i_truth.sum(0, keepdim=True)
            * F.log_softmax(logits[:, true_of_some], 0)).sum(0).mean()
    return 0.5 * (i2t + t2i)


def _step_batch(args, n_single: int, n_pair: int, step: int):
    return make_batch(args.seed, step, n_single, n_pair, args.captions, Tokenizer(), step / args.steps, args.hard_negatives)


def train(args) -> None:
    out, log, device = start_run(args, LOG_NAME)
    tokenizer = Tokenizer()
    config = clip_config(args.vision_width, args.vision_layers, args.text_width, args.text_layers)
    model = build_clip(config).to(device)
    model.train()
    # auxiliary patch-labelling head (training only, not shipped)
    width = config["vision_config"]["hidden_size"]
    n_shape = len(CLASSES) + 1
    aux = torch.nn.Linear(width, n_shape + len(COLORS) + 1).to(device)
    # auxiliary scene head on the pooled image features (training only, not shipped)
    aux_scene = torch.nn.Linear(width, len(CLASSES) * (1 + len(COLORS))).to(device)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in aux.named_parameters()] \
        + [("aux_scene." + n, p) for n, p in aux_scene.named_parameters()]
    optimizer = adamw(named, lambda n, p: p.ndim >= 2 and "embedding" not in n, args, betas=(0.9, 0.98), eps=1e-6)
    n_pair = int(round(args.batch_size * args.pair_fraction))
    n_single = args.batch_size - n_pair
    _log(log, f"start training seed={args.seed} config={json.dumps(config)} "
              f"params={sum(p.numel() for p in model.parameters())} batch={n_single}+{n_pair} "
              f"captions/scene={args.captions} hard_negatives/scene={args.hard_negatives} aux_weight={args.aux_weight} aux_end={args.aux_end} "
              f"lr={args.lr} wd={args.weight_decay} warmup={args.warmup} "
              f"{'minutes=%s' % args.minutes if args.steps is None else 'steps=%d' % args.steps} device={args.device} "
              f"threads={args.threads} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} {machine()}")
    meta = dict(seed=args.seed, batch_size=args.batch_size, pair_fraction=args.pair_fraction,
                captions_per_scene=args.captions, hard_negatives_per_scene=args.hard_negatives,
                aux_weight=args.aux_weight, aux_end=args.aux_end,
                lr=args.lr)
    loader = step_loader(args, partial(_step_batch, args, n_single, n_pair))

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        if loader is not None:
            batch = next(loader)
        else:
            batch = make_batch(args.seed, step, n_single, n_pair, args.captions, tokenizer, progress,
                               args.hard_negatives)
        images, ids, mask, truth, tok_target, scene_target = (t.to(device, non_blocking=True) for t in batch)
        vis = model.vision_model(pixel_values=images)
        img = model.visual_projection(vis.pooler_output)
        txt = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        loss = multi_positive_clip_loss(img, txt, model.logit_scale, truth)
        total = loss
        w = aux_weight(progress, args.aux_weight, args.aux_end)
        if w > 0:
            ce = lambda lo, ta: torch.sum(-ta * F.log_softmax(lo, -1), -1).mean()  # noqa: E731
            tok = aux(model.vision_model.post_layernorm(vis.last_hidden_state[:, 1:]))
            glob = aux_scene(vis.pooler_output)
            S = len(CLASSES)
            total = loss + w * (ce(tok[..., :n_shape], tok_target[..., :n_shape])
                                + ce(tok[..., n_shape:], tok_target[..., n_shape:])
                                + ce(glob[:, :S], scene_target[:, :S]) + ce(glob[:, S:], scene_target[:, S:]))
        return total, {"loss": loss.item(), "scale": model.logit_scale.exp().item()}

    def clamp_scale() -> None:
        with torch.no_grad():
            model.logit_scale.clamp_(0.0, math.log(100.0))

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        acc = evaluate_clip(model, tokenizer, n=args.val_n, seed=VAL_SEED)
        save_clip(model, tokenizer, config, out / CLIP_WEIGHTS_PATH.name,
                  dict(meta, steps=step, train_seconds=round(seconds), val=acc, final=final))
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val zero_shot_top1 "
                  f"{acc['zero_shot_top1']:.4f} retrieval_at1 {acc['retrieval_at1']:.4f} (n={acc['n']}, seeds {acc['seeds']})")

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size, "img", after_step=clamp_scale))


def evaluate(args) -> dict:
    """Measure the targets of the weights on ``args.n`` test scenes and log them."""
    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else Path(args.out) / CLIP_WEIGHTS_PATH.name
    model, tokenizer = load_clip(weights, device=args.device)
    t = time.time()
    acc = evaluate_clip(model, tokenizer, n=args.n, seed=EVAL_SEED_BASE)
    acc["seconds"] = round(time.time() - t, 1)
    acc["weights"] = str(weights)
    log = Path(args.out) / LOG_NAME
    _log(log if Path(args.out).exists() else None,
         f"evaluate {weights.name}: zero_shot_top1 {acc['zero_shot_top1']:.4f} retrieval_at1 "
         f"{acc['retrieval_at1']:.4f} (n={acc['n']} each, seeds {acc['seeds']})")
    print(json.dumps(acc))
    return acc


def main(argv=None) -> None:
    ap = training_parser(__doc__, minutes=85.0, pair_fraction=0.5, lr=1e-3, weight_decay=0.1)
    ap.add_argument("--captions", type=int, default=2, help="captions per scene and step")
    ap.add_argument("--hard-negatives", type=int, default=1,
                    help="confusable false captions per scene and step (binding and hue hard negatives)")
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the auxiliary patch-labelling loss early in training")
    ap.add_argument("--aux-end", type=float, default=0.8,
                    help="progress at which the auxiliary losses have faded out")
    ap.add_argument("--vision-width", type=int, default=None, help="override the vision width")
    ap.add_argument("--vision-layers", type=int, default=None, help="override the vision depth")
    ap.add_argument("--text-width", type=int, default=None, help="override the text width")
    ap.add_argument("--text-layers", type=int, default=None, help="override the text depth")
    run_training_command(
        ap, argv, train, evaluate, ckpt_minutes=10.0, n_help="test scenes per kind for --evaluate-only",
        threads_help="torch threads (on a CPU shared with other jobs use 1, or OMP_WAIT_POLICY=PASSIVE)",
    )


if __name__ == "__main__":
    main()
