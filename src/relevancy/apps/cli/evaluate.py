"""`relevancy evaluate`: the papers' evaluation protocols in one command.

    relevancy evaluate --benchmark shapes|imagenet|imagenet-seg|eraser|shapes-clip|coco-detr|shapes-detection|shapes-vqa|llm-retrieval|vlm-shapes
                       [--data PATH] [--images DIR] [--model NAME] [--arch A] [--methods all|a,b,c] [--n N | -n N]
                       [--batch-size B] [--out DIR] [--seed S] [--threshold P] [--perturbation-n P] [--paper-settings]
                       [--threads T] [--workers W] [--json]

Writes ``DIR/results.json`` (percentages in percent), ``DIR/report.md`` and ``DIR/perturbation.png`` (rank 0
only), and with ``--json`` prints the summary metrics on stdout; shapes-clip, coco-detr, eraser, shapes-detection,
shapes-vqa, llm-retrieval and vlm-shapes write results.json (fractions) and report.md only, and ``--json`` prints all of results.json. The options are defined in
:mod:`relevancy.apps.cli`; the output folder is checked before any work. Every benchmark is a fixed list of batches
(`relevancy.evaluation.shards`): under ``torchrun --nproc-per-node K`` (``WORLD_SIZE`` set) each process explains
every K-th batch; each process records every finished batch in ``DIR/partial/<benchmark>/`` as it goes, the same
command run again (with any K) computes only the batches not recorded, and the records are merged (gloo) in batch
order, so the numbers are those of one uninterrupted process. Each benchmark weighs its models
(`Shards.weigh`) before its first batch: records of another run (other options, weights or library versions) are
refused by field, and a second run into a ``DIR`` a live run holds is refused.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..catalogue import SHAPES_QWEN_VL, SHIPPED
from ..common import UsageError

import torch
from torch import nn

if TYPE_CHECKING:
    from ...evaluation.shards import Shards

__all__ = ["evaluate", "parse_methods"]

#: llm-retrieval's prompts: test prompts 0 .. n-1 of llm_world seed S, drawn from seeds 1,000,003 + 7,919 S + i: with
#: these bounds no two (S, i) share a seed, and none meets a train prompt of seeds 0-125
MAX_LLM_PROMPTS = 7_919
MAX_LLM_SEED = 99
#: shapes-detection renders its scenes at once (about 70 kB each)
MAX_DETECTION_SCENES = 10_000
#: shapes-detection's --seed S draws the scenes from DETECTION_TEST_SEED + S, below the detector's validation seed
MAX_DETECTION_SEED = 999
#: vlm-shapes renders its scenes at once (about 75 kB each with their masks)
MAX_VLM_ITEMS = 2_000
#: vlm-shapes' --seed S asks about the scenes of make_vlm seed VLM_TEST_SEED + 32 S (scene seeds up to +32S+23), below
#: the shapes LLaVA's validation seed VLM_TEST_SEED + 10_000
MAX_VLM_SEED = 299
#: shapes-vqa renders its scenes at once (about 20 kB each with their regions)
MAX_VQA_QUESTIONS = 10_000
#: shapes-vqa's --seed S asks about the scenes of make_questions seed VQA_TEST_SEED + 3 S (scene seeds +3S .. +3S+2),
#: below the LXMERT's validation seed VQA_TEST_SEED + 10_000
MAX_VQA_SEED = 999
#: the most images explained together (memory grows with it), torch threads and data-loading worker processes
MAX_BATCH_SIZE = 1_024
MAX_THREADS = 1_024
MAX_WORKERS = 64
#: the ``units`` field of the eraser benchmark's results.json
RATIONALE_UNITS = "token_f1: precision, recall and F1 as fractions in [0, 1], as ERASER reports them; seconds_per_text: seconds"


def parse_methods(spec: str) -> tuple[str, ...]:
    """``all`` (the seed papers' methods; the image benchmarks: every method of the model's family) or a
    comma-separated list of registered methods, for the image, text, pair, question and detection benchmarks (order
    kept, duplicates dropped); each benchmark keeps those its model's family offers."""
    from ...families.base import SEED_METHODS
    from ...methods import lookup

    if spec.strip() == "all":
        return SEED_METHODS
    names = [n.strip() for n in spec.split(",")]
    if not names or any(not n for n in names):
        raise UsageError(f"--methods must be 'all' or a comma-separated list of methods, got {spec!r}")
    for name in names:
        try:
            lookup(name)
        except ValueError as error:
            raise UsageError(str(error)) from error
    return tuple(dict.fromkeys(names))


def _offered(args: argparse.Namespace, methods: tuple[str, ...], offered: tuple[str, ...], what: str, benchmark: str) -> tuple[str, ...]:
    """The asked methods that the benchmark's model family offers (`all`: each of them); a usage error naming the
    offered ones for a method it does not."""
    if args.methods.strip() == "all":
        return tuple(m for m in methods if m in offered)
    unsupported = [m for m in methods if m not in offered]
    if unsupported:
        raise UsageError(f"method {unsupported[0]} does not explain {what}; {benchmark} takes {', '.join(offered)}")
    return methods


def _check(args: argparse.Namespace) -> tuple[str, int | None]:
    """Validate everything that can be checked before loading a model; the benchmark and ``n`` (None = all)."""
    from ...evaluation.data import BENCHMARKS
    from ...evaluation.report import OUTPUT_FILES
    from ...core.files import check_folder

    benchmark = args.benchmark
    if benchmark not in BENCHMARKS:
        close = difflib.get_close_matches(benchmark, BENCHMARKS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UsageError(f"unknown benchmark '{benchmark}'.{hint} Valid benchmarks: {', '.join(BENCHMARKS)}")
    row = TABLE[benchmark]
    if args.model is None:
        args.model = row.default_model
    n = args.n if args.n is not None else row.default_n
    if n is not None and n < 1:
        raise UsageError(f"--n must be at least 1, got {n}")
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        raise UsageError(f"--batch-size must be between 1 and {MAX_BATCH_SIZE:,}, got {args.batch_size:,}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise UsageError(f"--threads must be between 1 and {MAX_THREADS}, got {args.threads:,}")
    if not 0 <= args.workers <= MAX_WORKERS:
        raise UsageError(f"--workers must be between 0 and {MAX_WORKERS}, got {args.workers:,}")
    for name in OWN_OPTIONS:
        if getattr(args, name, None) is not None and name not in row.options:
            owner = next(key for key, other in TABLE.items() if name in other.options)
            raise UsageError(f"--{name.replace('_', '-')} is used only with --benchmark {owner}")
    row.check(args, n)
    check_folder(args.out, OUTPUT_FILES)
    return benchmark, n


def _check_scenes(args: argparse.Namespace, n: int) -> None:
    """shapes and shapes-clip: generated scenes, at most MAX_SCENES."""
    from ...evaluation.data import MAX_SCENES

    if args.data is not None:
        raise UsageError(f"the {args.benchmark} benchmark generates its scenes: --data is not used with it")
    if n > MAX_SCENES:
        raise UsageError(f"--n must be at most {MAX_SCENES} on the {args.benchmark} benchmark, got {n}")


def _check_image_data(args: argparse.Namespace, n: int | None) -> None:
    """imagenet (an ImageFolder validation directory) and imagenet-seg (the gtsegs_ijcv.mat file)."""
    folder = args.benchmark == "imagenet"
    wanted = "an ImageFolder validation directory (DIR/<wnid>/*.JPEG)" if folder else "the gtsegs_ijcv.mat file"
    if args.data is None:
        raise UsageError(f"--benchmark {args.benchmark} needs --data: {wanted}")
    path = Path(args.data)
    if folder and not path.is_dir():
        raise UsageError(f"--data {args.data} is not a directory; --benchmark imagenet needs {wanted}")
    if folder and not any(entry.is_dir() for entry in path.iterdir()):
        raise UsageError(f"--data {args.data} holds no class folders; --benchmark imagenet needs {wanted}")
    if not folder and not path.is_file():
        raise UsageError(f"--data {args.data} is not a file; --benchmark imagenet-seg needs {wanted}")


def _check_eraser(args: argparse.Namespace, n: int | None) -> None:
    """eraser: an ERASER folder with the split's annotations."""
    if args.data is None or not (Path(args.data) / f"{args.split}.jsonl").is_file():
        raise UsageError(f"--benchmark eraser needs --data: an ERASER folder with docs/ (or docs.jsonl) and {args.split}.jsonl")


def _check_coco_detr(args: argparse.Namespace, n: int | None) -> None:
    """coco-detr: a COCO instances file and a local DETR folder (the shipped shapes detector knows no COCO class)."""
    if args.data is None or not Path(args.data).is_file():
        raise UsageError("--benchmark coco-detr needs --data: a COCO instances annotation file (JSON); the images "
                         "are read from the folder given by --images (default: the annotation file's folder)")
    _check_coco(Path(args.data))
    if _shipped(args) or not Path(args.model).is_dir():
        raise UsageError("--benchmark coco-detr needs --model: a local folder of a transformers DetrForObjectDetection "
                         "(save_pretrained), whose class indices are the data set's category ids")


def _check_coco(path: Path) -> None:
    """A usage error unless `path` is JSON with the images, annotations and categories of a COCO instances file."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"--data {path} is not a COCO instances annotation file: not JSON ({error})") from None
    missing = [key for key in ("images", "annotations", "categories") if not isinstance(data, dict) or key not in data]
    if missing:
        raise UsageError(f"--data {path} is not a COCO instances annotation file: it has no {', '.join(missing)}")


def _check_generated(args: argparse.Namespace, benchmark: str, data: str, family: str, n: int, max_n: int,
                     max_seed: int) -> None:
    """A benchmark that generates its `data` for a shipped shapes `family` model takes no data options and no
    --paper-settings (its methods run as the authors' code for that family runs them), at most `max_n` items
    and a --seed up to `max_seed`."""
    for option, value in (("--data", args.data), ("--images", args.images), ("--arch", args.arch)):
        if value is not None:
            raise UsageError(f"{option} is not used with --benchmark {benchmark} (it generates its {data}; "
                               f"--model is 'shapes' or a shapes-{family} .safetensors file)")
    if args.paper_settings:
        raise UsageError(f"--paper-settings is not used with --benchmark {benchmark}: the {family} methods run "
                           f"as the authors' {family} code runs them")
    if n > max_n:
        raise UsageError(f"--n must be at most {max_n} on the {benchmark} benchmark, got {n}")
    if args.seed > max_seed:
        raise UsageError(f"--seed must be at most {max_seed} on the {benchmark} benchmark, got {args.seed}")


def _check_shapes_detection(args: argparse.Namespace, n: int) -> None:
    """The shapes-detection request: generated scenes, a shapes-DETR checkpoint, a detection threshold."""
    _check_generated(args, "shapes-detection", "scenes", "DETR", n, MAX_DETECTION_SCENES, MAX_DETECTION_SEED)
    threshold = getattr(args, "threshold", None)
    if threshold is not None and not 0.0 <= threshold < 1.0:
        raise UsageError(f"--threshold must be a probability in [0, 1), got {threshold}")
    if _shipped(args):
        SHIPPED["detector"].weights_path()
        return
    path = Path(args.model)
    if path.suffix != ".safetensors" or not path.is_file() or not path.with_suffix(".json").is_file():
        raise UsageError("--model for shapes-detection: 'shapes' (the shipped shapes DETR) or a shapes-DETR "
                           f".safetensors file with its .json (as training.shapes_detr writes them) beside it, got {args.model!r}")


def _check_shapes_vqa(args: argparse.Namespace, n: int) -> None:
    """The shapes-vqa request: generated questions, a shapes-LXMERT checkpoint, the perturbation subset."""
    from .questions import vqa_model_path

    _check_generated(args, "shapes-vqa", "questions", "LXMERT", n, MAX_VQA_QUESTIONS, MAX_VQA_SEED)
    perturbation_n = getattr(args, "perturbation_n", None)
    if perturbation_n is not None and not 0 <= perturbation_n <= n:
        raise UsageError(f"--perturbation-n must be between 0 (no perturbation test) and --n ({n}), got {perturbation_n}")
    vqa_model_path(args.model)


def _check_llm_retrieval(args: argparse.Namespace, n: int) -> None:
    """The llm-retrieval request: generated prompts, a language model by name or a local folder of a causal language model."""
    from ...models import LANGUAGE_MODELS

    for option, value in (("--data", args.data), ("--images", args.images), ("--arch", args.arch)):
        if value is not None:
            raise UsageError(f"{option} is not used with --benchmark llm-retrieval (it generates its prompts; "
                               f"--model is {', '.join(map(repr, LANGUAGE_MODELS))} or a folder of a causal language model and its tokenizer)")
    if args.paper_settings:
        raise UsageError("--paper-settings is not used with --benchmark llm-retrieval")
    if n > MAX_LLM_PROMPTS:
        raise UsageError(f"--n must be at most {MAX_LLM_PROMPTS:,} on the llm-retrieval benchmark, got {n:,}")
    if args.seed > MAX_LLM_SEED:
        raise UsageError(f"--seed must be at most {MAX_LLM_SEED} on the llm-retrieval benchmark, got {args.seed}")
    if args.model not in LANGUAGE_MODELS and not Path(args.model).is_dir():
        shipped = [repr(name) for name in LANGUAGE_MODELS if name.startswith("retrieval-")]
        named = ["'smollm2' (SmolLM2-135M-Instruct, docs/smollm2.md)", "'gemma3' (Gemma-3-270M, docs/gemma3.md)",
                 *([f"{', '.join(shipped)} (the retrieval world's small decoders, docs/language_models.md)"] if shipped else [])]
        raise UsageError(f"--model for llm-retrieval: {', '.join(named)} or a local folder of a causal language model and its "
                           f"tokenizer (save_pretrained), got {args.model!r}")


def _check_vlm_shapes(args: argparse.Namespace, n: int) -> None:
    """The vlm-shapes request: generated scenes and a shapes-LLaVA checkpoint."""
    _check_generated(args, "vlm-shapes", "scenes", "LLaVA", n, MAX_VLM_ITEMS, MAX_VLM_SEED)
    vlm_model_path(args.model)


def vlm_model_path(model: str) -> Path:
    """The weights file of ``--model`` for vlm-shapes: 'shapes' (the shipped shapes LLaVA), 'shapes-qwen-vl' (the
    shipped shapes Qwen2.5-VL) or a .safetensors file with its .json beside it; a UsageError otherwise."""
    if SHIPPED["vision-language"].means(model):
        return SHIPPED["vision-language"].weights_path()
    if model == SHAPES_QWEN_VL.name:
        return SHAPES_QWEN_VL.weights_path()
    path = Path(model)
    if path.suffix != ".safetensors" or not path.is_file() or not path.with_suffix(".json").is_file():
        raise UsageError(f"--model for vlm-shapes: 'shapes' (the shipped shapes LLaVA), '{SHAPES_QWEN_VL.name}' (the shipped "
                         "shapes Qwen2.5-VL) or a shapes-LLaVA or shapes-Qwen2.5-VL .safetensors file with its .json (as "
                         f"training.shapes_vlm and training.shapes_qwen_vl write them) beside it, got {model!r}")
    return path


def load_model(name: str, arch: str | None) -> tuple[nn.Module, dict[str, Any]]:
    """The model to evaluate and what its checkpoint says about itself (shapes checkpoints: steps, final, val).

    ``--arch shapes`` (``shapes-swin``) reads a checkpoint of the shapes ViT (Swin) architecture (its size in the file's
    metadata), as ``training.shapes_vit`` (``training.shapes_swin``) writes them; anything else goes through ``relevancy.models.load_image_model``.
    """
    from ... import models
    from ...worlds import load_model as load_shapes
    from ...worlds.shapes_swin import SWIN_WEIGHTS_PATH, load_swin

    if SHIPPED["image"].means(name):
        return models.load_image_model(name, arch), _shapes_metadata(SHIPPED["image"].weights_path())
    if name == models.SHIPPED_SWIN:
        return models.load_image_model(name, arch), _shapes_metadata(SWIN_WEIGHTS_PATH)
    if arch in ("shapes", "shapes-swin"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {name} does not exist")
        return (load_shapes if arch == "shapes" else load_swin)(path), _shapes_metadata(path)
    return models.load_image_model(name, arch), {}


def _shapes_metadata(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    if path.suffix != ".safetensors" or not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    info: dict[str, Any] = {}
    for key in ("steps", "final", "val"):
        if key in meta:
            try:
                info[key] = json.loads(meta[key])
            except json.JSONDecodeError:
                info[key] = meta[key]
    return info


def _check_shapes_model(model: nn.Module) -> None:
    """The shapes benchmark needs a model taking its 64x64 scenes and giving one logit per shape class."""
    from ...worlds import CLASSES, IMAGE_SIZE, make_scenes

    try:
        with torch.no_grad():
            logits = model(make_scenes(1, seed=0).images)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UsageError(f"the shapes benchmark needs a model taking {IMAGE_SIZE}x{IMAGE_SIZE} images ({error})") from error
    if logits.shape[-1] != len(CLASSES):
        raise UsageError(f"the shapes benchmark needs {len(CLASSES)} classes ({', '.join(CLASSES)}); the model has {logits.shape[-1]}")


#: options that change how a run goes, not its results: left out of the run's key (`run_key`)
RUN_ONLY_OPTIONS = frozenset({"out", "threads", "workers", "quiet", "json", "handler", "command"})


def run_key(args: argparse.Namespace, n: int | None) -> dict[str, Any]:
    """What determines a run's results: every option but `RUN_ONLY_OPTIONS`, and the number of items."""
    return {"n": n, **{k: v for k, v in sorted(vars(args).items())
                       if k not in RUN_ONLY_OPTIONS and (v is None or isinstance(v, (str, int, float, bool)))}}


def evaluate(args: argparse.Namespace) -> list[Path]:
    """The `evaluate` command: check the request, evaluate the missing chunks (sharded under torchrun, each
    process recording its chunks in --out as they finish), merge, rank 0 writes the files."""
    import torch.distributed as dist

    from ...core.runs import distributed
    from ...evaluation.shards import Shards

    benchmark, n = _check(args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rank, world, created = distributed()
    try:
        with Shards.at(args.out, benchmark, run_key(args, n), rank, world) as shards:
            written = _evaluate(args, benchmark, n, shards)
            shards.finish()
        if created:  # every rank leaves together: a rank tearing gloo down while another still runs can abort it
            dist.barrier()
        return written
    finally:
        if created:
            dist.destroy_process_group()
        torch.set_num_threads(threads)


def _evaluate(args: argparse.Namespace, benchmark: str, n: int | None, shards: Shards) -> list[Path]:
    """The benchmark's evaluation over `shards`; the files written (rank 0)."""
    row = TABLE[benchmark]
    return row.run(args, row.methods(args.methods), n, shards)


def evaluate_scenes(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """The shapes benchmark: `evaluate_images` on a model checked to take the shapes scenes."""
    return evaluate_images(args, methods, n, shards, _check_shapes_model)


def evaluate_images(args: argparse.Namespace, methods: tuple[str, ...], n: int | None, shards: Shards,
                    check: Callable[[nn.Module], None] = lambda model: None) -> list[Path]:
    """An image benchmark (shapes, imagenet, imagenet-seg) through `relevancy.evaluation.run`: results.json,
    report.md and perturbation.png (rank 0); `check`: what the benchmark asks of the model once it is loaded."""
    from .common import print_json
    from ...evaluation import Settings, run, write_outputs
    from ...evaluation.report import summary

    benchmark = args.benchmark
    from ...families import adapter_for

    model, info = load_model(args.model, args.arch)
    check(model)
    methods = _offered(args, adapter_for(model).methods if args.methods.strip() == "all" else methods,
                       adapter_for(model).methods, f"the {adapter_for(model).family} family", benchmark)
    shards.weigh(model)
    settings = Settings(benchmark=benchmark, methods=methods, n=n if n is not None else 2**62,
                        batch_size=args.batch_size, seed=args.seed, paper_settings=args.paper_settings,
                        data=args.data, workers=args.workers)
    results = run(model, settings, progress=not args.quiet, shards=shards)
    results = {"benchmark": results.pop("benchmark"), "model": args.model, "n": results.pop("n"),
               "methods": results.pop("methods"), "arch": args.arch, "model_info": info, **results}
    if shards.rank != 0:
        return []
    written = write_outputs(results, args.out)
    if args.json:
        print_json(summary(results))
    return written


def evaluate_coco_detr(args: argparse.Namespace, methods: tuple[str, ...], n: int | None, shards: Shards) -> list[Path]:
    """The authors' DETR segmentation test (Otsu masks of each kept object's map, COCO APs from IoU 0.2)."""
    from ...evaluation.detection import evaluate_detection_segmentation, write_detection_report
    from ...core.extras import require

    model = require("transformers", "text").DetrForObjectDetection.from_pretrained(args.model).eval()
    shards.weigh(model)
    images = args.images if args.images is not None else Path(args.data).parent
    results = evaluate_detection_segmentation(model, args.data, images, methods, n, shards, progress=not args.quiet)
    if shards.rank != 0:
        return []
    written = write_detection_report(results, args.out)
    if args.json:
        from .common import print_json

        print_json(results)
    return written


def evaluate_shapes_detection(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """Every object the shapes DETR detects, explained by each method and scored against its exact mask
    (`relevancy.evaluation.shapes_detection`); writes results.json and report.md."""
    from ...worlds.detection import DETECTION_TEST_SEED, load_detector
    from ...worlds.scenes import CLASSES
    from ...evaluation.shapes_detection import DETECTION_THRESHOLD, detection_report, supported_methods
    from ...evaluation.shapes_detection import evaluate_shapes_detection as run_benchmark

    path = SHIPPED["detector"].weights_path() if _shipped(args) else Path(args.model)
    try:
        model = load_detector(path)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise UsageError(f"cannot load a shapes detector from {path} and its .json: {type(error).__name__}: {error}") from error
    if model.config.num_labels != len(CLASSES):
        raise UsageError(f"the shapes-detection benchmark needs a detector of the {len(CLASSES)} shape classes; "
                           f"{path} has {model.config.num_labels}")
    shards.weigh(model)
    threshold = args.threshold if getattr(args, "threshold", None) is not None else DETECTION_THRESHOLD
    methods = _offered(args, methods, supported_methods(model), "DETR", "shapes-detection")
    results = run_benchmark(model, n=n, methods=methods, threshold=threshold, seed=DETECTION_TEST_SEED + args.seed,
                            batch_size=args.batch_size, progress=not args.quiet, shards=shards)
    return _write_generated(args, results, "shapes-detr (shipped)", detection_report, shards)


def _write_generated(args: argparse.Namespace, results: dict, shipped: str, report, shards: Shards) -> list[Path]:
    """results.json (strict JSON, the model named first: `shipped` where --model names the benchmark's shipped
    model) and report.md of a generated-data benchmark, written atomically to --out by rank 0; printed too with
    --json."""
    from ...core.files import strict_json, write_atomic

    if shards.rank != 0:
        return []
    results = {"benchmark": results.pop("benchmark"), "model": shipped if _shipped(args) else args.model,
               **results}
    out = Path(args.out)
    written = [write_atomic(out / "results.json", json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n"),
               write_atomic(out / "report.md", report(results))]
    if args.json:
        from .common import print_json

        print_json(results)
    return written


def evaluate_shapes_vqa(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """Questions about unseen scenes answered by the shapes LXMERT, each explained by each method and scored against
    the regions and words of the object(s) it is about, plus the perturbation test
    (`relevancy.evaluation.shapes_vqa`); writes results.json and report.md."""
    from ...worlds.questions import make_questions
    from ...worlds.shapes_lxmert import VQA_TEST_SEED, load_vqa_lxmert
    from ...evaluation.shapes_vqa import DEFAULT_PERTURBATION_N, supported_methods, vqa_report
    from .questions import vqa_model_path
    from ...evaluation.shapes_vqa import evaluate_shapes_vqa as run_benchmark

    path = vqa_model_path(args.model)
    try:
        model, _ = load_vqa_lxmert(path)
    except (KeyError, TypeError, ValueError, RuntimeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot load a shapes LXMERT from {path} and its .json: {type(error).__name__}: {error}") from error
    shards.weigh(model)
    perturbation_n = getattr(args, "perturbation_n", None)
    perturbation_n = min(n, DEFAULT_PERTURBATION_N) if perturbation_n is None else perturbation_n
    seed = VQA_TEST_SEED + 3 * args.seed
    batch = make_questions(n, seed)
    methods = _offered(args, methods, supported_methods(model), "LXMERT", "shapes-vqa")
    results = run_benchmark(model, n=n, methods=methods, seed=seed, batch_size=args.batch_size,
                            perturbation_n=perturbation_n, progress=not args.quiet, batch=batch, shards=shards)
    return _write_generated(args, results, "shapes-vqa-lxmert (shipped)", vqa_report, shards)


def evaluate_rationales(args: argparse.Namespace, methods: tuple[str, ...], n: int | None, shards: Shards) -> list[Path]:
    """Token-F1 (ERASER, e.g. Movie Reviews) of each method with a text classifier; writes results.json, report.md."""
    from ...core.files import write_atomic
    from ...evaluation.metrics.rationales import RationaleTest, load_eraser
    from ...models import load_text_classifier
    from ...evaluation.text_rationales import RationaleSet, rationale_test

    model, tokenizer = load_text_classifier(None if _shipped(args) else args.model)
    shards.weigh(model, tokenizer)
    annotations, documents = load_eraser(args.data, args.split)
    data = RationaleSet(documents, annotations[:n] if n is not None else annotations)
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    labels = data.labels(names)

    def chunk(rows: range) -> dict[str, Any]:
        """Each method's token-F1 state and seconds on the annotations `rows`."""
        record: dict[str, Any] = {}
        for method in methods:
            started = time.perf_counter()
            state = rationale_test(model, tokenizer, method, data, rows, labels).state_dict()
            record[method] = {"state": state, "seconds": time.perf_counter() - started}
        return record

    count = len(data.annotations)
    chunks = shards.map([range(s, min(count, s + args.batch_size)) for s in range(0, count, args.batch_size)], chunk,
                        not args.quiet, "eraser", "text", len)
    if shards.rank != 0:
        return []
    shipped = SHIPPED["text"]
    results: dict[str, Any] = {"benchmark": "eraser", "model": f"{shipped.name}: {shipped.title}" if _shipped(args) else args.model,
                               "n": count, "split": args.split,
                               "units": RATIONALE_UNITS, "methods": {}}
    for method in methods:
        test = RationaleTest()
        for record in chunks:
            test.merge(RationaleTest.from_state(record[method]["state"]))
        results["methods"][method] = {"token_f1": {str(k): v for k, v in test.compute()["scores"].items()},
                                      "seconds_per_text": math.fsum(r[method]["seconds"] for r in chunks) / count}
    ks = list(next(iter(results["methods"].values()))["token_f1"])
    rows = [f"| `{m}` | " + " | ".join(f"{r['token_f1'][k]['macro']['f1']:.3f}" for k in ks) + " |" for m, r in results["methods"].items()]
    report = "\n".join([
        f"# Token-F1 on {args.data} ({args.split}, {len(data.annotations)} documents), model {args.model}", "",
        "Macro token-level F1 of each method's top-k words against the human rationales, explaining the true class.", "",
        "| method | " + " | ".join(f"k={k}" for k in ks) + " |", "| --- |" + " --- |" * len(ks), *rows, "",
    ])
    out = Path(args.out)
    written = [write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n"), write_atomic(out / "report.md", report)]
    if args.json:
        from .common import print_json

        print_json(results)
    return written


def evaluate_shapes_clip(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """Grounding of captions in two-object scenes by the shipped shapes CLIP (or a checkpoint of it); writes
    results.json and report.md."""
    from ...worlds.shapes_clip import load_clip
    from ...evaluation.grounding import evaluate_grounding, grounding_report
    from ...core.files import write_atomic
    from ...families.clip.adapter import ClipAdapter

    methods = _offered(args, methods, ClipAdapter.methods, "image-text pairs", "shapes-clip")
    shipped = _shipped(args)
    if not shipped and not Path(args.model).is_file():
        raise UsageError(f"--model for shapes-clip: 'shapes' (the shipped shapes CLIP) or a shapes-CLIP .safetensors file, got {args.model!r}")
    model, tokenizer = load_clip(None if shipped else args.model)
    shards.weigh(model, tokenizer)
    results = evaluate_grounding(model, tokenizer, methods, n, seed=args.seed, batch_size=args.batch_size, progress=not args.quiet,
                                 shards=shards)
    if shards.rank != 0:
        return []
    results["model"] = "shapes-clip (shipped)" if shipped else args.model
    out = Path(args.out)
    written = [write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n"),
               write_atomic(out / "report.md", grounding_report(results))]
    if args.json:
        from .common import print_json

        print_json(results)
    return written


def evaluate_llm_retrieval(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """Retrieval prompts of the generated text world explained by each decoder method the model's family offers (a
    hybrid's attention maps are refused), scored against their known evidence and by the deletion test
    (`relevancy.evaluation.llm_retrieval`); writes results.json and report.md."""
    from ...evaluation.llm_retrieval import DEFAULT_METHODS, llm_report
    from ...evaluation.llm_retrieval import evaluate_llm_retrieval as run_benchmark
    from ...evaluation.support import supported_methods
    from ...models import load_language_model

    model, tokenizer = load_language_model(args.model)
    shards.weigh(model, tokenizer)
    methods = _offered(args, methods, supported_methods(model, DEFAULT_METHODS), type(model).__name__, "llm-retrieval")
    results = run_benchmark(model, tokenizer, methods=methods, n=n, seed=args.seed, batch_size=args.batch_size,
                            progress=not args.quiet, shards=shards)
    return _write_generated(args, results, args.model, llm_report, shards)


def evaluate_vlm_shapes(args: argparse.Namespace, methods: tuple[str, ...], n: int, shards: Shards) -> list[Path]:
    """The shapes LLaVA's (or Qwen2.5-VL's) words naming objects in its answers about unseen scenes, explained by every
    method its family offers and scored against the objects' masks and by patch deletion
    (`relevancy.evaluation.vlm_shapes`); writes results.json and report.md."""
    from ...worlds.shapes_vlm import VLM_TEST_SEED, load_shapes_vlm, merges_patches
    from ...evaluation.support import supported_methods
    from ...evaluation.vlm_shapes import DEFAULT_METHODS, vlm_report
    from ...evaluation.vlm_shapes import evaluate_vlm_shapes as run_benchmark

    path = vlm_model_path(args.model)
    try:
        model, processor = load_shapes_vlm(path)
    except (KeyError, TypeError, ValueError, RuntimeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot load a shapes LLaVA or Qwen2.5-VL from {path} and its .json: {type(error).__name__}: "
                         f"{error}") from error
    shards.weigh(model)  # its processor is the library's own (a fixed vocabulary, checked against the file's)
    family = "Qwen2.5-VL" if merges_patches(model.config) else "LLaVA"
    methods = _offered(args, methods, supported_methods(model, DEFAULT_METHODS), family, "vlm-shapes")
    results = run_benchmark(model, processor, methods=methods, n=n, seed=VLM_TEST_SEED + 32 * args.seed,
                            batch_size=args.batch_size, progress=not args.quiet, shards=shards)
    return _write_generated(args, results, "shapes-llava (shipped)", vlm_report, shards)


def listed_methods(module: str, benchmark: str) -> Callable[[str], tuple[str, ...]]:
    """The `--methods` parser of a decoder benchmark: ``all`` (every one of the ``DEFAULT_METHODS`` of
    ``relevancy.evaluation.<module>``, imported when parsing) or a comma-separated list of them (order kept,
    duplicates dropped); a usage error naming the valid ones otherwise."""
    def parse(spec: str) -> tuple[str, ...]:
        valid = importlib.import_module(f"relevancy.evaluation.{module}").DEFAULT_METHODS
        if spec.strip() == "all":
            return valid
        names = [name.strip() for name in spec.split(",")]
        for name in names:
            if name not in valid:
                raise UsageError(f"method {name!r} is not evaluated by {benchmark}; valid methods: "
                                 f"{', '.join(valid)} (or 'all')")
        return tuple(dict.fromkeys(names))
    return parse


@dataclass(frozen=True)
class Benchmark:
    """How `evaluate` runs one benchmark: `check` (what it asks of the options, before any model loads; given
    `--n`), `run` (the evaluation: the methods as `methods` parses `--methods`, `--n`, the shards), the catalogue's
    kind of model it takes (its shipped model is the default `--model`) and its default `--n` (None: the whole data
    set)."""

    check: Callable[[argparse.Namespace, int | None], None]
    run: Callable[[argparse.Namespace, tuple[str, ...], int | None, Shards], list[Path]]
    model: str
    default_n: int | None = None
    methods: Callable[[str], tuple[str, ...]] = parse_methods
    #: the options of OWN_OPTIONS it takes
    options: tuple[str, ...] = ()
    #: the name `evaluate` gives the shipped model where the catalogue's differs ('shapes', the default of every benchmark
    #: but llm-retrieval's)
    shipped_name: str | None = None

    @property
    def default_model(self) -> str:
        """`--model` when not given."""
        return self.shipped_name or SHIPPED[self.model].name

    def shipped(self, model: str | None) -> bool:
        """Whether `--model model` names the benchmark's shipped model (by the catalogue's name or its own)."""
        return model == self.default_model or SHIPPED[self.model].means(model)


def _shipped(args: argparse.Namespace) -> bool:
    """Whether `--model` names the shipped model of `--benchmark`."""
    return TABLE[args.benchmark].shipped(args.model)


#: the options only some benchmarks take (argument names)
OWN_OPTIONS = ("threshold", "perturbation_n")
#: every benchmark of `relevancy.evaluation.data.BENCHMARKS`, one row each
TABLE = {
    "shapes": Benchmark(_check_scenes, evaluate_scenes, "image", 500),
    "imagenet": Benchmark(_check_image_data, evaluate_images, "image"),
    "imagenet-seg": Benchmark(_check_image_data, evaluate_images, "image"),
    "eraser": Benchmark(_check_eraser, evaluate_rationales, "text", shipped_name="shapes"),
    "shapes-clip": Benchmark(_check_scenes, evaluate_shapes_clip, "pairs", 200, shipped_name="shapes"),
    "coco-detr": Benchmark(_check_coco_detr, evaluate_coco_detr, "detector"),
    "shapes-detection": Benchmark(_check_shapes_detection, evaluate_shapes_detection, "detector", 200, options=("threshold",)),
    "shapes-vqa": Benchmark(_check_shapes_vqa, evaluate_shapes_vqa, "questions", 300, options=("perturbation_n",)),
    "llm-retrieval": Benchmark(_check_llm_retrieval, evaluate_llm_retrieval, "language", 30,
                               listed_methods("llm_retrieval", "llm-retrieval")),
    "vlm-shapes": Benchmark(_check_vlm_shapes, evaluate_vlm_shapes, "vision-language", 100,
                            listed_methods("vlm_shapes", "vlm-shapes")),
}
