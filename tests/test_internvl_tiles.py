"""InternVL with the processor's tiles (tiny random float64 `InternVLForConditionalGeneration`, InternViT and a Qwen2
decoder, of `vlm_models.py`: a 32 x 48 image as 2 x 3 tiles of 16 x 16 pixels and its thumbnail, `pixel_values`
`(B * 7, 3, 16, 16)`, 4 placeholders per tile, `image_sizes` beside them): AttnLRP and CP-LRP equal to lxt's rules
composed over the whole model, text and every tile's pixels (tests/golden/vlm_lxt_reference.pt); input x gradient
equal to autograd through the model's own forward; the tiles laid on the picture's grid in the processor's order,
the thumbnail's map apart (one tile's pixels alone carrying signal; the decoder's attention laid by hand); token
ablation equal to a hand loop; a batch equal to its rows alone for every method; the model unchanged; what is
refused, by name."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_causal_lm import assert_close_to
from test_model_unchanged import assert_same, snapshot
from test_vision_language import GOLDEN, assert_equals_lxt
from vlm_models import INTERN_GRID, INTERN_IMAGE, INTERN_TILES, IMAGE_TOKEN, PATCH, SIDE, alone, build, checksum, embedding_leaf, inputs

import relevancy
from relevancy.families import InternVLAdapter, adapter_for
from relevancy.families.causal_lm.adapter import last_real

FAMILY = "internvl_tiles"
METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution", "token_ablation",
           "attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map")


@functools.lru_cache(maxsize=None)
def model() -> torch.nn.Module:
    return build(FAMILY)


def per_tile(pixels: torch.Tensor) -> torch.Tensor:
    """Per-pixel maps `(B, tiles, 16, 16)` summed per 4 x 4 patch: `(B, tiles, 4, 4)`."""
    return pixels.unflatten(-1, (-1, PATCH)).unflatten(-3, (-1, PATCH)).sum((-3, -1))


def laid_by_hand(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(the grid (B, 8, 12), the thumbnail (B, 4, 4))` from per-tile patch maps `(B, 7, 4, 4)`: tiles 0 to 5 the 2 x 3
    grid row by row, tile 6 the thumbnail."""
    rows = [torch.cat([tiles[:, 3 * r + c] for c in range(3)], 2) for r in range(2)]
    return torch.cat(rows, 1), tiles[:, 6]


def test_the_class_is_taken_by_its_adapter_and_is_lxts_model():
    adapter = adapter_for(model())
    assert type(adapter) is InternVLAdapter and adapter.vision.name == "internvl"
    assert checksum(model()) == GOLDEN["models"][FAMILY]["checksum"]


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_equals_lxt(method):
    """Every tile's pixel map `(B, 7, H, W)` and the text map within 1e-6 of the map's maximum, single and padded right
    and left; lxt's targets; relevance_total the share of the logit reaching text and pixels."""
    entry = GOLDEN["models"][FAMILY]
    assert_equals_lxt(model(), entry, method, FAMILY)
    plain = relevancy.explain(model(), entry["inputs"]["single0"], method="input_x_gradient")
    assert not torch.allclose(plain.pixel_scores, entry[method]["single0"]["image"], rtol=1e-3)


@pytest.mark.parametrize("side", ["right", "left"])
def test_input_x_gradient_is_autograd_through_the_models_own_forward(side):
    """The model's own forward (a copy with sdpa attention) from every row's tiles one after the other: its target's
    logit differentiated at the token embeddings and at every tile's pixels gives relevancy's maps to 1e-10; the
    maps of the grid and thumbnail are the pixels' laid by hand; the heat map at the image's size."""
    batch = inputs(FAMILY, side)
    explanation = relevancy.explain(model(), batch, method="input_x_gradient", target=[7, 9])
    own = copy.deepcopy(model())
    own.set_attn_implementation("sdpa")
    mask, pixels = batch["attention_mask"], batch["pixel_values"].clone().requires_grad_(True)
    with embedding_leaf(own) as leaf:
        logits = own(input_ids=batch["input_ids"], attention_mask=mask, pixel_values=pixels, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                     use_cache=False).logits
    logits[torch.arange(2), last_real(mask), torch.tensor([7, 9])].sum().backward()
    assert_close_to(explanation.scores, (leaf["text"] * leaf["text"].grad).sum(-1), f"{side} text", 1e-10)
    assert_close_to(explanation.pixel_scores, (pixels * pixels.grad).sum(1).view(2, INTERN_TILES, SIDE, SIDE), f"{side} pixels", 1e-10)
    grid, thumbnail = laid_by_hand(per_tile(explanation.pixel_scores))
    assert explanation.image_scores.shape == (2, 8, 12) and explanation.base_scores.shape == (2, 4, 4)
    assert torch.allclose(explanation.image_scores, grid) and torch.allclose(explanation.base_scores, thumbnail)
    assert explanation.image_size == INTERN_IMAGE and explanation.heatmap().shape == (2, *INTERN_IMAGE)


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp"])
def test_each_tiles_map_lands_in_its_place_and_the_thumbnails_apart(method):
    """Every tile but one set to 0 (input x gradient and AttnLRP give 0 at zero pixels): the one tile's relevance
    lands in its place on the 2 x 3 grid, `(t // 3, t % 3)`, nowhere else, and the thumbnail's in `base_scores` only."""
    batch = inputs(FAMILY, lengths=(5,))
    for tile in range(INTERN_TILES):
        pixels = torch.zeros_like(batch["pixel_values"])
        pixels[tile] = batch["pixel_values"][tile]
        explanation = relevancy.explain(model(), {**batch, "pixel_values": pixels}, method=method)
        grid, thumbnail = explanation.image_scores[0], explanation.base_scores[0]
        if tile == INTERN_TILES - 1:
            assert bool((grid == 0).all()) and bool((thumbnail != 0).any()), f"thumbnail: {grid.abs().sum()}"
            continue
        place = torch.zeros(8, 12, dtype=torch.bool)
        place[4 * (tile // 3):4 * (tile // 3 + 1), 4 * (tile % 3):4 * (tile % 3 + 1)] = True
        assert bool((grid[~place] == 0).all()) and bool((grid[place] != 0).any()) and bool((thumbnail == 0).all()), f"tile {tile}"


def test_the_processors_tiles_are_the_grid_row_by_row():
    """transformers' GotOcr2 image processor (InternVL's; tiles of 16 x 16) on a 32 x 48 picture: 6 tiles and the
    thumbnail, tile t the picture's block at row t // 3, column t % 3 (the picture is the 2 x 3 canvas's size, so it is
    cut as it is), which is where relevancy lays tile t's map; the grid relevancy reads from `image_sizes`."""
    import numpy as np
    from PIL import Image
    from transformers import GotOcr2ImageProcessor

    picture = np.random.default_rng(0).integers(0, 256, (*INTERN_IMAGE, 3), dtype=np.uint8)
    processor = GotOcr2ImageProcessor(size={"height": SIDE, "width": SIDE}, crop_to_patches=True, max_patches=12, do_normalize=False,
                                      do_rescale=False)
    out = processor(images=Image.fromarray(picture), return_tensors="pt")
    assert out["num_patches"].tolist() == [INTERN_TILES] and out["pixel_values"].shape == (INTERN_TILES, 3, SIDE, SIDE)
    canvas = torch.from_numpy(picture).permute(2, 0, 1).double()
    for tile in range(6):
        r, c = divmod(tile, 3)
        assert torch.allclose(out["pixel_values"][tile].double(), canvas[:, r * SIDE:(r + 1) * SIDE, c * SIDE:(c + 1) * SIDE], atol=1)
    assert adapter_for(model()).grid(INTERN_TILES, INTERN_IMAGE) == INTERN_GRID


def test_raw_attention_lays_each_tiles_tokens_back_by_hand():
    """raw_attention is the last decoder layer's head-mean attention row of the last token (the model's own eager
    attention): the image's 28 tokens are 7 tiles' 2 x 2 pixel-shuffled tokens, each shared by its 2 x 2 patches; the
    grid's tiles laid by hand, the thumbnail apart; everything sums to 1."""
    batch = inputs(FAMILY, lengths=(5,))
    explanation = relevancy.explain(model(), batch, method="raw_attention")
    own = copy.deepcopy(model())
    own.set_attn_implementation("eager")
    with torch.no_grad():
        row = own(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                  output_attentions=True).attentions[-1].mean(1)[0, -1]
    image = batch["input_ids"][0] == IMAGE_TOKEN
    tiles = row[image].view(1, INTERN_TILES, 2, 2).repeat_interleave(2, 2).repeat_interleave(2, 3) / 4
    grid, thumbnail = laid_by_hand(tiles)
    assert torch.allclose(explanation.scores[0], row.masked_fill(image, 0))
    assert torch.allclose(explanation.image_scores, grid) and torch.allclose(explanation.base_scores, thumbnail)
    assert not explanation.through_tower and explanation.pixel_scores is None
    total = explanation.scores.sum() + explanation.image_scores.sum() + explanation.base_scores.sum()
    assert torch.allclose(total, torch.ones((), dtype=torch.float64))


def test_generic_attention_through_each_tile_equals_the_naive_rule():
    """generic_attention carried into the tower, tile by tile: each row of a batch padded left equals the ICCV'21
    rule's full matrices from the model's own eager forward on the row alone (`test_vision_language_tower.rule`):
    the decoder's row at each tile's 2 x 2 tokens laid on its 2 x 2 blocks of patches (InternViT's [CLS] cropped, 0)
    and multiplied through that tile's own tower matrix; the tiles laid by hand, to 1e-6 of each map's maximum (the
    naive side reads Qwen2's stock eager attention, whose softmax runs in float32: up to 2.8e-7 measured)."""
    from test_vision_language_tower import rule

    batch, targets = inputs(FAMILY, "left"), [5, 7]
    explanation = relevancy.explain(model(), batch, method="generic_attention", target=targets)
    own = copy.deepcopy(model())
    own.set_attn_implementation("eager")
    adapter = adapter_for(own)
    for row in range(2):
        one = alone(batch, row)
        found: dict[str, list[torch.Tensor]] = {"tower": [], "decoder": []}
        hooks = [attention.register_forward_hook(lambda _m, _i, out, key=key: found[key].append(out[1]))
                 for key, attentions in (("tower", [layer.attention for layer in adapter.vision.tower_layers(own)]),
                                         ("decoder", [block.self_attn for block in adapter.blocks])) for attention in attentions]
        logit = own(input_ids=one["input_ids"], pixel_values=one["pixel_values"]).logits[0, -1, targets[row]]
        for hook in hooks:
            hook.remove()
        layers = len(found["tower"])
        gradients = torch.autograd.grad(logit, found["tower"] + found["decoder"])
        decoder = rule(found["decoder"], gradients[layers:])[-1]
        image = one["input_ids"][0] == IMAGE_TOKEN
        tokens = decoder[image].view(INTERN_TILES, 2, 2).repeat_interleave(2, 1).repeat_interleave(2, 2).flatten(1) / 4
        tiles = torch.stack([(torch.cat([torch.zeros(1, dtype=torch.float64), tokens[t]])
                              @ rule([a[t:t + 1] for a in found["tower"]], [g[t:t + 1] for g in gradients[:layers]]))[1:].view(4, 4)
                             for t in range(INTERN_TILES)])
        grid, thumbnail = laid_by_hand(tiles[None])
        assert_close_to(explanation.image_scores[row], grid[0], f"row {row} grid", 1e-6)
        assert_close_to(explanation.base_scores[row], thumbnail[0], f"row {row} thumbnail", 1e-6)
        assert_close_to(explanation.scores[row, batch["attention_mask"][row].bool()], decoder.masked_fill(image, 0), f"row {row} text", 1e-6)


def test_transformer_attribution_conserves_over_the_tiles():
    """transformer_attribution's relevance total counts every tile's tower input beside the text: 1 under the
    paper's rules (to 1e-6)."""
    explanation = relevancy.explain(model(), inputs(FAMILY), method="transformer_attribution")
    assert torch.allclose(explanation.relevance_total, torch.ones(2, dtype=torch.float64), atol=1e-6)
    assert explanation.through_tower and bool((explanation.image_scores != 0).any())


def test_tams_grids_are_the_tiles_apart():
    """TAM filters each tile's 2 x 2 token grid apart (`image_token_grids`): tile t's grid holds placeholders 4t to
    4t + 3, the thumbnail's last; none crosses a tile's edge."""
    adapter = adapter_for(model())
    grids = adapter.image_token_grids(adapter.check_inputs(inputs(FAMILY)))
    assert [shape for _, shape in grids] == [(2, 2)] * INTERN_TILES
    assert [cells.tolist() for cells, _ in grids] == [list(range(4 * tile, 4 * tile + 4)) for tile in range(INTERN_TILES)]


def own_logit(row: dict[str, torch.Tensor], target: int) -> float:
    with torch.no_grad():
        return float(model()(input_ids=row["input_ids"], pixel_values=row["pixel_values"], use_cache=False).logits[0, -1, target])


def test_token_ablation_equals_occluding_each_patch_and_deleting_each_token_by_hand():
    """Each patch of every tile set to 0 (the processor's mean), each text token deleted: a batch padded left, in
    chunks of 9 sequences, equal to a hand loop of the model's own forwards on each row alone, to 1e-10; the grid's
    tiles laid by hand, the thumbnail's patches in `base_scores`."""
    batch, targets = inputs(FAMILY, "left"), [5, 7]
    explanation = relevancy.explain(model(), batch, method="token_ablation", target=targets, chunk_size=9)
    assert explanation.through_tower and explanation.pixel_scores is None
    for row in range(2):
        one = alone(batch, row)
        full = own_logit(one, targets[row])
        ids = one["input_ids"]
        for j in range(ids.shape[1]):
            kept = {**one, "input_ids": torch.cat([ids[:, :j], ids[:, j + 1:]], 1)}
            drop = 0.0 if ids[0, j] == IMAGE_TOKEN else full - own_logit(kept, targets[row])
            assert abs(explanation.scores[row, batch["attention_mask"][row].bool()][j] - drop) < 1e-10
        drops = torch.zeros(1, INTERN_TILES, 4, 4, dtype=torch.float64)
        for tile in range(INTERN_TILES):
            for r in range(4):
                for c in range(4):
                    pixels = one["pixel_values"].clone()
                    pixels[tile, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH] = 0
                    drops[0, tile, r, c] = full - own_logit({**one, "pixel_values": pixels}, targets[row])
        grid, thumbnail = laid_by_hand(drops)
        assert_close_to(explanation.image_scores[row], grid[0], f"row {row} grid", 1e-10)
        assert_close_to(explanation.base_scores[row], thumbnail[0], f"row {row} thumbnail", 1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_a_batch_equals_its_rows_alone(method):
    """Every method: a batch padded right and left gives each row's maps alone (1e-9 of each map's maximum); the
    model is unchanged after the calls."""
    before = snapshot(model())
    for side in ("right", "left"):
        batch = inputs(FAMILY, side)
        explanation = relevancy.explain(model(), batch, method=method)
        assert explanation.image_scores.shape == (2, 8, 12) and explanation.base_scores.shape == (2, 4, 4)
        for row in range(2):
            single = relevancy.explain(model(), alone(batch, row), method=method)
            keep = batch["attention_mask"][row].bool()
            assert_close_to(explanation.scores[row, keep], single.scores[0], f"{method} {side} row {row} text", 1e-9)
            for name in ("image_scores", "base_scores", "pixel_scores"):
                if getattr(single, name) is not None:
                    assert_close_to(getattr(explanation, name)[row], getattr(single, name)[0], f"{method} {side} row {row} {name}", 1e-9)
    assert_same(before, snapshot(model()))


@pytest.mark.parametrize("method", ["cp_lrp", "input_x_gradient"])
def test_a_generation_equals_explain_on_each_prefix(method):
    """`explain_generation` over the tiles (a processor stand-in answering the tiles and `image_sizes`): row g of
    every map equals `explain` on the prompt and the g tokens generated before it (1e-10), the grid's tiles side by
    side, the thumbnail's apart; the picture the grid's tiles side by side (32 x 48)."""
    from test_vision_language_generation import PROMPT, GivenInputs
    from vlm_processor import picture

    result = relevancy.explain_generation(model(), GivenInputs(FAMILY), PROMPT, image=picture(), max_new_tokens=3, method=method)
    batch = inputs(FAMILY, lengths=(4,))
    start = batch["input_ids"].shape[1]
    ids = torch.cat([batch["input_ids"], result.generated_ids[None]], 1)
    assert result.image_scores.shape == (3, 8, 12) and result.base_scores.shape == (3, 4, 4)
    assert result.pictures().shape == (3, 3, *INTERN_IMAGE) and result.heatmap().shape == (3, *INTERN_IMAGE)
    for g in range(3):
        alone = relevancy.explain(model(), {**batch, "input_ids": ids[:, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long)},
                                  method=method, target=int(result.generated_ids[g]))
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"{method} text {g}", 1e-10)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"{method} grid {g}", 1e-10)
        assert_close_to(result.base_scores[g], alone.base_scores[0], f"{method} thumbnail {g}", 1e-10)


def test_a_generation_reads_the_tiles_grid_from_the_pictures_size():
    """A processor that tiles but writes no `image_sizes` (InternVL's own): `explain_generation` gives the picture's
    size (a 48 x 32 PIL image: height 32, width 48) as `image_sizes`, so the 2 x 3 grid is found; the maps those of
    the processor output with `image_sizes` given (1e-12)."""
    from PIL import Image
    from test_vision_language_generation import PROMPT, GivenInputs

    class Untiled(GivenInputs):
        def __call__(self, images: object, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
            return {name: value for name, value in super().__call__(images, text, return_tensors).items() if name != "image_sizes"}

    picture = Image.new("RGB", INTERN_IMAGE[::-1])
    read = relevancy.explain_generation(model(), Untiled(FAMILY), PROMPT, image=picture, continuation=[7, 9], method="input_x_gradient")
    given = relevancy.explain_generation(model(), GivenInputs(FAMILY), PROMPT, image=picture, continuation=[7, 9], method="input_x_gradient")
    assert read.image_scores.shape == (2, 8, 12)
    assert torch.allclose(read.image_scores, given.image_scores, rtol=0, atol=1e-12)
    assert torch.allclose(read.base_scores, given.base_scores, rtol=0, atol=1e-12)


def test_what_is_refused_by_name():
    """Several tiles without `image_sizes`, placeholders that are not every tile's, pixel rows that are not whole
    rows' tiles, two tiles, rows of different sizes: each a one-line error that says so; the model unchanged."""
    batch = inputs(FAMILY)
    before = snapshot(model())
    with pytest.raises(ValueError, match=r"7 tiles per image \(the processor's crop_to_patches\): their arrangement comes from the "
                                         r"image's size, .* add image_sizes, \(B, 2\) each image's \(height, width\) before tiling"):
        relevancy.explain(model(), {name: value for name, value in batch.items() if name != "image_sizes"}, method="attnlrp")
    with pytest.raises(ValueError, match=r"input_ids must hold 6 tile\(s\)' 24 placeholder tokens \(id 95, 4 per tile\) in every row; "
                                         r"counted per row: \[28, 28\]"):
        relevancy.explain(model(), {**batch, "pixel_values": batch["pixel_values"][:12]}, method="attnlrp")
    with pytest.raises(ValueError, match=r"pixel_values must be \(B \* tiles, 3, H, W\).*got \(13, 3, 16, 16\)"):
        relevancy.explain(model(), {**batch, "pixel_values": batch["pixel_values"][:13]}, method="attnlrp")
    with pytest.raises(ValueError, match="different sizes"):
        relevancy.explain(model(), {**batch, "image_sizes": torch.tensor([[32, 48], [48, 32]])}, method="attnlrp")
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * 8 + [5, 6]])
    two = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": batch["pixel_values"][:2]}
    with pytest.raises(ValueError, match="2 tiles per image: InternVL's processor gives one tile, or several and their thumbnail"):
        relevancy.explain(model(), two, method="attnlrp")
    assert_same(before, snapshot(model()))
