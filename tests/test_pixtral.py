"""Pixtral-12B's layout (a tiny random float64 `LlavaForConditionalGeneration` of `vlm_models.py` whose tower is a
`PixtralVisionModel`: Mistral 3's tower before LLaVA's projector, no patch merger; a 16 x 24 image, its 4 x 6
patches each a placeholder, the processor's [IMG_BREAK] after each row of them and [IMG_END] after the last): taken by
its layout, the LLaVA class with another tower by LLaVA's; AttnLRP and CP-LRP equal to lxt's rules composed over the
whole model, text and pixels, single and padded both ways (tests/golden/vlm_lxt_reference.pt); token ablation equal
to a hand loop; what is refused, by name. (Input x gradient equal to autograd through the model's own forward, the
model unchanged after a call and after a failure: `test_mistral3.py`.) (A batch equal to its rows alone, every method run or refused by
name: the family contract, `family_cases.py`; generations: `test_mistral3_generation.py`.)"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from test_mistral3 import assert_ablation_by_hand
from test_vision_language import assert_equals_lxt
from vlm_models import IMAGE_TOKEN, PATCH, SIZED_IMAGE, build, checksum, inputs

import relevancy
from relevancy.families import Mistral3VisionLanguageAdapter, adapter_for
from relevancy.families.base import UnsupportedModelError

GOLDEN = torch.load(Path(__file__).parent / "golden" / "vlm_lxt_reference.pt", weights_only=False)
GRID = (SIZED_IMAGE[0] // PATCH, SIZED_IMAGE[1] // PATCH)  # the image's 4 x 6 patches, each one placeholder
model_of = functools.lru_cache(maxsize=None)(lambda: build("pixtral"))


def test_the_class_is_taken_by_its_tower():
    """LLaVA's class with a Pixtral tower by the Pixtral layout (Mistral 3's tower, LLaVA's projector, merge 1) and
    the decoder layouts' Llama map; with a CLIP tower by LLaVA's; the reference's model the same weights as lxt's."""
    model = model_of()
    adapter = adapter_for(model)
    assert type(adapter) is Mistral3VisionLanguageAdapter and adapter.vision.name == "pixtral" and adapter.layout.name == "llama"
    assert adapter.merge == 1 and adapter.image_token_grid(adapter.check_inputs(inputs("pixtral"))) == GRID
    assert adapter_for(build("llava")).vision.name == "llava"
    assert checksum(model) == GOLDEN["models"]["pixtral"]["checksum"], "transformers made other weights; rerun benchmarks/vlm_lxt_reference.py --only pixtral"


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_equals_lxt(method):
    """Text and pixel maps within 1e-6 of each map's maximum (the RMSNorms compute in float32 in a float64 model, in
    transformers and lxt), single and padded right and left; lxt's targets; relevance_total the share of the logit
    reaching text and pixels."""
    assert_equals_lxt(model_of(), GOLDEN["models"]["pixtral"], method, "pixtral")


def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand():
    """Each patch set to 0 (the processor's mean), each text token deleted: a batch padded left, in chunks of 7
    sequences, equal to a hand loop of the model's own forwards on each row alone."""
    model, batch, targets = model_of(), inputs("pixtral", "left"), [5, 7]
    explanation = relevancy.explain(model, batch, method="token_ablation", target=targets, chunk_size=7)
    assert explanation.image_scores.shape == (2, *GRID)
    assert_ablation_by_hand(model, batch, explanation, targets)


def test_what_is_refused_by_name():
    """LLaVA's select strategy that crops a [CLS] the tower does not have, a projector that is not LLaVA's,
    placeholders not one per patch, a method the family does not offer: each a one-line error that says so."""
    model, batch = model_of(), inputs("pixtral")
    cropping = build("pixtral")
    cropping.config.vision_feature_select_strategy = "default"
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy 'default': the tower has no \\[CLS\\] to crop"):
        relevancy.explain(cropping, batch, method="attnlrp")
    odd = build("pixtral")
    odd.model.multi_modal_projector.linear_2 = torch.nn.Identity()
    with pytest.raises(UnsupportedModelError, match=r"model\.multi_modal_projector \(LlavaMultiModalProjector\) is not LLaVA's projector"):
        relevancy.explain(odd, batch, method="attnlrp")
    with pytest.raises(ValueError, match="placeholder tokens"):
        relevancy.explain(model, {**batch, "input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE_TOKEN, 5)}, method="attnlrp")
    with pytest.raises(UnsupportedModelError, match="'generic_attention'"):
        relevancy.explain(model, batch, method="generic_attention")
