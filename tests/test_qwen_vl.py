"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (tiny random float64 models of `qwen_vl_models.py`; Qwen2.5-VL with windowed
attention in two of its four tower blocks, windows ordered apart from the raster; Qwen3-VL with DeepStack on two tower
blocks; Qwen3-VL-MoE, not in lxt's reference, where the maps are checked against autograd and hand loops): each class
taken by its layout; AttnLRP
and CP-LRP equal to lxt's rules composed over the whole model, text and pixels, single and padded both ways
(tests/golden/qwen_vl_lxt_reference.pt, made by benchmarks/qwen_vl_lxt_reference.py), the pixels laid back by the
image processor's own `patchify`; input x gradient equal to autograd through the model's own forward; the image's
patch grid and the merge undone; token ablation equal to a hand loop; the image processor's own output, `checkpoint`, `rows_at_once`, contrasts and
spans; the model and its cached `rope_deltas` unchanged; what is refused, by name (`explain_generation`:
test_qwen_vl_generation.py).
(A batch equal to its rows alone, every method run or refused by name, the model unchanged after a failure:
the family contract, `family_cases.py`.)"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from qwen_vl_models import FAMILIES, GRID, IMAGE_TOKEN, MERGE, PATCH, SEEDS, TEMPORAL, VISION_END, VISION_START, alone, build, checksum, inputs
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from test_vision_language import assert_equals_lxt
from vlm_models import embedding_leaf

import relevancy
from relevancy.families import QwenVisionLanguageAdapter, adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm.adapter import last_real

GOLDEN = torch.load(Path(__file__).parent / "golden" / "qwen_vl_lxt_reference.pt", weights_only=False)
#: the families of lxt's reference and Qwen3-VL-MoE
MAPPED = list(SEEDS)
#: each family's model, built once
model_of = functools.lru_cache(maxsize=None)(build)


def on_pixels(relevance: torch.Tensor, grid: tuple[int, int, int] = GRID) -> torch.Tensor:
    """Flattened patches' relevance `(B, h * w, C * T * P * P)` summed onto the pixels `(B, H, W)` through the image
    processor's own `patchify` of an image of pixel indices (so the laying is transformers', not relevancy's)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    height, width = grid[1] * PATCH, grid[2] * PATCH
    index = torch.arange(3 * height * width, dtype=torch.float64).view(1, 3, height, width)
    where = Qwen2VLImageProcessor().patchify(index, PATCH, MERGE, TEMPORAL)[0][0].long().flatten()
    flat = relevance.new_zeros(len(relevance), 3 * height * width).index_add_(1, where, relevance.flatten(1))
    return flat.view(len(relevance), 3, height, width).sum(1)


@pytest.mark.parametrize("family", MAPPED)
def test_each_class_is_taken_by_its_layout(family):
    """Each class by its tower's layout and its decoder's (Qwen3-VL's with query and key norms, Qwen3-VL-MoE's a
    Qwen3-MoE), the reference's models the same weights as lxt's."""
    model = model_of(family)
    adapter = adapter_for(model)
    decoder = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}.get(family, "llama")
    assert type(adapter) is QwenVisionLanguageAdapter and adapter.vision.name == family.removesuffix("_moe") and adapter.layout.name == decoder
    if family in FAMILIES:
        assert checksum(model) == GOLDEN["models"][family]["checksum"], (
            f"{family}: transformers {GOLDEN['transformers']} made other weights from the same seed; rerun benchmarks/qwen_vl_lxt_reference.py")


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lrp_equals_lxt(family, method):
    """Text and pixel maps within 1e-6 of each map's maximum (3e-7 measured: the models' RMSNorms, and lxt's rule
    for them, compute in float32 even in a float64 model, where relevancy's RMSNorm rule computes in float64),
    single and padded right and left; the targets lxt's (the model's own prediction); relevance_total the share of
    the logit reaching text and pixels."""
    entry = GOLDEN["models"][family]
    assert_equals_lxt(model_of(family), entry, method, family, on_pixels)
    plain = relevancy.explain(model_of(family), entry["inputs"]["single0"], method="input_x_gradient")
    assert not torch.allclose(plain.pixel_scores, on_pixels(entry[method]["single0"]["image"]), rtol=1e-3)
    ruled = relevancy.explain(model_of(family), entry["inputs"]["single0"], method=method)
    # the model's own to its RMSNorms' float32 (the rule forward's divisor is computed in the model's dtype, float64)
    assert_close_to(ruled.logits, plain.logits, "the rule forwards' logits are the model's own", 1e-6)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", MAPPED)
def test_input_x_gradient_is_autograd_through_the_models_own_forward(family, side):
    """The model's own forward from its own inputs (its 3-D positions from `mm_token_type_ids`): its logits are the
    explanation's (1e-12), the target's logit differentiated at the token embeddings and the flattened patches gives
    relevancy's maps to 1e-10."""
    model, batch = model_of(family), inputs(family, side)
    explanation = relevancy.explain(model, batch, method="input_x_gradient", target=[7, 9])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pixels = batch["pixel_values"].clone().requires_grad_(True)
    try:
        with embedding_leaf(model) as leaf:
            logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=batch["image_grid_thw"],
                           mm_token_type_ids=(ids == IMAGE_TOKEN).int(), use_cache=False).logits
    finally:
        model.model.rope_deltas = None  # the model's own forward caches them; relevancy's does not
    last = last_real(mask)
    assert_close_to(explanation.logits, logits[torch.arange(2), last].detach(), "the model's own logits", 1e-12)
    logits[torch.arange(2), last, torch.tensor([7, 9])].sum().backward()
    text = (leaf["text"] * leaf["text"].grad).sum(-1)
    image = on_pixels((pixels * pixels.grad).view(2, -1, pixels.shape[-1]))
    assert_close_to(explanation.scores.masked_fill(ids == IMAGE_TOKEN, 0), text.masked_fill(ids == IMAGE_TOKEN, 0), "text", 1e-10)
    assert_close_to(explanation.pixel_scores, image, "pixels", 1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_image_grid_is_the_images_own_with_the_merge_undone(family):
    """`image_scores` on the image's h x w patch grid of `image_grid_thw` (4 x 6): the pixel methods' each patch's
    pixels summed; the decoder's attention methods' each merged token's score shared equally by its 2 x 2 patches,
    the sums kept, tokens in the raster order of the merge groups (Qwen2.5-VL's windows undone by the tower)."""
    model, batch = model_of(family), inputs(family)
    lrp = relevancy.explain(model, batch, method="attnlrp")
    assert lrp.image_scores.shape == (2, GRID[1], GRID[2]) and lrp.pixel_scores.shape == (2, GRID[1] * PATCH, GRID[2] * PATCH)
    assert lrp.image_size == (GRID[1] * PATCH, GRID[2] * PATCH) and lrp.heatmap().shape == (2, GRID[1] * PATCH, GRID[2] * PATCH)
    patches = lrp.pixel_scores.unflatten(2, (GRID[2], PATCH)).unflatten(1, (GRID[1], PATCH)).sum((2, 4))
    assert torch.allclose(lrp.image_scores, patches)
    attention = relevancy.explain(model, batch, method="raw_attention")
    assert not attention.through_tower and attention.pixel_scores is None
    decoder = attention_row(model, batch, last_real(batch["attention_mask"]))
    tokens = decoder[batch["input_ids"] == IMAGE_TOKEN].view(2, GRID[1] // MERGE, GRID[2] // MERGE)
    expected = tokens.repeat_interleave(MERGE, 1).repeat_interleave(MERGE, 2) / MERGE ** 2
    assert torch.allclose(attention.image_scores, expected, atol=1e-12)
    assert torch.allclose(attention.image_scores.sum((1, 2)), tokens.sum((1, 2)))


def attention_row(model: torch.nn.Module, batch: dict, last: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's eager attention at each row's last real token, mean over heads `(B, T)`, from the
    model's own forward."""
    configs = (model.config, model.config.get_text_config(), model.config.vision_config)
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            ids = batch["input_ids"]
            out = model(**batch, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), output_attentions=True, use_cache=False)
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation
        model.model.rope_deltas = None
    return out.attentions[-1].mean(1)[torch.arange(len(ids)), last]


def test_the_image_processors_output_and_the_options():
    """Qwen2-VL's own image processor (the tiny model's patch and merge sizes) resizes two 21 x 30 pictures to 24 x
    32, 6 x 8 patches each, float32 flattened patches, which go in as they come; `checkpoint=True` and `rows_at_once`
    give the same maps; a `Contrast` is the difference of its two tokens' maps (to 1e-6: the tower's rotation
    computes its gradient in float32); a `Span` and `score="log_prob"` run."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                      size={"shortest_edge": 64, "longest_edge": 64 * 64})
    pictures = [torch.randint(0, 256, (21, 30, 3), generator=torch.Generator().manual_seed(row), dtype=torch.uint8).numpy() for row in range(2)]
    images = processor(images=pictures, return_tensors="pt")
    assert images["image_grid_thw"].tolist() == [[1, 6, 8]] * 2
    ids = torch.tensor([[1, VISION_START] + [IMAGE_TOKEN] * 12 + [VISION_END, 5, 6, 7]] * 2)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **images}
    model = model_of("qwen2_5_vl")
    explanation = relevancy.explain(model, batch, method="attnlrp")
    assert explanation.image_scores.shape == (2, 6, 8) and explanation.pixel_scores.shape == (2, 24, 32)
    for options in ({"checkpoint": True}, {"rows_at_once": 1}):
        again = relevancy.explain(model, batch, method="attnlrp", **options)
        assert_close_to(again.pixel_scores, explanation.pixel_scores, str(options), 1e-12)
        assert_close_to(again.scores, explanation.scores, str(options), 1e-12)
    seven, nine = (relevancy.explain(model, batch, method="attnlrp", target=token) for token in (7, 9))
    contrast = relevancy.explain(model, batch, method="attnlrp", target=relevancy.Contrast(7, 9))
    assert_close_to(contrast.pixel_scores, seven.pixel_scores - nine.pixel_scores, "contrast")
    span = relevancy.explain(model, batch, method="attnlrp", target=relevancy.Span([7, 9]))
    logs = relevancy.explain(model, batch, method="input_x_gradient", score="log_prob")
    assert all(torch.isfinite(x.pixel_scores).all() for x in (span, logs))


def own_logits(model: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own forward on one unpadded row from its own inputs: the next token's logits."""
    ids = row["input_ids"]
    try:
        with torch.no_grad():
            return model(**row, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), use_cache=False).logits[0, -1]
    finally:
        model.model.rope_deltas = None


@pytest.mark.parametrize("family", MAPPED)
def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand(family):
    """Each patch of the image's own grid set to 0 (the processor's mean) at its place among the flattened patches
    (the image processor's own `patchify` of an image of 0s with one patch of 1s says where), each text token
    deleted: a batch padded left, in chunks of 5 sequences, equal to a hand loop of the model's own forwards on each
    row alone (its 3-D positions its own)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    model, batch, targets = model_of(family), inputs(family, "left"), [5, 7]
    explanation = relevancy.explain(model, batch, method="token_ablation", target=targets, chunk_size=5)
    assert explanation.image_scores.shape == (2, GRID[1], GRID[2]) and explanation.through_tower and explanation.pixel_scores is None
    for row in range(2):
        one = alone(batch, row)
        full = own_logits(model, one)[targets[row]]
        ids = one["input_ids"]
        for j in range(ids.shape[1]):
            kept = {**one, "input_ids": torch.cat([ids[:, :j], ids[:, j + 1:]], 1), "attention_mask": torch.ones(1, ids.shape[1] - 1, dtype=torch.long)}
            drop = 0.0 if ids[0, j] == IMAGE_TOKEN else full - own_logits(model, kept)[targets[row]]
            assert abs(explanation.scores[row, batch["attention_mask"][row].bool()][j] - drop) < 1e-10
        for r in range(GRID[1]):
            for c in range(GRID[2]):
                picture = torch.zeros(1, 3, GRID[1] * PATCH, GRID[2] * PATCH, dtype=torch.float64)
                picture[..., r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 1
                where = Qwen2VLImageProcessor().patchify(picture, PATCH, MERGE, TEMPORAL)[0][0].bool()
                drop = full - own_logits(model, {**one, "pixel_values": one["pixel_values"].masked_fill(where, 0)})[targets[row]]
                assert abs(explanation.image_scores[row, r, c] - drop) < 1e-10, (row, r, c)


@pytest.mark.parametrize("family", MAPPED)
def test_the_model_and_its_cached_positions_are_unchanged(family):
    """Weights, modes, hooks, forwards, the configs' attention and `rope_deltas` (which the model's own forward
    caches) as they were after a call, and after a call that fails inside the forward."""
    model = model_of(family)
    before, deltas = snapshot(model), model.model.rope_deltas
    relevancy.explain(model, inputs(family), method="attnlrp")
    assert_same(before, snapshot(model))
    assert model.model.rope_deltas is deltas

    failing_in_the_tower(model, lambda: relevancy.explain(model, inputs(family), method="cp_lrp"))
    assert_same(before, snapshot(model))
    assert model.model.rope_deltas is deltas


def failing_in_the_tower(model: torch.nn.Module, call: Callable[[], object]) -> None:
    """`call()` while the tower's second block raises: its error comes through, the block restored after."""

    def broken(*args, **kwargs):
        raise RuntimeError("inside the tower")

    block = model.model.visual.blocks[1]
    block.forward = broken
    try:
        with pytest.raises(RuntimeError, match="inside the tower"):
            call()
    finally:
        del block.forward


def test_what_is_refused_by_name():
    """Images of different grids in one batch, a video's grid, a video's inputs, a method the family does not offer,
    a tower block that fits no part: each a one-line error that says so (a generation's refusals:
    test_qwen_vl_generation.py)."""
    model = model_of("qwen2_vl")
    one, other = alone(inputs("qwen2_vl"), 0), inputs("qwen2_vl", lengths=(4,), grid=(1, 4, 4))
    mixed = {"input_ids": torch.cat([one["input_ids"][:, :9], other["input_ids"][:, :9]]), "attention_mask": torch.ones(2, 9, dtype=torch.long),
             "pixel_values": torch.cat([one["pixel_values"], other["pixel_values"]]),
             "image_grid_thw": torch.cat([one["image_grid_thw"], other["image_grid_thw"]])}
    with pytest.raises(ValueError, match="different patch grids"):
        relevancy.explain(model, mixed, method="attnlrp")
    with pytest.raises(ValueError, match="not videos"):
        relevancy.explain(model, {**one, "image_grid_thw": torch.tensor([[2, 4, 3]])}, method="attnlrp")
    with pytest.raises(ValueError, match="pixel_values_videos"):
        relevancy.explain(model, {**one, "pixel_values_videos": one["pixel_values"]}, method="attnlrp")
    with pytest.raises(ValueError, match="placeholder tokens"):
        relevancy.explain(model, {**one, "input_ids": one["input_ids"].masked_fill(one["input_ids"] == IMAGE_TOKEN, 5)}, method="attnlrp")
    for method in ("generic_attention", "transformer_attribution", "lrp"):
        with pytest.raises(UnsupportedModelError, match=f"'{method}'"):
            relevancy.explain(model, one, method=method)
    odd = build("qwen2_vl")
    odd.model.visual.blocks[1].mlp.act = torch.nn.Identity()
    odd.model.visual.blocks[1].norm2 = torch.nn.Identity()
    with pytest.raises(UnsupportedModelError, match=r"model\.visual\.blocks\.1\.norm2"):
        relevancy.explain(odd, one, method="attnlrp")
    stacked = build("qwen3_vl")  # a DeepStack merger's norm over one token, not the 2 x 2 side by side
    stacked.model.visual.deepstack_merger_list[1].norm = torch.nn.LayerNorm(16, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"model\.visual\.deepstack_merger_list\.1\.norm \(LayerNorm\)"):
        relevancy.explain(stacked, one, method="attnlrp")
