"""Running the protocols: explain every batch with every method, feed the accumulators, merge them over processes.

What each benchmark measures (a section of ``results.json`` per protocol):

* ``shapes``: ``n`` one-object scenes for perturbation (predicted and true class), segmentation (predicted
  class against the object's mask) and agreement (predicted class); ``n // 2`` two-object scenes (at least 1)
  for discrimination, each scene explained twice, once for each of its two classes.
* ``imagenet``: perturbation (predicted and true class) on ``n`` images of an ImageFolder.
* ``imagenet-seg``: segmentation (predicted class) on ``n`` images of ``gtsegs_ijcv.mat``.

Agreement is Pearson's r between a method's token scores and ``token_ablation``'s (TAM, the CDAM paper's
reference), pooled over all tokens of all images, plus each method's sparsity. ``token_ablation`` is computed
for it even when it is not among the evaluated methods. ``lrp`` gives pixel maps: they are summed over each
patch to get token scores.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import explain
from ..core.extras import require
from .metrics import AgreementTest, DiscriminationTest, PerturbationTest, SegmentationTest, perturbation_test
from . import data as D
from .shards import Shards, progress_bar

__all__ = ["PAPER_OPTIONS", "REFERENCE", "SECTIONS", "Evaluation", "Settings", "run"]

#: ``--paper-settings``: what the authors' evaluation scripts pass (METHODS.md)
PAPER_OPTIONS: dict[str, dict[str, Any]] = {
    "rollout": {"start_layer": 1},
    "transformer_attribution": {"start_layer": 1},
    "attention_gradcam": {"normalize": True},
}
#: the agreement reference (TAM)
REFERENCE = "token_ablation"
#: protocols measured on each benchmark
SECTIONS: dict[str, tuple[str, ...]] = {
    "shapes": ("perturbation", "segmentation", "discrimination", "agreement"),
    "imagenet": ("perturbation",),
    "imagenet-seg": ("segmentation",),
}


@dataclass
class Settings:
    """What to evaluate. ``n``: images (``shapes``: one-object scenes; two-object scenes are ``n // 2``, at least 1)."""

    benchmark: str
    methods: tuple[str, ...]
    n: int
    batch_size: int = 16
    seed: int = 0
    paper_settings: bool = False
    data: str | None = None
    workers: int = 0

    def options(self, method: str) -> dict[str, Any]:
        """Keyword options passed to ``explain`` for ``method``."""
        return dict(PAPER_OPTIONS.get(method, {})) if self.paper_settings else {}

    @property
    def pairs(self) -> int:
        return max(1, self.n // 2)


#: the accumulators of a method's record
_ACCUMULATORS = ("perturbation", "perturbation_target", "segmentation", "discrimination")


@dataclass
class _Record:
    """One method's accumulators and timings."""

    perturbation: PerturbationTest | None = None
    perturbation_target: PerturbationTest | None = None
    segmentation: SegmentationTest | None = None
    discrimination: DiscriminationTest | None = None
    timing: dict[str, float] = field(default_factory=lambda: {"explain_seconds": 0.0, "metric_seconds": 0.0, "maps": 0})


def pool_to_grid(maps: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, H, W)`` pixel maps summed over each patch of a ``grid`` = ``(h, w)`` patch grid: ``(B, h, w)``."""
    b, height, width = maps.shape
    h, w = grid
    if height % h or width % w:
        raise ValueError(f"a {height}x{width} map does not split into a {h}x{w} patch grid")
    return maps.reshape(b, h, height // h, w, width // w).sum(dim=(2, 4))


class Evaluation:
    """The accumulators of one chunk (:meth:`reset`, :meth:`state`) or of the whole run (:meth:`load` merges the
    chunks' states in order), :meth:`results` reads them."""

    def __init__(self, model: nn.Module, settings: Settings, mean: Sequence[float], std: Sequence[float]) -> None:
        self.model = model
        self.settings = settings
        self.sections = SECTIONS[settings.benchmark]
        self.forward_batch = max(32, 4 * settings.batch_size)
        self.mean, self.std = tuple(mean), tuple(std)
        if "segmentation" in self.sections:
            require("sklearn.metrics", extra="eval")  # imported here, not inside the first method's timing
        self.reset()

    def reset(self) -> None:
        """Empty accumulators and timings (each chunk of the run is recorded from empty ones)."""
        self.records: dict[str, _Record] = {}
        for m in self.settings.methods:
            r = _Record()
            if "perturbation" in self.sections:
                r.perturbation, r.perturbation_target = (PerturbationTest(mean=self.mean, std=self.std, batch_size=self.forward_batch)
                                                         for _ in range(2))
            if "segmentation" in self.sections:
                r.segmentation = SegmentationTest()
            if "discrimination" in self.sections:
                r.discrimination = DiscriminationTest()
            self.records[m] = r
        self.agreement = AgreementTest() if "agreement" in self.sections else None
        #: summed over chunks: reference and agreement costs, model accuracy counts
        self.shared: dict[str, float] = {
            "reference_seconds": 0.0, "agreement_seconds": 0.0, "batch_seconds": 0.0,
            "single_correct": 0, "single_count": 0, "pair_top2_correct": 0, "pair_count": 0,
        }

    # ------------------------------------------------------------------ explaining
    def _explain(self, method: str, images: torch.Tensor, target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores, explained class, logits)``, timed into the method's record (or the reference's cost)."""
        started = time.perf_counter()
        e = explain(self.model, images, method=method, target=target, **self.settings.options(method))
        seconds = time.perf_counter() - started
        if method in self.records:
            self.records[method].timing["explain_seconds"] += seconds
            self.records[method].timing["maps"] += len(images)
        else:
            self.shared["reference_seconds"] += seconds
        return e.scores.float(), e.target, e.logits

    def _metric(self, method: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = fn()
        self.records[method].timing["metric_seconds"] += time.perf_counter() - started
        return out

    def _perturb_target(self, method: str, images: torch.Tensor, maps: torch.Tensor, labels: torch.Tensor,
                        predicted: torch.Tensor, hits: Mapping[str, torch.Tensor]) -> None:
        """The true-class variant: only images whose prediction is wrong have another map (and other hits)."""
        r = self.records[method]
        differ = predicted.cpu() != labels.cpu()
        hits_target = {t: h.clone().cpu() for t, h in hits.items()}
        if bool(differ.any()):
            target_maps, _, _ = self._explain(method, images[differ], labels[differ])
            acc = r.perturbation_target
            assert acc is not None

            def run() -> dict[str, torch.Tensor]:
                return perturbation_test(self.model, images[differ], target_maps, labels[differ], mean=self.mean,
                                         std=self.std, tests=tuple(acc.hits), steps=acc.steps, batch_size=acc.batch_size)

            for t, h in self._metric(method, run).items():
                hits_target[t][differ] = h.cpu()
        assert r.perturbation_target is not None
        for t, h in hits_target.items():
            r.perturbation_target.hits[t].extend(h.tolist())

    def single_batch(self, images: torch.Tensor, labels: torch.Tensor | None, masks: torch.Tensor | None) -> None:
        """One-object images: perturbation (with ``labels``), segmentation (with ``masks``), agreement."""
        token_maps: dict[str, torch.Tensor] = {}
        counted = False
        for m, r in self.records.items():
            maps, predicted, logits = self._explain(m, images, None)
            if labels is not None and not counted:
                self.shared["single_correct"] += int((logits.argmax(-1).cpu() == labels.cpu()).sum())
                self.shared["single_count"] += len(labels)
                counted = True
            if r.perturbation is not None and labels is not None:
                hits = self._metric(m, lambda: r.perturbation.update(self.model, images, maps, labels))
                self._perturb_target(m, images, maps, labels, predicted, hits)
            if r.segmentation is not None and masks is not None:
                self._metric(m, lambda: r.segmentation.update(maps, masks))
            if self.agreement is not None:
                token_maps[m] = maps
        if self.agreement is not None:
            self._agree(images, token_maps)

    def _agree(self, images: torch.Tensor, token_maps: dict[str, torch.Tensor]) -> None:
        if REFERENCE not in token_maps:
            token_maps[REFERENCE], _, _ = self._explain(REFERENCE, images, None)
        started = time.perf_counter()
        grid = tuple(token_maps[REFERENCE].shape[-2:])
        pooled = {m: (pool_to_grid(s, grid) if tuple(s.shape[-2:]) != grid else s) for m, s in token_maps.items()}
        assert self.agreement is not None
        self.agreement.update(pooled)
        self.shared["agreement_seconds"] += time.perf_counter() - started

    def pair_batch(self, images: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor) -> None:
        """Two-object images, each explained for both of its classes: discrimination."""
        rows = torch.cat([images, images])
        targets = torch.cat([labels[:, 0], labels[:, 1]])
        target_masks = torch.cat([masks[:, 0], masks[:, 1]])
        other_masks = torch.cat([masks[:, 1], masks[:, 0]])
        counted = False
        for m, r in self.records.items():
            maps, _, logits = self._explain(m, rows, targets)
            if not counted:
                top2 = logits[: len(images)].topk(2, dim=-1).indices.sort(-1).values.cpu()
                self.shared["pair_top2_correct"] += int((top2 == labels.sort(-1).values).all(-1).sum())
                self.shared["pair_count"] += len(images)
                counted = True
            if r.discrimination is not None:
                self._metric(m, lambda: r.discrimination.update(maps, target_masks, other_masks))

    # ------------------------------------------------------------------ merging and reading
    def state(self) -> dict[str, Any]:
        """Every accumulator's and timing's plain state (a chunk's record)."""
        return {"methods": {m: {"timing": r.timing, **{name: getattr(r, name).state_dict() for name in _ACCUMULATORS
                                                       if getattr(r, name) is not None}} for m, r in self.records.items()},
                "agreement": None if self.agreement is None else self.agreement.state_dict(), "shared": self.shared}

    def load(self, states: Sequence[dict[str, Any]]) -> None:
        """Empty accumulators, then every state of `states` (chunk records, in chunk order) merged into them."""
        self.reset()
        for state in states:
            for m, r in self.records.items():
                own = state["methods"][m]
                r.timing = {k: v + own["timing"][k] for k, v in r.timing.items()}
                for name in _ACCUMULATORS:
                    acc = getattr(r, name)
                    if acc is not None:
                        acc.merge(type(acc).from_state(own[name]))
            if self.agreement is not None:
                self.agreement.merge(AgreementTest.from_state(state["agreement"]))
            self.shared = {k: v + state["shared"][k] for k, v in self.shared.items()}

    def results(self) -> dict[str, Any]:
        """The ``methods`` part of ``results.json`` plus shared figures (see :func:`run`)."""
        methods: dict[str, Any] = {}
        agreement = self.agreement.compute() if self.agreement is not None else None
        for m, r in self.records.items():
            out: dict[str, Any] = {}
            if r.perturbation is not None and r.perturbation_target is not None:
                p, t = r.perturbation.compute(), r.perturbation_target.compute()
                out["perturbation"] = {
                    "positive_auc": p["positive_auc"],
                    "negative_auc": p["negative_auc"],
                    "positive_auc_target": t["positive_auc"],
                    "negative_auc_target": t["negative_auc"],
                    "curves": {
                        "steps": p["steps"],
                        "positive": p["positive_curve"],
                        "negative": p["negative_curve"],
                        "positive_target": t["positive_curve"],
                        "negative_target": t["negative_curve"],
                    },
                    "num_images": p["num_images"],
                }
            if r.segmentation is not None:
                s = r.segmentation.compute()
                out["segmentation"] = {k: s[k] for k in ("pixel_accuracy", "miou", "map", "iou", "num_images")}
            if r.discrimination is not None:
                d = r.discrimination.compute()
                out["discrimination"] = {
                    "target_share": d["target_share"],
                    "other_share": d["other_share"],
                    "pointing_game": d["pointing"],
                    "num_images": d["num_images"],
                }
            if agreement is not None:
                out["agreement"] = {
                    "pearson_tam": 1.0 if m == REFERENCE else agreement["pearson"][m][REFERENCE],
                    "sparsity": agreement["sparsity"][m],
                    "num_images": agreement["num_images"],
                }
            maps = r.timing["maps"]
            out["seconds_per_image"] = r.timing["explain_seconds"] / maps if maps else math.nan
            out["metric_seconds_per_image"] = r.timing["metric_seconds"] / maps if maps else math.nan
            out["maps"] = int(maps)
            methods[m] = out
        sh = self.shared
        extra: dict[str, Any] = {
            "accuracy": {
                k: v for k, v in {
                    "single_top1": sh["single_correct"] / sh["single_count"] if sh["single_count"] else None,
                    "pair_top2": sh["pair_top2_correct"] / sh["pair_count"] if sh["pair_count"] else None,
                }.items() if v is not None
            },
            "timing": {
                "reference_seconds": sh["reference_seconds"],
                "agreement_seconds": sh["agreement_seconds"],
                "batch_seconds": sh["batch_seconds"],
            },
        }
        if agreement is not None:
            extra["agreement_pearson"] = agreement["pearson"]
        return {"methods": methods, **extra}


@dataclass
class _Work:
    """The benchmark's batches, how to read some of them, the number of benchmark items in all, notes for ``splits``."""

    batches: list[D.Batch]
    read: Callable[[list[D.Batch]], Iterable[tuple[D.Batch, dict[str, torch.Tensor]]]]
    total: int
    notes: dict[str, Any] = field(default_factory=dict)


def _work(settings: Settings, model: nn.Module) -> _Work:
    s = settings
    if s.benchmark == "shapes":
        batches = D.plan_batches("single", range(s.n), s.batch_size) + D.plan_batches("pair", range(s.pairs), s.batch_size)

        def read_scenes(mine: list[D.Batch]):
            for b in mine:
                yield b, dict(D.shapes_batch(b, s.seed))

        return _Work(batches, read_scenes, s.n + s.pairs)
    if s.benchmark == "imagenet":
        from .datasets import imagenet_folder

        folder = imagenet_folder(s.data, data_config(model, s.paper_settings), model)
        labels = D.imagenet_labels(folder, getattr(model, "num_classes", None))
        order = D.imagenet_order(len(folder), s.seed)[: s.n]
        batches = D.plan_batches("images", order.tolist(), s.batch_size)

        def read_folder(mine: list[D.Batch]):
            for b, (x, y) in zip(mine, D.loader(folder, mine, s.workers)):
                yield b, {"images": x, "labels": y}

        return _Work(batches, read_folder, len(order), {"labels": labels})
    if s.benchmark == "imagenet-seg":
        from .datasets import ImageNetSegmentation

        cfg = data_config(model, s.paper_settings)
        segs = ImageNetSegmentation(s.data, size=tuple(cfg["input_size"][-2:]), mean=cfg["mean"], std=cfg["std"])
        count = min(s.n, len(segs))
        batches = D.plan_batches("images", range(count), s.batch_size)

        def read_segs(mine: list[D.Batch]):
            for b, (x, y) in zip(mine, D.loader(segs, mine, s.workers)):
                yield b, {"images": x, "masks": y}

        return _Work(batches, read_segs, count)
    raise ValueError(f"unknown benchmark {s.benchmark!r}")


def data_config(model: nn.Module, paper: bool = False) -> dict[str, Any]:
    """The model's timm data config (input size from a fixed-size patch embedding); with ``paper``, the
    papers' geometry (squash resize, bilinear, no crop) keeping the model's input size, mean and std."""
    from timm.data import resolve_model_data_config

    from .datasets import PAPER_DATA_CONFIG

    cfg = dict(resolve_model_data_config(model))
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "strict_img_size", False):
        cfg["input_size"] = (3, *patch_embed.img_size)
    if paper:
        cfg.update({k: PAPER_DATA_CONFIG[k] for k in ("interpolation", "crop_pct", "crop_mode")})
    return cfg


def run(model: nn.Module, settings: Settings, progress: bool = True, shards: Shards | None = None) -> dict[str, Any]:
    """Evaluate this process's missing batches (recorded in `shards` as each finishes; default: in memory, one
    process) and merge every batch's record in order; every process returns the merged results:
    ``{"benchmark", "n", "splits", "settings", "methods": {...}, "accuracy", "timing", ...}``."""
    shards = Shards() if shards is None else shards
    model.eval()
    if settings.benchmark == "shapes":
        from ..worlds import MEAN, STD

        mean, std = MEAN, STD
    else:
        cfg = data_config(model, settings.paper_settings)
        mean, std = cfg["mean"], cfg["std"]
    evaluation = Evaluation(model, settings, mean, std)
    work = _work(settings, model)
    batches, total = work.batches, work.total
    todo = shards.pending(len(batches))
    with progress_bar(sum(len(batches[k].indices) for k in todo), shards.rank == 0 and progress, settings.benchmark, "img") as bar:
        for k, (batch, items) in zip(todo, work.read([batches[k] for k in todo])):
            evaluation.reset()
            started = time.perf_counter()
            if batch.kind == "pair":
                evaluation.pair_batch(items["images"], items["labels"], items["masks"])
            elif settings.benchmark == "shapes":
                evaluation.single_batch(items["images"], items["labels"][:, 0], items["masks"][:, 0].long())
            else:
                evaluation.single_batch(items["images"], items.get("labels"), items.get("masks"))
            evaluation.shared["batch_seconds"] = time.perf_counter() - started
            shards.save(k, evaluation.state())
            bar.update(len(batch.indices))
    evaluation.load(shards.collect(len(batches)))
    out = evaluation.results()
    splits: dict[str, Any]
    if settings.benchmark == "shapes":
        splits = {"single": settings.n, "pair": settings.pairs, "seed": settings.seed,
                  "scene_seed": f"make_scenes(1, seed={D.SHAPES_SEED_BASE} + {2 * D.MAX_SCENES} * seed + 2 * i "
                                "(+ 1 for two-object scenes))"}
    else:
        splits = {"images": total, "seed": settings.seed, **work.notes}
    return {
        "benchmark": settings.benchmark,
        "n": total if settings.benchmark != "shapes" else settings.n,
        "splits": splits,
        "settings": {
            "methods": list(settings.methods),
            "batch_size": settings.batch_size,
            "paper_settings": settings.paper_settings,
            "method_options": {m: settings.options(m) for m in settings.methods if settings.options(m)},
            "world_size": shards.world,
            "mean": list(mean),
            "std": list(std),
        },
        **out,
    }
