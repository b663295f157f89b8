"""Checks the decoder layouts' tests share (transformer, state-space and hybrid decoders alike): input x gradient
through the model's own forward, a padded batch's rows against each row alone, the model unchanged after a call
and after an exception, a hybrid's attention methods refused naming its layers without attention, a generation's
rows explained as their prefixes."""
from __future__ import annotations

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from test_causal_lm import assert_close_to, batch

import relevancy
from relevancy.families.base import UnsupportedModelError

#: the methods that read attention matrices or run the seeds' explicit pass: refused on a decoder with layers without
#: attention
ATTENTION_METHODS = ("raw_attention", "rollout", "generic_attention", "attention_gradcam", "transformer_attribution", "lrp", "cdam")


def assert_input_x_gradient_is_autograds(model: torch.nn.Module, what: str) -> tuple[relevancy.Explanation, torch.Tensor]:
    """relevancy's input x gradient on `batch("single0")` equals autograd's through the model's own forward from the
    ids at the token embeddings (made a leaf where they are looked up: Falcon-H1 scales the embeddings it looks up,
    not those it is given), summed over the width (1e-10 of the map); `(the explanation, the model's own next-token
    logits)`."""
    ids, mask = batch("single0").values()
    explanation = relevancy.explain(model, batch("single0"), method="input_x_gradient")
    found = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: found.append(out.detach().requires_grad_(True)) or found[-1])
    try:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, -1]
    finally:
        hook.remove()
    (embeddings,) = found
    (gradient,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores, (embeddings * gradient).sum(-1).detach(), f"{what} input x gradient", 1e-10)
    return explanation, logits.detach()


def assert_padded_rows_are_alone(model: torch.nn.Module, method: str, padding: str, tolerance: float, what: str) -> None:
    """Each row of the `padding` ("left", "right") batch explained as the row alone (to `tolerance` of the map), 0 at
    padding."""
    batched = relevancy.explain(model, batch(padding), method=method).scores
    mask = batch(padding)["attention_mask"].bool()
    assert (batched[~mask] == 0).all()
    for row in range(len(mask)):
        single = relevancy.explain(model, batch(f"single{row}"), method=method).scores[0]
        assert_close_to(batched[row][mask[row]], single, f"{what} {method} row {row}", tolerance)


def assert_generation_rows_are_their_prefixes(model: torch.nn.Module, method: str, tolerance: float) -> None:
    """`explain_generation` (3 tokens after `test_generation.PROMPT`, generated with the model's own cache) explains
    each row on the whole sequence: each equals `explain` on its prefix (to `tolerance` of the map), its target the
    generated token."""
    from test_generation import PROMPT, Characters

    tokenizer = Characters()
    result = relevancy.explain_generation(model, tokenizer, PROMPT, max_new_tokens=3, method=method)
    ids, start = torch.tensor([tokenizer(PROMPT)["input_ids"] + result.generated_ids.tolist()]), len(PROMPT)
    for row in range(3):
        alone = relevancy.explain(model, ids[:, :start + row], method=method)
        assert int(alone.target[0]) == int(result.generated_ids[row])
        assert_close_to(result.scores[row, :start + row], alone.scores[0], f"{method} row {row}", tolerance)


def assert_unchanged_after_a_call_and_an_error(model: torch.nn.Module, method: str) -> None:
    """Weights, modes, hooks and forwards as they were after a call on the left-padded batch, and after one whose
    target function raises inside the call."""
    before = snapshot(model)
    relevancy.explain(model, batch("left"), method=method)
    assert_same(before, snapshot(model))

    def failing(logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a failing target")

    with pytest.raises(RuntimeError, match="a failing target"):
        relevancy.explain(model, batch("left"), method=method, target=failing)
    assert_same(before, snapshot(model))


def assert_refused_naming_the_layers(model: torch.nn.Module, method: str, hybrid: str) -> None:
    """`method` refused on `model`, the refusal naming the `hybrid` decoder's layers without attention (a regular
    expression: `qwen3_next: its linear-attention layers 0, 2`)."""
    with pytest.raises(UnsupportedModelError, match=rf"method '{method}' does not apply to the hybrid decoder \({hybrid} have no "
                                                    r"attention matrix\)"):
        relevancy.explain(model, batch("single0"), method=method)
