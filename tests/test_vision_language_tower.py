"""`generic_attention` carried into the vision tower of vision-language decoders (tiny random float64 LLaVA with a Llama
and with a Qwen2 decoder and with a SigLIP tower, Gemma 3, Idefics3, PaliGemma 1 and 2, InternVL of `vlm_models.py`), equal to the ICCV'21 rule
computed naively: the full relevance matrices built with plain torch from the attentions and gradients of the model's
own eager forward, the decoder's readout row at the image's tokens laid on the tower's tokens by hand and multiplied
through the tower's matrix; padded batches equal each row alone; the model unchanged, also after an error."""
from __future__ import annotations

import copy

import pytest
import torch
from test_model_unchanged import assert_same, assert_unchanged_by_a_failure, snapshot
from vlm_models import EXTRA, FAMILIES, IMAGE_TOKEN, SIDE, alone, build, inputs, own_types

import relevancy
from relevancy.families import adapter_for

MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    """The family's tiny model after one forward of its own (transformers adds its output-recording hooks then)."""
    if family not in MODELS:
        MODELS[family] = build(family)
        batch = inputs(family, lengths=(2,))
        with torch.no_grad():
            MODELS[family](**{**batch, **own_types(family, batch["input_ids"], batch)})
    return MODELS[family]


def rule(attentions: list[torch.Tensor], gradients: list[torch.Tensor]) -> torch.Tensor:
    """`R = I; R = R + E_h (G * A)^+ @ R` over the layers, the full `(T, T)` matrix of one row."""
    size = attentions[0].shape[-1]
    relevance = torch.eye(size, dtype=torch.float64)
    for attention, gradient in zip(attentions, gradients):
        relevance = relevance + (gradient * attention)[0].clamp(min=0).mean(0) @ relevance
    return relevance


def naive(family: str, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(text scores (T,), patch scores (4, 4))` of one unpadded row, from the model's own eager forward."""
    model = copy.deepcopy(model_of(family))
    model.set_attn_implementation("eager")
    adapter = adapter_for(model)
    tower = [getattr(layer, adapter.vision.residual.attention) for layer in adapter.vision.tower_layers(model)]  # InternViT's `attention`
    found: dict[str, list[torch.Tensor]] = {"tower": [], "decoder": []}
    hooks = [attention.register_forward_hook(lambda _m, _i, out, key=key: found[key].append(out[1]))
             for key, attentions in (("tower", tower), ("decoder", [block.self_attn for block in adapter.blocks])) for attention in attentions]
    ids = row["input_ids"]
    logit = model(**{**row, **own_types(family, ids, row)}).logits[0, -1, target]
    for hook in hooks:
        hook.remove()
    attentions = found["tower"] + found["decoder"]
    gradients = [torch.zeros_like(a) if g is None else g  # LLaVA's last tower layer is read by nothing
                 for a, g in zip(attentions, torch.autograd.grad(logit, attentions, allow_unused=True))]
    layers = len(found["tower"])
    decoder = rule(found["decoder"], gradients[layers:])[-1]  # the last token's row
    image = ids[0] == IMAGE_TOKEN
    tokens = decoder[image]
    if family == "llava":  # the second-to-last layer's patch tokens, [CLS] cropped
        entering, depths = torch.cat([torch.zeros(1, dtype=torch.float64), tokens]), [1]
    elif family == "llava_full":  # both layers side by side, [CLS] kept: v R_2 + v R_1
        entering, depths = tokens, [2, 1]
    elif family in ("llava_siglip", "paligemma", "paligemma2"):  # the last layer's patch tokens, all kept: a SigLIP tower has no [CLS]
        entering, depths = tokens, [layers]
    else:  # each of the 2 x 2 tokens made of its 2 x 2 block of patches, in equal shares (InternViT's [CLS] cropped, 0)
        entering, depths = tokens.view(2, 2).repeat_interleave(2, 0).repeat_interleave(2, 1).flatten() / 4, [layers]
        entering = torch.cat([torch.zeros(int(family.startswith("internvl")), dtype=torch.float64), entering])
    patches = sum(entering @ rule(found["tower"][:d], gradients[:d]) for d in depths)
    return decoder.masked_fill(image, 0), patches[-16:].view(4, 4)


@pytest.mark.parametrize("family", [*FAMILIES, *EXTRA])
def test_generic_attention_through_the_tower_equals_the_naive_rule(family):
    """Each row of a batch padded right and left equals the naive matrices on the row alone, text and patches;
    through_tower; the model handed back as it was."""
    model = model_of(family)
    before = snapshot(model)
    targets = [5, 7]
    for side in ("right", "left"):
        batch = inputs(family, side)
        explanation = relevancy.explain(model, batch, method="generic_attention", target=targets)
        assert explanation.image_scores.shape == (2, 4, 4) and explanation.scores.shape == batch["input_ids"].shape
        assert explanation.through_tower is True and explanation.pixel_scores is None
        assert explanation.heatmap().shape == (2, SIDE, SIDE) and bool((explanation.image_scores > 0).any())
        for row in range(2):
            text, image = naive(family, alone(batch, row), targets[row])
            keep = batch["attention_mask"][row].bool()
            assert torch.allclose(explanation.image_scores[row], image, atol=1e-10), f"{side} row {row}"
            assert torch.allclose(explanation.scores[row, keep], text, atol=1e-10), f"{side} row {row}"
            assert bool((explanation.scores[row, ~keep] == 0).all())
    assert_same(before, snapshot(model))


def test_generic_attention_refusals_and_failures_leave_the_model_unchanged(monkeypatch):
    """checkpoint=True is refused by name (the tower's relevance needs the whole graph); an error inside the
    backward leaves the model as it was."""
    model, batch = model_of("llava_full"), inputs("llava_full")
    before = snapshot(model)
    with pytest.raises(ValueError, match="explain without checkpoint"):
        relevancy.explain(model, batch, method="generic_attention", checkpoint=True)
    assert_unchanged_by_a_failure(monkeypatch, model, batch, "generic_attention", "relevancy.methods.gradients.carried_into",
                                  before=before)
