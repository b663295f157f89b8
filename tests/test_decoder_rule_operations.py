"""The fused gradient rules of the decoders (`lrp.gradient`: RMSNorm, the gated MLP's product, RoPE's rotation) equal
the same rules written as separate autograd steps, and the call's shortcuts (the rotation replaced, the last
layer's MLP at the read positions only) change no map and leave nothing behind. The maps themselves are checked
against lxt's in test_causal_lm.py and test_decoder_families.py."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from language_models import GOLDEN, build
from transformers.models.llama import modeling_llama

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.lrp import gradient


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
    back = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, back, allow_unused=True)


def _leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_(True) for shape in shapes]


def test_rms_norm_is_the_constant_divisor_rule():
    x, = _leaves((2, 5, 8))
    weight = torch.randn(8, dtype=torch.float64)
    composed = weight * gradient.norm_identity(x, torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    fused = gradient.rms_norm(x, weight, 1e-6)
    assert torch.equal(fused, composed)
    assert torch.allclose(_grads(fused, (x,))[0], _grads(composed, (x,))[0], rtol=0, atol=1e-14)


@pytest.mark.parametrize("shares", [(0.5, 0.5), (1.0, None)])  # AttnLRP's, CP-LRP's
def test_gated_product_is_the_identity_rule_times_the_shares(shares):
    g, u = _leaves((2, 5, 8), (2, 5, 8))
    g.detach()[0, 0, :2] = 0.0  # the identity rule's 0 / 0
    composed = gradient.take(gradient.identity_rule(F.silu, g), shares[1]) * gradient.take(u, shares[0])
    fused = gradient.gated(F.silu, g, u, shares)
    assert torch.equal(fused, composed)
    for a, b in zip(_grads(fused, (g, u)), _grads(composed, (g, u))):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=0, atol=1e-14))


def test_rotation_is_llamas_bit_for_bit_with_its_gradient():
    q, k = _leaves((1, 4, 5, 8), (1, 2, 5, 8))
    cos, sin = torch.randn(1, 5, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)
    theirs, ours = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin), gradient.rotated(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(_grads(theirs[0] + 0, (q,)), _grads(ours[0] + 0, (q,))))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(_grads(theirs[1] + 0, (k,)), _grads(ours[1] + 0, (k,))))


def test_the_rotation_is_replaced_during_the_call_only():
    model = build("llama")
    own = modeling_llama.apply_rotary_pos_emb
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(modeling_llama.apply_rotary_pos_emb))
    ids, mask = GOLDEN["inputs"]["left"]
    try:
        relevancy.explain(model, {"input_ids": ids, "attention_mask": mask}, method="attnlrp")
        with pytest.raises((ValueError, TypeError)):  # a token text without a tokenizer: fails inside the relevance pass
            relevancy.explain(model, {"input_ids": ids, "attention_mask": mask}, method="attnlrp", target="x")
    finally:
        handle.remove()
    # the first forwards are the model's own and relevancy's on the probe (`own_forward_problems`), then the relevance pass
    assert any(rotate is not own for rotate in seen) and modeling_llama.apply_rotary_pos_emb is own


@pytest.mark.parametrize("target", [None, relevancy.Contrast(5, 9)])
def test_the_last_mlp_at_the_read_positions_changes_no_map(monkeypatch, target):
    model = build("llama")
    ids, mask = GOLDEN["inputs"]["right"]
    inputs = {"input_ids": ids, "attention_mask": mask}
    shortcut = relevancy.explain(model, inputs, method="attnlrp", target=target)
    monkeypatch.setattr(CausalLMAdapter, "last_mlp_at", lambda self, rows, positions: contextlib.nullcontext())
    whole = relevancy.explain(model, inputs, method="attnlrp", target=target)
    assert torch.allclose(shortcut.scores, whole.scores, rtol=0, atol=1e-12 * float(whole.scores.abs().max()))
    assert torch.allclose(shortcut.logits, whole.logits, rtol=0, atol=1e-12)
