"""Rule-aware autograd on unmodified models.

Inside `relevance_session(...)`, the model's modules run through `RuleFunction`s: the forward values are the
model's own, and each backward pass is either an ordinary gradient pass or a relevance pass, chosen by the
session's `mode` at backward time. So one forward serves both the gradient `dy/dA` and the LRP relevance at
`A`, each in one backward pass. The rule map (module type -> rule) is data: a new architecture needs a map,
not a fork. Every patched forward is removed when the session ends, also after an exception.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import FunctionType, MethodType
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from ..guard import this_thread_only
from . import rules

GRADIENT, RELEVANCE = "gradient", "relevance"

# A relevance rule: (session, detached inputs, the forward output, relevance at the output) -> relevance per input.
RelevanceRule = Callable[["Session", tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# A linear rule: (session, input, weight `(out, in)`, relevance at the output, the forward's output `x W^T + bias` or
# None where it is something else, the bias or None) -> relevance at the input.
LinearRule = Callable[["Session", torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


@dataclass
class Session:
    """State of one explanation call: the rule set, the backward mode, and the recorded attention maps."""

    rule_set: RuleSet
    mode: str = GRADIENT
    # every attention's probabilities, in forward order (the order of the adapter's attention sites)
    attentions: list[torch.Tensor] = field(default_factory=list)
    # per stream, the tokens entering each block, block by block: recorded by rule maps that know their streams
    # (several towers), by hooks on `adapter.blocks` otherwise (see methods.relevance)
    block_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Whether the rule set reproduces the reference's arithmetic (see `RuleSet.exact`)."""
        return self.rule_set.exact

    def stream_input(self, stream: str, tokens: torch.Tensor) -> torch.Tensor:
        """A stream's input tokens as a leaf of the session's graph, recorded in `block_inputs`: relevance is measured
        there and goes no further (into the embeddings, a region encoder or a backbone), and frozen weights still
        give a graph."""
        leaf = tokens.detach().requires_grad_(True)
        self.block_inputs.setdefault(stream, []).append(leaf)
        return leaf

    def apply(self, rule: RelevanceRule, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """`fn(*inputs)`, differentiated by autograd in gradient mode and by `rule` in relevance mode."""
        return RuleFunction.apply(self, rule, fn, *inputs)

    def backward(self, mode: str, outputs: torch.Tensor, inputs: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
        """One backward pass from `outputs` (seeded with `seed`) to `inputs` in the given mode. An input the outputs
        do not depend on (LXMERT's last image-to-text attention) gets zeros."""
        self.mode = mode
        found = torch.autograd.grad(outputs, inputs, seed, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(x) if r is None else r for x, r in zip(inputs, found)]


class RuleFunction(torch.autograd.Function):
    """Runs `fn` on detached inputs with a local graph; backward is that graph's gradient or the rule."""

    @staticmethod
    def forward(ctx, session: Session, rule: RelevanceRule, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor):
        wanted = ctx.needs_input_grad[3:]
        local = tuple(x.detach().requires_grad_(need) for x, need in zip(inputs, wanted))
        with torch.enable_grad():
            output = fn(*local)
        ctx.session, ctx.rule, ctx.local, ctx.output = session, rule, local, output
        return output.detach()

    @staticmethod
    def backward(ctx, incoming: torch.Tensor):
        wanted = ctx.needs_input_grad[3:]
        if ctx.session.mode == GRADIENT:
            sources = [x for x, need in zip(ctx.local, wanted) if need]
            found = iter(torch.autograd.grad(ctx.output, sources, incoming, retain_graph=True, allow_unused=True))
            result = [next(found) if need else None for need in wanted]
        else:
            with torch.no_grad():
                shares = ctx.rule(ctx.session, tuple(x.detach() for x in ctx.local), ctx.output.detach(), incoming)
            result = [r if need else None for r, need in zip(shares, wanted)]
        return (None, None, None, *result)


# -- the rules as session-aware functions -----------------------------------------------------------------
def passthrough_rule(_session: Session, _inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    return (rules.passthrough(relevance),)


def add_rule(session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rules.add(*inputs, relevance, rescale=session.rule_set.rescale_residuals, exact=session.exact)


def matmul_rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rules.matmul_halved(*inputs, relevance, exact=session.exact, product=output)


def gate_rule(_session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`value * gate` (element-wise gating: a sigmoid or SiLU gate, a gated MLP): all of the relevance stays with the
    value, none goes to the gate, which reweighs the value as a weight does (conserving)."""
    return relevance, torch.zeros_like(inputs[1])


def reweigh_rule(_session: Session, inputs: tuple, _output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
    return (rules.reweigh_branches(inputs[0], relevance),)


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


def weight_rule(weight: torch.Tensor, affine: bool = False, bias: torch.Tensor | None = None) -> RelevanceRule:
    """The rule set's Linear rule for a product with `weight` (`(out, in)`, as `F.linear` takes it). `affine`: the
    forward computes exactly `x W^T + bias` (`bias` None for none), so the rule may take the product from its
    output."""

    def rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
        return (session.rule_set.linear(session, inputs[0], weight, relevance, output if affine else None, bias),)

    return rule


def linear_module_rule(module: nn.Linear) -> RelevanceRule:
    """The Linear rule for an nn.Linear: the product taken from the output where the module runs nn.Linear's own
    forward (a subclass with its own forward may compute something else)."""
    return weight_rule(module.weight, type(module).forward is nn.Linear.forward, module.bias)


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
    canonical forwards (which only say what operation they compute). The flags choose between the paper's
    (conserving) rules and the vanilla LRP baselines' in the default rule functions.

    `exact` reproduces the reference's arithmetic where it differs from the rules' mathematics: its `1e-9`
    stabiliser in every division, and its branch splits (`Clone`) and [CLS] selection (`IndexSelect`), which
    scale the arriving relevance by `x / (x + 1e-9)`. Otherwise the rules divide stably (see `rules`).
    """

    name: str
    shared_linear_denominator: bool
    rescale_residuals: bool
    exact: bool = False
    linear: LinearRule = linear_share
    add: RelevanceRule = add_rule
    matmul: RelevanceRule = matmul_rule
    softmax: RelevanceRule = passthrough_rule
    normalisation: RelevanceRule = passthrough_rule
    activation: RelevanceRule = passthrough_rule
    gate: RelevanceRule = gate_rule


    def with_exact(self, exact: bool) -> RuleSet:
        """This rule set in the reference's arithmetic (`exact=True`) or the stable default."""
        return replace(self, exact=exact)


PAPER = RuleSet("paper", shared_linear_denominator=True, rescale_residuals=True)
VANILLA = RuleSet("vanilla", shared_linear_denominator=False, rescale_residuals=False)


# -- operations used by canonical forwards -----------------------------------------------------------------
def _apply(session: Session | None, rule: RelevanceRule, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """`fn(*inputs)` under `rule` in a session; the plain operation outside one (`session=None`)."""
    return fn(*inputs) if session is None else session.apply(rule, fn, *inputs)


def add(session: Session | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a + b` under the rule set's add rule; `b` may broadcast (e.g. a position embedding)."""
    return _apply(session, _ADD, torch.add, a, b.expand_as(a))


def matmul(session: Session | None, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`u @ v` of two feature maps under the rule set's matmul rule."""
    return _apply(session, _MATMUL, rules.matmul, u, v)


def gate(session: Session | None, value: torch.Tensor, gate_values: torch.Tensor) -> torch.Tensor:
    """`value * gate_values`, an element-wise gate (same shape), under the rule set's gate rule."""
    return _apply(session, _GATE, torch.mul, value, gate_values)


def softmax(session: Session | None, scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension (in float32 at least, back in the scores' dtype) under the rule set's
    softmax rule."""
    return _apply(session, _SOFTMAX, softmax_of, scores)


def softmax_of(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in float32 at least, back in the scores' dtype."""
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


def linear(
    session: Session, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """`fn(x)`, the product of `x` with `weight` (`(out, in)`; a bias is ignored by the rule) under the Linear rule:
    for weights no nn.Linear holds (open_clip's fused in-projection and projection parameters)."""
    return session.apply(weight_rule(weight), fn, x)


def passthrough(session: Session | None, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an operation that moves relevance unchanged (scaling, readouts): no rule set changes that."""
    return _apply(session, passthrough_rule, fn, x)


def branch(session: Session, x: torch.Tensor) -> torch.Tensor:
    """`x` about to feed several branches (a residual and its block): their relevances add up at `x`.

    Exact sessions apply the reference's `Clone` factor to the sum; otherwise autograd's accumulation is the rule.
    """
    return session.apply(reweigh_rule, torch.clone, x) if session.exact else x


def first_token(session: Session, x: torch.Tensor) -> torch.Tensor:
    """`x[:, 0]`, the [CLS] readout: relevance goes back to token 0 (times the reference's factor when exact)."""
    return session.apply(first_token_rule, lambda t: t[:, 0], x) if session.exact else x[:, 0]


# -- patching ----------------------------------------------------------------------------------------------
# A rule map entry turns (module, session) into replacement attributes of the module, e.g. {"forward": ...}; {} for
# none. A key `(owner, name)` replaces an attribute of another object the module's computation goes through (CLIP:
# the adapter's helper that computes the explained pair logit outside any module).
Replacements = dict[str | tuple[object, str], object]
ForwardFactory = Callable[[nn.Module, Session], Replacements]


def leaf(rule_for: Callable[[nn.Module], RelevanceRule]) -> ForwardFactory:
    """An entry for a module computing one tensor from one tensor, differentiated by the given rule."""

    def factory(module: nn.Module, session: Session):
        original, rule = module.forward, rule_for(module)
        return {"forward": lambda x: session.apply(rule, original, x)}

    return factory


def unchanged(_module: nn.Module, _session: Session) -> Replacements:
    """An entry for containers and ops whose ordinary backward already moves relevance correctly."""
    return {}


_ADD = rule_of(lambda rules: rules.add)
_MATMUL = rule_of(lambda rules: rules.matmul)
_SOFTMAX = rule_of(lambda rules: rules.softmax)
_GATE = rule_of(lambda rules: rules.gate)
PASSTHROUGH = leaf(lambda _m: passthrough_rule)
NORMALISATION = leaf(lambda _m: rule_of(lambda rules: rules.normalisation))
ACTIVATION = leaf(lambda _m: rule_of(lambda rules: rules.activation))
LINEAR = leaf(linear_module_rule)
PIXEL_CONV = leaf(pixel_conv_rule)


def default_leaves() -> dict[type, ForwardFactory]:
    """The entries every family shares for torch's own modules: containers, dropout and embeddings unchanged, Linear
    layers the Linear rule, norms the normalisation rule, activations the activation rule. A family's map states
    only its differences on top (its blocks, attention, embeddings; the pixel convolution)."""
    norms = [nn.LayerNorm] + ([nn.RMSNorm] if hasattr(nn, "RMSNorm") else [])
    activations = [nn.GELU, nn.ReLU, nn.Tanh, nn.SiLU, nn.Mish, nn.Sigmoid]
    return {
        **{container: unchanged for container in (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity)},
        nn.Dropout: unchanged,
        nn.Embedding: unchanged,
        nn.Linear: LINEAR,
        **{norm: NORMALISATION for norm in norms},
        **{activation: ACTIVATION for activation in activations},
    }


def by_type(modules: Iterable[nn.Module | None], rule: ForwardFactory) -> dict[type, ForwardFactory]:
    """`rule` for the type of each module given (None skipped): a family's entries keyed by the types its model was
    built with, found by role (attribute paths) rather than by class names."""
    return {type(module): rule for module in modules if module is not None}


class MissingRuleError(TypeError):
    """A module of the model has no relevance rule in the rule map."""


def _entry(rule_map: Mapping[type, ForwardFactory], module: nn.Module) -> ForwardFactory:
    for cls in type(module).__mro__:
        if cls in rule_map:
            return rule_map[cls]
    known = ", ".join(sorted(c.__name__ for c in rule_map))
    raise MissingRuleError(
        f"no relevance rule for module type {type(module).__module__}.{type(module).__name__}; "
        f"the rule map covers: {known}"
    )


@contextmanager
def relevance_session(
    model: nn.Module,
    rule_map: Mapping[type, ForwardFactory],
    rule_set: RuleSet,
    overrides: Mapping[nn.Module, ForwardFactory] | None = None,
) -> Iterator[Session]:
    """Apply `rule_map` to every module of `model` for the block, in the calling thread only (other threads run the model as it is), with `rule_set`'s rules (and
    arithmetic: see `RuleSet.exact`); the model is restored on exit. `overrides` pick a factory for particular modules."""
    session = Session(rule_set)
    overrides = dict(overrides or {})
    plans = [(m, overrides.get(m) or _entry(rule_map, m)) for m in model.modules()]
    patched: list[tuple[object, str, bool, object]] = []
    try:
        for module, factory in plans:
            for key, replacement in factory(module, session).items():
                owner, name = key if isinstance(key, tuple) else (module, key)
                had_own = name in owner.__dict__
                patched.append((owner, name, had_own, owner.__dict__.get(name)))
                if isinstance(replacement, (FunctionType, MethodType)):
                    # the user's own forwards from other threads run the model's computation, not the rules
                    replacement = this_thread_only(replacement, otherwise=getattr(owner, name))
                object.__setattr__(owner, name, replacement)
        yield session
    finally:
        for owner, name, had_own, previous in reversed(patched):
            if had_own:
                object.__setattr__(owner, name, previous)
            else:
                object.__delattr__(owner, name)
        session.attentions.clear()
        session.block_inputs.clear()
