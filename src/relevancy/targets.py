"""What is explained: a class per input, the predicted class, or a concept given by examples."""
from __future__ import annotations

import difflib
import numbers
from typing import Callable, Sequence, Union

import numpy as np
import torch
from torch import nn

from .guard import exclusive, ordinary
from .messages import quoted


class Concept:
    """A CDAM concept: the mean pre-logits latent of examples; explained as `f(x) = z(x) . c`.

    `Concept(model, examples)` takes what `explain` takes for that model (an image batch `(N, C, H, W)`, or a
    text model's tokenizer output), runs the model on the examples in batches of `batch_size` and leaves the
    model as it was.
    """

    def __init__(self, model: nn.Module, examples: object, batch_size: int = 64) -> None:
        from .families import adapter_for

        if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number of examples, 1 or more, got {quoted(batch_size)}")
        adapter = adapter_for(model)
        # one call at a time per model (threads); out of the caller's inference_mode, so the vector is an ordinary
        # tensor that a later explanation's backward pass can use
        with exclusive(model, *adapter.shared_state()), torch.inference_mode(False), torch.no_grad():
            inputs = ordinary(adapter.check_inputs(examples))  # refuses an empty batch, naming it
            with adapter.explaining(attention_probabilities=False):
                latents = [adapter.forward(chunk)[1] for chunk in adapter.batches(inputs, batch_size)]
            self.vector = torch.cat(latents).mean(0)

    @classmethod
    def from_vector(cls, vector: object) -> "Concept":
        """A concept from a latent vector computed elsewhere (e.g. saved from an earlier run): a 1-D tensor, array
        or list of finite numbers; its size is checked against the model's pre-logits when it is explained."""
        values = _numbers(vector)
        if values is None or values.ndim != 1 or len(values) == 0:
            got = type(vector).__name__ if values is None else f"shape {tuple(values.shape)}"
            raise ValueError(f"a concept vector must be 1-D numbers, one per pre-logits feature (a tensor, array or list), got {got}")
        if not torch.isfinite(values).all():
            raise ValueError("the concept vector holds NaN or infinite values: it must be finite")
        concept = cls.__new__(cls)
        concept.vector = values if values.is_floating_point() else values.float()
        return concept

    def score(self, pre_logits: torch.Tensor) -> torch.Tensor:
        """`z . c` per input; a concept of another model (another latent size) is refused, naming both sizes."""
        if self.vector.numel() != pre_logits.shape[-1]:
            raise ValueError(
                f"the concept has {self.vector.numel()} dimensions but this model's pre-logits have {pre_logits.shape[-1]}: "
                "build it from this model (Concept(model, examples)) or give Concept.from_vector a vector of that size"
            )
        return pre_logits @ ordinary(self.vector).to(pre_logits)  # a vector made under inference_mode is cloned

    def __repr__(self) -> str:
        return f"Concept(dim={self.vector.numel()})"


ScoreFunction = Callable[[torch.Tensor], torch.Tensor]
Target = Union[None, int, str, Sequence[Union[int, str]], torch.Tensor, Concept, ScoreFunction]


def _numbers(value: object) -> torch.Tensor | None:
    """`value` (tensor, array, list or tuple) as a tensor of real numbers; None for anything else."""
    if not isinstance(value, (torch.Tensor, np.ndarray, list, tuple)):
        return None
    try:
        values = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):  # strings, ragged lists, object arrays
        return None
    return None if values.dtype == torch.bool or values.is_complex() else values


TARGETS_ACCEPTED = (
    "None (the predicted class), a class index (an int) or class name (a str), one index per input (a list of ints or "
    "names, an integer array or tensor), a Concept, or a callable taking the logits (B, C) and returning one score per input (B,)"
)
#: class names listed in full in an error; longer lists are summarised
LISTED_CLASSES = 20
#: the largest class index a tensor holds (int64)
LARGEST_INDEX = 2**63 - 1


def named_classes(target: object, class_names: Callable[[], Sequence[str] | None]) -> object:
    """`target` with its class names (a str, or str items of a list or tuple) turned into class indices: a name of
    `class_names()` (case and surrounding spaces ignored; the first of equal names) or a written index ("3"). The
    command line's `--target` is such a string, so both take the same targets; other targets are returned as given."""
    items = [target] if isinstance(target, str) else list(target) if isinstance(target, (list, tuple)) else []
    if not any(isinstance(item, str) for item in items):
        return target
    names = class_names()
    lookup: dict[str, int] = {}
    for index, name in enumerate(names or []):
        lookup.setdefault(str(name).strip().lower(), index)

    def index_of(item: object) -> object:
        if not isinstance(item, str):
            return item
        key = item.strip().lower()
        if key.isdigit():
            return int(key)
        if key in lookup:
            return lookup[key]
        raise ValueError(unknown_class(item, names))

    indices = [index_of(item) for item in items]
    return indices[0] if isinstance(target, str) else indices


def unknown_class(name: str, names: Sequence[str] | None) -> str:
    """A one-line error for a class name the model does not have: its classes (or the closest of many)."""
    shown = quoted(name)
    if not names:
        return f"unknown target {shown}: the model names no classes; give a class index"
    if len(names) <= LISTED_CLASSES:
        return f"unknown target {shown}: the model's classes are {', '.join(f'{n} ({i})' for i, n in enumerate(names))}"
    close = difflib.get_close_matches(name.strip().lower(), [str(n).lower() for n in names], n=3)
    hint = f"; close names: {', '.join(close)}" if close else ""
    return f"unknown target {shown}: not one of the model's {len(names)} class names{hint}"


def is_score_function(target: object) -> bool:
    """A callable target (as in pytorch-grad-cam): `f(logits) -> (B,)`, differentiable scores to explain."""
    return callable(target) and not isinstance(target, (Concept, torch.Tensor, np.ndarray))


def _is_integer_array(value: torch.Tensor | np.ndarray) -> bool:
    """An array or tensor of integers (bool, float and complex ones are not class indices)."""
    if isinstance(value, np.ndarray):
        return np.issubdtype(value.dtype, np.integer)
    return not (value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex)


def _is_index(value: object) -> bool:
    """An integer scalar: int, numpy integer, or a 0-d integer array/tensor; bool is not a class index."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 0 and _is_integer_array(value)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _class_indices(target: object, num_classes: int) -> torch.Tensor:
    """The target's class indices as a flat long tensor; a TypeError saying what is accepted for anything else."""
    if isinstance(target, (torch.Tensor, np.ndarray)):
        if not _is_integer_array(target):
            raise TypeError(f"target must be {TARGETS_ACCEPTED}; got a {type(target).__name__} of {target.dtype}")
        return torch.as_tensor(target).flatten().long()
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    for position, item in enumerate(items):
        where = f" at position {position}" if isinstance(target, (list, tuple)) else ""
        if not _is_index(item):
            raise TypeError(f"target must be {TARGETS_ACCEPTED}; got {type(item).__name__} {quoted(item)}{where}")
        if not -LARGEST_INDEX <= int(item) <= LARGEST_INDEX:
            raise ValueError(f"target {int(item)}{where} is out of range: the model has {num_classes} classes (valid: 0..{num_classes - 1})")
    return torch.tensor([int(item) for item in items], dtype=torch.long)


def resolve_target(target: Target, logits: torch.Tensor) -> torch.Tensor:
    """One class index per image (`(B,)` long); predicted classes for None; -1 for a concept."""
    batch, num_classes = logits.shape
    if isinstance(target, Concept) or is_score_function(target):
        return torch.full((batch,), -1, dtype=torch.long, device=logits.device)
    if target is None:
        return logits.argmax(-1)
    indices = _class_indices(target, num_classes).to(logits.device)
    if indices.numel() == 1:
        indices = indices.expand(batch)
    if indices.numel() != batch:
        raise ValueError(
            f"target has {indices.numel()} entries for a batch of {batch} inputs; give one per image (or text) or one for all"
        )
    bad = indices[(indices < 0) | (indices >= num_classes)]
    if bad.numel():
        raise ValueError(f"target {bad[0].item()} is out of range: the model has {num_classes} classes (valid: 0..{num_classes - 1})")
    return indices.clone()


def target_score(target: Target, indices: torch.Tensor, logits: torch.Tensor, pre_logits: torch.Tensor) -> torch.Tensor:
    """The explained score per input, `(B,)`: the target logit, the concept score, or the callable's score."""
    if isinstance(target, Concept):
        return target.score(pre_logits)
    if is_score_function(target):
        score = target(logits)
        if not isinstance(score, torch.Tensor) or score.shape != (len(logits),):
            got = f"shape {tuple(score.shape)}" if isinstance(score, torch.Tensor) else type(score).__name__
            raise ValueError(f"a callable target must return one score per input, a tensor of shape ({len(logits)},); got {got}")
        return score
    return logits.gather(1, indices[:, None]).squeeze(1)
