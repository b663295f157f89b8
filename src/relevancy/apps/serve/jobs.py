"""The work behind each endpoint, split in two: `check_*` refuses a bad request at once (no model runs), and
the job it returns runs in a worker thread of the gate (decoding, tokenising, explaining), checking its
deadline between methods. A job answers each method's result as its `to_json()` (`explanation`), with what the
page needs to draw it (`view`: pictures and coloured HTML, `render.py`), its summary and the seconds it took."""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch

from .catalog import Catalog, ImageModel, LanguageModel
from .limits import Limits, RequestError, image_bytes, megabytes, open_image
from ...core.cancel import Cancelled
from .queue import Deadline, TimeUp
from ...results.viz import picture_url
from .render import image_view
from .samples import Sample
from .schemas import GenerationRequest, ImageInput, ImageRequest, PairRequest, TextRequest

Job = Callable[[Deadline], dict[str, Any]]


def method_names(requested: Sequence[str], allowed: Sequence[str], what: str) -> list[str]:
    """The requested methods in order without repeats; a 400 naming the closest valid one otherwise (`methods.lookup`,
    the one check of a method's name)."""
    from ...methods import lookup

    for name in requested:
        try:
            lookup(name, allowed, f"methods for {what}")
        except ValueError as error:
            raise RequestError(400, str(error)) from None
    return list(dict.fromkeys(requested))


#: float32 copies of each attention matrix an explanation of a decoder holds at its peak (probabilities, their
#: gradients, relevance, a transient): 4 bytes x 4 copies x tokens^2 x heads x layers matches the 6 GB measured for
#: generic_attention on a 1,162-token SmolLM2 generation (issue 35)
ATTENTION_COPIES = 4
#: bytes an image takes per pixel while it is decoded and converted (8-bit RGB(A) and a float copy)
BYTES_PER_PIXEL = 16


def attention_bytes(tokens: int, model: torch.nn.Module) -> int:
    """The estimated peak memory of explaining a decoder over `tokens` tokens: 4 B x ATTENTION_COPIES x tokens^2
    x heads x layers (from the model's config)."""
    config = model.config.get_text_config()  # a vision-language decoder's: its decoder's
    return 4 * ATTENTION_COPIES * tokens ** 2 * config.num_attention_heads * config.num_hidden_layers


def image_bytes_estimate(raws: Sequence[bytes], limits: Limits) -> int:
    """BYTES_PER_PIXEL x the pixels of the uploaded images, read from their headers (an unreadable one, or one over
    the pixel limit, counts 0: the job names its problem)."""
    import io

    from PIL import Image

    pixels = 0
    for raw in raws:
        try:
            with Image.open(io.BytesIO(raw)) as image:
                pixels += image.width * image.height if image.width * image.height <= limits.max_pixels else 0
        except Exception:  # noqa: BLE001 - any failure to read a header is the job's error to name
            continue
    return BYTES_PER_PIXEL * pixels


def check_memory(estimate: int, what: str, limits: Limits) -> None:
    """413 when a request's estimated memory is over its share of the server's budget (`Limits.request_bytes`)."""
    if estimate > limits.request_bytes:
        raise RequestError(413, f"{what} would take about {megabytes(estimate)} of memory; this server's budget is "
                                f"{limits.max_memory_mb:,} MiB for {limits.max_running} explanations at once, "
                                f"{megabytes(limits.request_bytes)} each")


def registry() -> dict:
    from ...methods import REGISTRY

    return REGISTRY


def pair_methods() -> tuple[str, ...]:
    """The methods of image-text pairs (the CLIP family's)."""
    from ...families.clip.adapter import ClipAdapter

    return ClipAdapter.methods


def check_target(target: int | None, names: Sequence[str], model: str, unit: str = "classes") -> None:
    if target is not None and not 0 <= target < len(names):
        raise RequestError(400, f"target {target} is out of range: the {model} model has {len(names)} {unit} (0 to {len(names) - 1})")


def sample_or_upload(source: ImageInput, samples: dict[str, Sample], limits: Limits, what: str) -> bytes:
    """The file bytes of an image input: a sample by id (looked up, never a path) or decoded base64."""
    if source.sample is not None:
        if source.sample not in samples:
            raise RequestError(400, f"unknown sample '{source.sample}'; the samples are {', '.join(samples)}")
        return samples[source.sample].png
    return image_bytes(source.data or "", limits, what)


def explained(model: torch.nn.Module, inputs: Any, method: str, **options: Any) -> tuple[Any, float]:
    """`relevancy.explain` and the seconds it took; its errors about the input become 400s."""
    from ...api import explain

    started = time.perf_counter()
    try:
        result = explain(model, inputs, method=method, **options)
    except (ValueError, TypeError) as error:
        raise RequestError(400, f"{method}: {error}") from error
    return result, time.perf_counter() - started


def answered(explanation: Any, seconds: float, view: dict[str, Any]) -> dict[str, Any]:
    """One method's answer: the result's `to_json()` exactly, how the page draws it, its summary and seconds."""
    return {"summary": registry()[explanation.method].summary, "seconds": seconds, "explanation": explanation.to_json(),
            "view": view}


def check_image(request: ImageRequest, catalog: Catalog, samples: dict[str, Sample], limits: Limits) -> Job:
    name = request.model or next(iter(catalog.images))
    if name not in catalog.images:
        raise RequestError(400, f"unknown model '{name}'; this server explains {', '.join(catalog.images)}")
    entry = catalog.images[name]
    methods = method_names(request.methods, entry.methods, f"the {name} model")
    check_target(request.target, entry.class_names, name, "classes" if entry.has_classes else "features")
    concept = request.concept
    targetless = {"raw_attention", "rollout"}  # the same map whatever the target
    if not entry.has_classes and concept is None and request.target is None and set(methods) - targetless:
        raise RequestError(400, f"the {name} model has no classes: give a concept (example images) or a feature index as "
                                f"target; {' and '.join(sorted(targetless))} need neither")
    if concept is not None:
        if request.target is not None:
            raise RequestError(400, "give either a target class or a concept, not both")
        if not concept:
            raise RequestError(400, "a concept needs at least one example image")
        if len(concept) > limits.max_concept_images:
            raise RequestError(400, f"a concept takes at most {limits.max_concept_images} example images, got {len(concept)}")
        refused = [m for m in methods if not registry()[m].accepts_concept]
        if refused:
            valid = ", ".join(n for n, m in registry().items() if m.accepts_concept)
            verb = "explains" if len(refused) == 1 else "explain"
            raise RequestError(400, f"{', '.join(refused)} {verb} classes, not a concept; the concept methods are {valid}")

    upload = sample_or_upload(request.image, samples, limits, "image")
    examples_raw = [sample_or_upload(c, samples, limits, f"concept image {k + 1}") for k, c in enumerate(concept or [])]
    check_memory(image_bytes_estimate([upload, *examples_raw], limits), "the images", limits)

    def job(deadline: Deadline) -> dict[str, Any]:
        from ...methods.targets import Concept

        started = time.perf_counter()
        batch = entry.prepare([_picture(upload, entry, limits, "image")])
        target: Any = request.target
        if concept is not None:
            examples = torch.cat([entry.prepare([_picture(raw, entry, limits, f"concept image {k + 1}")])
                                  for k, raw in enumerate(examples_raw)])
            deadline.check()
            target = Concept(entry.model, examples)
        results, picture = [], None
        for method in methods:
            deadline.check()
            explanation, seconds = explained(entry.model, batch, method, target=target)
            picture = explanation.parts["image"].pixels(batch)[0]  # the input as the model saw it
            results.append(answered(explanation, seconds, image_view(explanation.heatmap()[0], explanation.signed, picture)))
        return {"model": name, "input": picture_url(picture), "results": results, "seconds": time.perf_counter() - started}

    return job


def _picture(raw: bytes, entry: ImageModel | None, limits: Limits, what: str):
    draft = 2 * max(entry.input_size) if entry is not None else None
    return open_image(raw, limits, what, draft)


def check_text_length(text: str, limits: Limits, what: str) -> None:
    """A text to explain: not blank, within the length limit, and valid Unicode (JSON can carry lone surrogates)."""
    if not text.strip():
        raise RequestError(400, f"{what} is empty: there is nothing to explain")
    if len(text) > limits.max_text_chars:
        raise RequestError(413, f"{what} has {len(text):,} characters; the limit is {limits.max_text_chars:,}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(400, f"{what} is not valid Unicode: a lone surrogate \\u{ord(text[error.start]):04x} at "
                                f"character {error.start + 1}") from None


def check_text(request: TextRequest, catalog: Catalog, limits: Limits) -> Job:
    if catalog.text is None:
        raise RequestError(404, "this server has no text model (it was started without one)")
    entry = catalog.text
    from ...families import adapter_for

    methods = method_names(request.methods, list(adapter_for(entry.model).methods), "texts")
    check_text_length(request.text, limits, "the text")
    check_target(request.target, entry.class_names, entry.name)

    def job(deadline: Deadline) -> dict[str, Any]:
        from ...zoo.text.model import encode

        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = encode(entry.tokenizer, [request.text], model=entry.model)
        results = []
        for method in methods:
            deadline.check()
            explanation, seconds = explained(entry.model, batch, method, target=request.target)
            results.append(answered(explanation, seconds, {"html": explanation.to_html()}))
        return {"model": entry.name, "warnings": [str(w.message) for w in caught], "results": results,
                "seconds": time.perf_counter() - started}

    return job


def check_pairs(request: PairRequest, catalog: Catalog, samples: dict[str, Sample], limits: Limits) -> Job:
    if catalog.pairs is None:
        raise RequestError(404, "this server has no image-text model (it was started without one)")
    entry = catalog.pairs
    methods = method_names(request.methods, pair_methods(), "image-text pairs")
    if len(request.captions) > limits.max_captions:
        raise RequestError(400, f"at most {limits.max_captions} captions per request, got {len(request.captions)}")
    for k, caption in enumerate(request.captions):
        check_text_length(caption, limits, f"caption {k + 1}")

    upload = sample_or_upload(request.image, samples, limits, "image")
    check_memory(image_bytes_estimate([upload], limits), "the image", limits)

    def job(deadline: Deadline) -> dict[str, Any]:
        from ...families.clip.batch import ImageTextBatch

        started = time.perf_counter()
        bundle = entry.bundle
        try:
            encoded = bundle.encode(list(request.captions))
        except ValueError as error:  # the shipped tokenizer names the words it does not know
            raise RequestError(400, str(error)) from error
        images = entry.prepare([_picture(upload, None, limits, "image")])
        batch = ImageTextBatch.grid(images, encoded, tokens=bundle.token_strings(encoded["input_ids"]))  # cut at each end
        results, picture = [], None
        for method in methods:
            deadline.check()
            explanation, seconds = explained(bundle.model, batch, method)
            picture = explanation.parts["image"].pixels(images)[0]
            text, heatmaps = explanation.parts["text"], explanation.heatmap()
            pairs = [{"html": text.html_line(p), **image_view(heatmaps[p], explanation.signed, picture)}
                     for p in range(len(request.captions))]
            results.append(answered(explanation, seconds, {"legend": text.legend(), "pairs": pairs}))
        return {"model": entry.name, "input": picture_url(picture), "results": results, "seconds": time.perf_counter() - started}

    return job


def generation_methods(entry: LanguageModel) -> dict[str, str]:
    """The generation tab's methods for the entry's model (those of one forward it offers) and their summaries."""
    from ...families import adapter_for
    from ...generation import ONE_FORWARD_METHODS, methods_generating

    offered = methods_generating(adapter_for(entry.model))
    return {name: registry()[name].summary for name in ONE_FORWARD_METHODS if name in offered}


def estimate_generation(request: GenerationRequest, entry: LanguageModel, image_tokens: int = 0) -> int:
    """The estimated peak memory of a generation request: `attention_bytes` of the prompt's tokens, a vision-language
    decoder's `image_tokens` (`image_token_count`) and the tokens to generate (or the continuation's)."""
    tokenizer = text_tokenizer(entry)
    tokens = len(tokenizer(request.prompt)["input_ids"]) + image_tokens
    if request.continuation is not None:
        tokens += len(tokenizer(request.continuation, add_special_tokens=False)["input_ids"])
    else:
        tokens += request.max_new_tokens
    return attention_bytes(tokens, entry.model)


def image_token_count(entry: LanguageModel, picture: Any) -> int:
    """The placeholder tokens `picture` takes in a vision-language decoder's sequence, as the entry's processor writes
    them (a token per patch of the tower for LLaVA, fewer where patches are pooled or merged, a count from the image's
    size where it is tiled or has a grid of its own)."""
    processor = entry.tokenizer
    try:
        made = processor(images=picture, text=processor.image_token, return_tensors="pt")
    except ValueError as error:  # e.g. a picture the image processor cannot resize
        raise RequestError(400, f"the image: {error}") from None
    return int((made["input_ids"] == entry.model.config.image_token_id).sum())


def text_tokenizer(entry: LanguageModel) -> Any:
    """The entry's tokenizer (a vision-language decoder's: its processor's)."""
    return entry.tokenizer.tokenizer if entry.reads_images else entry.tokenizer


def check_generation(request: GenerationRequest, catalog: Catalog, samples: dict[str, Sample], limits: Limits) -> Job:
    if catalog.language is None:
        raise RequestError(404, "this server has no language model (it was started without one)")
    entry = catalog.language
    method = method_names([request.method], list(generation_methods(entry)), "this model's generations")[0]
    if not 1 <= request.max_new_tokens <= limits.max_new_tokens:
        raise RequestError(400, f"max_new_tokens must be between 1 and {limits.max_new_tokens} on this server, got {request.max_new_tokens}")
    check_text_length(request.prompt, limits, "the prompt")
    tokenizer = text_tokenizer(entry)
    prompt_tokens = len(tokenizer(request.prompt)["input_ids"])  # as explain_generation tokenises it (the image's tokens apart)
    if prompt_tokens > limits.max_prompt_tokens:
        raise RequestError(413, f"the prompt is {prompt_tokens:,} tokens; the limit is {limits.max_prompt_tokens:,} on this server")
    if request.continuation is not None:
        check_text_length(request.continuation, limits, "the continuation")
        tokens = len(tokenizer(request.continuation, add_special_tokens=False)["input_ids"])
        if tokens > limits.max_new_tokens:
            raise RequestError(400, f"the continuation is {tokens} tokens; the limit is {limits.max_new_tokens} on this server")
    if entry.reads_images and request.image is None:
        raise RequestError(400, f"the {entry.name} model generates about an image: give one (upload it or pick a sample)")
    if not entry.reads_images and request.image is not None:
        raise RequestError(400, f"the {entry.name} model reads text only: leave the image out")
    upload = None if request.image is None else sample_or_upload(request.image, samples, limits, "the image")
    picture = None if upload is None else _picture(upload, None, limits, "the image")
    image_tokens = 0 if picture is None else image_token_count(entry, picture)
    check_memory(estimate_generation(request, entry, image_tokens) + (0 if upload is None else image_bytes_estimate([upload], limits)),
                 "this generation", limits)

    def job(deadline: Deadline) -> dict[str, Any]:
        from ...generation import explain_generation
        from ...results.generation_page import palette

        started = time.perf_counter()
        deadline.check()
        try:
            result = explain_generation(entry.model, entry.tokenizer, request.prompt, max_new_tokens=request.max_new_tokens,
                                        method=method, continuation=request.continuation, should_stop=deadline.should_stop,
                                        image=picture)
        except ValueError as error:  # e.g. a continuation longer than the model's positions
            raise RequestError(400, str(error)) from error
        except Cancelled:  # between two tokens or backward rounds: time up or the client gone
            raise TimeUp from None
        seconds = time.perf_counter() - started
        return {"model": entry.name, "results": [answered(result, seconds, {"palette": palette(result.signed)})], "seconds": seconds}

    return job
