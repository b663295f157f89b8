"""`token_activation_map` (TAM, Li et al., ICCV 2025) on the tiny random float64 vision-language decoders: equal to
the authors' own `tam.py` (tests/golden/tam_reference.pt, made by benchmarks/tam_reference.py) for the next token
(`explain`) and every generated token (`explain_generation`), LLaVA-NeXT's two grids (the base tile's, the tiles'
without their newlines) and InternVL's seven (its 2 x 3 tiles' and its thumbnail's) among them; a left-padded batch equal to its rows alone; its options;
the model left as it was after a call and after a failure; bad options refused by name; the rank filter's edges;
half precision."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from test_causal_lm import assert_close_to, build as build_decoder
from test_vision_language_generation import GivenInputs
import vlm_models
from vlm_models import build, checksum, inputs
from vlm_processor import picture

import qwen_vl_models

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.vision_language import VisionLanguageGenerationExplanation
from relevancy.methods.activation import rank_gaussian_filter

GOLDEN = torch.load(Path(__file__).parent / "golden/tam_reference.pt", weights_only=True)["cases"]
#: the authors' least squares is scipy's Brent search, to 1.48e-8 of the scale (xtol): their maps move by that
#: much of the subtracted interference, a few times the map at most (1.4e-9 of the map's maximum measured); the
#: `_exact` records answer the scale itself (1.5e-15 measured)
BRENT_TOLERANCE = 1e-7
EXACT_TOLERANCE = 1e-12


class Recorded(GivenInputs):
    """The processor stand-in answering one golden case's prompt and image."""

    def __init__(self, case: dict) -> None:
        super().__init__(case["family"])
        self.case = case

    def __call__(self, images: object, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return prompt_of(self.case)


def prompt_of(case: dict) -> dict[str, torch.Tensor]:
    length = case["prompt_length"]
    return {"input_ids": case["input_ids"][:, :length], "attention_mask": torch.ones(1, length, dtype=torch.long), **case["image"]}


def on_token_grid(image_scores: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """`(..., rows, cols)`: patch-grid maps summed over each image token's block of patches (its value again)."""
    k = image_scores.shape[-1] // grid[1]
    return image_scores.unflatten(-1, (grid[1], k)).unflatten(-3, (grid[0], k)).sum((-1, -3))


def on_their_grids(image_scores: torch.Tensor, base_scores: torch.Tensor | None, case: dict) -> torch.Tensor:
    """Our maps as their records lay them: on the token grid (`on_token_grid`), or, where their map is several
    grids flattened one after the other (LLaVA-NeXT: the base tile's 4 x 4 tokens, the tiles' 6 x 8, a token a
    patch; InternVL: the 2 x 3 tiles' 2 x 2 tokens row by row, then the thumbnail's, each token 2 x 2 patches),
    `base_scores` and `image_scores` flattened so."""
    if case["family"] == "internvl_tiles":  # the 8 x 12 patch grid cut into its 2 x 3 tiles of 4 x 4 patches
        tiles = image_scores.unflatten(-2, (2, 4)).unflatten(-1, (3, 4)).movedim(-3, -2).flatten(-4, -3)
        return on_token_grid(torch.cat([tiles, base_scores.unsqueeze(-3)], -3), (2, 2)).flatten(-3)
    if case["next_token"].ndim == 1:
        return torch.cat([base_scores.flatten(-2), image_scores.flatten(-2)], -1)
    return on_token_grid(image_scores, case["next_token"].shape)


def build_case(family: str) -> torch.nn.Module:
    return qwen_vl_models.build(family) if family in qwen_vl_models.FAMILIES else build(family)


@pytest.fixture(scope="module")
def models():
    built = {name: build_case(case["family"]) for name, case in GOLDEN.items()}
    for name, model in built.items():
        assert checksum(model) == GOLDEN[name]["checksum"], f"{name}: the tiny model is not the golden file's"
    return built


@pytest.mark.parametrize("name", GOLDEN)
def test_the_next_token_equals_the_authors_code(models, name):
    """Their map of the next token reads its class at the last prompt position (that token's id): `explain` with
    it as target (benchmarks/tam_reference.py)."""
    case = GOLDEN[name]
    last = int(case["input_ids"][0, case["prompt_length"] - 1])
    explanation = relevancy.explain(models[name], prompt_of(case), method="token_activation_map", target=last)
    ours = on_their_grids(explanation.image_scores[0], None if explanation.base_scores is None else explanation.base_scores[0], case)
    assert_close_to(ours, case["next_token_exact"], f"{name} next token", EXACT_TOLERANCE)
    assert_close_to(ours, case["next_token"], f"{name} next token (Brent)", BRENT_TOLERANCE)


@pytest.mark.parametrize("name", GOLDEN)
def test_every_generated_token_equals_the_authors_code(models, name):
    """Rows 1.. equal their rounds 1.. (the earlier generated tokens in the causal inference), their uint8 maps too;
    row 0 equals `explain` of the first continuation token (their round 0 returns another map, the model's
    prediction at the first prompt word)."""
    case = GOLDEN[name]
    length = case["prompt_length"]
    continuation = case["input_ids"][0, length:].tolist()
    result = relevancy.explain_generation(models[name], Recorded(case), "the prompt", continuation=continuation,
                                          image=picture(), method="token_activation_map")
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.generated_ids.tolist() == continuation
    ours = on_their_grids(result.image_scores, result.base_scores, case)
    assert_close_to(ours[1:], case["generated_exact"], f"{name} generated", EXACT_TOLERANCE)
    assert_close_to(ours[1:], case["generated"], f"{name} generated (Brent)", BRENT_TOLERANCE)
    assert torch.equal(torch.from_numpy((ours[1:].numpy() * 255).astype("uint8")), case["uint8_exact"][1:])
    first = relevancy.explain(models[name], prompt_of(case), method="token_activation_map", target=continuation[0])
    assert_close_to(result.image_scores[0], first.image_scores[0], f"{name} first token", EXACT_TOLERANCE)
    if first.base_scores is not None:
        assert_close_to(result.base_scores[0], first.base_scores[0], f"{name} first token's base tile", EXACT_TOLERANCE)
    assert_close_to(result.scores[0, :length], first.scores[0], f"{name} first token's text", EXACT_TOLERANCE)
    assert (result.scores[:, result.image_tokens] == 0).all()
    assert ((result.scores[:, :length] >= 0) & (result.scores[:, :length] <= 1)).all()


def test_a_left_padded_batch_equals_its_rows_alone(models):
    model, batch = models["llava"], inputs("llava", side="left", lengths=(6, 2, 4))
    together = relevancy.explain(model, batch, method="token_activation_map")
    for row in range(3):
        real = batch["attention_mask"][row].bool()
        alone = relevancy.explain(model, {"input_ids": batch["input_ids"][row:row + 1, real], "attention_mask": torch.ones(1, int(real.sum()), dtype=torch.long),
                                          "pixel_values": batch["pixel_values"][row:row + 1]}, method="token_activation_map")
        assert_close_to(together.image_scores[row], alone.image_scores[0], f"row {row}", EXACT_TOLERANCE)
        assert_close_to(together.scores[row, real], alone.scores[0], f"row {row} text", EXACT_TOLERANCE)
        assert together.target[row] == alone.target[0]


def test_the_options_each_change_their_step(models):
    """Without the filter the map is the normalised one (0 and 1 among image and text scores); without the causal
    inference the image map is the explained logit's, clipped at 0, normalised."""
    model, batch = models["llava"], inputs("llava", lengths=(5,))
    plain = relevancy.explain(model, batch, method="token_activation_map", causal_inference=False, rank_filter=False)
    logits = relevancy.explain(model, batch, method="raw_attention").logits
    assert plain.through_tower is False and not plain.signed
    both = torch.cat([plain.image_scores.flatten(), plain.scores[0, [0, 17, 18, 19, 20]]])  # [1], 16 image tokens, 5 words
    assert both.min() == 0 and both.max() == 1
    filtered = relevancy.explain(model, batch, method="token_activation_map", causal_inference=False)
    assert not torch.allclose(filtered.image_scores, plain.image_scores)
    assert torch.equal(filtered.target, logits.argmax(-1))
    default = relevancy.explain(model, batch, method="token_activation_map")
    assert not torch.allclose(default.image_scores, filtered.image_scores)


def test_the_model_is_left_as_it_was(models):
    model = models["llava"]
    before = snapshot(model)
    relevancy.explain(model, inputs("llava"), method="token_activation_map")
    relevancy.explain_generation(model, Recorded(GOLDEN["llava"]), "the prompt", max_new_tokens=2, image=picture(),
                                 method="token_activation_map")
    assert_same(before, snapshot(model))
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))

    def fail(*_args) -> None:
        raise RuntimeError("failing on purpose")

    handle = norm.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="failing on purpose"):
            relevancy.explain(model, inputs("llava"), method="token_activation_map")
    finally:
        handle.remove()
    assert_same(before, snapshot(model))


def enclosed(batch: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """`vlm_models.inputs` (one image of placeholders a row) with `start` put right before each row's placeholders
    and `end` right after them, as InternVL's processor writes `<img>` and `</img>`."""
    image = (batch["input_ids"][0] == vlm_models.IMAGE_TOKEN).nonzero()[:, 0]  # at the same place in every row: padded right
    first, last = int(image[0]), int(image[-1]) + 1
    put = lambda rows, a, b: torch.cat([rows[:, :first], torch.full((len(rows), 1), a), rows[:, first:last], torch.full((len(rows), 1), b), rows[:, last:]], 1)  # noqa: E731
    return {**batch, "input_ids": put(batch["input_ids"], start, end), "attention_mask": put(batch["attention_mask"], 1, 1)}


@pytest.mark.parametrize("family", ["mistral3", "internvl", "qwen2_vl"])
def test_the_images_delimiters_are_no_words(family):
    """The tokens a processor writes around and among the image's placeholders, known by their place (Mistral 3's
    [IMG_BREAK] after each row of placeholders and [IMG_END] after the last; InternVL's `<img>` right before the
    first and `</img>` right after the last, 93 and 94 here; Qwen2-VL's vision start and end), are left out of TAM's
    words: its history's text positions are every real token but the placeholders and those, and their scores are
    0. Qwen2-VL's are known by their config's ids too: a text prompt, whose processor writes no vision start and
    end, loses no word."""
    from relevancy.families import adapter_for
    from relevancy.methods.activation import history

    model = build_case(family)
    batch = (qwen_vl_models if family == "qwen2_vl" else vlm_models).inputs(family)
    edges = (qwen_vl_models.VISION_START, qwen_vl_models.VISION_END) if family == "qwen2_vl" else (93, 94)
    if family == "internvl":
        batch = enclosed(batch, *edges)
    adapter = adapter_for(model)
    checked = adapter.check_inputs(batch)
    ids, real = checked.input_ids, checked.attention_mask.bool()
    delimiter = torch.isin(ids, torch.tensor(edges)) & real
    assert delimiter.sum(1).tolist() == [2, 2]
    hidden = torch.zeros(ids.shape[1], model.config.get_text_config().hidden_size, dtype=torch.float64)  # the positions alone are read
    for row in range(2):
        read = history(adapter, hidden, ids[row], real[row], ids.shape[1], adapter.image_token_grids(checked))
        assert read.text.tolist() == (real[row] & (ids[row] != adapter.image_token) & ~delimiter[row]).nonzero()[:, 0].tolist()
    tam = relevancy.explain(model, batch, method="token_activation_map")
    assert (tam.scores[delimiter] == 0).all() and (tam.scores[real & ~delimiter & (ids != adapter.image_token)] > 0).any()
    if family == "qwen2_vl":  # a text prompt: the processor writes the placeholders alone, the tokens around them are words
        words = ids.masked_fill(delimiter, 7)
        read = history(adapter, hidden, words[0], real[0], ids.shape[1], adapter.image_token_grids(checked))
        assert read.text.tolist() == (real[0] & (ids[0] != adapter.image_token)).nonzero()[:, 0].tolist()


def test_bad_options_and_targets_are_named(models):
    model, batch = models["llava"], inputs("llava")
    with pytest.raises(ValueError, match="no option 'rank_filtr'.*Did you mean 'rank_filter'"):
        relevancy.explain(model, batch, method="token_activation_map", rank_filtr=False)
    with pytest.raises(ValueError, match="option causal_inference of method 'token_activation_map' must be bool, got int"):
        relevancy.explain(model, batch, method="token_activation_map", causal_inference=1)
    with pytest.raises(ValueError, match="token_activation_map explains a token"):
        relevancy.explain(model, batch, method="token_activation_map", target=lambda logits: logits[:, 3])
    with pytest.raises(UnsupportedModelError, match="method 'token_activation_map' does not apply to the decoder"):
        relevancy.explain(build_decoder("llama"), {"input_ids": torch.tensor([[1, 5, 7]])}, method="token_activation_map")


def test_the_rank_filter_at_its_edges():
    """A window whose mean is 0 gives 0; a constant window keeps its value (the authors' code gives NaN there); a
    bright cell among zeros is pulled towards its window's median, 0 (a Gaussian over the ranks of width std / mean
    = 2.8: 0.058)."""
    assert torch.equal(rank_gaussian_filter(torch.zeros(3, 4, dtype=torch.float64)), torch.zeros(3, 4, dtype=torch.float64))
    assert torch.equal(rank_gaussian_filter(torch.full((2, 2), 0.5, dtype=torch.float64)), torch.full((2, 2), 0.5, dtype=torch.float64))
    spike = torch.zeros(5, 5, dtype=torch.float64)
    spike[2, 2] = 1
    filtered = rank_gaussian_filter(spike)
    assert abs(filtered[2, 2] - 0.0583) < 1e-3 and torch.isfinite(filtered).all() and (filtered >= 0).all()


def test_a_half_precision_model_gives_float32_maps():
    model = build("llava", torch.bfloat16)
    half = relevancy.explain(model, inputs("llava"), method="token_activation_map")
    assert half.image_scores.dtype == torch.float32 and torch.isfinite(half.image_scores).all()
    generated = relevancy.explain_generation(model, Recorded(GOLDEN["llava"]), "the prompt", max_new_tokens=2, image=picture(),
                                             method="token_activation_map")
    assert generated.image_scores.dtype == generated.scores.dtype == torch.float32
