"""State-space decoders (transformers' Mamba and Mamba-2, tiny random float64 models of `state_space_models.py`) under
MambaLRP's rules: `attnlrp` on Mamba equals MambaLRP's own code (recorded in its venv by
`benchmarks/mamba_lrp_reference.py`), Mamba-2's equals a written-out reference of the stated rules over full
matrices; input x gradient is autograd's through the model's own forward, padded rows are the rows alone, the rules
conserve the logit on bias-free models, the attention methods are refused by name and the model is unchanged after a
call and after an exception."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from decoder_checks import assert_input_x_gradient_is_autograds, assert_padded_rows_are_alone, assert_unchanged_after_a_call_and_an_error
from state_space_models import build
from test_causal_lm import assert_close_to, batch

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm import CausalLMAdapter

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = ("mamba", "mamba2", "falcon_h1")
MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in MODELS:
        MODELS[family] = build(family)
    return MODELS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layouts_rule_the_norms_and_the_mixers(family):
    """Every norm and mixer (Falcon-H1: and its MLP; its attention runs relevancy's attention through the config)."""
    adapter = CausalLMAdapter(model_of(family))
    assert adapter.layout.name == family
    expected = {"mamba": {"MambaRMSNorm", "MambaMixer"}, "mamba2": {"Mamba2RMSNorm", "Mamba2Mixer"},
                "falcon_h1": {"FalconH1RMSNorm", "FalconH1Mixer", "FalconH1MLP"}}[family]
    assert {type(module).__name__ for module, _ in adapter.ruled} == expected


def test_attnlrp_on_mamba_is_mamba_lrps_own():
    """MambaLRP's code (its slow path, its casts to float32 kept in float64 for the recording) gives relevancy's map to
    float64's precision with its stabiliser at 0 (the rule as stated: `f(x) / x`), and within its 1e-6 stabiliser's
    effect as published."""
    reference = torch.load(GOLDEN / "mamba_lrp_reference.pt", weights_only=True)
    model = build("mamba")
    model.load_state_dict(reference["weights"])
    prompts = reference["prompts"]
    explanation = relevancy.explain(model, {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)},
                                    method="attnlrp", target=reference["targets"])
    assert_close_to(explanation.scores, reference["exact"], "MambaLRP (no stabiliser)", 1e-12)
    assert_close_to(explanation.scores, reference["published"], "MambaLRP as published", 1e-5)


def _written_out_mamba2(model: torch.nn.Module, ids: torch.Tensor, target: int, cp: bool) -> torch.Tensor:
    """Mamba-2 under the stated rules, written out from the model's weights with the scan as full matrices: per head
    `y = M x + D x`, `M[l, s] = (C_l . B_s) exp(sum_{s < k <= l} dt_k A) dt_s` for `s <= l`, with `dt`, `B`, `C` (hence
    `M`) detached; the SiLU after the convolution and in the gate under the identity rule (`x * (silu(x) / x)`
    detached); the gate product `y * silu(z)` half to each factor (AttnLRP) or with the gate detached (CP-LRP); the
    norms' divisors detached. Input x gradient of the target's logit at the last position, summed over the width."""
    def identity(fn, x):
        return x * (fn(x) / x).detach()

    def rms(norm, x):
        return norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()

    embeddings = model.backbone.embeddings(ids).detach().requires_grad_(True)
    h = embeddings
    length = ids.shape[1]
    for layer in model.backbone.layers:
        mixer = layer.mixer
        inner, grouped = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
        z, xbc, dt = F.linear(rms(layer.norm, h), mixer.in_proj.weight).split([inner, mixer.conv_dim, mixer.num_heads], -1)
        kernel = mixer.conv1d.weight[:, 0]  # (channels, k): out_t = sum_j w_j x_{t - k + 1 + j} + bias
        padded = F.pad(xbc, (0, 0, kernel.shape[1] - 1, 0))
        xbc = sum(kernel[:, j] * padded[:, j:j + length] for j in range(kernel.shape[1])) + mixer.conv1d.bias
        x, b, c = identity(F.silu, xbc).split([inner, grouped, grouped], -1)
        dt = F.softplus(dt + mixer.dt_bias).detach()  # (1, T, heads)
        a = -torch.exp(mixer.A_log)
        heads, per_group = mixer.num_heads, mixer.num_heads // mixer.n_groups
        b, c = (t.detach().view(1, length, mixer.n_groups, -1).repeat_interleave(per_group, 2) for t in (b, c))
        x = x.view(1, length, heads, mixer.head_dim)
        cumulative = torch.cumsum(dt * a, 1)[0]  # (T, heads)
        causal = torch.ones(length, length, dtype=torch.bool).tril()[..., None]
        decay = torch.exp(cumulative[:, None] - cumulative[None, :]).masked_fill(~causal, 0.0)  # (T, T, heads)
        matrix = torch.einsum("lhn,shn->lsh", c[0], b[0]) * decay * dt[0][None]  # (T, T, heads)
        y = torch.einsum("lsh,shp->lhp", matrix, x[0])[None] + x * mixer.D[:, None]
        y = y.reshape(1, length, inner)
        gate = identity(F.silu, z)
        gate = gate.detach() if cp else gate
        product = y * gate
        product = product if cp else product / 2 + (product / 2).detach()
        groups = product.unflatten(-1, (-1, mixer.norm.group_size))
        normed = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon).detach()).flatten(-2)
        h = h + F.linear(mixer.norm.weight * normed, mixer.out_proj.weight)
    logit = F.linear(rms(model.backbone.norm_f, h)[:, -1], model.lm_head.weight)[0, target]
    (gradient,) = torch.autograd.grad(logit, embeddings)
    return (embeddings * gradient).sum(-1)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_mamba2_equals_the_written_out_rules(method):
    model = model_of("mamba2")
    ids = batch("single0")["input_ids"]
    explanation = relevancy.explain(model, {"input_ids": ids}, method=method, target=7)
    assert_close_to(explanation.scores, _written_out_mamba2(model, ids, 7, cp=method == "cp_lrp").detach(), f"Mamba-2 {method}", 1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_input_x_gradient_is_autograds_through_the_models_own_forward(family):
    assert_input_x_gradient_is_autograds(model_of(family), family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_the_rules_explain_the_models_own_logit(family, method):
    """The explained logits are the model's own (transformers computes its norms, parts of its scan and its logits in
    float32 even for a float64 model, hence 1e-6); the rules change the map."""
    model = model_of(family)
    explanation = relevancy.explain(model, batch("single0"), method=method)
    with torch.no_grad():
        own = model(**batch("single0"), use_cache=False).logits[:, -1]
    assert torch.isfinite(explanation.scores).all()
    assert_close_to(explanation.logits, own.double(), f"{family} {method} logits", 1e-6)
    plain = relevancy.explain(model, batch("single0"), method="input_x_gradient").scores
    assert not torch.allclose(explanation.scores, plain, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_padded_row_is_the_row_alone(family, method, padding):
    """The mixers set padding to 0 before and after the convolution: a left-padded row's recurrence starts from the
    same zero state as the row alone. Input x gradient runs Mamba-2's own scan (Falcon-H1's too), which transformers
    computes in float32 in chunks of positions: a left-padded row's chunks start elsewhere, hence 1e-6 there."""
    tolerance = 1e-6 if family != "mamba" and method == "input_x_gradient" else 1e-10
    assert_padded_rows_are_alone(model_of(family), method, padding, tolerance, family)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_the_rules_conserve_the_logit_without_biases(family, method):
    """No bias anywhere (the convolution's off): the embeddings get the whole explained logit on every row; the step's
    bias feeds `dt` only, which is held constant."""
    model = build(family, use_conv_bias=False)
    explanation = relevancy.explain(model, batch("left"), method=method)
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-8)


@pytest.mark.parametrize("options", [{}, {"mamba_norm_before_gate": True}, {"mamba_rms_norm": False}])
def test_falcon_h1_conserves_under_cp_lrp_without_biases(options):
    """Falcon-H1 without the convolution's bias, its norm gating before or after it or absent: CP-LRP (attention's
    probabilities constant, the values taking all) conserves the logit through both branches and every multiplier."""
    model = build("falcon_h1", mamba_conv_bias=False, **options)
    explanation = relevancy.explain(model, batch("left"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-8)


@pytest.mark.parametrize("method", ["raw_attention", "rollout", "generic_attention", "transformer_attribution", "lrp", "cdam"])
def test_the_attention_methods_are_refused_by_name(method):
    """Mamba has no attention; Falcon-H1's attention maps would miss what its mixers mix beside it."""
    with pytest.raises(UnsupportedModelError, match=rf"method '{method}' does not apply to the mamba decoder \(state-space mixers, no attention layers\)"):
        relevancy.explain(model_of("mamba"), batch("single0"), method=method)
    with pytest.raises(UnsupportedModelError, match=rf"method '{method}' does not apply to the falcon_h1 decoder \(a state-space mixer beside attention"):
        relevancy.explain(model_of("falcon_h1"), batch("single0"), method=method)


def test_latent_heads_are_refused_layers_are_read():
    """Heads asked for by name are refused; `latent=True` reads all the model has (its layers)."""
    model = model_of("mamba2")
    with pytest.raises(ValueError, match="no attention layers"):
        relevancy.explain(model, batch("single0"), method="attnlrp", latent="heads")
    latent = relevancy.explain(model, batch("single0"), method="attnlrp", latent=True).latent
    assert latent.heads is None and latent.layers.shape[0] == 3 and latent.neurons is not None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "token_ablation"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(family, method):
    assert_unchanged_after_a_call_and_an_error(build(family), method)


def test_the_chunked_scan_is_the_recurrence():
    """Mamba-2's scan chunk by chunk (several chunks and a padded last one) equals the recurrence one position at a
    time, `s_t = exp(dt_t a) s_{t-1} + dt_t x_t b_t^T`, `y_t = s_t c_t`, in float64."""
    from relevancy.lrp.recurrence import head_scan

    generator = torch.Generator().manual_seed(0)
    x, b, c = (torch.randn(2, 11, 3, size, generator=generator, dtype=torch.float64) for size in (4, 5, 5))
    dt = torch.rand(2, 11, 3, generator=generator, dtype=torch.float64)
    a = -torch.rand(3, generator=generator, dtype=torch.float64) * 2
    state, expected = torch.zeros(2, 3, 4, 5, dtype=torch.float64), []
    for t in range(11):
        state = torch.exp(dt[:, t] * a)[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None]
        expected.append((state * c[:, t, :, None]).sum(-1))
    assert torch.allclose(head_scan(x, dt, a, b, c, chunk=4), torch.stack(expected, 1), atol=1e-13, rtol=0)
