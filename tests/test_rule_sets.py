"""The one rule vocabulary: one `RuleSet` type whose values every method reads by name, the engine's operations
under each (an explicit relevance pass or a modified gradient), and the one attention under each."""
from __future__ import annotations

from typing import get_args

import pytest
import torch

import relevancy
from models import tiny_vit
from relevancy.core.conventions import RuleName
from relevancy.lrp import ATTNLRP, CP_LRP, PAPER, RELEVANCE, RULE_SETS, VANILLA, RuleSet, Session, engine
from relevancy.lrp.attention import SCALED_QUERIES, attend


def test_one_table_of_rule_sets_of_one_type():
    """Every rule set is a `RuleSet` in `RULE_SETS`; the seeds' methods take the explicit ones by name (`rules=`),
    and the conventions' type names exactly those."""
    assert list(RULE_SETS) == ["vanilla", "paper", "attnlrp", "cp_lrp"]
    assert [RULE_SETS[name] for name in RULE_SETS] == [VANILLA, PAPER, ATTNLRP, CP_LRP]
    assert all(type(rule_set) is RuleSet for rule_set in RULE_SETS.values())
    assert list(get_args(RuleName)) == [name for name, rule_set in RULE_SETS.items() if rule_set.explicit]
    assert PAPER.with_exact(True).exact and PAPER.with_exact(True).name == "paper"


def test_a_rule_set_that_carries_a_gradient_is_refused_by_the_seeds_methods_by_name():
    model, images = tiny_vit(), torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match=r"^rules must be one of vanilla, paper; got 'attnlrp' \(attnlrp, cp_lrp are methods"):
        relevancy.explain(model, images, method="lrp", rules="attnlrp")


def _input_times_gradient(rule_set: RuleSet, value: torch.Tensor, gate_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    value, gate_values = value.clone().requires_grad_(True), gate_values.clone().requires_grad_(True)
    out = engine.gate(Session(rule_set), value, gate_values)
    grads = torch.autograd.grad(out.sum(), [value, gate_values], allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else x * g for x, g in zip((value, gate_values), grads))


def test_one_gate_operation_under_every_rule_set():
    """`engine.gate` reads the rule set's shares `(value, gate)`: the seeds' explicit pass and CP-LRP give the value
    everything, AttnLRP half to each factor (as input x gradient)."""
    value, gate_values = torch.randn(4, 3, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    product = value * gate_values
    session = Session(PAPER)
    leaf, gates = value.clone().requires_grad_(True), gate_values.clone().requires_grad_(True)
    out = engine.gate(session, leaf, gates)
    relevance_value, relevance_gate = session.backward(RELEVANCE, out, [leaf, gates], product)
    assert torch.equal(relevance_value, product) and torch.equal(relevance_gate, torch.zeros_like(gates))
    half = _input_times_gradient(ATTNLRP, value, gate_values)
    assert torch.allclose(half[0], product / 2) and torch.allclose(half[1], product / 2)
    whole = _input_times_gradient(CP_LRP, value, gate_values)
    assert torch.allclose(whole[0], product) and torch.equal(whole[1], torch.zeros_like(gate_values))


@pytest.mark.parametrize("rule_set", [None, PAPER, ATTNLRP, CP_LRP])
def test_one_attention_with_grouped_heads_under_every_rule_set(rule_set):
    """Keys and values shared by groups of query heads give what the same heads copied per query head give: the
    output, the probabilities, and the relevance (explicit pass) or gradient (modified gradient) at the inputs;
    for a gradient rule set torch's fused kernel gives the same output and gradients."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 5, 4, dtype=torch.float64, generator=generator) for heads in (4, 2, 2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def run(grouped: bool, probabilities: bool = True):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        keys, values = leaves[1:] if grouped else (x.repeat_interleave(2, 1) for x in leaves[1:])
        session = None if rule_set is None else Session(rule_set)
        context, weights = attend(session, leaves[0], keys, values, 0.5, mask, style=SCALED_QUERIES, probabilities=probabilities)
        seed = torch.linspace(-1, 1, context.numel(), dtype=torch.float64).view(context.shape)
        if session is not None and rule_set.explicit:
            found = session.backward(RELEVANCE, context, leaves, seed)
        else:
            found = [torch.zeros_like(x) if g is None else g  # CP-LRP: queries and keys detached
                     for x, g in zip(leaves, torch.autograd.grad(context, leaves, seed, allow_unused=True))]
        return context.detach(), weights, found

    grouped, copied = run(True), run(False)
    torch.testing.assert_close(grouped[0], copied[0])
    torch.testing.assert_close(grouped[1].detach(), copied[1].detach())
    for a, b in zip(grouped[2], copied[2]):
        torch.testing.assert_close(a, b)
    if rule_set is None or not rule_set.explicit:
        fused = run(True, probabilities=False)
        assert fused[1] is None
        torch.testing.assert_close(fused[0], grouped[0])
        for a, b in zip(fused[2], grouped[2]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_half_precision_attention_on_a_cpu_runs_as_eager_products(monkeypatch, dtype):
    """Without probabilities asked for, a half-precision attention on a CPU up to `EAGER_HALF_PRECISION_KEYS` keys
    runs as the eager products (faster there, forward and backward), beyond them torch's fused kernel: the same
    output and gradients to the dtype's rounding."""
    from relevancy.lrp import attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 6, 8, generator=generator).to(dtype) for heads in (4, 2, 2))
    seed = torch.randn(2, 4, 6, 8, generator=generator).to(dtype)

    def run():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        context, weights = attend(Session(ATTNLRP), *leaves, 0.5, None, style=SCALED_QUERIES, causal=True, probabilities=False)
        return context.detach(), weights, torch.autograd.grad(context, leaves, seed)

    eager = run()
    # its softmax runs in the half-precision dtype (keeping that output for the backward): the CPU's kernel gives the
    # float32 softmax's numbers rounded
    scores = (torch.randn(2, 4, 6, 6, generator=generator) * 8).to(dtype)
    assert torch.equal(torch.softmax(scores, -1), torch.softmax(scores, -1, dtype=torch.float32).to(dtype))
    monkeypatch.setattr(attention, "EAGER_HALF_PRECISION_KEYS", 5)
    fused = run()
    assert eager[1] is not None and fused[1] is None
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for a, b in zip((eager[0], *eager[2]), (fused[0], *fused[2])):
        assert (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()


def test_a_session_of_relevance_passes_only_gives_the_same_relevance_and_refuses_a_gradient_pass():
    """`gradient_pass=False` (LRP, partial LRP): the operations keep no local graph, the relevance is the same to
    the bit, and a gradient pass is refused by name."""
    from relevancy.methods.capture import record_forward
    from relevancy.families import adapter_for
    from relevancy.lrp import GRADIENT, relevance_session

    model = tiny_vit(depth=2).double()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    adapter = adapter_for(model)

    def relevance(gradient_pass: bool) -> torch.Tensor:
        with adapter.explaining(False), relevance_session(model, adapter.relevance_rule_map(), PAPER, gradient_pass=gradient_pass) as session:
            pixels = images.clone().requires_grad_(True)
            fwd = record_forward(adapter, pixels, [0, 1], gradients=True)
            found = session.backward(RELEVANCE, fwd.score.sum(), [pixels], torch.ones((), dtype=torch.float64))[0]
            if not gradient_pass:
                with pytest.raises(RuntimeError, match=r"keeps no graph for a gradient pass \(gradient_pass=False\)"):
                    session.backward(GRADIENT, fwd.score.sum(), [pixels], torch.ones((), dtype=torch.float64))
        return found

    assert torch.equal(relevance(True), relevance(False))
