"""`explain_generation()`: what a decoder language model read to write each token of a generation.

Decoding (greedy, or sampled with a seed; or a given continuation), then one forward over prompt + generated tokens:
a causal `(G, T + G)` matrix, row `g` the relevance of every token before generated token `g` for its logit. A batch
of prompts is decoded in one `generate` call (left-padded) and, for the input-relevance methods, explained by one
forward of the whole batch and batched backward passes (`families.causal_lm.generation`). The other methods explain
one row per generated token, the prefix before it: the attention and gradient methods read those prefixes as one
forward (`CausalLMAdapter.forward_shared`) with a backward per token; the methods of a pass (or forwards) per token
(transformer attribution, LRP, token ablation) run the prefixes as the rows of one batch. A vision-language decoder
generates about an image (`image=`, through its processor): the same one forward reads the image too, and each
generated token gets its image map beside its text relevance.
"""
from __future__ import annotations

from numbers import Integral
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .api import explain, prepared
from .core.cancel import cancellable, checkpoint
from .results.explanation import GenerationExplanation
from .results.token_text import decoded_texts
from .families import adapter_for, adapters
from .families.base import Adapter, UnsupportedModelError
from .families.causal_lm.adapter import context_window
from .families.causal_lm.generation import causal_rows, generation_relevance
from .core.messages import quoted
from .methods import REGISTRY, lookup
from .methods.language import INPUT_RELEVANCE_RULES


def generation_methods(*modes: str) -> tuple[str, ...]:
    """The methods whose way of explaining a generation (`Method.generation` in the registry) is one of `modes`, in
    that order."""
    return tuple(name for mode in modes for name, method in REGISTRY.items() if method.generation == mode)


def methods_generating(family: Adapter) -> tuple[str, ...]:
    """The methods that explain the family's generations: those it offers, and on a family that reads an image only
    those of one forward over prompt, image and generation (the others would explain rows of the prompt without its
    image)."""
    modes = ("one_forward",) if family.reads_images else ("one_forward", "shared_forward", "prefixes")
    return tuple(name for name in generation_methods(*modes) if name in family.methods)


#: the methods that explain a generation: those that explain every generated token from one forward (batched backward
#: passes), those run on one row per token's prefix of a shared forward (a backward per token where they take
#: gradients), then those run on the prefixes as the rows of one batch (a pass or forwards of their own per row)
GENERATION_METHODS = generation_methods("one_forward", "shared_forward", "prefixes")
#: the methods that read the attention and gradients of one forward shared by every generated token's prefix
SHARED_FORWARD_METHODS = generation_methods("shared_forward")
#: the methods that explain every generated token from one forward (what the web page offers: a bounded request)
ONE_FORWARD_METHODS = generation_methods("one_forward", "shared_forward")
#: the memory a shared-forward method may take at once (`shared_forward_memory`): rows beyond it run in another
#: forward; a call whose one forward alone exceeds it is refused, naming the estimate
MEMORY_BUDGET = 2**30
#: per shared-forward method, what it holds in `(T + G, T + G)` matrices of the explained dtype, measured on CPU
#: (tests/test_generation_memory.py): `(for the forward: per attention site and head, per site; for each row: per
#: site, per head of the last site)`. Generic attention keeps every site's probabilities and their gradient for the
#: forward and a weighted head mean with its identity per row; Grad-CAM a full gradient of the last site per row;
#: rollout and raw attention each site's head mean, rollout a chain per site and row, raw attention a row of it
MATRICES = {
    "generic_attention": (4, 0, 3, 0),
    "attention_gradcam": (0, 0, 0, 3),
    "rollout": (0, 2, 3, 0),
    "raw_attention": (0, 3, 1, 0),
    "cdam": (0, 0, 0, 1),
}


def check_generation_method(method: object) -> str:
    """`method` if it explains generations; a one-line error naming the valid ones otherwise."""
    return lookup(method, GENERATION_METHODS, "methods of explain_generation").name


def check_max_new_tokens(value: object) -> int:
    """`max_new_tokens` as a whole number >= 1 (numpy's integers too; the model's context window bounds it); a one-line
    error otherwise."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"max_new_tokens must be a whole number from 1 to the model's context window, got {value!r}")
    return int(value)


def stop_tokens(model: nn.Module, tokenizer: Any) -> set[int]:
    """The end-of-text token ids of the tokenizer and the model's generation config (decoding stops there)."""
    found = {getattr(tokenizer, "eos_token_id", None)}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return {int(token) for token in found if token is not None}


def sampling_settings(do_sample: object, temperature: object, top_k: object, top_p: object, seed: object) -> dict[str, Any]:
    """The decoding settings checked (`{}` for greedy decoding): `do_sample` a bool; with it `temperature` > 0, `top_k` >= 1, `top_p` in
    (0, 1], `seed` >= 0 (None: transformers' default, or the global random state for the seed); without it none of
    them (greedy decoding has nothing to sample)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    given = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed))
             if value is not None}
    if not do_sample:
        if given:
            raise ValueError(f"{', '.join(given)} act only when sampling: pass do_sample=True, or leave them out for greedy decoding")
        return {}
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    checks = {"temperature": (lambda v: number(v) and v > 0, "a number > 0"), "top_k": (lambda v: whole(v) and v >= 1, "a whole number >= 1"),
              "top_p": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"), "seed": (lambda v: whole(v) and v >= 0, "a whole number >= 0")}
    for name, value in given.items():
        good, wanted = checks[name]
        if not good(value):
            raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return {"do_sample": True, **given}


def decode(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, stops: set[int],
           sampling: dict[str, Any], further: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """`(B, P + G)`: the left-padded prompts `ids` and up to `max_new_tokens` decoded tokens (transformers'
    `generate`, its KV cache inside that call only): greedy, or sampled with `sampling` (a `seed` draws from a
    generator of its own, the caller's random state left as it was). `further`: what else the model reads (a
    vision-language decoder's pixels, `adapter.decoding_inputs`)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    sampling = dict(sampling)
    seed = sampling.pop("seed", None)
    stop = sorted(stops) or None
    settings = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                eos_token_id=stop, pad_token_id=stop[0] if stop else 0)
    settings.update(**sampling)
    devices = [ids.device] if ids.device.type != "cpu" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices, enabled=seed is not None, device_type=ids.device.type):
        if seed is not None:
            torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, generation_config=settings,
                              stopping_criteria=StoppingCriteriaList([_Checkpoint()]), **(further or {}))


class _Checkpoint:
    """A stopping criterion that never stops a generation but asks the caller's should_stop after every token
    (`relevancy.core.cancel.checkpoint`, which raises `Cancelled`)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        checkpoint()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _is_one_prompt(prompt: object) -> bool:
    """A text, a sequence of token ids, a 1-D tensor, or chat messages (a list of {"role", "content"} dicts)."""
    if isinstance(prompt, str) or isinstance(prompt, torch.Tensor) and prompt.ndim == 1:
        return True
    return isinstance(prompt, (list, tuple)) and bool(prompt) and (
        all(isinstance(v, int) and not isinstance(v, bool) for v in prompt) or all(isinstance(v, Mapping) for v in prompt))


def prompt_ids(tokenizer: Any, prompt: object) -> list[int]:
    """One prompt's token ids: a text tokenised (special tokens added as the tokenizer does), token ids as given, chat
    messages through the tokenizer's chat template with the generation prompt (the assistant's turn) appended."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"prompt must be a non-empty text, token ids or chat messages, got {quoted(prompt)}")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.numel() == 0:
            raise ValueError(f"token ids must be a non-empty tensor of integers, got {prompt.dtype} of shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if all(isinstance(v, Mapping) for v in prompt):
        for message in prompt:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ValueError(f"each chat message is a dict with a 'role' and a 'content' text, got {quoted(dict(message))}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the prompt is chat messages but the tokenizer has no chat template (tokenizer.chat_template): give the prompt as text or token ids")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return list(prompt)


def _prompts(tokenizer: Any, prompt: object) -> tuple[list[list[int]], bool]:
    """`(token ids per prompt, one prompt given)` from one prompt or a batch (a list of prompts, a 2-D tensor)."""
    if prompt is None:
        raise ValueError("a prompt is missing: give a text, token ids, chat messages, or a list of these")
    if isinstance(prompt, torch.Tensor) and prompt.ndim == 2:
        return [row.tolist() for row in prompt], False
    if _is_one_prompt(prompt):
        return [prompt_ids(tokenizer, prompt)], True
    if isinstance(prompt, (list, tuple)) and prompt and all(_is_one_prompt(p) for p in prompt):
        return [prompt_ids(tokenizer, p) for p in prompt], False
    raise ValueError("prompt must be a text, token ids, chat messages (a list of {'role', 'content'} dicts), or a non-empty "
                     f"list of these (a batch), got {quoted(prompt)}")


def _continuations(tokenizer: Any, continuation: object, count: int, single: bool) -> list[list[int]] | None:
    """The forced continuations' token ids, one per prompt (None: decode instead)."""
    if continuation is None:
        return None
    given = [continuation] if single else continuation
    if not isinstance(given, (list, tuple)) or len(given) != count:
        raise ValueError(f"continuation must be one text or token ids per prompt ({count}), got {quoted(continuation)}")
    forced = [tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else list(text) for text in given]
    for text, ids in zip(given, forced):
        if not ids:
            raise ValueError(f"continuation must be a text of at least 1 token, got 0 tokens from {quoted(text)}")
    return forced


def _image_prompt(processor: Any, prompt: object, image: Any, separator: str,
                  sized: Callable[[tuple[int, int]], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A vision-language decoder's prompt and image through its processor (one of each): the processor's output.
    A text gets the image's placeholder token and `separator` (the layout's) put before it where it does not hold it; chat messages go through the
    processor's chat template with the generation prompt, an image item put first in the first user message where
    none is there; a prompt that then holds the image token other than once is refused (the processor would count
    images and tokens in words of its own). A text that starts with the tokenizer's BOS (a chat template's) gets no
    second one. The image is checked by `_one_image`; `sized` gives what the model's inputs read from its (height,
    width) where the processor's output does not hold it (the adapter's `image_size_inputs`: InternVL's `image_sizes`)."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str) or getattr(processor, "image_processor", None) is None:
        raise TypeError(f"a vision-language decoder generates with its processor (transformers AutoProcessor: tokenizer and "
                        f"image processor), got {type(processor).__name__}: explain_generation(model, processor, prompt, image=...)")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(message, Mapping) for message in prompt):
        text = _chat_text(processor, prompt)
    elif isinstance(prompt, str) and prompt.strip():
        text = prompt if token in prompt else f"{token}{separator}{prompt}"
    else:
        raise ValueError(f"with an image, the prompt is one non-empty text or chat messages (the processor places the image's "
                         f"tokens), got {quoted(prompt)}")
    if text.count(token) != 1:
        raise ValueError(f"the prompt holds the image token {token!r} {text.count(token)} times, but one image is explained: write it "
                         "once where the image goes, or leave it out of a text prompt (it is put first), or give chat messages with "
                         "one image item")
    image, size = _one_image(image)
    bos = getattr(processor.tokenizer, "bos_token", None)
    templated = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    return {**sized(size), **processor(images=image, text=text, return_tensors="pt", **templated)}  # the processor's own first


#: what `image=` takes, for messages
IMAGES_TAKEN = ("a PIL image, an image file's path, or one image as an array (H, W, C) or tensor (C, H, W) of 1, 3 or 4 "
                "channels")


def _one_image(image: object) -> tuple[Any, tuple[int, int]]:
    """`(image=` as the processor takes it, its (height, width))`: one picture (a path read as one), at least 1 x 1 pixels, finite; a one-line
    error naming the argument and what it takes otherwise (the processor's own errors speak of lists of images, or
    divide by zero)."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        from .core.pictures import read_image

        image = read_image(str(image))
    if isinstance(image, (list, tuple)):
        raise TypeError(f"image= is one image, got a {type(image).__name__} of {len(image)}: a vision-language decoder's generation is "
                        f"explained about one image; give it alone ({IMAGES_TAKEN})")
    if isinstance(image, Image.Image):
        width, height = image.size
    elif isinstance(image, (torch.Tensor, np.ndarray)):
        shape = tuple(image.shape)
        if len(shape) != 3 or not {shape[0], shape[-1]} & {1, 3, 4}:
            raise ValueError(f"image= as an array is one image, (H, W, C) or (C, H, W) with 1, 3 or 4 channels; got shape {shape}")
        height, width = shape[1:] if shape[0] in (1, 3, 4) else shape[:2]
        values = image if isinstance(image, torch.Tensor) else torch.tensor(image) if image.dtype.kind in "biufc" else None
        if values is None or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"image= as an array holds real numbers (integers 0..255 or floats 0..1), got {image.dtype}")
        if values.is_floating_point() and not bool(torch.isfinite(values.detach()).all()):
            raise ValueError("image= holds NaN or infinite values: a map of it is not defined")
    else:
        raise TypeError(f"image= takes {IMAGES_TAKEN}; got {type(image).__name__}")
    if not width or not height:
        raise ValueError(f"image= is {width} x {height} pixels: an image has at least 1 x 1")
    return image, (int(height), int(width))


def _chat_text(processor: Any, messages: Sequence[Mapping]) -> str:
    """Chat messages about one image as the processor's chat template writes them, the generation prompt appended;
    the image item put first in the first user message where no message holds one."""
    if not getattr(processor, "chat_template", None):
        raise ValueError("the prompt is chat messages but the processor has no chat template (processor.chat_template): give the prompt as text")
    rows = []
    for message in messages:
        content = message.get("content")
        if not isinstance(message.get("role"), str) or not isinstance(content, (str, list, tuple)):
            raise ValueError(f"each chat message is a dict with a 'role' and a 'content' (a text or a list of items), got {quoted(dict(message))}")
        rows.append({**message, "content": [{"type": "text", "text": content}] if isinstance(content, str) else list(content)})
    if not any(isinstance(item, Mapping) and item.get("type") == "image" for row in rows for item in row["content"]):
        first = next((row for row in rows if row["role"] == "user"), None)
        if first is None:
            raise ValueError("chat messages about an image need a user message (the image is put first in it)")
        first["content"] = [{"type": "image"}, *first["content"]]
    return processor.apply_chat_template(rows, add_generation_prompt=True, tokenize=False)


def _seen_picture(processor: Any, pixels: torch.Tensor) -> torch.Tensor:
    """`(H, W, 3)` in [0, 1]: the image `pixels` `(3, H, W)` as the model saw it (`seen_pixels`), the processor's
    normalisation undone."""
    settings = processor.image_processor
    mean = torch.tensor(getattr(settings, "image_mean", None) or [0.0] * 3, dtype=torch.float32)
    std = torch.tensor(getattr(settings, "image_std", None) or [1.0] * 3, dtype=torch.float32)
    image = pixels.detach().float().cpu()
    return (image * std[:, None, None] + mean[:, None, None]).clamp(0, 1).permute(1, 2, 0)


def _unwrapped(model: Any, tokenizer: Any, prompt: Any) -> tuple[nn.Module, Any, Any]:
    """A transformers text-generation pipeline as its model and tokenizer (`explain_generation(pipe, "text")`: the
    second argument is then the prompt)."""
    if isinstance(model, nn.Module):
        if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must be the model's tokenizer (called on a text, with decode), got {type(tokenizer).__name__}: "
                            "explain_generation(model, tokenizer, prompt), or a transformers pipeline as the model")
        return model, tokenizer, prompt
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and getattr(model, "tokenizer", None) is not None:
        return inner, model.tokenizer, tokenizer if prompt is None else prompt
    families = [family for family in adapters() if family.generates]
    firsts = ", ".join(family.examples.removeprefix("transformers ").split(", ")[0] for family in families)
    raise UnsupportedModelError(f"explain_generation takes a decoder language model or a vision-language decoder of the "
                                f"families relevancy maps ({', '.join(family.family for family in families)}: e.g. "
                                f"{firsts}; every class in docs/language_models.md and docs/vision_language.md) or a "
                                f"transformers text-generation pipeline, got {type(model).__name__}")


@cancellable
def explain_generation(model: Any, tokenizer: Any = None, prompt: Any = None, max_new_tokens: int = 32, method: str = "attnlrp",
                       continuation: Any = None, *, do_sample: bool = False, temperature: float | None = None,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None, image: Any = None,
                       ) -> GenerationExplanation | list[GenerationExplanation]:
    """Decode from `prompt` (at most `max_new_tokens`, bounded by the model's context window, stopping after an
    end-of-text token), or read `continuation` instead (a forced continuation: why the model would write this text),
    then explain every generated token over the prompt and the tokens generated before it.

    `model`: a decoder language model, or a transformers text-generation pipeline (its model and tokenizer; then
    `explain_generation(pipe, prompt)`). `prompt`: a text, token ids (a list or 1-D tensor), chat messages (a list of
    `{"role", "content"}` dicts, put through the tokenizer's chat template with the generation prompt), or a list of
    these (a 2-D tensor of ids: one prompt per row): a batch, decoded together (left-padded) and returned as a list,
    one `GenerationExplanation` per prompt, each what that prompt alone gives. `continuation`: a text or token ids
    (a list of them, one per prompt, for a batch).
    Decoding is greedy unless `do_sample=True` (`temperature`, `top_k`, `top_p` as transformers takes them; `seed`:
    the same tokens on every call with the same prompts, the caller's random state untouched).
    `method`: `attnlrp`, `cp_lrp`, `input_x_gradient` (one forward, batched backward passes), `raw_attention`,
    `rollout`, `attention_gradcam`, `generic_attention`, `cdam` (one forward shared by every token's prefix, a
    backward per token where the method takes gradients), or `transformer_attribution`, `lrp`, `partial_lrp`,
    `token_ablation` (the prefixes as the rows of one batch), `token_activation_map` (vision-language decoders: one
    forward, no gradient, the authors' defaults).
    Returns a `GenerationExplanation`: `scores` `(G, T + G)`, row `g` the relevance of each earlier token for the
    logit of generated token `g`, 0 at and after it; `tokens`, `generated_ids`, `text`, `relevance_total`. Row `g`
    equals `explain(model, prompt + first g generated tokens, method=method, target=token g)`. The model is left
    as it was; fp16 / bf16 models run in their own dtype (the maps in float32) for the one-forward methods.
    A vision-language decoder (LLaVA, Gemma 3, Idefics3, PaliGemma, InternVL, the Qwen-VL models, LLaVA-NeXT and
    OneVision, Mistral 3) generates about
    `image` (one image: a PIL image, an image file's path, or an array (H, W, C) or tensor (C, H, W); a list, a
    0-size or non-finite image is refused), the processor given in place of the tokenizer and one text prompt (holding the image token once;
    the image's placeholder token put first where the prompt does not hold it) or chat messages (through the
    processor's chat template, the image first in the first user message unless an item places it); the methods that reach the pixels
    (`attnlrp`, `cp_lrp`, `input_x_gradient`) explain every token from one forward, and the result, a
    `VisionLanguageGenerationExplanation`, has `image_scores` `(G, rows, cols)` too: row `g` the relevance of each
    patch for generated token `g`, equal to `explain` on that prefix and token (LLaVA-NeXT, OneVision: the tiles'
    grid, and `base_scores` the base tile's). `token_activation_map` reads the same
    one forward, its row `g` cleared of the interference of the prompt's and the earlier generated tokens' maps (row
    0 equals `explain`; docs/methods.md).
    `should_stop` (keyword): a callable asked before the work, after every generated token and before every
    backward round (a token's, for the attention methods) or group of rows; when it answers True the call raises
    `relevancy.core.cancel.Cancelled`.
    """
    model, tokenizer, prompt = _unwrapped(model, tokenizer, prompt)
    method = check_generation_method(method)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    sampling = sampling_settings(do_sample, temperature, top_k, top_p, seed)
    family = adapter_for(model)
    if not family.generates:
        raise UnsupportedModelError(f"explain_generation explains decoder language models, not the {family.family} family ({family.examples})")
    REGISTRY[method].check_offered(family)
    images: dict[str, torch.Tensor] = {}
    processor = None
    if family.reads_images:
        if method not in methods_generating(family):
            raise UnsupportedModelError(f"explain_generation on a {family.family} takes the methods of one forward over prompt, image and generation: "
                                        f"{', '.join(methods_generating(family))}; got '{method}'")
        if image is None:
            raise ValueError(f"a {family.family} generates about an image: pass image= ({IMAGES_TAKEN})")
        processor = tokenizer
        processed = _image_prompt(processor, prompt, image, family.image_separator(model), family.image_size_inputs)
        images = {key: value for key, value in processed.items() if key not in ("input_ids", "attention_mask")}
        tokenizer, prompt = processor.tokenizer, processed["input_ids"][0]
    elif image is not None:
        raise ValueError(f"image= is read by vision-language decoders; the {family.family} family reads text only: leave image out")
    prompts, single = _prompts(tokenizer, prompt)
    forced = _continuations(tokenizer, continuation, len(prompts), single)
    vocab = model.config.get_text_config().vocab_size
    if forced is not None and any(not 0 <= token < vocab for ids in forced for token in ids):
        raise ValueError(f"continuation token ids must be in the model's vocabulary, 0..{vocab - 1}")
    if forced is not None and sampling:
        raise ValueError("a forced continuation is read as given: leave out do_sample and its settings")
    window = context_window(model)
    news = [len(f) for f in forced] if forced else [max_new_tokens] * len(prompts)
    for p, new in zip(prompts, news):
        if window is not None and len(p) + new > window:
            raise ValueError(f"the prompt's {len(p)} tokens and {new} new ones exceed the model's context window of {window} tokens: "
                             "shorten the prompt or generate fewer")
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with prepared(model, {"input_ids": ids, "attention_mask": mask, **images}, attention_probabilities=False) as call:
        adapter, ids, mask = call.adapter, call.inputs.input_ids, call.inputs.attention_mask
        picture = None if processor is None else _seen_picture(processor, adapter.seen_pixels(call.inputs))
        if forced is None:
            stops = stop_tokens(model, tokenizer)
            ids = decode(model, ids, mask, max_new_tokens, stops, sampling, adapter.decoding_inputs(call.inputs))
            lengths = [_until_stop(row, stops) for row in ids[:, width:].tolist()]
        else:
            lengths = [len(f) for f in forced]
            ids = torch.cat([ids, torch.tensor([f + [0] * (max(lengths) - len(f)) for f in forced], device=ids.device)], 1)
        mask = torch.cat([mask, (torch.arange(ids.shape[1] - width)[None] < torch.tensor(lengths)[:, None]).to(mask)], 1)
        if REGISTRY[method].generation_run is not None:  # a method of one forward with its own reading of a generation
            scores, explained, maps = REGISTRY[method].generation_run(adapter, ids, mask, width, call.inputs)
            rows = [(scores[b], explained[b], None) for b in range(len(prompts))]
        elif REGISTRY[method].generation == "one_forward":
            rules = INPUT_RELEVANCE_RULES[method]
            scores, explained, maps = generation_relevance(adapter, ids, mask, width, rules, call.inputs)
            reached = scores.sum(-1) + sum((value.flatten(2).sum(-1) for value in maps.values()), torch.zeros_like(explained))
            rows = [(scores[b], explained[b], None if rules is None else reached[b].cpu() / explained[b].cpu())
                    for b in range(len(prompts))]
        else:
            sites = len(adapter.attention_sites())
            rows = [_prefix_rows(model, sites, ids[b:b + 1, width - len(p): width + lengths[b]], len(p), method)
                    for b, p in enumerate(prompts)]
            rows = [(torch.nn.functional.pad(s, (width - len(p), 0)), e, t) for (s, e, t), p in zip(rows, prompts)]
            maps = {}
    results = []
    for b, (prompt_ids, length) in enumerate(zip(prompts, lengths)):
        start, end = width - len(prompt_ids), width + length
        row_scores, row_logits, totals = rows[b]
        generated = ids[b, width:end].cpu()
        fields = dict(
            scores=row_scores[:length, start:end].cpu(), generated_ids=generated, logits=row_logits[:length].cpu()[:, None],
            method=method, signed=REGISTRY[method].signed, tokens=decoded_texts(tokenizer, ids[b, start:end].tolist()),
            prompt_length=len(prompt_ids), text=tokenizer.decode(generated.tolist(), skip_special_tokens=True),
            relevance_total=None if totals is None else totals[:length].cpu(),
        )
        results.append(adapter.generation_explanation(fields, ids[b, start:end].cpu(), {name: value[b, :length].cpu()
                                                      for name, value in maps.items()}, picture, call.inputs))
    return results[0] if single else results


def _until_stop(generated: list[int], stops: set[int]) -> int:
    """How many of a row's decoded tokens count: up to and including its first end-of-text token."""
    return next((k + 1 for k, token in enumerate(generated) if token in stops), len(generated))


def _prefix_rows(model: nn.Module, sites: int, ids: torch.Tensor, prompt_length: int, method: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(scores (G, N), explained logits (G,), relevance totals (G,) or None)` of a per-prefix method on a model of
    `sites` attention sites: `explain` on one row per generated token, the sequence `ids` `(1, N)` with the mask of
    the prefix before it (the attention methods' rows read as one forward by the adapter), the token as target;
    padding at 0 is the causal mask. Rows run in groups that fit `MEMORY_BUDGET` (`shared_forward_memory`)."""
    length = ids.shape[1]
    rows = causal_rows(prompt_length, length, ids.device).long()
    generated = ids[0, prompt_length:]
    forward, per_row = shared_forward_memory(model, sites, length, method)
    if forward + per_row > MEMORY_BUDGET:
        raise ValueError(
            f"explain_generation with {method} on {length} tokens needs about {(forward + per_row) / 2**20:,.0f} MiB for one "
            f"forward's attention matrices, over the budget of {MEMORY_BUDGET / 2**20:,.0f} MiB "
            f"(relevancy.generation.MEMORY_BUDGET): shorten the prompt, generate fewer tokens, or use "
            f"{', '.join(INPUT_RELEVANCE_RULES)} (no (T, T) matrices)")
    # long prompts run the rows in groups that fit the budget, one forward (or batch) per group
    explanation = explain(model, {"input_ids": ids.expand(len(generated), -1), "attention_mask": rows}, method=method,
                          target=generated.tolist(), rows_at_once=int((MEMORY_BUDGET - forward) // per_row) if per_row else None)
    explained = explanation.logits.gather(1, generated[:, None].to(explanation.logits.device))[:, 0]
    return explanation.scores, explained, explanation.relevance_total


#: what the methods of a batch of prefixes (each row its own forward) hold per row, in `(T + G, T + G)` matrices per
#: attention site and head: the relevance methods every head's probabilities and what flows back through them (an
#: estimate, not measured); token ablation none (no gradient; its sequences run in chunks of their own)
PREFIX_ROW_MATRICES = {"transformer_attribution": 2, "lrp": 2, "partial_lrp": 2, "token_ablation": 0}


def shared_forward_memory(model: nn.Module, sites: int, length: int, method: str) -> tuple[int, int]:
    """`(bytes of the one forward, bytes per explained row)` that per-prefix `method` holds on a decoder of `sites`
    attention sites over a sequence of `length` tokens: `MATRICES` (`PREFIX_ROW_MATRICES` for the methods of a batch
    of prefixes) in `(length, length)` matrices of the dtype it is explained in (float32 for half precision),
    counted per head where the method keeps every head."""
    heads = model.config.num_attention_heads
    parameter = next(model.parameters())
    matrix = length * length * torch.promote_types(parameter.dtype, torch.float32).itemsize
    if method in PREFIX_ROW_MATRICES:
        return 0, PREFIX_ROW_MATRICES[method] * sites * heads * matrix
    per_head_site, per_site, per_site_row, per_head_row = MATRICES[method]
    return (per_head_site * heads + per_site) * sites * matrix, (per_site_row * sites + per_head_row * heads) * matrix
