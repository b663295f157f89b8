"""What the question-and-regions families (LXMERT, VisualBERT) share: reading answer logits off the model's own
output, and the checks of the inputs their Hugging Face models take (a tokenised question and detector region
features). Their result, `RegionTextExplanation`, lives with the other result types (`relevancy.results.explanation`).

An explanation of such a model has a text part (the question's tokens, `(B, T)`) and an image part over the regions
(`(B, N)`, one score per detector box, no grid): the maps the ICCV'21 paper reads (LXMERT: `R_t_t[CLS]` and
`R_t_i[CLS]`; VisualBERT: the pooled token's row split into its text and region columns).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, ClassVar, Iterator, Sequence, TypeVar

import torch
from torch import nn

from ..core.guard import this_thread_only
from ._shared import UnsupportedModelError
from .base import Adapter


# -- running --------------------------------------------------------------------------------------------------
# the methods these families run; the LRP-based ones need a relevance rule map (LXMERT adds its own)
METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "cdam", "token_ablation")


class InputPart:
    """One input of a module's forward (positional `index`, or keyword `name`), hookable like a module:
    `register_forward_hook(hook)` calls `hook(module, args, tensor)` as the module starts, with the tensor it reads
    (CDAM's X where that is a layer's input). Never replaces the input."""

    def __init__(self, module: nn.Module, index: int, name: str) -> None:
        self.module, self.index, self.name = module, index, name

    def register_forward_hook(self, hook) -> torch.utils.hooks.RemovableHandle:
        def observe(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hook(module, args, args[self.index] if len(args) > self.index else kwargs[self.name])

        return self.module.register_forward_pre_hook(this_thread_only(observe), with_kwargs=True)

    def __repr__(self) -> str:
        return f"InputPart({type(self.module).__name__}, {self.name})"


def gather_tokens(value: torch.Tensor | None, rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor | None:
    """`value` `(B, T, ...)` at batch rows `rows` `(R,)` and, per row, token positions `index` `(R, T')` (None: all)."""
    if value is None:
        return None
    rows = rows.to(value.device)
    return value[rows] if index is None else value[rows[:, None], index.to(value.device)]


def on_graph(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Frozen weights leave the embeddings off the graph: make them a leaf that is on it."""
    return output if output.requires_grad else output.detach().requires_grad_(True)


def inner_model(model: nn.Module, module: str, name: str) -> nn.Module | None:
    """The one `name` model (a class of transformers' module `module`) inside `model`, itself included; None when
    there is none (or transformers never loaded that module, so no such model exists); an error for several."""
    modeling = sys.modules.get(module)
    if modeling is None:
        return None
    found = [m for m in model.modules() if isinstance(m, getattr(modeling, name))]
    if len(found) > 1:
        raise UnsupportedModelError(f"{type(model).__name__} holds {len(found)} {name}s; relevancy explains models with one")
    return found[0] if found else None


def answer_logits(output: object, batch: int | None = None) -> torch.Tensor:
    """The answer logits in a model's output: the tensor itself, or its `question_answering_score` / `logits`;
    with `batch`, checked to be `(batch, K)`."""
    logits = output if isinstance(output, torch.Tensor) else None
    for name in ("question_answering_score", "logits"):
        if logits is None:
            value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
            logits = value if isinstance(value, torch.Tensor) else None
    if logits is None:
        raise UnsupportedModelError(
            f"the model returned a {type(output).__name__} without answer logits: its forward must return a tensor "
            "(B, K) or an output with question_answering_score or logits"
        )
    if batch is not None and (logits.ndim != 2 or len(logits) != batch):
        raise UnsupportedModelError(f"the model's answer logits must be (B, K) = ({batch}, K), got shape {tuple(logits.shape)}")
    return logits


# -- the typed batch and the adapter both families build on ----------------------------------------------------------
Batch = TypeVar("Batch", bound="RegionBatch")


class RegionBatch:
    """What the question-and-regions batches share (each a frozen dataclass of the model's keyword inputs plus
    `tokens`): the fields named in `REGION_FIELDS` are per region `(B, N, ...)`, every other tensor per question token
    `(B, T)`."""

    REGION_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __len__(self) -> int:
        return len(self.input_ids)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward: every field that is set, but the token strings."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "tokens")
        return {name: value for name, value in values if value is not None}

    def rows(self: Batch, part: slice) -> Batch:
        """The inputs of `part`, every field sliced alike."""
        return replace(self, **{f.name: _cut(getattr(self, f.name), part) for f in fields(self)})

    def select(self: Batch, rows: torch.Tensor, text: torch.Tensor | None = None, regions: torch.Tensor | None = None) -> Batch:
        """The inputs of batch rows `rows` `(R,)`, each keeping the question tokens at `text[r]` and the regions at
        `regions[r]` (`(R, T')`, `(R, N')`; None: all): what the model's forward takes for a token-ablated batch."""
        return type(self)(**{
            f.name: gather_tokens(getattr(self, f.name), rows, regions if f.name in self.REGION_FIELDS else text)
            for f in fields(self) if f.name != "tokens"
        })


def _cut(value: Any, part: slice) -> Any:
    return None if value is None else value[part]


class RegionAdapter(Adapter):
    """The adapter both question-and-regions families build on: the model is supported when it holds the one inner
    transformers model of the family (`inner`), batches are runs of consecutive rows, and a tokenised question is
    checked alike."""

    @classmethod
    def inner(cls, model: nn.Module) -> nn.Module | None:
        """The family's one transformers model inside `model` (itself included); None when there is none."""
        raise NotImplementedError

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        try:
            return cls.inner(model) is not None
        except UnsupportedModelError:
            return True  # the constructor names the problem

    def batches(self, inputs: Batch, size: int) -> Iterator[Batch]:
        return (inputs.rows(slice(start, start + size)) for start in range(0, len(inputs), size))

    def question(
        self, inputs: object, batch_type: type, required: Sequence[str], optional: Sequence[str], minimum: int, family: str,
    ) -> tuple[dict[str, object], list[list[str]] | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(fields, tokens, input_ids, attention_mask, token_type_ids)` of the inputs (a `batch_type` or the model's
        keyword inputs), the question checked against the model's config (at least `minimum` real tokens each);
        tokens None where the inputs are not a batch already."""
        if isinstance(inputs, batch_type):
            given, tokens = inputs.model_inputs(), inputs.tokens
        else:
            given, tokens = input_fields(inputs, required, optional, family), None
        ids = lift(integer_tensor(given["input_ids"], "input_ids"), 2)
        mask = lift(mask_tensor(given["attention_mask"], "attention_mask"), 2) if "attention_mask" in given else torch.ones_like(ids)
        types = lift(integer_tensor(given["token_type_ids"], "token_type_ids"), 2) if "token_type_ids" in given else None
        check_question(ids, mask, types, self.config, minimum, family)
        return given, tokens, ids, mask, types

    def region_mask(self, given: dict[str, object], shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor | None:
        """The checked `visual_attention_mask` `(B, N)` on the model's device, None where not given."""
        if "visual_attention_mask" not in given:
            return None
        regions = lift(mask_tensor(given["visual_attention_mask"], "visual_attention_mask"), 2).to(like.device)
        check_region_mask(regions, shape, "visual_attention_mask")
        return regions


# -- inputs -------------------------------------------------------------------------------------------------------
def input_fields(inputs: object, required: Sequence[str], optional: Sequence[str], family: str) -> dict[str, object]:
    """The given keyword inputs (None values left out) of a dict such as the tokenizer's output plus the region
    features; a one-line error for anything but a dict, for unknown keys and for missing ones."""
    valid = ", ".join([*required, *(f"{name} (optional)" for name in optional)])
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs of a {family} model must be a dict of its keyword inputs ({valid}), got {type(inputs).__name__}")
    unknown = sorted(str(k) for k in inputs if k not in required and k not in optional)
    if unknown:
        raise ValueError(f"{family} inputs take the keys {valid}; unknown: {', '.join(unknown)}")
    missing = [name for name in required if inputs.get(name) is None]
    if missing:
        raise ValueError(f"{family} inputs need {', '.join(missing)} (keys: {valid})")
    return {name: value for name, value in inputs.items() if value is not None}


def _tensor(value: object, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a tensor (or an array or nested list of numbers), got {type(value).__name__}") from None


def integer_tensor(value: object, name: str) -> torch.Tensor:
    """Token ids or token types as a long tensor; a one-line error for floats, booleans and anything else."""
    tensor = _tensor(value, name)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers (as the tokenizer returns them), got {tensor.dtype}")
    return tensor.long()


def mask_tensor(value: object, name: str) -> torch.Tensor:
    """An attention mask as a long tensor of 0/1 (integers, booleans or floats holding only 0 and 1 accepted)."""
    tensor = _tensor(value, name)
    if tensor.is_complex() or ((tensor != 0) & (tensor != 1)).any():
        raise ValueError(f"{name} must hold 1 at real tokens and 0 at padding, nothing else")
    return tensor.long()


def feature_tensor(value: object, name: str, like: torch.Tensor) -> torch.Tensor:
    """Region features or boxes as a finite float tensor in the model's dtype and on its device (`like`)."""
    tensor = _tensor(value, name)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {tensor.dtype}")
    tensor = tensor.to(like.device, like.dtype)
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} holds NaN or infinite values (in {tensor.dtype}): region features must be finite")
    return tensor


def lift(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """One input's tensor (one dimension short of `rank`) with the batch dimension added; a batch unchanged."""
    return tensor[None] if tensor.ndim == rank - 1 else tensor


def check_question(
    ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None, config: object, minimum: int, family: str
) -> None:
    """Shapes and values of a tokenised, right-padded question batch against the model's config: `(B, T)` ids in the
    vocabulary, a mask of the same shape with at least `minimum` real tokens per text, token types in range."""
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be (B, T) (or one text, (T,)), got shape {tuple(ids.shape)}")
    if len(ids) == 0:
        raise ValueError(f"the batch holds no questions (input_ids of shape {tuple(ids.shape)}): give at least one")
    for name, tensor in (("attention_mask", mask), ("token_type_ids", types)):
        if tensor is not None and tensor.shape != ids.shape:
            raise ValueError(f"{name} must have the shape of input_ids {tuple(ids.shape)}, got {tuple(tensor.shape)}")
    lengths = mask.sum(1)
    short = (lengths < minimum).nonzero().flatten()
    if len(short):
        row = int(short[0])
        raise ValueError(f"text {row} of the batch has {int(lengths[row])} real tokens; {family} needs at least {minimum}")
    right = torch.arange(ids.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask.bool(), right):
        row = int((mask.bool() != right).any(1).nonzero()[0])
        raise ValueError(
            f"text {row} of the batch is not right-padded: {family} reads its tokens from position 0 on, so the "
            "attention_mask must be 1s then 0s (tokenize with padding_side='right')"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] > limit:
        raise ValueError(f"the questions have {ids.shape[1]} positions but the model reads at most {limit}: tokenise with truncation")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise ValueError(f"input_ids must be in the model's vocabulary, 0..{vocab - 1}, got {bad}: tokenised with this model's tokenizer?")
    kinds = getattr(config, "type_vocab_size", None)
    if types is not None and kinds is not None and (types.min() < 0 or types.max() >= kinds):
        bad = int(types[(types < 0) | (types >= kinds)][0])
        raise ValueError(f"token_type_ids must be in 0..{kinds - 1} (the model's type_vocab_size is {kinds}), got {bad}")


def check_regions(features: torch.Tensor, name: str, batch: int, width: int | None) -> None:
    """Region features `(B, N, width)` with N >= 1 for a batch of `batch` questions."""
    if features.ndim != 3 or len(features) != batch or features.shape[1] == 0:
        raise ValueError(
            f"{name} must be (B, N, F) with one row per question (B = {batch}) and N >= 1 regions, got shape "
            f"{tuple(features.shape)}"
        )
    if width is not None and features.shape[2] != width:
        raise ValueError(f"{name} must have {width} features per region (the model's config), got {features.shape[2]}")


def check_region_mask(mask: torch.Tensor | None, shape: tuple[int, int], name: str) -> None:
    """A region mask `(B, N)` with at least one real region per input."""
    if mask is None:
        return
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must be (B, N) = {shape}, got {tuple(mask.shape)}")
    empty = (mask.sum(1) == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(f"input {int(empty[0])} of the batch has no real region ({name} all 0): there is nothing to explain")


def token_strings(inputs: object, ids: torch.Tensor, mask: torch.Tensor) -> list[list[str]]:
    """The real tokens' strings of each question: a fast tokenizer's own (a `BatchEncoding` of a batch), else `[id]`."""
    valid = mask.bool().tolist()
    encodings = getattr(inputs, "encodings", None) if isinstance(inputs, Mapping) else None
    if encodings and len(encodings) == len(ids):
        return [[t for t, v in zip(inputs.tokens(i), row) if v] for i, row in enumerate(valid)]
    return [[f"[{t}]" for t, v in zip(row, keep) if v] for row, keep in zip(ids.tolist(), valid)]


def class_names(config: object, count: int | None) -> list[str] | None:
    """The answer names of the config's `id2label` when it names exactly `count` answers, else None."""
    id2label = getattr(config, "id2label", None) or {}
    if count is None or len(id2label) != count:
        return None
    return [str(id2label.get(i, id2label.get(str(i), f"answer {i}"))) for i in range(count)]
