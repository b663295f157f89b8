"""LRP methods on CLIP (open_clip and transformers, unmodified, float64): transformer attribution per tower.

No reference code exists for CLIP LRP, so the checks are the rules' own promises (docs/methods.md, "CLIP"):
relevance 1 reaches each tower and is conserved down to its earliest block used, a pair's maps do not depend on
the batch, both libraries give the same maps for the same weights, the model is handed back untouched.
"""
from __future__ import annotations

import copy

import pytest
import torch

import relevancy  # noqa: E402
from relevancy.families.base import UnsupportedModelError  # noqa: E402
from relevancy.families.clip.batch import ImageTextBatch  # noqa: E402
from relevancy.lrp import MissingRuleError  # noqa: E402
from test_clip import CASES, LIBRARIES, build, close  # noqa: E402

CASE = CASES[0]
MODELS = {library: build(CASE, library) for library in LIBRARIES}
GRID = ImageTextBatch.grid(CASE["images"], CASE["input_ids"])
TOWERS = ("image", "text")


def explain(library: str, inputs=GRID, **options):
    return relevancy.explain(MODELS[library], inputs, method="transformer_attribution", **options)


def maps(expl) -> dict[str, torch.Tensor]:
    return {"image": expl.image_scores, "text": expl.text_scores}


@pytest.fixture(scope="module")
def stable():
    return {library: explain(library) for library in LIBRARIES}


@pytest.mark.parametrize("library", LIBRARIES)
def test_maps_are_finite_and_non_trivial(stable, library):
    expl = stable[library]
    pairs = len(GRID)
    assert expl.image_scores.shape == (pairs, 4, 4) and expl.text_scores.shape == (pairs, CASE["input_ids"].shape[1])
    for scores in maps(expl).values():
        assert torch.isfinite(scores).all() and (scores >= 0).all()
        assert (scores.flatten(1).amax(1) > 0).all()  # every pair's map has some relevance
        assert (scores.flatten(1).std(1) > 0).all()  # and it is not flat
    after_end = torch.arange(expl.text_scores.shape[1]) > GRID.pair_ids.argmax(-1)[:, None]
    assert (expl.text_scores[after_end] == 0).all()  # causal: nothing after the end-of-text token
    plain = relevancy.explain(MODELS[library], GRID, method="raw_attention")  # the rules' forwards are the model's
    assert expl.logits.shape == (pairs, 1) and close(expl.logits, plain.logits) < 1e-12


@pytest.mark.parametrize("exact, tolerance", [(True, 1e-6), (False, 1e-2)])
@pytest.mark.parametrize("library", LIBRARIES)
def test_each_tower_receives_and_conserves_relevance_one(stable, library, exact, tolerance):
    """The pair rule gives each tower relevance 1; the paper's rules conserve it down to the earliest block used."""
    totals = (explain(library, exact=True) if exact else stable[library]).relevance_total
    assert totals.shape == (len(GRID), 2)  # columns: image, text
    assert (totals - 1).abs().max() < tolerance
    for options in ({"start_layer": 1}, {"blocks": "last"}):
        assert (explain(library, exact=exact, **options).relevance_total - 1).abs().max() < tolerance


@pytest.mark.parametrize("library", LIBRARIES)
def test_batched_pairs_equal_single_pairs(stable, library):
    batched = stable[library]
    m = len(CASE["input_ids"])
    for p, (i, j) in enumerate(GRID.pairs.tolist()):
        single = explain(library, (CASE["images"][i:i + 1], CASE["input_ids"][j:j + 1]))
        for tower in TOWERS:
            assert close(maps(batched)[tower][p], maps(single)[tower][0]) < 1e-10
        assert p == i * m + j


@pytest.mark.parametrize("exact", [False, True])
def test_both_libraries_give_the_same_maps(stable, exact):
    ours = stable if not exact else {library: explain(library, exact=True) for library in LIBRARIES}
    for tower in TOWERS:
        assert close(maps(ours["open_clip"])[tower], maps(ours["transformers"])[tower]) < 1e-8
    torch.testing.assert_close(ours["open_clip"].relevance_total, ours["transformers"].relevance_total, rtol=0, atol=1e-10)


@pytest.mark.parametrize("library", LIBRARIES)
def test_ablations_and_start_layers(stable, library):
    attention = explain(library, weights="attention")
    for tower in TOWERS:
        scores = maps(attention)[tower]
        assert torch.isfinite(scores).all() and scores.abs().sum() > 0
        assert close(scores, maps(stable[library])[tower]) > 1e-3  # the ablation changes the map
    last, from_end = explain(library, blocks="last"), explain(library, start_layer=-1)
    per_tower = explain(library, start_layer={"image": 2, "text": 2})
    for tower in TOWERS:
        assert torch.equal(maps(last)[tower], maps(from_end)[tower])
        assert torch.equal(maps(last)[tower], maps(per_tower)[tower])
    with pytest.raises(ValueError, match="start_layer"):
        explain(library, start_layer=3)


@pytest.mark.parametrize("library", LIBRARIES)
def test_partial_lrp_per_tower_and_lrp_refused(library):
    model = MODELS[library]
    vanilla = relevancy.explain(model, GRID, method="partial_lrp")
    paper = relevancy.explain(model, GRID, method="partial_lrp", rules="paper", exact=True)
    for expl in (vanilla, paper):
        assert all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in maps(expl).values())
    assert (paper.relevance_total - 1).abs().max() < 1e-6  # at each tower's last block input
    with pytest.raises(UnsupportedModelError, match="method 'lrp' does not apply to the CLIP"):
        relevancy.explain(model, GRID, method="lrp")


def _instance_state(model: torch.nn.Module) -> list[tuple[str, set]]:
    return [(name, set(module.__dict__)) for name, module in model.named_modules()]


def _implementations(model: torch.nn.Module) -> list[str]:
    """transformers: the attention implementation each config names (open_clip has none)."""
    config = getattr(model, "config", None)
    return [] if config is None else [c._attn_implementation for c in (config, config.vision_config, config.text_config)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_model_unchanged(library):
    model = MODELS[library]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attributes = _instance_state(model)
    configs = _implementations(model)
    for exact in (False, True):
        explain(library, exact=exact)
    for method in ("partial_lrp", "attnlrp", "cp_lrp", "input_x_gradient"):
        relevancy.explain(model, GRID, method=method)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert _instance_state(model) == attributes  # no patched forward, projection or attribute left behind
    assert _implementations(model) == configs
    assert not model.training


@pytest.mark.parametrize("library", LIBRARIES)
def test_unknown_module_is_an_error_not_a_gradient(library):
    model = copy.deepcopy(MODELS[library])
    if library == "transformers":
        model.vision_model.encoder.layers[0].mlp.activation_fn = torch.nn.Softplus()
    else:
        model.visual.transformer.resblocks[0].mlp.gelu = torch.nn.Softplus()
    attributes = _instance_state(model)
    with pytest.raises(MissingRuleError, match="Softplus"):
        relevancy.explain(model, GRID, method="transformer_attribution")
    assert _instance_state(model) == attributes


@pytest.mark.parametrize("library", LIBRARIES)
def test_half_precision_models_are_explained_in_float32(library):
    half = build(CASE, library).to(torch.bfloat16)
    rounded = build(CASE, library).to(torch.bfloat16).float()  # the same weights, in float32
    ids = CASE["input_ids"][:2]
    ours = relevancy.explain(half, (CASE["images"].to(torch.bfloat16), ids), method="transformer_attribution")
    reference = relevancy.explain(rounded, (CASE["images"].to(torch.bfloat16).float(), ids), method="transformer_attribution")
    for tower in TOWERS:
        assert close(maps(ours)[tower], maps(reference)[tower]) < 1e-6
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
