"""`relevancy.explain_generation` on the tiny random float64 Qwen2-VL and Qwen2.5-VL of `qwen_vl_models.py` (a processor
stand-in answering the processor's flattened patches, `image_grid_thw` and `mm_token_type_ids`): transformers'
`generate` decodes greedily (each token the argmax of `explain`'s logits on its prefix, so the 3-D positions are the
model's own); every generated token's text and image maps, from one forward, equal `explain` on that prefix with that
token as target (attnlrp, cp_lrp, input_x_gradient; TAM's first row), the image maps on the image's own h x w patch
grid; the picture is the flattened patches laid back as the image processor's own `patchify` lays them; the model and
its cached `rope_deltas` as they were after a call, a cancelled call and a failing one; videos and several images
refused by name. (TAM's every generated token against the authors' code: test_token_activation_map.py.)"""
from __future__ import annotations

import functools

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from qwen_vl_models import FAMILIES, GRID, IMAGE_TOKEN, MERGE, PATCH, TEMPORAL, build, inputs
from test_causal_lm import assert_close_to
from test_qwen_vl import failing_in_the_tower
from test_vision_language_generation import GivenInputs
from vlm_processor import picture

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.vision_language import VisionLanguageGenerationExplanation

#: each family's model, built once
model_of = functools.lru_cache(maxsize=None)(build)
#: generated tokens per call
STEPS = 3


class QwenInputs(GivenInputs):
    """The processor stand-in for Qwen2-VL: `qwen_vl_models.inputs` (one row of `grid`) with the processor's
    `mm_token_type_ids`, whatever the prompt and image; `further`: keys added to its output."""

    def __init__(self, family: str, grid: tuple[int, int, int] = GRID, **further: torch.Tensor) -> None:
        super().__init__(family)
        self.grid, self.further = grid, further

    def __call__(self, images: object, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        made = inputs(self.family, lengths=(4,), grid=self.grid)
        return {**made, "mm_token_type_ids": (made["input_ids"] == IMAGE_TOKEN).int(), **self.further}


def prefix(batch: dict[str, torch.Tensor], ids: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """The processor's output `batch` (one row) for the first `length` tokens of `ids` (the prompt's image)."""
    return {**batch, "input_ids": ids[:, :length], "attention_mask": torch.ones(1, length, dtype=torch.long)}


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "input_x_gradient"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_tokens_maps_equal_explain_on_its_prefix(family, method):
    """Text and image maps to 1e-9 of each map's maximum (2e-15 measured), the logits and relevance totals; the image
    maps on the 4 x 6 patch grid of `image_grid_thw`."""
    model = model_of(family)
    result = relevancy.explain_generation(model, QwenInputs(family), "what is in the image ?", image=picture(),
                                          max_new_tokens=STEPS, method=method)
    batch = inputs(family, lengths=(4,))
    start = batch["input_ids"].shape[1]
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.prompt_length == start
    assert result.scores.shape == (STEPS, start + STEPS) and result.image_scores.shape == (STEPS, GRID[1], GRID[2])
    assert_rows_equal_explain(model, result, batch, f"{family} {method}", 1e-9)


def assert_rows_equal_explain(model: torch.nn.Module, result: VisionLanguageGenerationExplanation, batch: dict[str, torch.Tensor],
                              name: str, tolerance: float) -> None:
    """Each generated token's text and image maps `explain`'s on its prefix of the prompt `batch` (the processor's
    output, one row) with that token as target, within `tolerance` of each map's maximum, its logit and relevance
    total too; each token the argmax of the prefix's logits (greedy decoding at the model's own positions)."""
    start, steps = batch["input_ids"].shape[1], len(result.generated_ids)
    assert result.image_tokens.tolist() == [t == IMAGE_TOKEN for t in batch["input_ids"][0].tolist()] + [False] * steps
    ids = torch.cat([batch["input_ids"], result.generated_ids[None]], 1)
    for g in range(steps):
        alone = relevancy.explain(model, prefix(batch, ids, start + g), method=result.method, target=int(result.generated_ids[g]))
        assert int(alone.logits[0].argmax()) == int(result.generated_ids[g])
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"{name} text {g}", tolerance)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"{name} image {g}", tolerance)
        assert (result.scores[g, start + g:] == 0).all()
        assert torch.allclose(result.logits[g, 0], alone.logits[0, result.generated_ids[g]], rtol=1e-12)
        if alone.relevance_total is None:
            assert result.relevance_total is None
        else:
            assert torch.allclose(result.relevance_total[g], alone.relevance_total[0], rtol=tolerance)
    assert not torch.equal(result.image_scores[0], result.image_scores[1])  # each token has a map of its own


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_activation_maps_lie_on_the_patch_grid(family):
    """TAM's first row equals `explain` on the prompt (its later rows hold the earlier generated tokens in their
    causal inference: the authors' rounds, test_token_activation_map.py); every row's map on the 4 x 6 patch grid,
    each merged token's score shared by its 2 x 2 patches."""
    model = model_of(family)
    result = relevancy.explain_generation(model, QwenInputs(family), "what", image=picture(), max_new_tokens=STEPS,
                                          method="token_activation_map")
    batch = inputs(family, lengths=(4,))
    first = relevancy.explain(model, prefix(batch, batch["input_ids"], batch["input_ids"].shape[1]), method="token_activation_map",
                              target=int(result.generated_ids[0]))
    assert_close_to(result.image_scores[0], first.image_scores[0], f"{family} TAM image", 1e-12)
    assert result.image_scores.shape == (STEPS, GRID[1], GRID[2])
    blocks = result.image_scores.unflatten(2, (-1, MERGE)).unflatten(1, (-1, MERGE))  # (G, rows, k, cols, k)
    assert torch.equal(blocks, blocks[:, :, :1, :, :1].expand_as(blocks))


def test_the_picture_is_the_patches_laid_back_as_the_image_processor_lays_them():
    """The image processor's own `patchify` of an image of pixel indices says where each flattened value came from:
    the page's picture is the pixels put back there, the stand-in's [-1, 1] normalisation undone (to the PNG's 8
    bits)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    result = relevancy.explain_generation(model_of("qwen2_5_vl"), QwenInputs("qwen2_5_vl"), "what", image=picture(),
                                          continuation=[5, 6], method="attnlrp")
    height, width = GRID[1] * PATCH, GRID[2] * PATCH
    index = torch.arange(3 * height * width, dtype=torch.float64).view(1, 3, height, width)
    where = Qwen2VLImageProcessor().patchify(index, PATCH, MERGE, TEMPORAL)[0][0].long().flatten()
    pixels = torch.zeros(3 * height * width, dtype=torch.float64).index_put_((where,), inputs("qwen2_5_vl", lengths=(4,))["pixel_values"].flatten())
    expected = (pixels.view(3, height, width) * 0.5 + 0.5).clamp(0, 1)
    seen = result.pictures()[0].double()
    assert seen.shape == (3, height, width) and (seen - expected).abs().max() <= 1 / 255
    assert result.heatmap().shape == (2, height, width)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_model_and_its_cached_positions_are_left_as_they_were(family):
    """Weights, modes, hooks, the configs' attention, and `rope_deltas` (which `generate` caches on the model) the
    very tensor they were, after a generation, a generation cancelled inside the decoding and one failing in the
    tower."""
    model = model_of(family)
    relevancy.explain_generation(model, QwenInputs(family), "what", image=picture(), max_new_tokens=1)  # first-run hooks
    cached = torch.zeros(1, 1, dtype=torch.long)
    model.model.rope_deltas = cached
    before = snapshot(model)
    try:
        relevancy.explain_generation(model, QwenInputs(family), "what", image=picture(), max_new_tokens=2, method="cp_lrp")
        assert model.model.rope_deltas is cached
        asked = []  # should_stop answers True at its third question: inside the decoding, after generate cached its deltas
        with pytest.raises(relevancy.core.cancel.Cancelled):
            relevancy.explain_generation(model, QwenInputs(family), "what", image=picture(), max_new_tokens=4,
                                         should_stop=lambda: asked.append(1) or len(asked) >= 3)
        assert model.model.rope_deltas is cached
        failing_in_the_tower(model, lambda: relevancy.explain_generation(model, QwenInputs(family), "what", image=picture(), max_new_tokens=2))
        assert model.model.rope_deltas is cached
        assert_same(before, snapshot(model))
    finally:
        model.model.rope_deltas = None


def test_videos_several_images_and_other_methods_are_refused_by_name():
    model = model_of("qwen2_vl")
    with pytest.raises(ValueError, match=r"image_grid_thw \[2, 4, 6\] is not one image's grid .* relevancy explains images, not videos"):
        relevancy.explain_generation(model, QwenInputs("qwen2_vl", grid=(2, 4, 6)), "what", image=picture())
    with pytest.raises(ValueError, match="holds pixel_values_videos, which relevancy does not take; it takes input_ids, .* no videos"):
        relevancy.explain_generation(model, QwenInputs("qwen2_vl", pixel_values_videos=torch.zeros(4, 96)), "what", image=picture())
    with pytest.raises(TypeError, match="image= is one image, got a list of 2"):
        relevancy.explain_generation(model, QwenInputs("qwen2_vl"), "what", image=[picture(), picture(1)])
    with pytest.raises(ValueError, match="holds the image token '<image>' 2 times, but one image is explained"):
        relevancy.explain_generation(model, QwenInputs("qwen2_vl"), "<image> and <image>", image=picture())
    with pytest.raises(UnsupportedModelError, match="takes the methods of one forward over prompt, image and generation: attnlrp, "
                                                    "cp_lrp, input_x_gradient, token_activation_map; got 'rollout'"):
        relevancy.explain_generation(model, QwenInputs("qwen2_vl"), "what", image=picture(), method="rollout")


def test_the_shipped_qwen_with_its_own_processor():
    """The shipped shapes Qwen2.5-VL and its `Qwen2_5_VLProcessor` (flattened patches, `image_grid_thw`,
    `mm_token_type_ids` as they come): the answer `model.generate` gives on the processor's output, each token's maps
    `explain`'s on its prefix (float32: to 1e-5 of each map's maximum), on the 8 x 8 patch grid under the 64 x 64
    picture."""
    from PIL import Image

    from relevancy.models import shapes_qwen_vl
    from relevancy.worlds.vision_language import make_vlm

    model, processor = shapes_qwen_vl()
    scene = Image.fromarray(make_vlm(1, seed=1_000_050_007).pixels[0])
    result = relevancy.explain_generation(model, processor, "what color is the star", image=scene, max_new_tokens=4)
    made = processor(images=scene, text="<image>\nwhat color is the star", return_tensors="pt")
    with torch.no_grad():
        answer = model.generate(**made, max_new_tokens=4, do_sample=False)[0, made["input_ids"].shape[1]:]
    model.model.rope_deltas = None
    assert result.generated_ids.tolist() == answer[:len(result.generated_ids)].tolist()
    assert result.image_scores.shape == (len(result.generated_ids), 8, 8) and result.pictures().shape[-2:] == (64, 64)
    ids = torch.cat([made["input_ids"], result.generated_ids[None]], 1)
    start = made["input_ids"].shape[1]
    for g in range(len(result.generated_ids)):
        alone = relevancy.explain(model, {**made, "input_ids": ids[:, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long),
                                          "mm_token_type_ids": (ids[:, :start + g] == model.config.image_token_id).int()},
                                  method="attnlrp", target=int(result.generated_ids[g]))
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"shipped text {g}", 1e-5)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"shipped image {g}", 1e-5)
