"""The models a server explains: loaded once, in a thread of their own from the server's start
(`CatalogLoading`: the page answers while they load), from its command line, never from a request.

Four kinds, one per tab of the page: image classifiers (the shipped shapes ViT by default, the photo model
when its package is installed), a text classifier (the shipped sentiment model), an image-text model (the
shipped shapes CLIP) and a decoder language model (SmolLM2, when the `llm` extra is installed). A request names
a model among those loaded; any other name is refused.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from PIL import Image
from torch import nn

from ..catalogue import SHIPPED

#: the image model `relevancy.models.dinov2_small()` gives, when this relevancy has it and its extra is installed
PHOTO = "photo"
NONE = "none"


@dataclass
class ImageModel:
    """An image classifier with its preprocessing: `prepare(pictures)` is the normalised batch it takes."""

    name: str
    title: str
    model: nn.Module
    class_names: list[str]  # for a model without classes, its output features ("feature k")
    prepare: Callable[[Sequence[Image.Image]], torch.Tensor]
    input_size: tuple[int, int]
    has_classes: bool = True  # False: explained through concepts (or a feature index), no class probabilities
    methods: tuple[str, ...] = ()  # the methods offered for it (all, unless too slow to offer on a shared server)


@dataclass
class TextModel:
    """A BERT-family text classifier and its tokenizer."""

    name: str
    title: str
    model: nn.Module
    tokenizer: object
    class_names: list[str]


@dataclass
class PairModel:
    """A CLIP model with its tokenizer and image preprocessing (`relevancy.models.ClipBundle`)."""

    name: str
    title: str
    bundle: object

    def prepare(self, pictures: Sequence[Image.Image]) -> torch.Tensor:
        from ...core.pictures import normalised

        return normalised(pictures, self.bundle.image_size, self.bundle.mean, self.bundle.std)


@dataclass
class LanguageModel:
    """A decoder language model and its tokenizer (the text-generation tab); or a vision-language decoder and its
    processor (`reads_images`: each generation is about an uploaded image)."""

    name: str
    title: str
    model: nn.Module
    tokenizer: object
    reads_images: bool = False


@dataclass
class Catalog:
    """Everything a server explains; `notes` say what was left out and why (printed at start)."""

    images: dict[str, ImageModel]
    text: TextModel | None
    pairs: PairModel | None
    notes: list[str]
    language: LanguageModel | None = None


class CatalogLoading:
    """The catalog loaded in a thread of its own from the server's start, so that the page answers at once:
    `wait()` gives it once loaded (or raises what the load raised), `state` says "loading", "ready" or "failed" (the
    health endpoint's `models`); `then(catalog)` runs in the loading thread once it is there, `otherwise(error)` if
    the load failed."""

    def __init__(self, load: Callable[[], Catalog], then: Callable[[Catalog], None] = lambda _catalog: None,
                 otherwise: Callable[[BaseException], None] = lambda _error: None) -> None:
        self.catalog: Catalog | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._load, self._then, self._otherwise = load, then, otherwise
        self._thread = threading.Thread(target=self._run, name="relevancy-catalog", daemon=True)

    def start(self) -> "CatalogLoading":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.catalog = self._load()
        except BaseException as error:  # handed to whoever waits, and to `otherwise` (the command stops the server)
            self.error = error
        finally:
            self._done.set()
        if self.error is None:
            self._then(self.catalog)
        else:
            self._otherwise(self.error)

    @property
    def state(self) -> str:
        return "loading" if not self._done.is_set() else "failed" if self.error is not None else "ready"

    def wait(self) -> Catalog:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"the server's models failed to load: {' '.join(str(self.error).split())}")
        return self.catalog


def _image_model(name: str) -> ImageModel:
    """`shapes`, `photo` or any name `relevancy.models.load_image_model` takes (a timm name: hub weights)."""
    from ... import models
    from ...core.pictures import preprocess
    from ...families import adapter_for

    if name == PHOTO:
        factory = getattr(models, "dinov2_small", None)
        if factory is None:
            raise ValueError("the photo model (relevancy.models.dinov2_small) is not part of this relevancy version")
        from ...zoo.photos import preprocess as photo_preprocess

        model = factory()
        size = tuple(photo_preprocess([Image.new("RGB", (8, 8))]).shape[-2:])
        features = int(model.config.hidden_size)
        # no classes (self-supervised): concepts from example images; token ablation (257 forwards of the
        # network per image, about a minute on two CPU cores) is not offered on a shared server
        return ImageModel(name, "photo model (DINOv2-S/14)", model, [f"feature {k}" for k in range(features)],
                          photo_preprocess, size, has_classes=False,
                          methods=tuple(m for m in adapter_for(model).methods if m != "token_ablation"))
    model = models.load_image_model(name)
    title = SHIPPED["image"].title if SHIPPED["image"].means(name) else name
    count = model.num_classes if hasattr(model, "num_classes") else None
    names = adapter_for(model).class_names() or [f"class {k}" for k in range(count or 0)]

    def prepare(pictures: Sequence[Image.Image]) -> torch.Tensor:
        return preprocess(pictures, model)

    size = tuple(prepare([Image.new("RGB", (8, 8))]).shape[-2:])
    return ImageModel(name, title, model, names, prepare, size, methods=adapter_for(model).methods)


def load_catalog(image_names: Sequence[str] | None = None, text: str | None = None, pairs: str | None = None,
                 language: str | None = None) -> Catalog:
    """Load the models. `image_names` None: the shapes ViT, and the photo model where it loads. `text`, `pairs`
    None: the shipped models where the `text` extra is installed; `language` None: SmolLM2 where the `llm` extra
    is installed (else "smollm2" or a model folder, `relevancy.models.load_language_model`); "none": no such tab.
    A model asked for by name that cannot load is an error; a default one that cannot is left out with a note."""
    from ...core.extras import MissingExtraError

    notes: list[str] = []
    images: dict[str, ImageModel] = {}
    for name in image_names or [SHIPPED["image"].name, PHOTO]:
        if name in images:
            continue
        try:
            images[name] = _image_model(name)
        except (ValueError, ImportError, MissingExtraError, OSError, RuntimeError) as error:
            if image_names:
                raise
            notes.append(f"{name} model not offered: {' '.join(str(error).split())}")
    if not images:
        raise ValueError("no image model loaded: pass --model shapes or another image model")
    return Catalog(images, _text_model(text, notes), _pair_model(pairs, notes), notes, _language_model(language, notes))


def _text_model(name: str | None, notes: list[str]) -> TextModel | None:
    from ...core.extras import MissingExtraError

    if name == NONE:
        return None
    try:
        from ...models import load_text_classifier

        model, tokenizer = load_text_classifier(name)
    except (MissingExtraError, ImportError) as error:
        if name is not None:
            raise
        notes.append(f"text tab not offered: {' '.join(str(error).split())}")
        return None
    labels = getattr(model.config, "id2label", None) or {}
    names = [str(labels.get(k, f"class {k}")) for k in range(model.config.num_labels)]
    shipped = SHIPPED["text"]
    return TextModel(name or shipped.name, shipped.title if name is None else name, model, tokenizer, names)


def _pair_model(name: str | None, notes: list[str]) -> PairModel | None:
    from ... import models
    from ...core.extras import MissingExtraError

    if name == NONE:
        return None
    try:
        bundle = models.load_clip_model(name or SHIPPED["pairs"].name)
    except (MissingExtraError, ImportError) as error:
        if name is not None:
            raise
        notes.append(f"image-text tab not offered: {' '.join(str(error).split())}")
        return None
    shipped = SHIPPED["pairs"]
    return PairModel(name or shipped.name, shipped.title if shipped.means(name) else name, bundle)


def _language_model(name: str | None, notes: list[str]) -> LanguageModel | None:
    from ... import models
    from ...core.extras import MissingExtraError

    if name == NONE:
        return None
    images = name is not None and models.reads_images(name)
    try:
        model, tokenizer = models.load_vision_language_model(name) if images else models.load_language_model(name or SHIPPED["language"].name)
    except (MissingExtraError, ImportError) as error:
        if name is not None:
            raise
        notes.append(f"text-generation tab not offered: {' '.join(str(error).split())}")
        return None
    shipped = SHIPPED["language"]
    return LanguageModel(name or shipped.name, shipped.title if shipped.means(name) else name, model, tokenizer, images)
