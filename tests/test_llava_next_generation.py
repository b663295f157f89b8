"""`relevancy.explain_generation` on the tiny random float64 LLaVA-NeXT and LLaVA-OneVision of `vlm_models.py` with
transformers' own `LlavaNextProcessor` / `LlavaOnevisionProcessor` (`vlm_processor.tiled_processor`) on a 45 x 60
picture (2 x 2 tiles at 32 x 32 and the base tile, the 8 x 8 patch grid unpadded to 6 x 8; OneVision's interpolated to
3 x 4 tokens): transformers' `generate` decodes greedily on the tiles and `image_sizes`; every generated token's text,
tiles' and base tile's maps, from one forward, equal `explain` on that prefix with that token as target (attnlrp,
cp_lrp, input_x_gradient; TAM's first row); TAM's grids are the base tile's and the tiles' without their newlines;
the picture is the tiles laid on the grid and unpadded by hand; the result's JSON keeps both maps; the model as it
was after a call, a cancelled call and a failing one; the other methods refused by name. (TAM's every generated
token against the authors' code: test_token_activation_map.py's llava_next case.)"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from vlm_models import IMAGE_TOKEN, PATCH, TILED, build
from vlm_processor import tiled_processor

import relevancy
from relevancy.families import adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.vision_language import VisionLanguageGenerationExplanation

FAMILIES = list(TILED)
PROMPT = "what is in the image ?"
#: generated tokens per call
STEPS = 3

model = functools.lru_cache(maxsize=None)(build)
processor = functools.lru_cache(maxsize=None)(tiled_processor)


def scene() -> Image.Image:
    """A 45 x 60 picture (H x W) of random colours."""
    return Image.fromarray(np.random.default_rng(5).integers(0, 256, (45, 60, 3), dtype=np.uint8))


def prompt_inputs(family: str) -> dict[str, torch.Tensor]:
    """What `explain_generation` gives the model: the processor's output for the image's token before the prompt."""
    return dict(processor(family)(images=scene(), text=f"<image>\n{PROMPT}", return_tensors="pt"))


def prefix(batch: dict[str, torch.Tensor], ids: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """The processor's output for the first `length` tokens of `ids` (the prompt's image)."""
    return {**batch, "input_ids": ids[:, :length], "attention_mask": torch.ones(1, length, dtype=torch.long)}


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "input_x_gradient"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_tokens_maps_equal_explain_on_its_prefix(family, method):
    """Text, tiles' and base tile's maps to 1e-9 of each map's maximum, the logits and relevance totals; each token
    the argmax of `explain`'s logits on its prefix (greedy on the model's own tiles and sizes)."""
    result = relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=STEPS, method=method)
    batch = prompt_inputs(family)
    start = batch["input_ids"].shape[1]
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.prompt_length == start
    assert result.scores.shape == (STEPS, start + STEPS) and result.image_scores.shape == (STEPS, 6, 8)
    assert result.base_scores.shape == (STEPS, 4, 4) and result.scores.dtype == result.base_scores.dtype == torch.float64
    assert result.image_tokens.tolist() == [t == IMAGE_TOKEN for t in batch["input_ids"][0].tolist()] + [False] * STEPS
    ids = torch.cat([batch["input_ids"], result.generated_ids[None]], 1)
    for g in range(STEPS):
        alone = relevancy.explain(model(family), prefix(batch, ids, start + g), method=method, target=int(result.generated_ids[g]))
        assert int(alone.logits[0].argmax()) == int(result.generated_ids[g])
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"{family} {method} text {g}", 1e-9)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"{family} {method} tiles {g}", 1e-9)
        assert_close_to(result.base_scores[g], alone.base_scores[0], f"{family} {method} base {g}", 1e-9)
        assert (result.scores[g, start + g:] == 0).all()
        assert torch.allclose(result.logits[g, 0], alone.logits[0, result.generated_ids[g]], rtol=1e-12)
        assert torch.allclose(result.relevance_total[g], alone.relevance_total[0], rtol=1e-9) if method != "input_x_gradient" \
            else result.relevance_total is None
    assert not torch.equal(result.image_scores[0], result.image_scores[1])  # each token has a map of its own


@pytest.mark.parametrize("family", FAMILIES)
def test_token_activation_maps_grids_and_first_row(family):
    """TAM's grids are the base tile's 16 placeholders (4 x 4), then the tiles' rows without the newline closing
    each (LLaVA-NeXT: 6 rows of 8 among 9 placeholders; OneVision: 3 of 4 among 5); its first generated row equals
    `explain` on the prompt (later rows hold the earlier generated tokens in their causal inference: the authors'
    rounds), text, tiles and base tile; the text holds 0 at every placeholder."""
    batch = prompt_inputs(family)
    adapter = adapter_for(model(family))
    (base, base_shape), (cells, shape) = adapter.image_token_grids(adapter.check_inputs(batch))
    rows, cols = (6, 8) if family == "llava_next" else (3, 4)
    assert base.tolist() == list(range(16)) and base_shape == (4, 4) and shape == (rows, cols)
    assert cells.tolist() == [16 + r * (cols + 1) + c for r in range(rows) for c in range(cols)]
    result = relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=STEPS,
                                          method="token_activation_map")
    first = relevancy.explain(model(family), batch, method="token_activation_map", target=int(result.generated_ids[0]))
    start = batch["input_ids"].shape[1]
    assert_close_to(result.image_scores[0], first.image_scores[0], f"{family} TAM tiles", 1e-12)
    assert_close_to(result.base_scores[0], first.base_scores[0], f"{family} TAM base", 1e-12)
    assert_close_to(result.scores[0, :start], first.scores[0], f"{family} TAM text", 1e-12)
    assert result.image_scores.shape == (STEPS, 6, 8) and result.base_scores.shape == (STEPS, 4, 4)
    assert (result.scores[:, result.image_tokens] == 0).all() and not first.through_tower


def test_the_picture_is_the_tiles_laid_and_unpadded_and_the_json_keeps_both_maps(tmp_path):
    """The page's picture is the processor's tiles 1 to 4 laid 2 x 2 (32 x 32) with the padding's rows cropped as the
    model crops the patch grid (a patch row above and below: 24 x 32), its [-1, 1] normalisation undone (to the PNG's
    8 bits); the heat map at its size; `to_json` and `relevancy.load` keep `base_scores`."""
    result = relevancy.explain_generation(model("llava_next"), processor("llava_next"), PROMPT, image=scene(), continuation="a red star",
                                          method="attnlrp")
    tiles = prompt_inputs("llava_next")["pixel_values"][0].double()
    laid = torch.cat([torch.cat([tiles[1], tiles[2]], 2), torch.cat([tiles[3], tiles[4]], 2)], 1)[:, PATCH:-PATCH]
    mean = torch.tensor(processor("llava_next").image_processor.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(processor("llava_next").image_processor.image_std, dtype=torch.float64)[:, None, None]
    seen = result.pictures()[0].double()
    assert seen.shape == (3, 24, 32) and (seen - (laid * std + mean).clamp(0, 1)).abs().max() <= 1 / 255
    assert result.heatmap().shape == (3, 24, 32)
    again = relevancy.load(json.loads(json.dumps(result.to_json())))
    assert type(again) is type(result) and torch.equal(again.base_scores, result.base_scores)
    assert result.save(tmp_path / "generation.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_is_left_as_it_was(family):
    """Weights, modes, hooks and forwards as they were after a generation, a generation cancelled inside the
    decoding and one failing in the tower (its error comes through)."""
    relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=1)  # first-run hooks
    before = snapshot(model(family))
    relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=2, method="cp_lrp")
    assert_same(before, snapshot(model(family)))
    asked = []  # should_stop answers True at its third question: inside the decoding
    with pytest.raises(relevancy.core.cancel.Cancelled):
        relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=4,
                                     should_stop=lambda: asked.append(1) or len(asked) >= 3)
    assert_same(before, snapshot(model(family)))
    layer = adapter_for(model(family)).vision.transformer(model(family)).encoder.layers[1]

    def broken(*args, **kwargs):
        raise RuntimeError("inside the tower")

    layer.forward = broken
    try:
        with pytest.raises(RuntimeError, match="inside the tower"):
            relevancy.explain_generation(model(family), processor(family), PROMPT, image=scene(), max_new_tokens=2,
                                         method="token_activation_map")
    finally:
        del layer.forward
    assert_same(before, snapshot(model(family)))


def test_the_other_methods_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="takes the methods of one forward over prompt, image and generation: attnlrp, "
                                                    "cp_lrp, input_x_gradient, token_activation_map; got 'rollout'"):
        relevancy.explain_generation(model("llava_next"), processor("llava_next"), PROMPT, image=scene(), method="rollout")
    with pytest.raises(UnsupportedModelError, match="'generic_attention' does not apply to the tiled vision-language decoder"):
        relevancy.explain_generation(model("llava_next"), processor("llava_next"), PROMPT, image=scene(), method="generic_attention")
