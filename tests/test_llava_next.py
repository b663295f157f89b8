"""LLaVA-NeXT and LLaVA-OneVision (tiny random float64 `LlavaNextForConditionalGeneration` with CLIP and Llama,
`LlavaOnevisionForConditionalGeneration` with SigLIP and Qwen2, of `vlm_models.py`: a 24 x 32 image as its base tile
and 2 x 2 tiles of 16 x 16 pixels, whose 8 x 8 patch grid the model unpads to 6 x 8, OneVision's "anyres_max_1" then
interpolates to 3 x 4, a newline embedding after each row): AttnLRP and CP-LRP equal to lxt's rules composed over the whole model, text and every tile's
pixels, single and padded both ways (tests/golden/vlm_lxt_reference.pt); input x gradient equal to autograd through
the model's own forward; the maps laid back by hand (the base tile's apart, the tiles' grid unpadded, the newlines
left out); token ablation equal to a hand loop; a batch padded left equal to its rows alone for every method; the
model unchanged after a call and after a failure; transformers' processor's output taken as it comes; what is
refused, by name. (Generations: test_llava_next_generation.py; TAM against the authors' code:
test_token_activation_map.py.) (Right padding, every method run or
refused, the result protocol: the family contract, `family_cases.py`.)"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from test_vision_language import GOLDEN, assert_equals_lxt
from vlm_models import IMAGE_TOKEN, PATCH, TILED, TILES, alone, build, checksum, embedding_leaf, inputs

import relevancy
from relevancy.families import TiledVisionLanguageAdapter, adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm.adapter import last_real

FAMILY = "llava_next"
FAMILIES = list(TILED)
METHODS = ("raw_attention", "rollout", "attention_gradcam", "token_ablation", "attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map")


@functools.lru_cache(maxsize=None)
def model(family: str = FAMILY) -> torch.nn.Module:
    return build(family)


def laid_by_hand(per_tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(base (B, 4, 4), the tiles' grid (B, 6, 8))` from per-tile patch maps `(B, 5, 4, 4)`: tiles 1 to 4 are the
    2 x 2 tiles row by row, their 8 x 8 grid unpadded by a row of patches above and below (24 x 32 in 32 x 32)."""
    top = torch.cat([per_tile[:, 1], per_tile[:, 2]], 2)
    bottom = torch.cat([per_tile[:, 3], per_tile[:, 4]], 2)
    return per_tile[:, 0], torch.cat([top, bottom], 1)[:, 1:7]


def patch_sums(pixels: torch.Tensor) -> torch.Tensor:
    """Per-pixel maps `(B, tiles, 16, 16)` summed per 4 x 4 patch: `(B, tiles, 4, 4)`."""
    return pixels.unflatten(-1, (4, PATCH)).unflatten(-3, (4, PATCH)).sum((-3, -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_class_is_taken_by_its_layout_and_is_lxts_model(family):
    """Each class by the tiled adapter on LLaVA's tower and projector, a Llama or Qwen2 decoder (the decoder layouts'
    LLAMA); the same weights as lxt's."""
    adapter = adapter_for(model(family))
    assert type(adapter) is TiledVisionLanguageAdapter and adapter.vision.name == family and adapter.layout.name == "llama"
    assert checksum(model(family)) == GOLDEN["models"][family]["checksum"]


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_equals_lxt(family, method):
    """Every tile's pixel maps `(B, tiles, H, W)` within 1e-6 of the map's maximum (3.8e-7 measured), the text maps
    within 1e-6 too but LLaVA-NeXT's within 1e-5 (5.5e-6 measured: AttnLRP's first row alone, whose text map's
    maximum, 0.03, is a ninth of its pixels'; its largest difference, 1.7e-7, is the other maps' size); single and
    padded right and left. The gap is lxt's: its RMSNorm rule computes in float32 (relevancy's in the model's
    float64); with lxt's rule run in float64 LLaVA-NeXT's maps agree to 1.3e-8. The targets lxt's; relevance_total
    the share of the logit reaching text and pixels (the newline embedding's share stays on the parameter, in lxt's
    maps as in relevancy's)."""
    entry = GOLDEN["models"][family]
    assert_equals_lxt(model(family), entry, method, family, text_tolerance=1e-5 if family == "llava_next" else 1e-6)
    plain = relevancy.explain(model(family), entry["inputs"]["single0"], method="input_x_gradient")
    assert not torch.allclose(plain.pixel_scores, entry[method]["single0"]["image"], rtol=1e-3)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_input_x_gradient_is_autograd_through_the_models_own_forward(family, side):
    """The model's own forward from its own inputs (tiles, `image_sizes`; a copy with sdpa attention, exact in
    float64): its target's logit differentiated at the token embeddings and at every tile's pixels gives relevancy's
    maps to 1e-10 of each map's maximum; the maps of the patches are the pixels' laid by hand."""
    batch = inputs(family, side)
    explanation = relevancy.explain(model(family), batch, method="input_x_gradient", target=[7, 9])
    own = copy.deepcopy(model(family))
    own.set_attn_implementation("sdpa")
    mask, pixels = batch["attention_mask"], batch["pixel_values"].clone().requires_grad_(True)
    with embedding_leaf(own) as leaf:
        logits = own(**{**batch, "pixel_values": pixels}, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False).logits
    logits[torch.arange(2), last_real(mask), torch.tensor([7, 9])].sum().backward()
    assert_close_to(explanation.scores, (leaf["text"] * leaf["text"].grad).sum(-1), f"{side} text", 1e-10)
    assert_close_to(explanation.pixel_scores, (pixels * pixels.grad).sum(2), f"{side} pixels", 1e-10)
    base, grid = laid_by_hand(patch_sums(explanation.pixel_scores))
    assert explanation.image_scores.shape == (2, 6, 8) and explanation.base_scores.shape == (2, 4, 4)
    assert torch.allclose(explanation.base_scores, base) and torch.allclose(explanation.image_scores, grid)
    assert explanation.image_size == (24, 32) and explanation.heatmap().shape == (2, 24, 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_attention_lays_the_image_tokens_back_by_hand(family):
    """raw_attention is the last decoder layer's head-mean attention row of the last token (the model's own eager
    attention): the image's tokens are the base tile's 16, then the grid's rows, each followed by its newline:
    LLaVA-NeXT's 6 rows of 8 tokens, one a patch; OneVision's 3 rows of 4, each the mean of 2 x 2 patches (the
    interpolation halving the grid), its score shared equally by them. The newlines' scores are in no map (the text
    scores 0 at every placeholder), all else sums to 1."""
    batch = inputs(family, lengths=(5,))
    explanation = relevancy.explain(model(family), batch, method="raw_attention")
    own = copy.deepcopy(model(family))
    own.set_attn_implementation("eager")
    with torch.no_grad():
        row = own(**batch, output_attentions=True).attentions[-1].mean(1)[0, -1]
    image = batch["input_ids"][0] == IMAGE_TOKEN
    tokens = row[image]
    if family == "llava_next":
        rows = tokens[16:].view(6, 9)
        grid = rows[:, :8]
    else:
        rows = tokens[16:].view(3, 5)
        grid = rows[:, :4].repeat_interleave(2, 0).repeat_interleave(2, 1) / 4
    assert torch.allclose(explanation.scores[0], row.masked_fill(image, 0))
    assert torch.allclose(explanation.base_scores[0], tokens[:16].view(4, 4)) and torch.allclose(explanation.image_scores[0], grid)
    assert not explanation.through_tower and explanation.pixel_scores is None
    total = explanation.scores.sum() + explanation.base_scores.sum() + explanation.image_scores.sum() + rows[:, -1].sum()
    assert torch.allclose(total, torch.ones((), dtype=torch.float64))


def own_logit(family: str, row: dict[str, torch.Tensor], target: int) -> float:
    with torch.no_grad():
        return float(model(family)(**row, use_cache=False).logits[0, -1, target])


@pytest.mark.parametrize("family", FAMILIES)
def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand(family):
    """Each patch of every tile set to 0 (the processor's mean), each text token deleted: a batch padded left, in
    chunks of 7 sequences, equal to a hand loop of the model's own forwards on each row alone, to 1e-10; the base
    tile's patches in `base_scores`, the other tiles' on the unpadded grid (the padding's patches, above and below
    the image, in no map)."""
    batch, targets = inputs(family, "left"), [5, 7]
    explanation = relevancy.explain(model(family), batch, method="token_ablation", target=targets, chunk_size=7)
    assert explanation.through_tower and explanation.pixel_scores is None
    for row in range(2):
        one = alone(batch, row)
        full = own_logit(family, one, targets[row])
        ids = one["input_ids"]
        for j in range(ids.shape[1]):
            kept = {**one, "input_ids": torch.cat([ids[:, :j], ids[:, j + 1:]], 1), "attention_mask": torch.ones(1, ids.shape[1] - 1, dtype=torch.long)}
            drop = 0.0 if ids[0, j] == IMAGE_TOKEN else full - own_logit(family, kept, targets[row])
            assert abs(explanation.scores[row, batch["attention_mask"][row].bool()][j] - drop) < 1e-10
        drops = torch.zeros(1, TILES, 4, 4, dtype=torch.float64)
        for tile in range(TILES):
            for r in range(4):
                for c in range(4):
                    pixels = one["pixel_values"].clone()
                    pixels[0, tile, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 0
                    drops[0, tile, r, c] = full - own_logit(family, {**one, "pixel_values": pixels}, targets[row])
        base, grid = laid_by_hand(drops)
        assert_close_to(explanation.base_scores[row], base[0], f"row {row} base", 1e-10)
        assert_close_to(explanation.image_scores[row], grid[0], f"row {row} tiles", 1e-10)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_padded_left_equals_its_rows_alone(family, method):
    """Every method: a batch padded left gives each row's maps alone (1e-9 of each map's maximum)."""
    batch = inputs(family, "left")
    explanation = relevancy.explain(model(family), batch, method=method)
    for row in range(2):
        single = relevancy.explain(model(family), alone(batch, row), method=method)
        keep = batch["attention_mask"][row].bool()
        assert_close_to(explanation.scores[row, keep], single.scores[0], f"{method} row {row} text", 1e-9)
        for name in ("image_scores", "base_scores", "pixel_scores"):
            if getattr(single, name) is not None:
                assert_close_to(getattr(explanation, name)[row], getattr(single, name)[0], f"{method} row {row} {name}", 1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_is_unchanged_after_a_call_and_after_a_failure(family):
    """Weights, modes, hooks and forwards as they were after a call, and after a call that fails inside the tower
    (its error comes through)."""
    before = snapshot(model(family))
    relevancy.explain(model(family), inputs(family), method="attnlrp")
    assert_same(before, snapshot(model(family)))
    layer = adapter_for(model(family)).vision.transformer(model(family)).encoder.layers[1]

    def broken(*args, **kwargs):
        raise RuntimeError("inside the tower")

    layer.forward = broken
    try:
        with pytest.raises(RuntimeError, match="inside the tower"):
            relevancy.explain(model(family), inputs(family), method="cp_lrp")
    finally:
        del layer.forward
    assert_same(before, snapshot(model(family)))


def test_what_is_refused_by_name():
    """Images of different sizes in one batch, tiles that are not the image's, placeholders that are not its tokens,
    the tower-token methods: each a one-line error that says so."""
    batch = inputs(FAMILY)
    with pytest.raises(ValueError, match="different sizes"):
        relevancy.explain(model(), {**batch, "image_sizes": torch.tensor([[24, 32], [32, 24]])}, method="attnlrp")
    with pytest.raises(ValueError, match=r"the processor's tiles \(B, tiles, 3, H, W\) = \(2, 5, 3, 16, 16\)"):
        relevancy.explain(model(), {**batch, "pixel_values": batch["pixel_values"][:, :3]}, method="attnlrp")
    with pytest.raises(ValueError, match=r"one image's 88 placeholder tokens \(id 95\) in every row for an image of size \[32, 32\]; "
                                         r"counted per row: \[70, 70\]"):  # a square image: its 8 x 8 grid not unpadded
        relevancy.explain(model(), {**batch, "image_sizes": torch.tensor([[32, 32]] * 2)}, method="attnlrp")
    with pytest.raises(TypeError, match="image_sizes"):
        relevancy.explain(model(), {name: value for name, value in batch.items() if name != "image_sizes"}, method="attnlrp")
    for method in ("generic_attention", "transformer_attribution", "lrp"):
        with pytest.raises(UnsupportedModelError, match=f"'{method}' does not apply to the tiled vision-language decoder"):
            relevancy.explain(model(), batch, method=method)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_processors_output_goes_in_as_it_comes(family):
    """transformers' `LlavaNextProcessor` / `LlavaOnevisionProcessor` (the tiny tokenizer, 16 x 16 tiles at the
    models' pinpoints) on two 45 x 60 pictures: float32 tiles `(2, 5, 3, 16, 16)`, `image_sizes` (OneVision's
    `batch_num_images` too) and as many placeholders as the model lays out (the 24 x 32 image's aspect); the maps on
    the unpadded grid, the heat map at the picture's size; several images in a row refused by name."""
    import numpy as np
    from PIL import Image
    from vlm_processor import tiled_processor

    pictures = [Image.fromarray(np.random.default_rng(seed).integers(0, 256, (45, 60, 3), dtype=np.uint8)) for seed in range(2)]
    batch = dict(tiled_processor(family)(images=pictures, text=["<image> what is in the image ?", "<image> describe it"],
                                         return_tensors="pt", padding=True))
    count = TILED[family][1]
    assert batch["pixel_values"].shape == (2, TILES, 3, 16, 16) and (batch["input_ids"] == IMAGE_TOKEN).sum(1).tolist() == [count] * 2
    explanation = relevancy.explain(model(family), batch, method="attnlrp")
    assert explanation.image_scores.shape == (2, 6, 8) and explanation.base_scores.shape == (2, 4, 4)
    assert explanation.heatmap().shape == (2, 45, 60) and torch.isfinite(explanation.pixel_scores).all()
    with pytest.raises(ValueError, match=r"batch_num_images must be 1 for every row \(one image per row\); got \[2, 1\]"):
        relevancy.explain(model(family), {**batch, "batch_num_images": torch.tensor([2, 1])}, method="attnlrp")
