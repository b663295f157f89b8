"""Relevance propagation: conservation of the paper's rules, where the vanilla rules lose it, batch independence."""
from __future__ import annotations

import pytest
import torch

import relevancy
from relevancy.families import adapter_for
from relevancy.methods import propagation
from relevancy.methods.capture import record_forward
from relevancy.lrp import PAPER, RELEVANCE, VANILLA, engine, relevance_session, rules
from models import tiny_deit_distilled, tiny_vit


def relevance_at_block_inputs(model, images, targets, rule_set):
    """Per-sample relevance sums at every block's input and at the final norm's input."""
    adapter = adapter_for(model)
    recorded = []
    modules = list(model.blocks) + [model.norm]
    handles = [m.register_forward_pre_hook(lambda _m, args: recorded.append(args[0])) for m in modules]
    try:
        with adapter.explaining(False), relevance_session(model, adapter.relevance_rule_map(), rule_set) as session:
            fwd = record_forward(adapter, images, targets, gradients=True)
            grads = session.backward(RELEVANCE, fwd.score.sum(), recorded, torch.ones(()))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([g.sum(dim=(1, 2)) for g in grads], 1)  # (B, blocks + 1)


def test_paper_rules_conserve_relevance_through_every_block():
    model = tiny_vit(depth=4)
    sums = relevance_at_block_inputs(model, torch.randn(3, 3, 32, 32), [0, 2, 4], PAPER)
    # one-hot at the logits: total relevance 1 from the head down to the tokens entering block 0
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)


def test_paper_rules_conserve_on_distilled_models():
    sums = relevance_at_block_inputs(tiny_deit_distilled(), torch.randn(2, 3, 32, 32), [1, 3], PAPER)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)


def test_vanilla_rules_do_not_conserve():
    """The vanilla Linear rule divides positive and negative parts separately: each part gets all of R."""
    sums = relevance_at_block_inputs(tiny_vit(depth=4), torch.randn(2, 3, 32, 32), [0, 1], VANILLA)
    assert ((sums - 1).abs() > 0.05).any()


def test_linear_rules():
    torch.manual_seed(0)
    x, weight, relevance = torch.randn(4, 64), torch.randn(3, 64), torch.rand(4, 3)  # wide: no output with Z = 0
    shared = rules.linear_alpha1_beta0(x, weight, relevance, shared_denominator=True)
    torch.testing.assert_close(shared.sum(1), relevance.sum(1))
    separate = rules.linear_alpha1_beta0(x, weight, relevance, shared_denominator=False)
    # inputs of both signs: positive and negative parts each receive the whole relevance
    torch.testing.assert_close(separate.sum(1), 2 * relevance.sum(1))


@pytest.mark.parametrize("exact", [True, False])
def test_residual_rule_conserves_per_sample(exact):
    torch.manual_seed(0)
    a, b, relevance = torch.randn(3, 5, 4), torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    r_a, r_b = rules.add(a, b, relevance, rescale=True, exact=exact)
    torch.testing.assert_close((r_a + r_b).sum(dim=(1, 2)), relevance.sum(dim=(1, 2)))
    # shares follow |sum|: each sample on its own, so a batch equals its images one by one
    for i in range(3):
        single = rules.add(a[i : i + 1], b[i : i + 1], relevance[i : i + 1], rescale=True, exact=exact)
        torch.testing.assert_close(single[0][0], r_a[i])
        torch.testing.assert_close(single[1][0], r_b[i])


@pytest.mark.parametrize("exact", [True, False])
def test_matmul_rule_halves(exact):
    torch.manual_seed(0)
    u, v = torch.rand(2, 3, 4), torch.rand(2, 4, 5)
    relevance = torch.rand(2, 3, 5)
    r_u, r_v = rules.matmul_halved(u, v, relevance, exact=exact)
    torch.testing.assert_close(r_u.sum(dim=(1, 2)), relevance.sum(dim=(1, 2)) / 2)
    torch.testing.assert_close(r_v.sum(dim=(1, 2)), relevance.sum(dim=(1, 2)) / 2)


def plain_rule(monkeypatch, compute):
    """`compute()` with the matmul rule's bands switched off (the rule over whole matrices)."""
    with monkeypatch.context() as patched:
        patched.setattr(rules, "BANDS", 1)
        return compute()


@pytest.mark.parametrize("exact", [True, False])
def test_causal_products_run_in_bands_with_the_same_shares(monkeypatch, exact):
    """A causal attention's products (relevance zero above the diagonal at `q k^T`, probabilities zero above it in
    `A v`) skip the blocks above the diagonal: the shares of the whole-matrix rule, to float64 rounding; an
    attention that is not causal gets the whole-matrix rule."""
    torch.manual_seed(0)
    length, width = 2 * rules.MIN_BAND_ROWS + 5, 8
    q, k = torch.randn(2, 3, length, width, dtype=torch.float64), torch.randn(2, 3, length, width, dtype=torch.float64)
    at_scores = torch.randn(2, 3, length, length, dtype=torch.float64).tril()
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    probabilities = torch.softmax(torch.randn(2, 3, length, length, dtype=torch.float64) + causal, -1)
    v, at_context = torch.randn(2, 3, length, width, dtype=torch.float64), torch.randn(2, 3, length, width, dtype=torch.float64)
    for u, w, relevance in ((q, k.transpose(-2, -1), at_scores), (probabilities, v, at_context)):
        assert rules.causal_bands(u, relevance) is not None
        banded = rules.matmul_halved(u, w, relevance, exact=exact)
        whole = plain_rule(monkeypatch, lambda: rules.matmul_halved(u, w, relevance, exact=exact))
        for found, expected in zip(banded, whole):
            assert (found - expected).abs().max() <= 1e-13 * expected.abs().max()
    assert rules.causal_bands(torch.randn(1, 2, length, length), torch.randn(1, 2, length, width)) is None
    assert rules.causal_bands(q[..., :10, :], at_scores[..., :10, :10]) is None  # too few rows to band
    assert rules.causal_bands(q.to("meta"), at_scores.to("meta")) is None  # off the CPU: whole matrices


def test_causal_products_gradients_run_in_bands_equal_to_autograd():
    """The explicit pass's gradient of an attention product (`matmul_gradient`) is autograd's: in bands where the
    gradient at `q k^T` or the probabilities of `A v` are zero above the diagonal (the probabilities' own gradient
    whole), whole otherwise, and only for the factors that need it."""
    torch.manual_seed(0)
    length, width = 2 * rules.MIN_BAND_ROWS + 7, 8
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    q, k = torch.randn(2, 3, length, width, dtype=torch.float64), torch.randn(2, 3, length, width, dtype=torch.float64)
    at_scores = torch.randn(2, 3, length, length, dtype=torch.float64).tril()
    probabilities = torch.softmax(torch.randn(2, 3, length, length, dtype=torch.float64) + causal, -1)
    v, at_context = torch.randn(2, 3, length, width, dtype=torch.float64), torch.randn(2, 3, length, width, dtype=torch.float64)
    full = torch.randn(2, 3, length, length, dtype=torch.float64)
    for u, w, grad in ((q, k.transpose(-2, -1), at_scores), (probabilities, v, at_context), (full, v, at_context)):
        u_leaf, w_leaf = u.clone().requires_grad_(True), w.clone().requires_grad_(True)
        expected = torch.autograd.grad(u_leaf @ w_leaf, [u_leaf, w_leaf], grad)
        for wanted in ((True, True), (True, False), (False, True)):
            found = rules.matmul_gradient(u, w, grad, wanted)
            for one, reference, need in zip(found, expected, wanted):
                if not need:
                    assert one is None
                    continue
                assert one.shape == reference.shape
                assert (one - reference).abs().max() <= 1e-13 * reference.abs().max()


def test_attribution_matrix_made_in_bands_of_rows():
    """A block's `E_h (F R)^+` made `ATTRIBUTION_ROWS` rows at a time equals the whole product's."""
    torch.manual_seed(0)
    rows = 2 * propagation.ATTRIBUTION_ROWS + 3
    factor, relevance = torch.randn(2, 3, rows, rows, dtype=torch.float64), torch.randn(2, 3, rows, rows, dtype=torch.float64)
    assert torch.equal(propagation.attribution_matrix(factor, relevance), (factor * relevance).clamp(min=0).mean(1))


def test_a_heads_rule_runs_at_its_explained_outputs_only():
    """A head (one row per input) read at one output: the Linear rule on that output's weights alone gives the shares
    of the rule on every output."""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    relevance = torch.zeros(2, 40, dtype=torch.float64)
    relevance[0, 3], relevance[1, 7] = 1.0, 2.0
    assert rules.live_columns(relevance).tolist() == [3, 7]
    for shared in (True, False):
        found = rules.linear_alpha1_beta0(x, weight, relevance, shared)
        expected = rules.direct_rule(x, rules.sign_parts(weight), relevance, shared)
        assert (found - expected).abs().max() <= 1e-13 * expected.abs().max()


def test_banded_rules_give_a_decoders_maps(monkeypatch):
    """On a tiny causal decoder, transformer attribution and LRP with every attention product in bands give the
    maps of the whole-matrix rule (float64)."""
    from language_models import build

    model = build("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    monkeypatch.setattr(rules, "MIN_BAND_ROWS", 2)
    for method in ("transformer_attribution", "lrp"):
        banded = relevancy.explain(model, inputs, method=method).scores
        whole = plain_rule(monkeypatch, lambda: relevancy.explain(model, inputs, method=method).scores)
        assert (banded - whole).abs().max() <= 1e-13 * whole.abs().max()


def test_safe_divide_matches_the_reference_stabiliser():
    a = torch.tensor([1.0, 1.0, 1.0, 1.0])
    b = torch.tensor([2.0, -2.0, 0.0, 1e-12])
    out = rules.safe_divide(a, b)
    assert out[0] == 1 / (2 + 1e-9) and out[1] == 1 / (-2 + 1e-9) and out[2] == 0
    assert torch.isfinite(out).all()


def test_stable_division_holds_only_cancelling_sums_at_the_floor():
    a = torch.tensor([3.0, 1.0, -1.0, 0.0])
    b = torch.tensor([1.0, -0.9999, 0.9999, 0.0])
    signed, unsigned = rules.stable_quotients(torch.ones(4), a + b, a.abs() + b.abs())
    floor = rules.RELATIVE_FLOOR * 1.9999
    assert signed[0] == 1 / 4 and unsigned[0] == 0  # no cancellation: the plain quotient
    torch.testing.assert_close(signed[1:3], torch.tensor([1 / floor, -1 / floor]))  # the sign of the sum is kept
    assert signed[3] == 0 and unsigned[3] == 0
    shares = a * signed + a.abs() * unsigned + b * signed + b.abs() * unsigned
    torch.testing.assert_close(shares, torch.tensor([1.0, 1.0, 1.0, 0.0]))  # conserved, cancelling or not


def test_stable_rules_conserve_where_sums_cancel():
    a = torch.tensor([[1.0, 2.0]])
    r_a, r_b = rules.add(a, -a + 1e-6, torch.ones(1, 2), rescale=False, exact=False)
    torch.testing.assert_close(r_a + r_b, torch.ones(1, 2))
    assert (r_a.abs() < 1 / rules.RELATIVE_FLOOR).all()
    u, v = torch.tensor([[[1.0, -1.0]]]), torch.tensor([[[1.0], [1.0 + 1e-6]]])  # u @ v = -1e-6
    r_u, r_v = rules.matmul_halved(u, v, torch.ones(1, 1, 1), exact=False)
    torch.testing.assert_close(r_u.sum() + r_v.sum(), torch.tensor(1.0))


def test_pixel_rule_forms_agree():
    """The default z^B computes the same sums as the reference's form, without its cancellation."""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, 4, 4, dtype=torch.float64)
    relevance = torch.rand(2, 4, 2, 2, dtype=torch.float64)
    exact = rules.conv_zb(x, weight, relevance, (4, 4), (0, 0), exact=True)
    stable = rules.conv_zb(x, weight, relevance, (4, 4), (0, 0), exact=False)
    torch.testing.assert_close(stable, exact, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(stable.sum(), relevance.sum())


@pytest.mark.parametrize("layer", ["attn_layer", "mlp_layer"])
def test_gates_keep_the_relevance_with_the_value(layer):
    """Gated attention and SwiGLU: the gating product passes all relevance to the value (the gate rule), so the
    paper's rules still conserve 1 from the logit to the last block's input; the gate's branch receives none."""
    from family_cases import GatedAttention
    from timm.layers import SwiGLU

    model = tiny_vit(**{layer: GatedAttention if layer == "attn_layer" else SwiGLU}).double()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    explanation = relevancy.explain(model, images, method="partial_lrp", rules="paper", exact=True)
    assert torch.allclose(explanation.relevance_total, torch.ones(2, dtype=torch.float64), atol=1e-6)
    gate_values = torch.rand(2, 3, dtype=torch.float64)
    value, gate_share = engine.gate_rule(engine.Session(PAPER), (torch.randn(2, 3), gate_values), None, torch.ones(2, 3))
    assert torch.equal(value, torch.ones(2, 3)) and torch.equal(gate_share, torch.zeros(2, 3))


def test_dinov2_swiglu_feed_forwards_conserve_with_the_gate_rule():
    from hf_vit_models import tiny_dinov2_swiglu

    images = torch.randn(2, 3, 42, 42, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    explanation = relevancy.explain(tiny_dinov2_swiglu(torch.float64), images, method="partial_lrp", rules="paper", exact=True)
    assert torch.allclose(explanation.relevance_total, torch.ones(2, dtype=torch.float64), atol=1e-6)


def test_a_rule_set_is_a_value_the_session_reads_for_every_operation_kind():
    """A rule set with another softmax rule is used by every attention of the family, without touching its map."""
    import dataclasses

    calls = []

    def counting_softmax(session, inputs, output, relevance):
        calls.append(tuple(output.shape))
        return engine.passthrough_rule(session, inputs, output, relevance)

    counting = dataclasses.replace(PAPER, name="counting", softmax=counting_softmax)
    model, images = tiny_vit(depth=3), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sums = relevance_at_block_inputs(model, images, [0, 1], counting)
    assert calls == [(2, 2, 17, 17)] * 3
    torch.testing.assert_close(sums, relevance_at_block_inputs(model, images, [0, 1], PAPER), atol=0, rtol=0)


def test_the_rules_helpers_give_torchs_numbers():
    """`sign_parts` and `rules.matmul` (bmm on views) are faster forms of the clamps and of `torch.matmul`."""
    torch.manual_seed(0)
    t = torch.randn(40, 30)
    t[0, :3] = torch.tensor([0.0, -0.0, 1e-40])
    positive, negative = rules.sign_parts(t)
    assert torch.equal(positive, t.clamp(min=0)) and torch.equal(negative, t.clamp(max=0))
    u, v = torch.randn(2, 3, 7, 5), torch.randn(2, 3, 6, 5)
    assert torch.equal(rules.matmul(u, v.transpose(-2, -1)), u @ v.transpose(-2, -1))
    assert torch.equal(rules.matmul(u.transpose(-2, -1), u), u.transpose(-2, -1) @ u)
    shared = torch.randn(5, 4)  # broadcast over the batch: torch.matmul itself
    assert torch.equal(rules.matmul(u, shared), u @ shared)
