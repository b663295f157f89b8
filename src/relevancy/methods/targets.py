"""What is explained: a class per input, the predicted class, or a concept given by examples."""
from __future__ import annotations

import numbers
from typing import Callable, Literal, Mapping, Sequence, Union, get_args

import numpy as np
import torch
from torch import nn

from ..core.guard import exclusive, ordinary
from ..core.linears import cpu_packing_undone
from ..core.messages import quoted
from ..core.scores import checked_scores


#: how a concept's direction is made from its examples' features (the option `kind`)
ConceptKind = Literal["contrast", "lda", "plain"]
CONCEPT_KINDS: tuple[str, ...] = get_args(ConceptKind)
#: `kind="lda"`: the within-group covariance is taken half-way to a multiple of the identity (the same trace), so
#: that a few dozen examples in hundreds of dimensions give a well-conditioned, stable direction
LDA_SHRINKAGE = 0.5


class Concept:
    """A CDAM concept: a direction `c` in the pre-logits latent space, explained as `f(x) = z(x) . c`.

    `kind="lda"` (the default wherever there is something to contrast with; docs/concepts.md measures the kinds):
    the mean latent of the examples minus the mean latent of a `reference` (other images, or other concepts built
    from examples), multiplied by the inverse of the within-group covariance (shrunk by `LDA_SHRINKAGE`), Fisher's
    linear discriminant: the component every image feature shares (large in DINOv2) cancels, and directions along
    which the examples of one group vary count less. `kind="contrast"`: the difference of the means alone.
    `kind="plain"`: the mean latent of the examples, as in the CDAM paper; this is what a concept without a
    reference is. `Concept.contrasted({name: concept, ...})` sets each concept of a set against
    the others.

    `examples` and `reference` are what `explain` takes for that model (an image batch `(N, C, H, W)`, or a
    text model's tokenizer output; `reference` may also be a sequence of Concepts built from examples); the
    model runs on them in batches of `batch_size` and is left as it was.
    """

    def __init__(self, model: nn.Module, examples: object, batch_size: int = 64, *, reference: object = None,
                 kind: ConceptKind | None = None) -> None:
        kind = _concept_kind(kind, has_reference=reference is not None)
        #: the examples' latents `(N, D)` (None for a concept made from a vector)
        self.latents = example_latents(model, examples, batch_size)
        self.kind = kind
        if kind == "plain":
            self.vector = self.mean
            return
        groups = _reference_groups(model, reference, batch_size)
        if groups[0].shape[-1] != self.latents.shape[-1]:
            raise ValueError(f"the reference's latents have {groups[0].shape[-1]} dimensions but the examples' have "
                             f"{self.latents.shape[-1]}: build reference concepts from the same model")
        with torch.inference_mode(False):
            self.vector = _direction(kind, self.latents, groups)

    @property
    def mean(self) -> torch.Tensor | None:
        """The examples' mean latent (None for a concept made from a vector)."""
        with torch.inference_mode(False):  # an ordinary tensor also inside the caller's inference_mode
            return None if self.latents is None else self.latents.mean(0)

    @classmethod
    def contrasted(cls, concepts: Mapping[str, "Concept"], kind: ConceptKind = "lda") -> dict[str, "Concept"]:
        """Each concept of a set (at least two, built from examples of one model) against the others: the
        difference between its examples' mean latent and the mean of the other concepts' mean latents through the
        within-concept covariance (`kind="lda"`), that difference alone (`kind="contrast"`), or its plain mean
        latent (`kind="plain"`)."""
        kind = _concept_kind(kind, has_reference=True)
        latents = {name: _latents_of(concept, f"concept {name!r}") for name, concept in concepts.items()}
        if len(latents) < 2:
            raise ValueError(f"a contrasted set needs at least two concepts, got {len(latents)}")
        sizes = {found.shape[-1] for found in latents.values()}
        if len(sizes) != 1:
            raise ValueError(f"the concepts have different sizes {sorted(sizes)}: build them all from one model")
        made = {}
        for name, found in latents.items():
            concept = cls.__new__(cls)
            concept.latents, concept.kind = found, kind
            others = [other for other_name, other in latents.items() if other_name != name]
            with torch.inference_mode(False):
                concept.vector = concept.mean if kind == "plain" else _direction(kind, found, others)
            made[name] = concept
        return made

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
        concept.latents, concept.kind = None, "plain"  # its examples are unknown: it cannot serve as a reference
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
        return f"Concept(dim={self.vector.numel()}, kind={self.kind!r})"


def example_latents(model: nn.Module, examples: object, batch_size: int = 64) -> torch.Tensor:
    """The pre-logits latents `(N, D)` of `examples` (what `explain` takes for `model`), the model left as it was."""
    from ..families import adapter_for

    if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number of examples, 1 or more, got {quoted(batch_size)}")
    adapter = adapter_for(model)
    # one call at a time per model (threads); out of the caller's inference_mode, so the vector is an ordinary
    # tensor that a later explanation's backward pass can use
    with exclusive(model, *adapter.shared_state()), torch.inference_mode(False), torch.no_grad(), cpu_packing_undone(model):
        inputs = ordinary(adapter.check_inputs(examples))  # refuses an empty batch, naming it
        with adapter.explaining(attention_probabilities=False):
            return torch.cat([adapter.forward(chunk)[1] for chunk in adapter.batches(inputs, batch_size)])


def _direction(kind: str, latents: torch.Tensor, reference: Sequence[torch.Tensor]) -> torch.Tensor:
    """The concept of `latents` against reference groups of latents (each group's mean weighs the same)."""
    difference = latents.mean(0) - torch.stack([group.mean(0) for group in reference]).mean(0)
    if kind == "contrast":
        return difference
    centred = torch.cat([group - group.mean(0) for group in (latents, *reference)]).double()
    covariance = centred.T @ centred / len(centred)
    scale = covariance.trace() / len(covariance)
    if scale == 0:  # no spread within any group (one example each): nothing to discount, lda is the contrast
        return difference
    identity = torch.eye(len(covariance), dtype=covariance.dtype, device=covariance.device)
    shrunk = (1 - LDA_SHRINKAGE) * covariance + LDA_SHRINKAGE * scale * identity
    return torch.linalg.solve(shrunk, difference.double()).to(difference.dtype)


def _concept_kind(kind: object, has_reference: bool) -> str:
    """The concept kind asked for (None: lda when there is a reference, plain otherwise), checked."""
    if kind is None:
        return "lda" if has_reference else "plain"
    if not isinstance(kind, str) or kind not in CONCEPT_KINDS:
        raise ValueError(f"concept kind must be one of {', '.join(repr(k) for k in CONCEPT_KINDS)}, got {kind!r}")
    if kind != "plain" and not has_reference:
        raise ValueError(f"kind={kind!r} needs a reference: other images (reference=...), other Concepts, or "
                         "Concept.contrasted({name: concept, ...}); kind='plain' takes the examples' mean alone")
    return kind


def _latents_of(concept: object, what: str) -> torch.Tensor:
    """A concept's examples' latents; refused, naming `what`, for anything else."""
    if not isinstance(concept, Concept):
        raise TypeError(f"{what} must be a Concept, got {type(concept).__name__}")
    if concept.latents is None:
        raise ValueError(f"{what} was made from a vector (Concept.from_vector), not from examples: its latents are unknown")
    return concept.latents


def _reference_groups(model: nn.Module, reference: object, batch_size: int) -> list[torch.Tensor]:
    """The reference's groups of latents: one per reference Concept, or one for example inputs."""
    if isinstance(reference, (list, tuple)) and reference and all(isinstance(r, Concept) for r in reference):
        return [_latents_of(r, f"reference concept {k}") for k, r in enumerate(reference)]
    return [example_latents(model, reference, batch_size)]


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
#: the largest class index a tensor holds (int64)
LARGEST_INDEX = 2**63 - 1


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


def target_score(target: Target, indices: torch.Tensor, logits: torch.Tensor, pre_logits: torch.Tensor, graph: bool) -> torch.Tensor:
    """The explained score per input, `(B,)`: the target logit, the concept score, or the callable's score, checked
    (`checked_scores`: attached to the model's output where `graph`, a method taking its gradient)."""
    if isinstance(target, Concept):
        score, what = target.score(pre_logits), "the concept's score"
    elif is_score_function(target):
        score, what = target(logits), "target=f(logits)"
    else:
        score, what = logits.gather(1, indices[:, None]).squeeze(1), "the target's logit"
    return checked_scores(score, what, len(logits), graph)
