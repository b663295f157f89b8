"""Rule-aware autograd on unmodified models.

Inside `relevance_session(...)`, the model's modules run through `RuleFunction`s: the forward values are the
model's own, and each backward pass is either an ordinary gradient pass or a relevance pass, chosen by the
session's `mode` at backward time. So one forward serves both the gradient `dy/dA` and the LRP relevance at
`A`, each in one backward pass. The rule map (module type -> rule) is data: a new architecture needs a map,
not a fork. Every patched forward is removed when the session ends, also after an exception.
"""
from __future__ import annotations

import threading

from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from ..core import linears
from ..core.dispatch import within_hook
from ..core.guard import this_thread_only
from . import gradient, rules
from .rule_sets import (
    RelevanceRule, RuleSet, gate_rule, linear_module_rule, mean_rule, passthrough_rule, pixel_conv_rule, reweigh_rule,
    rule_of, first_token_rule, weight_rule,
)

GRADIENT, RELEVANCE = "gradient", "relevance"  # the modes of an explicit pass's backward

@dataclass
class Session:
    """State of one explanation call: the rule set, the backward mode, and the recorded attention maps."""

    rule_set: RuleSet
    mode: str = GRADIENT
    #: whether a gradient pass will be taken too (transformer attribution): each operation then keeps a local graph
    #: for it; a session of relevance passes only keeps its operations' inputs and outputs alone (the rules read no
    #: more), in less time and memory (docs/speed.md)
    gradient_pass: bool = True
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
        if mode == GRADIENT and not self.gradient_pass:
            raise RuntimeError("this relevance session keeps no graph for a gradient pass (gradient_pass=False)")
        self.mode = mode
        found = torch.autograd.grad(outputs, inputs, seed, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(x) if r is None else r for x, r in zip(inputs, found)]


@dataclass(frozen=True)
class WrittenGradient:
    """An operation whose gradient is written out (`gradient(inputs, output, incoming, wanted)` -> one gradient per
    input, None where not `wanted`) rather than taken from a local graph: an explicit pass then keeps no graph for
    it, and the gradient may skip what is known to be zero (a causal attention's blocks above the diagonal)."""

    forward: Callable[..., torch.Tensor]
    gradient: Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, tuple[bool, ...]], tuple]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.forward(*inputs)


class RuleFunction(torch.autograd.Function):
    """Runs `fn` on detached inputs, with a local graph where the session takes a gradient pass too; backward is that
    graph's gradient or the rule."""

    @staticmethod
    def forward(ctx, session: Session, rule: RelevanceRule, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor):
        wanted = ctx.needs_input_grad[3:]
        # no local graph where the session takes no gradient pass (the rule reads the inputs and the output only) or
        # the operation's gradient is written out
        graph = session.gradient_pass and not isinstance(fn, WrittenGradient)
        local = tuple(x.detach().requires_grad_(need and graph) for x, need in zip(inputs, wanted))
        with torch.set_grad_enabled(graph):
            output = fn(*local)
        ctx.session, ctx.rule, ctx.fn, ctx.local, ctx.output = session, rule, fn, local, output
        return output.detach()

    @staticmethod
    def backward(ctx, incoming: torch.Tensor):
        wanted = ctx.needs_input_grad[3:]
        if ctx.session.mode == GRADIENT and isinstance(ctx.fn, WrittenGradient):
            result = ctx.fn.gradient(ctx.local, ctx.output, incoming, wanted)
        elif ctx.session.mode == GRADIENT:
            sources = [x for x, need in zip(ctx.local, wanted) if need]
            found = iter(torch.autograd.grad(ctx.output, sources, incoming, retain_graph=True, allow_unused=True))
            result = [next(found) if need else None for need in wanted]
        else:
            with torch.no_grad():
                shares = ctx.rule(ctx.session, tuple(x.detach() for x in ctx.local), ctx.output.detach(), incoming)
            result = [r if need else None for r, need in zip(shares, wanted)]
        return (None, None, None, *result)


# -- operations used by canonical forwards -----------------------------------------------------------------
# Each runs the model's operation; the session's rule set decides what its backward carries: under an explicit
# rule set (`RuleSet.explicit`) it runs through a `RuleFunction` with the rule set's rule for its kind, under a
# gradient rule set on the live graph with the rule set's modified gradient (`lrp.gradient`), and outside a
# session (`None`) as the plain operation.
def _explicit(session: Session | None) -> bool:
    return session is not None and session.rule_set.explicit


def _apply(session: Session | None, rule: RelevanceRule, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """`fn(*inputs)` under `rule` in an explicit session; the operation with its own gradient otherwise."""
    return session.apply(rule, fn, *inputs) if _explicit(session) else fn(*inputs)


def add(session: Session | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a + b` under the rule set's add rule; `b` may broadcast (e.g. a position embedding)."""
    return _apply(session, _ADD, torch.add, a, b.expand_as(a))


def matmul(session: Session | None, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`u @ v` of two feature maps under the rule set's matmul rule (a gradient rule set shares the factors before:
    `attention.attend`)."""
    return _apply(session, _MATMUL, _PRODUCT, u, v)


def gate(session: Session | None, value: torch.Tensor, gate_values: torch.Tensor) -> torch.Tensor:
    """`value * gate_values`, an element-wise gate, under the rule set's gate shares."""
    if session is None:
        return torch.mul(value, gate_values)
    if session.rule_set.explicit:
        return session.apply(gate_rule, torch.mul, value, gate_values)
    value_share, gate_share = session.rule_set.gate
    return gradient.take(gate_values, gate_share) * gradient.take(value, value_share)


def softmax(session: Session | None, scores: torch.Tensor,
            of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Softmax over the last dimension (in float32 at least, back in the scores' dtype; `of`: another such map of
    the scores, gpt-oss's softmax with sinks) under the rule set's softmax rule (a gradient rule set: its true
    gradient)."""
    return _apply(session, _SOFTMAX, of or softmax_of, scores)


def softmax_of(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in float32 at least, back in the scores' dtype."""
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


def activation(session: Session | None, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)`, an element-wise activation, under the rule set's activation rule (a gradient rule set: the identity
    rule; an input that needs no gradient needs no rule)."""
    if _explicit(session):
        return session.apply(_ACTIVATION, fn, x)
    return gradient.identity_rule(fn, x) if session is not None and x.requires_grad else fn(x)


def normalisation(session: Session | None, fn: Callable[[torch.Tensor], torch.Tensor],
                  constant_divisor: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A norm `fn(x)` under the rule set's normalisation rule; a gradient rule set runs `constant_divisor(x)`, the
    same norm with its divisor held constant in the backward (the identity rule, `lrp.gradient`)."""
    if _explicit(session):
        return session.apply(_NORMALISATION, fn, x)
    return fn(x) if session is None else constant_divisor(x)


def linear(
    session: Session | None, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """`fn(x)`, the product of `x` with `weight` (`(out, in)`; a bias is ignored by the rule) under the Linear rule:
    for weights no nn.Linear holds (open_clip's fused in-projection, a mixture's stored experts)."""
    return session.apply(weight_rule(weight), fn, x) if _explicit(session) else fn(x)


def passthrough(session: Session | None, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an operation that moves relevance unchanged in an explicit pass (scaling, readouts, a rotation);
    its own gradient otherwise."""
    return _apply(session, passthrough_rule, fn, x)


def branch(session: Session | None, x: torch.Tensor) -> torch.Tensor:
    """`x` about to feed several branches (a residual and its block): their relevances add up at `x`.

    Exact sessions apply the reference's `Clone` factor to the sum; otherwise autograd's accumulation is the rule.
    """
    return session.apply(reweigh_rule, torch.clone, x) if _explicit(session) and session.exact else x


def first_token(session: Session | None, x: torch.Tensor) -> torch.Tensor:
    """`x[:, 0]`, the [CLS] readout: relevance goes back to token 0 (times the reference's factor when exact)."""
    return session.apply(first_token_rule, lambda t: t[:, 0], x) if _explicit(session) and session.exact else x[:, 0]


def mean_tokens(session: Session | None, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens.mean(1)`, `(B, N, D) -> (B, D)` (global average pooling): relevance shared over the tokens in proportion
    to their values in an explicit pass (`rule_sets.mean_rule`); its own gradient otherwise."""
    return _apply(session, mean_rule, lambda t: t.mean(1), tokens)


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
        return {"forward": lambda x: _apply(session, rule, original, x)}

    return factory


def unchanged(_module: nn.Module, _session: Session) -> Replacements:
    """An entry for containers and ops whose ordinary backward already moves relevance correctly."""
    return {}


_PRODUCT = WrittenGradient(rules.matmul, lambda inputs, _output, incoming, wanted: rules.matmul_gradient(*inputs, incoming, wanted))
_ADD = rule_of(lambda rules: rules.add)
_MATMUL = rule_of(lambda rules: rules.matmul)
_SOFTMAX = rule_of(lambda rules: rules.softmax)
_NORMALISATION = rule_of(lambda rules: rules.normalisation)
_ACTIVATION = rule_of(lambda rules: rules.activation)
PASSTHROUGH = leaf(lambda _m: passthrough_rule)


def NORMALISATION(module: nn.Module, session: Session) -> Replacements:
    """An entry for a norm module (LayerNorm, RMSNorm): the normalisation rule of the session's rule set (a gradient
    rule set: the module's norm with its divisor constant, `gradient.module_norm`)."""
    original = module.forward
    return {"forward": lambda x: normalisation(session, original, lambda t: gradient.module_norm(module, t), x)}


def ACTIVATION(module: nn.Module, session: Session) -> Replacements:
    """An entry for an element-wise activation module: the activation rule of the session's rule set (a gradient
    rule set: the identity rule)."""
    original = module.forward
    return {"forward": lambda x: activation(session, original, x)}


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
    """The rule map's entry for `module`'s type (its nearest class in the map); an adapter layer (peft's LoRA) takes
    its base layer's entry, so that it is ruled as the one layer it computes."""
    for cls in type(linears.base_of(module)).__mro__:
        if cls in rule_map:
            return rule_map[cls]
    known = ", ".join(sorted(c.__name__ for c in rule_map))
    raise MissingRuleError(
        f"no relevance rule for module type {type(module).__module__}.{type(module).__name__}; "
        f"the rule map covers: {known}"
    )


_restoring = threading.Lock()


@contextmanager
def replaced(replacements: Iterable[tuple[object, str, object]]) -> Iterator[None]:
    """Each `(owner, name, value)`: the attribute set on the owner for the block (a function in the calling thread
    only: another thread calls what was there), what the owner had before (its own attribute, or none: its class's)
    given back after, also after an exception. The one way relevancy patches and restores a model.

    Calls in several threads may patch the same function (two models of one family share their modeling file's
    functions) and end in any order: a call that ends under a later call's patch leaves that patch in place and
    retires its own gate (it hands on to what it replaced), and a restore that would give back a retired gate gives
    back what that gate replaced, so the last call to end leaves the original."""
    patched: list[tuple[object, str, bool, object, object]] = []
    try:
        for owner, name, replacement in replacements:
            had_own = name in owner.__dict__
            if isinstance(replacement, (FunctionType, MethodType)):
                if name == "forward":  # where accelerate dispatches the model, inside its hook, as the module's own
                    replacement = within_hook(owner, replacement)
                # the user's own forwards from other threads run the model's computation, not the rules
                replacement = this_thread_only(replacement, otherwise=getattr(owner, name))
            patched.append((owner, name, had_own, owner.__dict__.get(name), replacement))
            object.__setattr__(owner, name, replacement)
        yield
    finally:
        with _restoring:
            for owner, name, had_own, previous, installed in reversed(patched):
                state = getattr(installed, "gate_state", None)
                if owner.__dict__.get(name) is not installed and state is not None:
                    state.retired = (had_own, previous)  # a later call's patch is on top: it restores past ours
                    continue
                while getattr(getattr(previous, "gate_state", None), "retired", None) is not None:
                    had_own, previous = previous.gate_state.retired
                if had_own:
                    object.__setattr__(owner, name, previous)
                else:
                    object.__delattr__(owner, name)


def _replacements(plans: list[tuple[nn.Module, ForwardFactory]], session: Session) -> Iterator[tuple[object, str, object]]:
    """Each module's replacements from its rule map entry, made as the patching reaches the module."""
    for module, factory in plans:
        for key, replacement in factory(module, session).items():
            owner, name = key if isinstance(key, tuple) else (module, key)
            yield owner, name, replacement


@contextmanager
def relevance_session(
    model: nn.Module,
    rule_map: Mapping[type, ForwardFactory],
    rule_set: RuleSet,
    overrides: Mapping[nn.Module, ForwardFactory] | None = None,
    gradient_pass: bool = True,
) -> Iterator[Session]:
    """Apply `rule_map` to every module of `model` for the block, in the calling thread only (other threads run the
    model as it is), with `rule_set`'s rules (and arithmetic: see `RuleSet.exact`); the model is restored on exit.
    `overrides` pick a factory for particular modules; `gradient_pass=False`: relevance passes only (see
    `Session.gradient_pass`)."""
    session = Session(rule_set, gradient_pass=gradient_pass)
    overrides = dict(overrides or {})
    # an adapter layer is ruled as one layer: the modules inside it (its base layer, the adapters) run as they are
    inside = {id(child) for m in model.modules() if linears.tuner_layer(m) for child in m.modules() if child is not m}
    plans = [(m, overrides.get(m) or _entry(rule_map, m)) for m in model.modules() if id(m) not in inside]
    try:
        with replaced(_replacements(plans, session)):
            yield session
    finally:
        session.attentions.clear()
        session.block_inputs.clear()
