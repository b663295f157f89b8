"""Vision-language decoders (tiny random float64 LLaVA with a Llama and with a Qwen2 decoder, Gemma 3, Idefics3,
PaliGemma 1 and 2, InternVL with a Qwen2 and with a Llama decoder of `vlm_models.py`): AttnLRP and CP-LRP equal to lxt's rules composed over the whole model, text and pixels, single
and padded both ways (tests/golden/vlm_lxt_reference.pt, made by benchmarks/vlm_lxt_reference.py); the result's
shapes and fields; the attention methods on the decoder's attention, the image's tokens laid back on the patch
grid (LLaVA's by hand); what is refused, by name."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import copy

import pytest
import torch
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from vlm_models import FAMILIES, IMAGE_TOKEN, alone, build, checksum, inputs, own_types

import relevancy
from relevancy.families.base import UnsupportedModelError

GOLDEN = torch.load(Path(__file__).parent / "golden" / "vlm_lxt_reference.pt", weights_only=False)
MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in MODELS:
        MODELS[family] = build(family)
    return MODELS[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_models_are_lxts(family):
    """The same seed and config give the weights lxt explained."""
    assert checksum(model_of(family)) == GOLDEN["models"][family]["checksum"], (
        f"{family}: transformers {GOLDEN['transformers']} made other weights from the same seed; rerun benchmarks/vlm_lxt_reference.py")


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lrp_equals_lxt(family, method):
    """Text and pixel maps within 1e-6 of each map's maximum (lxt's identity rule divides by `x + 1e-10`), single
    and padded right and left; the targets lxt's; relevance_total the share of the logit reaching text and pixels."""
    entry = GOLDEN["models"][family]
    assert_equals_lxt(model_of(family), entry, method, family)
    plain = relevancy.explain(model_of(family), entry["inputs"]["single0"], method="input_x_gradient")
    assert not torch.allclose(plain.pixel_scores, entry[method]["single0"]["image"], rtol=1e-3)


def assert_equals_lxt(model: torch.nn.Module, entry: dict, method: str, family: str,
                      on_pixels: Callable[[torch.Tensor], torch.Tensor] = lambda image: image, text_tolerance: float = 1e-6) -> None:
    """Each of a reference `entry`'s batches explained by `method`: lxt's targets, text and pixel maps (the
    reference's image map laid on the pixels by `on_pixels`) within 1e-6 of each map's maximum (the text map within
    `text_tolerance`), relevance_total the share of the logit reaching text and pixels."""
    for name, batch in entry["inputs"].items():
        expected = entry[method][name]
        explanation = relevancy.explain(model, batch, method=method)
        assert torch.equal(explanation.target, entry["targets"][name])
        assert_close_to(explanation.scores, expected["text"], f"{family} {method} {name} text", text_tolerance)
        assert_close_to(explanation.pixel_scores, on_pixels(expected["image"]), f"{family} {method} {name} pixels")
        explained = explanation.logits.gather(1, explanation.target[:, None])[:, 0]
        total = explanation.scores.sum(1) + explanation.pixel_scores.flatten(1).sum(1)
        assert torch.allclose(explanation.relevance_total * explained, total)


def test_result_shapes_and_parts():
    """`scores` (B, T) with 0 at the image's placeholders, `image_scores` on the tower's 4 x 4 patch grid (each
    patch's pixels summed), `heatmap()` at the image's 16 x 16 pixels; a token text as target with tokenizer=."""
    batch = inputs("llava")
    explanation = relevancy.explain(model_of("llava"), batch, method="attnlrp", target=[7, 9])
    assert explanation.scores.shape == batch["input_ids"].shape
    assert explanation.image_scores.shape == (2, 4, 4) and explanation.heatmap().shape == (2, 16, 16)
    assert bool((explanation.scores[batch["input_ids"] == IMAGE_TOKEN] == 0).all())
    assert torch.allclose(explanation.image_scores.sum((1, 2)), explanation.pixel_scores.sum((1, 2)))
    assert explanation.target.tolist() == [7, 9] and len(explanation.tokens) == 2
    assert set(explanation.parts) == {"text", "image"}
    assert bool(((explanation.image_share > 0) & (explanation.image_share < 1)).all())
    contrast = relevancy.explain(model_of("llava"), batch, method="attnlrp", target=relevancy.Contrast(7, 9))
    one = relevancy.explain(model_of("llava"), batch, method="attnlrp", target=9)
    seven = relevancy.explain(model_of("llava"), batch, method="attnlrp", target=7)
    assert torch.allclose(contrast.pixel_scores, seven.pixel_scores - one.pixel_scores)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_gives_the_same_maps(family, monkeypatch):
    """checkpoint=True runs the tower's and the decoder's layers again in the backward: the same maps, also where
    autograd runs the backward, and with it the recomputation, in a thread of its own (as on CUDA): the rule
    forwards and the tower's switched attention act for the call there."""
    from test_checkpoint import backward_in_a_worker_thread

    batch = inputs(family)
    plain = relevancy.explain(model_of(family), batch, method="attnlrp")
    again = relevancy.explain(model_of(family), batch, method="attnlrp", checkpoint=True)
    ran_in = backward_in_a_worker_thread(monkeypatch)
    elsewhere = relevancy.explain(model_of(family), batch, method="attnlrp", checkpoint=True)
    assert ran_in and set(ran_in) == {"autograd-worker"}
    for result in (again, elsewhere):
        assert torch.allclose(plain.pixel_scores, result.pixel_scores, atol=1e-12) and torch.allclose(plain.scores, result.scores, atol=1e-12)


ATTENTION_METHODS = ["raw_attention", "rollout", "attention_gradcam"]  # generic_attention: tests/test_vision_language_tower.py


def attention_implementations(model: torch.nn.Module) -> list[str | None]:
    return [getattr(config, "_attn_implementation", None) for config in (model.config, *(model.config.sub_configs and
            [getattr(model.config, name) for name in model.config.sub_configs]))]


@pytest.mark.parametrize("method", ATTENTION_METHODS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_methods(family, method):
    """The decoder's attention methods: text scores (B, T) with 0 at the image's tokens and at padding, the image's
    tokens on the 4 x 4 patch grid (their sum kept), no pixel map and `through_tower` False; a padded row (left and
    right) equals the row alone; the model handed back as it was (weights, hooks, attention implementations)."""
    model = model_of(family)
    before, implementations = snapshot(model), attention_implementations(model)
    for side in ("right", "left"):
        batch = inputs(family, side)
        explanation = relevancy.explain(model, batch, method=method)
        assert explanation.scores.shape == batch["input_ids"].shape and explanation.image_scores.shape == (2, 4, 4)
        assert explanation.heatmap().shape == (2, 16, 16) and explanation.pixel_scores is None
        assert explanation.through_tower is False and explanation.to_json()["through_tower"] is False
        assert bool((explanation.scores[(batch["input_ids"] == IMAGE_TOKEN) | (batch["attention_mask"] == 0)] == 0).all())
        assert bool((explanation.image_scores.abs().sum((1, 2)) > 0).all())
        for row in range(2):
            single = relevancy.explain(model, alone(batch, row), method=method)
            keep = batch["attention_mask"][row].bool()
            assert torch.allclose(explanation.image_scores[row], single.image_scores[0], atol=1e-12), f"{side} row {row}"
            assert torch.allclose(explanation.scores[row, keep], single.scores[0], atol=1e-12), f"{side} row {row}"
            assert torch.equal(explanation.target[row], single.target[0])
    assert_same(before, snapshot(model))
    assert attention_implementations(model) == implementations


@pytest.mark.parametrize("family", list(FAMILIES))
def test_raw_attention_maps_the_image_tokens_back_by_hand(family):
    """raw_attention is the last decoder layer's head-mean attention row of the last token (the model's own eager
    attention): over the text tokens in `scores`, and over the image's tokens laid on the patch grid by hand: LLaVA
    one token per patch (row-major), its kept [CLS] shared by all 16 patches; Gemma 3's pooled and Idefics3's
    shuffled tokens each shared by its 2 x 2 block of patches."""
    batch = inputs(family, lengths=(5,))
    explanation = relevancy.explain(model_of(family), batch, method="raw_attention")
    own = copy.deepcopy(model_of(family))
    own.set_attn_implementation("eager")
    with torch.no_grad():
        row = own(**{**batch, **own_types(family, batch["input_ids"], batch)}, output_attentions=True).attentions[-1].mean(1)[0, -1]
    image = batch["input_ids"][0] == IMAGE_TOKEN
    assert torch.allclose(explanation.scores[0], row.masked_fill(image, 0))
    tokens = row[image]
    if family in ("llava", "paligemma", "paligemma2"):
        by_hand = tokens.view(4, 4)
    elif family == "llava_full":
        by_hand = tokens[1:].view(4, 4) + tokens[0] / 16
    else:
        by_hand = tokens.view(2, 2).repeat_interleave(2, 0).repeat_interleave(2, 1) / 4
    assert torch.allclose(explanation.image_scores[0], by_hand)
    assert torch.allclose(explanation.image_scores.sum() + explanation.scores.sum(), torch.ones((), dtype=torch.float64))


def test_refusals_name_the_problem():
    """Methods not offered here (full LRP to the pixels under the seeds' rules), other vision-language classes and bad
    pixels are refused by name."""
    model, batch = model_of("llava"), inputs("llava")
    with pytest.raises(UnsupportedModelError, match="'lrp' does not apply to the vision-language decoder family; "
                                                    "its methods: raw_attention, rollout"):
        relevancy.explain(model, batch, method="lrp")
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, 3, H, W\): one image per row"):
        relevancy.explain(model, {**batch, "pixel_values": batch["pixel_values"][:1]}, method="attnlrp")
    with pytest.raises(ValueError, match="placeholder tokens"):
        relevancy.explain(model, {**batch, "input_ids": torch.where(batch["input_ids"] == IMAGE_TOKEN, 3, batch["input_ids"])}, method="attnlrp")
    long = inputs("llava", lengths=(60, 3))  # 77 positions; the decoder's window is 64
    with pytest.raises(ValueError, match="the model's context window is 64 tokens"):
        relevancy.explain(model, long, method="attnlrp")
    with pytest.raises(ValueError, match="image_sizes, which relevancy does not take"):
        relevancy.explain(model, {**batch, "image_sizes": torch.tensor([[16, 16]] * 2)}, method="attnlrp")
    import transformers

    other = transformers.VipLlavaForConditionalGeneration(transformers.VipLlavaConfig(
        text_config=transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1),
        vision_config=transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                    image_size=16, patch_size=4)))
    with pytest.raises(UnsupportedModelError, match="cannot map VipLlavaForConditionalGeneration: vision-language decoders relevancy maps: "
                                                    "LlavaForConditionalGeneration.*PaliGemmaForConditionalGeneration"):
        relevancy.explain(other, batch, method="attnlrp")


@pytest.mark.parametrize("family", ["paligemma", "paligemma2"])
def test_paligemmas_prefix_attends_both_ways(family):
    """PaliGemma's token types are honoured: the processor's (0 on image and prompt) give other maps than all 1 (a
    causal decoder), none given is read as all 0 (the whole prompt a prefix, as its processor writes it), and types
    of another shape or value are refused by name."""
    model, batch = model_of(family), inputs(family, lengths=(5,))
    prefix = relevancy.explain(model, batch, method="input_x_gradient")
    causal = relevancy.explain(model, {**batch, "token_type_ids": torch.ones_like(batch["input_ids"])}, method="input_x_gradient")
    untyped = relevancy.explain(model, {name: value for name, value in batch.items() if name != "token_type_ids"}, method="input_x_gradient")
    assert not torch.allclose(prefix.image_scores, causal.image_scores, rtol=1e-3)
    assert torch.equal(untyped.scores, prefix.scores) and torch.equal(untyped.image_scores, prefix.image_scores)
    for bad in (batch["token_type_ids"][:, 1:], batch["token_type_ids"] + 2):
        with pytest.raises(ValueError, match=r"token_type_ids must be 0 \(the prefix: image and prompt\) or 1"):
            relevancy.explain(model, {**batch, "token_type_ids": bad}, method="input_x_gradient")


@pytest.mark.parametrize("family", ["paligemma", "paligemma2", "internvl", "internvl_rms"])
def test_input_x_gradient_is_autograd_of_the_models_own_forward(family):
    """input_x_gradient on a batch padded right and left equals autograd through the model's own forward (a copy, its
    attention transformers' sdpa, exact in float64; PaliGemma's token types and positions from 1 over the real
    tokens; InternVL through InternViT's layer scale, the pixel shuffle and the normed projector) at the token
    embeddings and at the pixels, to 1e-10 of each map's largest value."""
    from vlm_models import PREFIX_FAMILIES, embedding_leaf

    own = copy.deepcopy(model_of(family))
    for config in (own.config, own.config.text_config, own.config.vision_config):
        config._attn_implementation = "sdpa"
    for side in ("right", "left"):
        batch = inputs(family, side)
        explanation = relevancy.explain(model_of(family), batch, method="input_x_gradient")
        mask = batch["attention_mask"]
        pixels = batch["pixel_values"].clone().requires_grad_(True)
        with embedding_leaf(own) as leaf:
            logits = own(**{**batch, "pixel_values": pixels}, position_ids=(mask.cumsum(-1) - 1).clamp(min=0) + int(family in PREFIX_FAMILIES)).logits
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
        logits[torch.arange(2), last].gather(1, explanation.target[:, None]).sum().backward()
        assert_close_to(explanation.scores, (leaf["text"] * leaf["text"].grad).sum(-1), f"{family} {side} text", 1e-10)
        assert_close_to(explanation.pixel_scores, (pixels * pixels.grad).sum(1), f"{family} {side} pixels", 1e-10)


def test_internvls_untiled_placeholders_and_other_towers_are_refused_by_name():
    """InternVL's tiles without every tile's placeholders (several rows of pixel_values per image, one tile's
    placeholders) are refused naming the count (the tiles themselves: tests/test_internvl_tiles.py); a tower of
    non-square images, or whose layer has a part InternViT's layout does not know, naming it; the model unchanged
    after each refusal."""
    model, batch = model_of("internvl"), inputs("internvl")
    before = snapshot(model)
    tiles = {**batch, "pixel_values": batch["pixel_values"].repeat_interleave(3, 0)}
    with pytest.raises(ValueError, match=r"input_ids must hold 3 tile\(s\)' 12 placeholder tokens \(id 95, 4 per tile\) in every row; "
                                         r"counted per row: \[4, 4\]"):
        relevancy.explain(model, tiles, method="attnlrp")
    assert_same(before, snapshot(model))
    wide = copy.deepcopy(model)
    wide.config.vision_config.image_size = (16, 32)
    with pytest.raises(UnsupportedModelError, match=r"non-square size \(16, 32\)"):
        relevancy.explain(wide, batch, method="attnlrp")
    extra = copy.deepcopy(model)
    extra.model.vision_tower.encoder.layer[1].gamma = torch.nn.Parameter(torch.ones(16, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match=r"model.vision_tower.encoder.layer.1.gamma belongs to no part of the internvl vision tower"):
        relevancy.explain(extra, batch, method="attnlrp")


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_latent_layer_0_holds_the_image_features_relevance(family):
    """latent="layers" on a vision-language model: layer 0 is the decoder's input, so the image's positions carry the
    relevance of the features put there in place of the placeholders (they were 0), and the text's positions equal
    the input scores; checkpoint=True gives the same."""
    batch = inputs(family)
    explanation = relevancy.explain(model_of(family), batch, method="attnlrp", latent="layers")
    layer0, width = explanation.latent.layers[0], explanation.scores.shape[1]
    image = (batch["input_ids"] == IMAGE_TOKEN)[:, :width]
    assert (layer0[image].abs() > 0).any() and layer0[image].sum() > 0
    assert torch.allclose(layer0[:, :width][~image], explanation.scores[~image], rtol=1e-10, atol=1e-12)
    again = relevancy.explain(model_of(family), batch, method="attnlrp", latent="layers", checkpoint=True)
    assert torch.allclose(again.latent.layers, explanation.latent.layers, rtol=1e-8, atol=1e-12)
