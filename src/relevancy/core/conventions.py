"""A model family's conventions for the explanation methods: typed, one dataclass per method.

Where a family's reference code makes another choice than the ViT reference (the BERT code sets the [CLS] entry
of its maps to 0, the LXMERT code uses the conserving rules for its LRP baseline, ...), its adapter declares it as
`conventions = Conventions(rollout=RolloutConventions(cls_entry="zero"), ...)`. Every field is also a keyword
option of its method, so a caller can override it; option values are `Literal` types, checked when a convention is
made and when a caller passes one: a misspelt value is an error naming the valid ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar, get_args, get_origin, get_type_hints

ClassEntry = Literal["keep", "zero", "min"]  # the readout token's own entry of its row: kept, 0, or the row's minimum
Region = Literal["class_row", "matrix"]  # where Grad-CAM averages the attention gradient
RuleName = Literal["vanilla", "paper"]  # the LRP baselines' rules: layers_lrp (ViT reference) or layers_ours

Value = TypeVar("Value")


def check_choice(option: str, value: Value, choices: object) -> Value:
    """`value` if it is one of the `Literal` type `choices`; else an error naming the valid ones."""
    valid = get_args(choices)
    if value not in valid:
        raise ValueError(f"{option} must be one of {', '.join(map(str, valid))}; got {value!r}")
    return value


def given_or(value: Value | None, convention: Value) -> Value:
    """The caller's `value` where one was given, else the family's convention."""
    return convention if value is None else value


@dataclass(frozen=True)
class ReadoutConventions:
    """Conventions of a method that reads the readout token's row (`raw_attention`, `token_ablation`)."""

    cls_entry: ClassEntry = "keep"

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for item in fields(self):
            value, hint = getattr(self, item.name), hints[item.name]
            if get_origin(hint) is Literal:
                check_choice(item.name, value, hint)
            elif not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
                raise TypeError(f"{type(self).__name__}.{item.name} must be of type {hint.__name__}, got {value!r}")


@dataclass(frozen=True)
class RolloutConventions(ReadoutConventions):
    row_normalize: bool = True  # divide each `I + A` by its row sums (the authors' VisualBERT code: no)


@dataclass(frozen=True)
class GradCamConventions(ReadoutConventions):
    normalize: bool = False  # min-max normalise the map (the authors' VisualBERT code)
    region: Region = "class_row"


@dataclass(frozen=True)
class GenericAttentionConventions(ReadoutConventions):
    start_layer: int = 0  # the first block the rule uses (-1: the last only)


@dataclass(frozen=True)
class TransformerAttributionConventions(ReadoutConventions):
    row_normalize: bool = False  # row-normalise `I + E_h(G*R)^+` before chaining (the authors' BERT code)
    readout_rollout: bool = False  # roll out every text self-attention for the readout stream (their LXMERT code)


@dataclass(frozen=True)
class LrpConventions(ReadoutConventions):
    rules: RuleName = "vanilla"


@dataclass(frozen=True)
class Conventions:
    """A family's conventions, one field per method that has any; the defaults are the ViT reference's choices."""

    raw_attention: ReadoutConventions = field(default_factory=ReadoutConventions)
    rollout: RolloutConventions = field(default_factory=RolloutConventions)
    attention_gradcam: GradCamConventions = field(default_factory=GradCamConventions)
    generic_attention: GenericAttentionConventions = field(default_factory=GenericAttentionConventions)
    transformer_attribution: TransformerAttributionConventions = field(default_factory=TransformerAttributionConventions)
    partial_lrp: LrpConventions = field(default_factory=LrpConventions)
    lrp: LrpConventions = field(default_factory=LrpConventions)
    token_ablation: ReadoutConventions = field(default_factory=ReadoutConventions)


VIT_REFERENCE = Conventions()
