"""The one registry of explanation methods: name -> how to run it, what it reads and what its scores mean. Every
caller (`explain`, `explain_generation`, the command line, the web page, the evaluation, the docs' tables) reads
`REGISTRY`; which of its methods a model takes is its family's `Adapter.methods`."""
from __future__ import annotations

import difflib
import inspect
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping, Sequence, get_args

import torch

from ..families import adapters
from ..families.base import Adapter, UnsupportedModelError
from ..core.messages import quoted
from ..core.streams import streams_attend_to_each_other
from .targets import Target


#: how a method explains a decoder's generation (`Method.generation`)
GenerationMode = Literal["one_forward", "shared_forward", "prefixes"]
GENERATION_MODES: tuple[str, ...] = get_args(GenerationMode)
#: the yes-or-no fields of a `Method`
METHOD_FLAGS = ("signed", "reads_class_token", "needs_attention", "accepts_concept", "pixels", "token_targets")
#: the types an option's annotation names, as the values it takes (others, e.g. StartLayer, are the method's to check)
OPTION_TYPES = {"bool": (bool,), "int": (numbers.Integral,), "str": (str,), "float": (numbers.Real,), "None": (type(None),)}


@dataclass(frozen=True)
class Method:
    """An explanation method.

    `run(adapter, inputs, target, **options)` returns `(scores, indices, logits)`: scores over the patch tokens
    `(B, N)` or, for `pixels` methods, over the input `(B, H, W)`; optionally a fourth item, a dict of further
    `Explanation` fields (e.g. `relevance_total`).
    """

    name: str
    run: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    signed: bool  # scores take both signs: shown with a diverging colormap centred on zero
    reads_class_token: bool  # reads the [CLS] row: needs a model with a class token or a pooled readout (Stream.pooled)
    needs_attention: bool = True  # reads attention probabilities: fused attention is switched off for the call
    accepts_concept: bool = False  # can explain a `Concept` instead of a class
    pixels: bool = False
    summary: str = ""
    # the method on models whose streams attend to each other (`across`); None: `run` serves them too
    across: Callable[..., tuple] | None = None
    # how it explains a decoder's generation (`explain_generation`): "one_forward" (every generated token from one
    # forward, batched backward passes), "shared_forward" (one row per token's prefix in one shared forward, a
    # backward per token), "prefixes" (the prefixes as the rows of one batch, a pass or forwards per row); None: it
    # does not
    generation: GenerationMode | None = None
    # takes a decoder's token texts and `Contrast`s as targets (the others take token ids there)
    token_targets: bool = False
    # a "one_forward" method's own explanation of a generation, `(adapter, ids, mask, prompt_length, inputs) ->
    # (scores (B, G, N), explained logits (B, G), image maps)`; None: input x gradient under its rules
    # (`families.causal_lm.generation.generation_relevance`)
    generation_run: Callable[..., tuple] | None = None

    def runner(self, adapter: Adapter) -> Callable[..., tuple]:
        """The strategy for the adapter's streams, chosen once from its attention sites: `across` where some
        attention has queries and keys from different streams, `run` otherwise. A method the adapter's family does
        not offer (`Adapter.methods`) is refused by name."""
        self.check_offered(adapter)
        if self.across is not None and streams_attend_to_each_other(adapter.attention_sites()):
            return self.across
        return self.run

    def check_offered(self, adapter: Adapter) -> None:
        """A one-line refusal, naming the family's methods and the families it explains, where the adapter's family
        does not offer this method (`Adapter.methods`)."""
        if self.name not in adapter.methods:
            offering = [family.family for family in adapters() if self.name in family.methods]
            raise UnsupportedModelError(
                f"method '{self.name}' does not apply to the {adapter.family} family; its methods: "
                f"{', '.join(adapter.methods)}. '{self.name}' explains: {'; '.join(dict.fromkeys(offering)) or 'no family'}"
            )

    def option_names(self) -> list[str]:
        """The keyword options `run` takes (after adapter, inputs, target)."""
        return list(inspect.signature(self.run).parameters)[3:]

    def check_options(self, options: Mapping[str, object]) -> None:
        """An error naming the valid options (and the closest one) for an option name `run` does not take, and one
        naming the type for a value of another type than the option's annotation (`bool | None`, `int`, `str`, ...;
        `True` is no int here). Literal choices and other types are the method's to check."""
        parameters = {p.name: p for p in list(inspect.signature(self.run).parameters.values())[3:]}
        for name, value in options.items():
            if name not in parameters:
                close = difflib.get_close_matches(name, list(parameters), n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"method '{self.name}' has no option {quoted(name)}; its options: {', '.join(parameters) or 'none'}.{hint}")
            names = [part.strip() for part in str(parameters[name].annotation).split("|")]
            if not all(part in OPTION_TYPES for part in names):
                continue
            accepted = tuple(t for part in names for t in OPTION_TYPES[part])
            if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
                raise ValueError(
                    f"option {name} of method '{self.name}' must be {' or '.join(names)}, got {type(value).__name__} {quoted(value)}")


from . import across  # noqa: E402
from .ablation import token_ablation  # noqa: E402
from .activation import token_activation_generation, token_activation_map  # noqa: E402
from .attention import raw_attention, rollout  # noqa: E402
from .gradients import attention_gradcam, cdam, generic_attention, gradcam  # noqa: E402
from .language import attnlrp, cp_lrp, input_x_gradient  # noqa: E402
from .propagation import lrp, partial_lrp, transformer_attribution  # noqa: E402

REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("raw_attention", raw_attention, across=across.raw_attention, signed=False, reads_class_token=True,
               generation="shared_forward", summary="last block's attention of [CLS], mean over heads"),
        Method("rollout", rollout, across=across.rollout, signed=False, reads_class_token=True,
               generation="shared_forward", summary="attention rollout (Abnar & Zuidema), residual-aware, row-normalised"),
        Method("attention_gradcam", attention_gradcam, across=across.attention_gradcam, signed=False, reads_class_token=True,
               generation="shared_forward", summary="Grad-CAM on the last block's attention"),
        Method("generic_attention", generic_attention, across=across.generic_attention, signed=False, reads_class_token=True,
               generation="shared_forward", summary="Chefer ICCV'21 gradient-weighted attention rule"),
        Method("transformer_attribution", transformer_attribution, across=across.transformer_attribution, signed=False, reads_class_token=True,
               needs_attention=False, generation="prefixes", summary="Chefer CVPR'21: LRP relevance x attention gradient, rolled out"),
        Method("partial_lrp", partial_lrp, across=across.partial_lrp, signed=False, reads_class_token=True, needs_attention=False,
               generation="prefixes", summary="LRP relevance at the last attention (Voita et al.), vanilla rules"),
        Method("lrp", lrp, signed=True, reads_class_token=False, needs_attention=False, pixels=True,
               generation="prefixes", summary="full LRP to the pixels, vanilla rules"),
        Method("cdam", cdam, signed=True, reads_class_token=False, needs_attention=False, accepts_concept=True,
               generation="shared_forward", summary="class-discriminative attention map (Brocki & Chung)"),
        Method("token_ablation", token_ablation, signed=True, reads_class_token=False, needs_attention=False,
               accepts_concept=True,
               generation="prefixes", summary="score drop when a patch token is removed"),
        Method("gradcam", gradcam, signed=False, reads_class_token=False, needs_attention=False,
               summary="Grad-CAM on the tokens entering the last attention (pytorch-grad-cam's transformer recipe)"),
        Method("attnlrp", attnlrp, signed=True, reads_class_token=False, needs_attention=False, token_targets=True, generation="one_forward",
               summary="AttnLRP (Achtibat et al.) at the token or patch embeddings"),
        Method("cp_lrp", cp_lrp, signed=True, reads_class_token=False, needs_attention=False, token_targets=True, generation="one_forward",
               summary="CP-LRP: AttnLRP without relevance through queries, keys, gates"),
        Method("input_x_gradient", input_x_gradient, signed=True, reads_class_token=False, needs_attention=False, token_targets=True,
               generation="one_forward", summary="input x gradient at the token or patch embeddings"),
        Method("token_activation_map", token_activation_map, signed=False, reads_class_token=False, needs_attention=False,
               generation="one_forward", generation_run=token_activation_generation,
               summary="TAM (Li et al.): the token's logit at the image's tokens, less the earlier tokens' interference, rank-filtered"),
    )
}


def lookup(name: object, among: Sequence[str] | None = None, what: str = "methods") -> Method:
    """The registered method called `name`, one of `among` (default: every registered method); a one-line error
    naming the valid ones (`what` they are) and the closest name otherwise: the one check of a method's name."""
    valid = list(REGISTRY) if among is None else list(among)
    if isinstance(name, str) and name in valid:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, valid, n=1) if isinstance(name, str) else []
    hint = f" Did you mean '{close[0]}'?" if close else ""
    given = quoted(name) if isinstance(name, str) else f"a {type(name).__name__} (method must be a method name)"
    raise ValueError(f"unknown method {given}.{hint} Valid {what}: {', '.join(valid)}")


def register_method(method: Method, families: type[Adapter] | Iterable[type[Adapter]], replace: bool = False) -> None:
    """Add a user's method to the registry, offered by the adapters of `families` (one adapter class or several;
    docs/adding-a-method.md). Checked before anything changes, so that a refusal leaves the registry and the families
    as they were: a `Method` whose `run` (and `across`) are callables taking `(adapter, inputs, target)`, whose flags
    are True or False and whose `generation` is one of `GENERATION_MODES` or None, a name that is a non-empty
    identifier not taken by another method (a built-in is replaced, for the whole process, only with `replace=True`),
    and families that are adapter classes."""
    if not isinstance(method, Method):
        raise TypeError(f"register_method takes a relevancy.methods.Method, got {type(method).__name__}")
    if not isinstance(method.name, str) or not method.name.isidentifier():
        raise ValueError(f"a method's name must be a non-empty identifier (letters, digits, _), got {method.name!r}")
    for part, function in (("run", method.run), ("across", method.across)):
        if function is None and part == "across" or callable(function) and _takes_a_call(function):
            continue
        got = f"{getattr(function, '__name__', '')}{inspect.signature(function)}" if callable(function) else type(function).__name__
        raise TypeError(f"method {method.name!r}: run (and across, where given) must be callables "
                        f"run(adapter, inputs, target, **options), got {part} {got}")
    flag = next((name for name in METHOD_FLAGS if not isinstance(getattr(method, name), bool)), None)
    if flag is not None:
        raise TypeError(f"method {method.name!r}: {flag} must be True or False, got {quoted(getattr(method, flag))}")
    if method.generation is not None and method.generation not in GENERATION_MODES:
        raise ValueError(f"method {method.name!r}: generation must be one of {', '.join(GENERATION_MODES)} or None, got {quoted(method.generation)}")
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be True or False, got {quoted(replace)}")
    if method.name in REGISTRY and REGISTRY[method.name] is not method and not replace:
        raise ValueError(f"a method named {method.name!r} is registered already (every call in this process would use yours); "
                         "choose another name, or pass replace=True to replace it")
    families = [families] if isinstance(families, (type, str)) or not isinstance(families, Iterable) else list(families)
    unknown = [family for family in families if not (isinstance(family, type) and issubclass(family, Adapter))]
    if unknown:
        raise TypeError(f"families must be adapter classes (relevancy.families.adapters() lists them), got {unknown[0]!r}")
    REGISTRY[method.name] = method
    for family in families:
        if method.name not in family.methods:
            family.methods = (*family.methods, method.name)


def _takes_a_call(function: Callable) -> bool:
    """Whether `function` can be called as `function(adapter, inputs, target)` (True where its signature is not known)."""
    try:
        inspect.signature(function).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some built-ins)
        pass
    return True


__all__ = ["Method", "REGISTRY", "lookup", "register_method", "Adapter", "Target"]
