"""`relevancy.explain_generation` on the tiny random float64 Mistral 3 (and Pixtral-12B's LLaVA) of `vlm_models.py`
with an offline `PixtralProcessor` (`vlm_processor.pixtral_processor`: the word-level tokenizer with `[IMG]`, `[IMG_BREAK]` and
`[IMG_END]`, `PixtralImageProcessor`): transformers' `generate` decodes greedily from the pixels and `image_sizes`;
every generated token's text and image maps, from one forward, equal `explain` on that prefix with that token as
target (attnlrp, cp_lrp, input_x_gradient; TAM's first row), the image maps on the image's own patch grid; the
picture is the processor's pixels; the model as it was after a call, a cancelled one and a failing one; the methods
of a forward per prefix refused by name."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image
from test_causal_lm import assert_close_to
from test_mistral3 import failing_in_the_tower
from test_qwen_vl_generation import assert_rows_equal_explain, prefix
from test_model_unchanged import assert_same, snapshot
from vlm_models import IMAGE_TOKEN, MERGE, MERGES, PATCH, SIZED_IMAGE, build
from vlm_processor import pixtral_processor

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.vision_language import VisionLanguageGenerationExplanation

model_of = functools.lru_cache(maxsize=None)(lambda family="mistral3": build(family))
GRID = (SIZED_IMAGE[0] // PATCH, SIZED_IMAGE[1] // PATCH)  # the image's 4 x 6 patches
STEPS = 3
PROMPT = "what is in the image ?"


def scene(seed: int = 0) -> Image.Image:
    """A 16 x 24 picture (the processor keeps its size: whole 8 x 8 merged patches): random colours."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*SIZED_IMAGE, 3), dtype=np.uint8))


def processed(text: str = PROMPT, family: str = "mistral3") -> dict[str, torch.Tensor]:
    """The processor's output for the prompt with the image first, as `explain_generation` makes it."""
    return dict(pixtral_processor(MERGES[family])(images=scene(), text=f"[IMG]\n{text}", return_tensors="pt"))


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "input_x_gradient"])
@pytest.mark.parametrize("family", list(MERGES))
def test_each_tokens_maps_equal_explain_on_its_prefix(family, method):
    """Text and image maps to 1e-12 of each map's maximum, the logits and relevance totals; the processor's prompt
    holds the placeholders (Mistral 3: 2 x 3, Pixtral: 4 x 6) with [IMG_BREAK] after each row but the last and
    [IMG_END] after it; the image maps on the 4 x 6 patch grid."""
    model, batch = model_of(family), processed(family=family)
    result = relevancy.explain_generation(model, pixtral_processor(MERGES[family]), PROMPT, image=scene(), max_new_tokens=STEPS, method=method)
    start = batch["input_ids"].shape[1]
    rows, cols = GRID[0] // MERGES[family], GRID[1] // MERGES[family]
    assert batch["input_ids"][0, :rows * (cols + 1)].tolist() == ([IMAGE_TOKEN] * cols + [93]) * (rows - 1) + [IMAGE_TOKEN] * cols + [94]
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.prompt_length == start
    assert result.scores.shape == (STEPS, start + STEPS) and result.image_scores.shape == (STEPS, *GRID)
    assert_rows_equal_explain(model, result, batch, f"{family} {method}", 1e-12)


def test_token_activation_maps_lie_on_the_patch_grid_and_the_picture_is_the_processors():
    """TAM's first row equals `explain` on the prompt (its later rows read the earlier generated tokens' maps); every
    row's map on the 4 x 6 patch grid, each merged token's score shared by its 2 x 2 patches; the page's picture the
    processor's pixels, its [-1, 1] normalisation undone (to the PNG's 8 bits)."""
    model, batch = model_of(), processed("what")
    result = relevancy.explain_generation(model, pixtral_processor(MERGE), "what", image=scene(), max_new_tokens=STEPS,
                                          method="token_activation_map")
    first = relevancy.explain(model, prefix(batch, batch["input_ids"], batch["input_ids"].shape[1]), method="token_activation_map",
                              target=int(result.generated_ids[0]))
    assert_close_to(result.image_scores[0], first.image_scores[0], "TAM image", 1e-12)
    assert result.image_scores.shape == (STEPS, *GRID)
    blocks = result.image_scores.unflatten(2, (-1, MERGE)).unflatten(1, (-1, MERGE))  # (G, rows, k, cols, k)
    assert torch.equal(blocks, blocks[:, :, :1, :, :1].expand_as(blocks))
    expected = (batch["pixel_values"][0].double() * 0.5 + 0.5).clamp(0, 1)
    seen = result.pictures()[0].double()
    assert seen.shape == (3, *SIZED_IMAGE) and (seen - expected).abs().max() <= 1 / 255


def test_the_model_is_left_as_it_was():
    """Weights, modes, hooks, forwards and the configs' attention after a generation, one cancelled inside the
    decoding and one failing inside the tower (its error comes through)."""
    model, made = model_of(), pixtral_processor(MERGE)
    relevancy.explain_generation(model, made, PROMPT, image=scene(), max_new_tokens=1)  # transformers' own first-run hooks
    before = snapshot(model)
    relevancy.explain_generation(model, made, PROMPT, image=scene(), max_new_tokens=2, method="cp_lrp")
    asked = []  # should_stop answers True at its third question: inside the decoding, the model switched for the call
    with pytest.raises(relevancy.core.cancel.Cancelled):
        relevancy.explain_generation(model, made, PROMPT, image=scene(), max_new_tokens=4, should_stop=lambda: asked.append(1) or len(asked) >= 3)
    failing_in_the_tower(model, lambda: relevancy.explain_generation(model, made, PROMPT, image=scene(), max_new_tokens=2))
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("method", ["rollout", "raw_attention", "token_ablation"])
def test_the_methods_of_a_forward_per_prefix_are_refused_by_name(method):
    with pytest.raises(UnsupportedModelError, match="explain_generation on a Mistral 3 / Pixtral vision-language decoder takes the methods of one "
                                                    "forward over prompt, image and generation: attnlrp, cp_lrp, input_x_gradient, "
                                                    f"token_activation_map; got '{method}'"):
        relevancy.explain_generation(model_of(), pixtral_processor(MERGE), PROMPT, image=scene(), method=method)
