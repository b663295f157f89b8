"""Mistral 3 (a tiny random float64 `Mistral3ForConditionalGeneration` of `vlm_models.py`: a Pixtral tower, the merged
projector, a Mistral decoder; a 16 x 24 image, 4 x 6 patches merged 2 x 2 into 2 x 3 placeholders with the
processor's [IMG_BREAK] and [IMG_END] among them): taken by its layout; AttnLRP and CP-LRP equal to lxt's rules
composed over the whole model, text and pixels, single and padded both ways (tests/golden/vlm_lxt_reference.pt);
input x gradient equal to autograd through the model's own forward; the image's own patch grid and the merge undone;
token ablation equal to a hand loop; the model unchanged after a call and after a failure; what is refused, by name.
(A batch equal to its rows alone, every method run or refused by name: the family contract, `family_cases.py`.)"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from test_vision_language import assert_equals_lxt
from vlm_models import IMAGE_TOKEN, MERGE, PATCH, SIZED_IMAGE, alone, build, checksum, embedding_leaf, inputs

import relevancy
from relevancy.families import Mistral3VisionLanguageAdapter, adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm.adapter import last_real

GOLDEN = torch.load(Path(__file__).parent / "golden" / "vlm_lxt_reference.pt", weights_only=False)
GRID = (SIZED_IMAGE[0] // PATCH, SIZED_IMAGE[1] // PATCH)  # the image's 4 x 6 patches
model_of = functools.lru_cache(maxsize=None)(lambda family="mistral3": build(family))


def own_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], pixels: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own forward from the batch (its `pixels` where given), positions counting real tokens (as under
    left padding the reference's and relevancy's do): the logits `(B, T, V)`."""
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return model(**{**batch, **({} if pixels is None else {"pixel_values": pixels})}, position_ids=positions, use_cache=False).logits


def test_the_class_is_taken_by_its_layout():
    """By the Mistral 3 layout (Pixtral tower, merged projector) and the decoder layouts' Llama map (Mistral's is
    Llama's); the reference's model the same weights as lxt's."""
    model = model_of()
    adapter = adapter_for(model)
    assert type(adapter) is Mistral3VisionLanguageAdapter and adapter.vision.name == "mistral3" and adapter.layout.name == "llama"
    assert checksum(model) == GOLDEN["models"]["mistral3"]["checksum"], "transformers made other weights; rerun benchmarks/vlm_lxt_reference.py --only mistral3"


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_equals_lxt(method):
    """Text and pixel maps within 1e-6 of each map's maximum (4e-7 measured: Pixtral's and Mistral's RMSNorms, and
    lxt's rule for them, compute in float32 in a float64 model, relevancy's rule in float64), single and padded right
    and left; lxt's targets; relevance_total the share of the logit reaching text and pixels; not input x gradient."""
    entry = GOLDEN["models"]["mistral3"]
    assert_equals_lxt(model_of(), entry, method, "mistral3")
    plain = relevancy.explain(model_of(), entry["inputs"]["single0"], method="input_x_gradient")
    assert not torch.allclose(plain.pixel_scores, entry[method]["single0"]["image"], rtol=1e-3)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["mistral3", "pixtral"])
def test_input_x_gradient_is_autograd_through_the_models_own_forward(family, side):
    """The model's own forward from its own inputs: its logits are the explanation's (1e-12), the target's logit
    differentiated at the token embeddings and the pixels gives relevancy's maps to 1e-10 (Pixtral-12B's layout
    too)."""
    model, batch = model_of(family), inputs(family, side)
    explanation = relevancy.explain(model, batch, method="input_x_gradient", target=[7, 9])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pixels = batch["pixel_values"].clone().requires_grad_(True)
    with embedding_leaf(model) as leaf:
        logits = own_logits(model, batch, pixels)
    last = last_real(mask)
    assert_close_to(explanation.logits, logits[torch.arange(2), last].detach(), "the model's own logits", 1e-12)
    logits[torch.arange(2), last, torch.tensor([7, 9])].sum().backward()
    text = (leaf["text"] * leaf["text"].grad).sum(-1)
    assert_close_to(explanation.scores.masked_fill(ids == IMAGE_TOKEN, 0), text.masked_fill(ids == IMAGE_TOKEN, 0), "text", 1e-10)
    assert_close_to(explanation.pixel_scores, (pixels * pixels.grad).sum(1), "pixels", 1e-10)


def test_the_image_grid_is_the_images_own_with_the_merge_undone():
    """`image_scores` on the image's 4 x 6 patch grid: the pixel methods' each patch's pixels summed; the decoder's
    attention methods' each merged token's score shared equally by its 2 x 2 patches (sums kept), tokens row-major on
    the merged grid (the patch merger's unfold); TAM on the merged 2 x 3 token grid."""
    model, batch = model_of(), inputs("mistral3")
    lrp = relevancy.explain(model, batch, method="attnlrp")
    assert lrp.image_scores.shape == (2, *GRID) and lrp.pixel_scores.shape == (2, *SIZED_IMAGE)
    assert lrp.image_size == SIZED_IMAGE and lrp.heatmap().shape == (2, *SIZED_IMAGE)
    assert torch.allclose(lrp.image_scores, lrp.pixel_scores.unflatten(2, (GRID[1], PATCH)).unflatten(1, (GRID[0], PATCH)).sum((2, 4)))
    attention = relevancy.explain(model, batch, method="raw_attention")
    assert not attention.through_tower and attention.pixel_scores is None
    before = model.config.get_text_config()._attn_implementation
    model.config.get_text_config()._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(**batch, output_attentions=True, use_cache=False)
    finally:
        model.config.get_text_config()._attn_implementation = before
    decoder = out.attentions[-1].mean(1)[torch.arange(2), last_real(batch["attention_mask"])]
    tokens = decoder[batch["input_ids"] == IMAGE_TOKEN].view(2, GRID[0] // MERGE, GRID[1] // MERGE)
    assert torch.allclose(attention.image_scores, tokens.repeat_interleave(MERGE, 1).repeat_interleave(MERGE, 2) / MERGE ** 2, atol=1e-12)
    tam = relevancy.explain(model, batch, method="token_activation_map")
    assert tam.image_scores.shape == (2, *GRID)


def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand():
    """Each patch set to 0 (the processor's mean), each text token deleted: a batch padded left, in chunks of 5
    sequences, equal to a hand loop of the model's own forwards on each row alone."""
    model, batch, targets = model_of(), inputs("mistral3", "left"), [5, 7]
    explanation = relevancy.explain(model, batch, method="token_ablation", target=targets, chunk_size=5)
    assert explanation.image_scores.shape == (2, *GRID) and explanation.through_tower and explanation.pixel_scores is None
    assert_ablation_by_hand(model, batch, explanation, targets)


def assert_ablation_by_hand(model: torch.nn.Module, batch: dict[str, torch.Tensor], explanation: object, targets: list[int]) -> None:
    """Token ablation's scores of the `batch` (two rows) for `targets` within 1e-10 of the model's own forwards on
    each row alone, each text token deleted, each patch of the `GRID` set to 0."""
    with torch.no_grad():
        for row in range(2):
            one = alone(batch, row)
            full = own_logits(model, one)[0, -1, targets[row]]
            ids = one["input_ids"]
            for j in range(ids.shape[1]):
                kept = {**one, "input_ids": torch.cat([ids[:, :j], ids[:, j + 1:]], 1), "attention_mask": torch.ones(1, ids.shape[1] - 1, dtype=torch.long)}
                drop = 0.0 if ids[0, j] == IMAGE_TOKEN else full - own_logits(model, kept)[0, -1, targets[row]]
                assert abs(explanation.scores[row, batch["attention_mask"][row].bool()][j] - drop) < 1e-10
            for r in range(GRID[0]):
                for c in range(GRID[1]):
                    pixels = one["pixel_values"].clone()
                    pixels[..., r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 0
                    drop = full - own_logits(model, one, pixels)[0, -1, targets[row]]
                    assert abs(explanation.image_scores[row, r, c] - drop) < 1e-10, (row, r, c)


def failing_in_the_tower(model: torch.nn.Module, call: Callable[[], object]) -> None:
    """`call()` while the Pixtral tower's second layer raises: its error comes through, the layer restored after."""

    def broken(*args, **kwargs):
        raise RuntimeError("inside the tower")

    layer = model.model.vision_tower.transformer.layers[1]
    layer.forward = broken
    try:
        with pytest.raises(RuntimeError, match="inside the tower"):
            call()
    finally:
        del layer.forward


@pytest.mark.parametrize("family", ["mistral3", "pixtral"])
def test_the_model_is_unchanged_after_a_call_and_after_a_failure(family):
    """Weights, modes, hooks, forwards and the configs' attention as they were after a call, and after a call that
    fails inside the tower (its error comes through); Pixtral-12B's layout too."""
    model = build(family)
    relevancy.explain(model, inputs(family), method="input_x_gradient")  # transformers' own first-run hooks
    before = snapshot(model)
    relevancy.explain(model, inputs(family), method="attnlrp")
    assert_same(before, snapshot(model))
    failing_in_the_tower(model, lambda: relevancy.explain(model, inputs(family), method="cp_lrp"))
    assert_same(before, snapshot(model))


def test_what_is_refused_by_name():
    """Images of different sizes in one batch, a size of no whole merged patches, pixels not of the size, missing
    placeholders, a tower part that fits no part: each a one-line error that says so."""
    model, batch = model_of(), inputs("mistral3")
    with pytest.raises(ValueError, match="different sizes"):
        relevancy.explain(model, {**batch, "image_sizes": torch.tensor([SIZED_IMAGE, (16, 16)])}, method="attnlrp")
    with pytest.raises(ValueError, match="whole merged patches"):
        relevancy.explain(model, {**batch, "image_sizes": torch.tensor([(12, 24)] * 2)}, method="attnlrp")
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, 3, H, W\)"):
        relevancy.explain(model, {**batch, "pixel_values": batch["pixel_values"][..., :16]}, method="attnlrp")
    with pytest.raises(ValueError, match="placeholder tokens"):
        relevancy.explain(model, {**batch, "input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE_TOKEN, 5)}, method="attnlrp")
    odd = build("mistral3")
    odd.model.vision_tower.transformer.layers[1].ffn_norm = torch.nn.LayerNorm(16, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"model\.vision_tower\.transformer\.layers\.1\.ffn_norm"):
        relevancy.explain(odd, batch, method="attnlrp")


@pytest.mark.parametrize("method", ["generic_attention", "transformer_attribution", "lrp"])
def test_a_method_the_family_does_not_offer_is_refused_by_name(method):
    """The tower-token methods (no explicit rule map of the Pixtral tower) and the plain LRP, each named."""
    with pytest.raises(UnsupportedModelError, match=f"'{method}'"):
        relevancy.explain(model_of(), inputs("mistral3"), method=method)
