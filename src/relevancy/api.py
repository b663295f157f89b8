"""`explain()`: the one call. Picks the adapter, runs a method with the model prepared, builds the Explanation."""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .core.cancel import checkpoint
from .results.explanation import Explanation
from .core.dispatch import offloaded_weights_reread
from .core.linears import cpu_packing_undone
from .families import adapter_for
from .families.base import Adapter, UnsupportedModelError
from .core.guard import exclusive, finite, gradients_enabled, ordinary
from .methods import REGISTRY, lookup
from .core.streams import Stream, streams_attend_to_each_other
from .methods.targets import Concept, Target


def explain(model: nn.Module, inputs: Any, method: str = "transformer_attribution", target: Target = None,
            rows_at_once: int | None = None, exclude: Any = None, **options: Any) -> Explanation:
    """Explain `model`'s prediction on a batch: relevance of every patch (or pixel, for `lrp`) for `target`.

    Returns an `Explanation` (`scores`, `target`, `logits`, `heatmap()`, `save()`; text models: a
    `TextExplanation` with `tokens` and `show()`). The model is handed back exactly as it was.
    `rows_at_once`: explain the batch this many rows (inputs, pairs, objects) at a time, the maps the same up to
    float rounding. The gradient and relevance methods keep every layer's activations of the rows they run, so
    their peak memory grows with the rows run together; fewer trade a little time (on a CPU next to none) for
    memory (docs/speed.md). None (the default): the whole batch at once.
    `exclude` (decoder language models): tokens left out of the map, its colour scale and its rendering ("first",
    "last", "bos", "special", "template", positions, or a bool mask; `DecoderExplanation.excluding`).
    The inputs, targets, methods and options accepted are listed below (generated from the method registry).
    """
    if rows_at_once is not None and (isinstance(rows_at_once, bool) or not isinstance(rows_at_once, int) or rows_at_once < 1):
        raise ValueError(f"rows_at_once must be a positive whole number or None (the whole batch), got {rows_at_once!r}")
    spec = lookup(method)
    spec.check_options(options)
    if isinstance(target, Concept) and not spec.accepts_concept:
        valid = ", ".join(n for n, m in REGISTRY.items() if m.accepts_concept)
        raise ValueError(f"method '{method}' explains classes, not a Concept; concept methods: {valid}")
    with prepared(model, inputs, target, attention_probabilities=spec.needs_attention) as call:
        adapter, inputs, streams = call.adapter, call.inputs, call.streams
        adapter.check_method_target(call.target, method, tuple(n for n, m in REGISTRY.items() if m.token_targets))
        # a cross-attention model reads every stream from its one readout stream's row; a pooled stream its pooled token's
        across = streams_attend_to_each_other(adapter.attention_sites())
        unread = [] if across else [name for name, s in streams.items() if s.readout is None and not s.pooled]
        if spec.reads_class_token and unread:
            raise UnsupportedModelError(
                f"method '{method}' reads the [CLS] row of attention, but this model has no class token "
                f"(global pooling). Use one of: {', '.join(n for n in adapter.methods if not REGISTRY[n].reads_class_token)}"
            )
        scores, indices, logits, *details = run_in_groups(spec.runner(adapter), adapter, inputs, call.target, options, rows_at_once)
        named = _target_tokens(options.get("tokenizer"), indices)
        if not isinstance(scores, dict):  # a one-stream method
            scores = {next(iter(streams)): scores}
        if not spec.pixels:  # a unit that is no stream of the adapter's (a vision-language tower's patches) is the family's to lay out
            scores = {name: adapter.arrange(streams[name], values) if name in streams else values for name, values in scores.items()}
        explanation = adapter.explanation(
            {name: values.detach() for name, values in scores.items()},
            inputs,
            target=indices,
            logits=logits.detach(),
            method=method,
            signed=spec.signed,
            concept=call.target if isinstance(call.target, Concept) else None,
            **(details[0] if details else {}), **named,
        )
    if exclude is None:
        return explanation
    if not hasattr(explanation, "excluding"):
        raise ValueError(f"exclude= leaves tokens out of a decoder language model's explanation; this {type(explanation).__name__} has none to leave out")
    return explanation.excluding(exclude)


def _target_tokens(tokenizer: Any, indices: torch.Tensor) -> dict[str, list[str]]:
    """A decoder's explained tokens as text (`target_tokens`), where `tokenizer=` was given: the result and its page
    name " Mia", not a token id (a tokenizer that cannot decode names none)."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return {}
    return {"target_tokens": [decode([token]) if token >= 0 else "" for token in indices.tolist()]}


@dataclass(frozen=True)
class PreparedCall:
    """A model ready for one explanation: its adapter, the checked inputs, the bound target and the token streams."""

    adapter: Adapter
    inputs: Any
    target: Any
    streams: dict[str, Stream]


@contextmanager
def prepared(model: nn.Module, inputs: Any, target: Target = None, attention_probabilities: bool = True) -> Iterator[PreparedCall]:
    """The sequence `explain` runs around a method, for callers that compute something of their own on the model
    (e.g. `capture.record_forward(call.adapter, call.inputs, call.target, attentions=True)`): the model locked for the
    block (one call at a time per model, across threads), autograd on whatever no_grad / inference_mode the caller
    is in, the inputs checked and the target bound to them, the model in eval mode and switched to give its attention
    probabilities (`attention_probabilities`), its 4-bit layers differentiable (`core.linears.cpu_packing_undone`);
    everything restored on exit, also after an exception."""
    adapter = adapter_for(model)
    with exclusive(adapter.model, *adapter.shared_state()), gradients_enabled(), offloaded_weights_reread(adapter.model), \
            cpu_packing_undone(adapter.model):
        checked, bound = adapter.bind_target(finite(ordinary(adapter.check_inputs(inputs))), adapter.named_target(target))
        with adapter.explaining(attention_probabilities=attention_probabilities):
            yield PreparedCall(adapter, checked, bound, adapter.streams(checked))


def run_in_groups(run, adapter, inputs: Any, target: Any, options: dict, rows_at_once: int | None = None) -> tuple:
    """`run(adapter, inputs, target, **options)`, once per group of rows the adapter says are cheaper apart
    (`Adapter.independent_groups`), else once per `rows_at_once` consecutive rows, the results joined back in row
    order; at once where neither splits the batch. `relevancy.core.cancel.checkpoint()` runs before each group."""
    groups = adapter.independent_groups(inputs)
    if groups is None and rows_at_once is not None and len(inputs) > rows_at_once and _per_row(target) in (None, len(inputs)):
        groups, start = [], 0
        for part in adapter.batches(inputs, rows_at_once):
            groups.append((torch.arange(start, start + len(part)), part))
            start += len(part)
    if groups is None:  # also where a target's entries do not match the rows: the whole batch's run names that
        return run(adapter, inputs, target, **options)
    results = []
    for rows, group in groups:
        checkpoint()  # a caller's should_stop (relevancy.core.cancel) is asked between groups
        results.append(run(adapter, group, _target_rows(target, rows), **options))
    order = torch.cat([rows for rows, _ in groups]).argsort()
    return tuple(_joined([result[k] for result in results], order) for k in range(len(results[0])))


def _per_row(target: Any) -> int | None:
    """How many entries a target of one class per row has (a tensor, array, list or tuple of several); None for
    a target that holds for every row (None, one class, a Concept, a callable)."""
    if isinstance(target, (torch.Tensor, np.ndarray)):
        entries = int(np.prod(target.shape))
    elif isinstance(target, (list, tuple)):
        entries = len(target)
    else:
        return None
    return entries if entries > 1 else None


def _target_rows(target: Any, rows: torch.Tensor) -> Any:
    """The part of `target` for the given rows: the rows' entries of a per-row target, else the target itself."""
    if _per_row(target) is None:
        return target
    if isinstance(target, (list, tuple)):
        return [target[row] for row in rows.tolist()]
    entries = torch.as_tensor(target).flatten()
    return entries[rows.to(entries.device)]


def _joined(values: list, order: torch.Tensor) -> Any:
    """Per-group results (tensors, or dicts of them) concatenated along rows and put back in row order."""
    if isinstance(values[0], dict):
        keys = set().union(*values)
        if any(key not in value for value in values for key in keys):
            raise ValueError(f"rows_at_once: the row groups' results differ ({', '.join(sorted(keys))}); explain the batch at once")
        return {key: _joined([value[key] for value in values], order) for key in values[0]}
    if not all(isinstance(value, torch.Tensor) for value in values):
        raise ValueError(f"rows_at_once cannot join a {type(values[0]).__name__} (answer spans, latent relevance) over row groups; "
                         "explain the batch at once, or one call per group of rows")
    joined = torch.cat(values)
    return joined[order.to(joined.device)]


EXPLAIN_INPUTS = """\
Inputs, by model family:
  timm VisionTransformer (ViT, DeiT, DINO/DINOv2, ...): a float tensor (B, 3, H, W), or one image (3, H, W),
      normalised as the model expects (its pretrained_cfg mean and std).
  Hugging Face vision transformers (ViT, DeiT incl. WithTeacher, DINOv2, DINOv2 with registers; classifiers and
      bare *Model, explained through their features): a float tensor (B, 3, H, W), sides multiples of the patch.
  Hugging Face BERT-family sequence classifier (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT): the tokenizer's
      output, a dict or BatchEncoding with input_ids and attention_mask (e.g. relevancy.zoo.text.encode(tokenizer,
      texts)), or a LongTensor of token ids (B, T).
  CLIP (transformers CLIPModel, open_clip CLIP with a ViT image tower): (images, texts), texts the tokenizer's
      output or input_ids (m, T); image i with text i (one image with every text, or every image with one text),
      or relevancy.ImageTextBatch.grid(images, texts) for every pair. Returns a PairExplanation: parts["image"]
      (P, h, w) and parts["text"] (P, T). generic_attention's start_layer defaults to -1 (the last block).
  relevancy.ZeroShotClassifier(clip, prompts, class_names): images (B, 3, H, W), explained like a ViT classifier.
  transformers LxmertForQuestionAnswering / VisualBertForQuestionAnswering: the dict the model's forward takes (the
      tokenizer's output plus visual_feats and visual_pos, or visual_embeds and its masks). Returns a
      RegionTextExplanation: parts["text"] (B, T) over the question's tokens, parts["image"] (B, N) over the regions.
  transformers DetrForObjectDetection: {"pixel_values": (B, 3, H, W), "pixel_mask": (B, H, W) optional}; target
      (query, class) for every image, a list with a pair or a list of pairs per image, or None (every query whose
      best class has probability > 0.5: relevancy.detect). Returns a DetectionExplanation, one row per object:
      parts["image"] (R, h, w) over the backbone's grid, with .image and .query per row.
  transformers LlamaForCausalLM (Qwen2, Mistral, SmolLM2: relevancy.models.smollm2()) / GPT2LMHeadModel: the
      tokenizer's output (input_ids, attention_mask; left or right padding). Explains a logit of the next token after
      each row's last real token; target: a token id, a token's text (with tokenizer=), one per row, or
      relevancy.Contrast(token, foil). attnlrp, cp_lrp and input_x_gradient also explain answer spans read
      teacher-forced (a text of several tokens, relevancy.Span(ids)), score="logit" / "log_prob" / a callable per
      token, and latent=True (relevance of layers, neurons and heads). Returns a DecoderExplanation (span, latent,
      sink_share, excluding()). Methods: attnlrp, cp_lrp, input_x_gradient and the attention methods.
      With tokenizer=, the result names each explained token (target_tokens, its page's title).
  transformers LlavaForConditionalGeneration / Gemma3ForConditionalGeneration / Idefics3ForConditionalGeneration /
      SmolVLMForConditionalGeneration: the processor's output (input_ids with the image's placeholder tokens,
      attention_mask, pixel_values: one image per row). Targets as for decoders. Returns a VisionLanguageExplanation:
      scores (B, T) over the prompt's tokens, image_scores (B, rows, cols) on the vision tower's patch grid,
      pixel_scores (B, H, W), heatmap() at the image's pixels. Methods: attnlrp, cp_lrp, input_x_gradient (through the
      tower to the pixels); generic_attention (the ICCV'21 rule carried into the tower's patch tokens); token_ablation
      (text tokens deleted, the tower's patches set to 0); raw_attention, rollout, attention_gradcam (the decoder's
      attention at the image's tokens laid on the patch grid, not through the tower: through_tower=False).
  transformers LlavaNextForConditionalGeneration / LlavaOnevisionForConditionalGeneration: the processor's output
      with the image's tiles (pixel_values (B, tiles, 3, H, W)) and image_sizes (one size per call). image_scores
      (B, rows, cols): the tiles' patches on the model's grid, unpadded to the image's aspect; base_scores (B, side,
      side): the base (downscaled) image's; pixel_scores (B, tiles, H, W). Methods: attnlrp, cp_lrp,
      input_x_gradient, token_ablation, raw_attention, rollout, attention_gradcam (docs/vision_language.md#llava-next).
  transformers InternVLForConditionalGeneration: one tile per image as above, or the processor's tiles
      (pixel_values (B * tiles, 3, H, W)) with image_sizes (B, 2) added (one size per call): image_scores the grid's
      tiles side by side, base_scores the thumbnail's, pixel_scores (B, tiles, H, W) (docs/vision_language.md#internvl).

target:
  None                     the predicted class of each input (default); image-text pairs: the pair's logit
  int                      the same class for every input
  list or tensor of ints   one class per input
  relevancy.Concept        a concept given by examples (methods marked "concept" below)
  callable                 f(logits) -> one differentiable score per input, (B,) (as in pytorch-grad-cam)
"""


def method_reference() -> str:
    """The methods of the registry, one line each with its options and defaults (read from `run`'s signature),
    so that `help(relevancy.explain)` cannot drift from the code."""
    lines = ["method= (keyword options and their defaults; None: the model family's default, see docs/methods.md):"]
    for name, spec in REGISTRY.items():
        parameters = inspect.signature(spec.run).parameters
        options = ", ".join(f"{name}={parameters[name].default!r}" for name in spec.option_names()) or "no options"
        traits = ", ".join(t for t, on in (("signed", spec.signed), ("concept", spec.accepts_concept), ("pixels", spec.pixels)) if on)
        lines.append(f"  {name}{f' [{traits}]' if traits else ''}: {spec.summary}")
        lines.append(f"      {options}")
    return "\n".join(lines)


explain.__doc__ = f"{inspect.cleandoc(explain.__doc__ or '')}\n\n{EXPLAIN_INPUTS}\n{method_reference()}\n"
