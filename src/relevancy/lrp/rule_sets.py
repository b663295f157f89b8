"""The one rule vocabulary: a `RuleSet` says which rule each kind of operation gets, for every family and method.

A family's canonical forwards (its rule map) only say which operations a model computes (`engine.add`, `matmul`,
`gate`, `softmax`, `linear`, `activation`, `normalisation`, `passthrough`, the one attention `attention.attend`);
the rule set decides, when relevance flows, what each operation does with it (zennit's composites apart from its
canonizers). A rule set also says what its backward pass carries (`carries`):
- "relevance": the seeds' explicit relevance pass (Chefer et al. CVPR'21 `layers_ours`: `PAPER`; their LRP
  baselines `layers_lrp`: `VANILLA`). Every operation runs through `engine.RuleFunction`, whose backward is the
  relevance rule of the fields `linear`, `add`, `matmul`, `softmax`, `normalisation`, `activation` and `gate`;
  the paper's residual rule rescales per sample, which no local gradient can express. `exact` is the authors'
  arithmetic (their 1e-9 stabilisers and `Clone` / `IndexSelect` factors), `PAPER.with_exact(True)`.
- "gradient": AttnLRP (Achtibat et al. ICML 2024: `ATTNLRP`) and CP-LRP (Ali et al. ICML 2022: `CP_LRP`) in the
  gradient x input form (`lrp.gradient`): the operations run on the live autograd graph, each product's factors
  sharing the backward (`query_key`, `value`, `gate`), activations and norms under the identity rule, the rest
  (Linear: the epsilon-0 rule, softmax, additions) their true gradient; relevance is input x gradient.
`gate` is read by both: the shares `(value, gate)` of relevance that the two factors of a gating product receive
(a gated MLP, a router weight times its expert; `None`: the factor is a constant, nothing flows into it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Protocol

import torch
from torch import nn

from ..core import dispatch, linears
from . import rules


class Session(Protocol):
    """What a rule reads of the engine's session (`engine.Session` is one): its rule set and its arithmetic."""

    rule_set: RuleSet
    exact: bool

# A relevance rule: (session, detached inputs, the forward output, relevance at the output) -> relevance per input.
RelevanceRule = Callable[["Session", tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# A linear rule: (session, input, weight `(out, in)`, relevance at the output, the forward's output `x W^T + bias` or
# None where it is something else, the bias or None) -> relevance at the input.
LinearRule = Callable[["Session", torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
RELEVANCE, GRADIENT_X_INPUT = "relevance", "gradient"


# -- the explicit pass's rules as session-aware functions ------------------------------------------------------
def passthrough_rule(_session: Session, _inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    return (rules.passthrough(relevance),)


def add_rule(session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rules.add(*inputs, relevance, rescale=session.rule_set.rescale_residuals, exact=session.exact)


def matmul_rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rules.matmul_halved(*inputs, relevance, exact=session.exact, product=output)


def gate_rule(session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`value * gate`: the rule set's shares `(value, gate)` of the relevance (the seeds': all of it with the value,
    none with the gate, which reweighs the value as a weight does; conserving)."""
    return tuple(torch.zeros_like(x) if not share else relevance if share == 1.0 else relevance * share
                 for x, share in zip(inputs, session.rule_set.gate))


def reweigh_rule(_session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    return (rules.reweigh_branches(inputs[0], relevance),)


def mean_rule(session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    """`mean_i x_i` over dim 1 (global average pooling): token i gets `x_i / sum_j x_j` of the relevance (the add rule
    over N terms)."""
    (tokens,) = inputs
    total = tokens.sum(1, keepdim=True)
    arriving = relevance[:, None]
    if session.exact:
        return (tokens * rules.safe_divide(arriving, total),)
    signed, unsigned = rules.stable_quotients(arriving, total, tokens.abs().sum(1, keepdim=True))
    return (torch.addcmul(tokens * signed, tokens.abs(), unsigned),)


def first_token_rule(_session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    (tokens,) = inputs
    shares = torch.zeros_like(tokens)
    shares[:, 0] = rules.reweigh_branches(tokens[:, 0], relevance)
    return (shares,)


def linear_share(
    session: Session, x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, output: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """alpha=1, beta=0 (bias ignored), with the rule set's denominator."""
    return rules.linear_alpha1_beta0(x, weight, relevance, session.rule_set.shared_linear_denominator, output, bias)


def weight_rule(weight: torch.Tensor | Callable[[], tuple[torch.Tensor, torch.Tensor | None]], affine: bool = False,
                bias: torch.Tensor | None = None) -> RelevanceRule:
    """The rule set's Linear rule for a product with `weight` (`(out, in)`, as `F.linear` takes it), or with the
    `(weight, bias)` a callable reads when relevance reaches the product (a quantized, adapted or offloaded layer's
    effective weight: one layer's at a time). `affine`: the forward computes exactly `x W^T + bias` (`bias` None
    for none), so the rule may take the product from its output."""

    def rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
        x = inputs[0]
        w, b = weight() if callable(weight) else (weight, bias)
        w, b = w.to(x.device, x.dtype), None if b is None else b.to(x.device, x.dtype)
        return (session.rule_set.linear(session, x, w, relevance, output if affine else None, b),)

    return rule


def linear_module_rule(module: nn.Module) -> RelevanceRule:
    """The Linear rule for a linear layer (`core.linears`: plain, quantized, LoRA-adapted, offloaded), its effective
    weight read when relevance reaches it; the product taken from the output where the module runs nn.Linear's own
    forward (a subclass with its own forward may compute something else)."""
    if linears.plain(module) and not dispatch.hook_of(module):
        return weight_rule(module.weight, True, module.bias)
    linears.check_readable(module)  # refused before any work
    return weight_rule(lambda: linears.effective(module), linears.plain(module))


def rule_of(kind: Callable[[RuleSet], RelevanceRule]) -> RelevanceRule:
    """The rule the session's rule set gives an operation kind (`kind` picks the `RuleSet` field, e.g.
    `lambda rules: rules.softmax`), looked up when relevance flows, so that the rule set decides."""

    def rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return kind(session.rule_set)(session, inputs, output, relevance)

    return rule


def pixel_conv_rule(module: nn.Conv2d) -> RelevanceRule:
    def rule(session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
        return (rules.conv_zb(inputs[0], module.weight, relevance, module.stride, module.padding, exact=session.exact),)

    return rule


@dataclass(frozen=True)
class RuleSet:
    """Which rule each kind of operation gets: a value, so that a rule set is swapped without touching any family's
    canonical forwards (which only say what operation they compute). See the module's docstring for the fields
    each `carries` reads.

    `exact` reproduces the reference's arithmetic where it differs from the rules' mathematics: its `1e-9`
    stabiliser in every division, and its branch splits (`Clone`) and [CLS] selection (`IndexSelect`), which
    scale the arriving relevance by `x / (x + 1e-9)`. Otherwise the rules divide stably (see `rules`).
    """

    name: str
    carries: Literal["relevance", "gradient"]
    #: the shares (value, gate) of a gating product's relevance (None: the factor is a constant)
    gate: tuple[float, float | None]
    # the explicit pass (carries "relevance")
    shared_linear_denominator: bool = True
    rescale_residuals: bool = True
    exact: bool = False
    linear: LinearRule = linear_share
    add: RelevanceRule = add_rule
    matmul: RelevanceRule = matmul_rule
    softmax: RelevanceRule = passthrough_rule
    normalisation: RelevanceRule = passthrough_rule
    activation: RelevanceRule = passthrough_rule
    # the gradient form (carries "gradient"): the backward's share of attention's queries and keys (None: detached)
    # and values
    query_key: float | None = 1.0
    value: float = 1.0

    @property
    def explicit(self) -> bool:
        """Whether the backward carries relevance (the explicit pass) rather than a gradient."""
        return self.carries == RELEVANCE

    def with_exact(self, exact: bool) -> RuleSet:
        """This rule set in the reference's arithmetic (`exact=True`) or the stable default."""
        return replace(self, exact=exact)


PAPER = RuleSet("paper", RELEVANCE, gate=(1.0, None))
VANILLA = RuleSet("vanilla", RELEVANCE, gate=(1.0, None), shared_linear_denominator=False, rescale_residuals=False)
#: the uniform rule on every product: half to each factor (queries and keys: half of half, through the softmax)
ATTNLRP = RuleSet("attnlrp", GRADIENT_X_INPUT, gate=(0.5, 0.5), query_key=0.25, value=0.5)
#: queries, keys and gates detached: they only decide where relevance goes
CP_LRP = RuleSet("cp_lrp", GRADIENT_X_INPUT, gate=(1.0, None), query_key=None, value=1.0)
#: every rule set by name: the methods' `rules=` choices, the command line and the docs read this table
RULE_SETS: dict[str, RuleSet] = {rule_set.name: rule_set for rule_set in (VANILLA, PAPER, ATTNLRP, CP_LRP)}
