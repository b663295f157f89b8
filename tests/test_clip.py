"""`relevancy.explain` on CLIP (open_clip and transformers, unmodified) against the ICCV'21 authors' notebook outputs.

Every record of golden/clip_reference.pt within 1e-8 of its map's largest magnitude in float64, one pair at a time
and every pair of a case in one batched call; the other methods run on both towers; the model is left unchanged.
"""
from __future__ import annotations

import open_clip
import pytest
import torch
import torch.nn.functional as F
import transformers

import relevancy  # noqa: E402
from golden import GOLDEN  # noqa: E402
from relevancy.families.clip.batch import ImageTextBatch  # noqa: E402

CASES = torch.load(GOLDEN / "clip_reference.pt", weights_only=True)
LIBRARIES = ("open_clip", "transformers")
RTOL = 1e-8
SETTINGS = {"last": -1, "all": 0}  # the notebook's start_layer=-1 (last layer) and 0 (every layer)


def build(case: dict, library: str) -> torch.nn.Module:
    if library == "open_clip":
        model = open_clip.model.CLIP(**case["open_clip_config"]).double().eval()
        model.load_state_dict(case["state_dict_openai"], strict=True)
    else:
        model = transformers.CLIPModel(transformers.CLIPConfig(**case["hf_config"])).double().eval()
        model.load_state_dict(case["state_dict_hf"], strict=True)
    return model


def close(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| relative to the reference's largest magnitude."""
    return float((ours.double() - reference.double()).abs().max() / reference.abs().max())


@pytest.fixture(scope="module", params=[(c, lib) for c in range(len(CASES)) for lib in LIBRARIES],
                ids=lambda p: f"{CASES[p[0]]['name']}-{p[1]}")
def setup(request):
    case = CASES[request.param[0]]
    return case, build(case, request.param[1])


@pytest.mark.parametrize("setting", SETTINGS)
def test_generic_attention_single_pairs(setup, setting):
    case, model = setup
    for record in case["records"]:
        i, j = record["image"], record["text"]
        expl = relevancy.explain(model, (case["images"][i:i + 1], case["input_ids"][j:j + 1]),
                                 method="generic_attention", start_layer=SETTINGS[setting])
        assert close(expl.parts["image"].scores.flatten(), record[f"image_relevance_{setting}"]) < RTOL
        assert close(expl.parts["text"].scores[0], record[f"text_relevance_row_{setting}"]) < RTOL
        assert close(expl.text_relevance()[0], record[f"text_relevance_{setting}"]) < RTOL
        logit = float(record["logit"])
        assert abs(expl.logits[0, 0].item() - logit) < 1e-10 * abs(logit) + 1e-12
        grid = expl.parts["image"].scores[:, None].double()
        up = F.interpolate(grid, size=case["images"].shape[-1], mode="bilinear")[0, 0]
        up = (up - up.min()) / (up.max() - up.min())
        assert close(up, record[f"image_relevance_upsampled_{setting}"]) < RTOL


@pytest.mark.parametrize("setting", SETTINGS)
def test_generic_attention_batched_grid(setup, setting):
    case, model = setup
    batch = ImageTextBatch.grid(case["images"], case["input_ids"])
    expl = relevancy.explain(model, batch, method="generic_attention", start_layer=SETTINGS[setting])
    m = len(case["input_ids"])
    assert expl.parts["image"].scores.shape[0] == len(case["records"])
    for record in case["records"]:
        p = record["image"] * m + record["text"]
        assert close(expl.parts["image"].scores[p].flatten(), record[f"image_relevance_{setting}"]) < RTOL
        assert close(expl.parts["text"].scores[p], record[f"text_relevance_row_{setting}"]) < RTOL


def test_pairs_image_i_with_text_i(setup):
    case, model = setup
    n = min(len(case["images"]), len(case["input_ids"]))
    expl = relevancy.explain(model, (case["images"][:n], case["input_ids"][:n]), method="generic_attention", start_layer=0)
    m = len(case["input_ids"])
    for k in range(n):
        record = case["records"][k * m + k]
        assert close(expl.parts["image"].scores[k].flatten(), record["image_relevance_all"]) < RTOL
    assert expl.parts["image"].scores.shape[1:] == expl.parts["image"].scores.shape[1:]
    assert expl.parts["text"].scores.shape == (n, case["input_ids"].shape[1])


@pytest.mark.parametrize("method", ["raw_attention", "rollout", "attention_gradcam", "cdam", "token_ablation"])
def test_other_methods_run_on_both_towers(setup, method):
    case, model = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images, ids = case["images"][:2], case["input_ids"][:2]
    expl = relevancy.explain(model, (images, ids), method=method)
    grid = images.shape[-1] // (case["config"]["vision_patch_size"])
    assert expl.parts["image"].scores.shape == (2, grid, grid)
    text = expl.parts["text"].scores
    assert text.shape == ids.shape and torch.isfinite(text).all()
    eot = ids.argmax(-1)
    after_end = torch.arange(ids.shape[1]) > eot[:, None]
    assert (text[after_end] == 0).all()  # causal: nothing after the end token
    assert expl.parts["image"].scores.abs().sum() > 0 and text.abs().sum() > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training


def test_token_ablation_matches_a_rerun_without_the_token(setup):
    """Dropping a patch or a word by hand and re-running the model gives the map's entry."""
    case, model = setup
    images, ids = case["images"][:1], case["input_ids"][:1]
    expl = relevancy.explain(model, (images, ids), method="token_ablation")
    from relevancy.families.clip.towers import towers_of

    towers = towers_of(model)
    with torch.no_grad():
        full = towers.pair_logits(towers.image_features(images), towers.text_features(ids))
        tokens = towers.image_tokens(images)
        keep = [k for k in range(tokens.shape[1]) if k != 1 + 3]
        dropped = towers.pair_logits(towers.image_features_from_tokens(tokens[:, keep]), towers.text_features(ids))
        assert close(expl.parts["image"].scores.flatten()[3:4], full - dropped) < 1e-10
        keep_text = torch.ones_like(ids, dtype=torch.bool)
        keep_text[0, 2] = False
        text = towers.text_features_from_tokens(towers.text_tokens(ids), ids, keep_text)
        dropped = towers.pair_logits(towers.image_features(images), text)
        assert close(expl.parts["text"].scores[0, 2:3], full - dropped) < 1e-10


def test_callable_target_and_errors(setup):
    case, model = setup
    images, ids = case["images"][:2], case["input_ids"][:2]
    doubled = relevancy.explain(model, (images, ids), method="cdam", target=lambda logits: 2 * logits[:, 0])
    plain = relevancy.explain(model, (images, ids), method="cdam")
    assert torch.allclose(doubled.parts["image"].scores, 2 * plain.parts["image"].scores, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="ImageTextBatch.grid"):
        relevancy.explain(model, (case["images"][:2], case["input_ids"][:3]), method="raw_attention")
    with pytest.raises(TypeError, match="tokenised"):
        relevancy.explain(model, (images, ["a photo"]), method="raw_attention")
    with pytest.raises(TypeError, match=r"\(images, texts\)"):
        relevancy.explain(model, images, method="raw_attention")
    with pytest.raises(ValueError, match="start_layer"):
        relevancy.explain(model, (images, ids), method="generic_attention", start_layer=99)


def test_zero_shot_classifier_explains_classes_and_concepts(setup):
    """A CLIP + prompts classifier: logits equal the model's own; every image method runs on it, concepts too."""
    case, model = setup
    images, prompts = case["images"], case["input_ids"]
    classifier = relevancy.ZeroShotClassifier(model, prompts, class_names=[f"c{k}" for k in range(len(prompts))])
    with torch.no_grad():
        logits = classifier(images)
    assert close(logits, case["logits_per_image"]) < 1e-10
    for method in ("generic_attention", "raw_attention", "rollout", "attention_gradcam", "cdam", "token_ablation",
                   "transformer_attribution", "partial_lrp"):
        expl = relevancy.explain(classifier, images, method=method, target=1)
        assert expl.scores.shape[0] == len(images) and torch.isfinite(expl.scores).all()
        assert expl.labels()[0].startswith("c1")
    # the zero-shot head (scale, normalisation, product with the prompts' features) conserves relevance
    expl = relevancy.explain(classifier, images, method="transformer_attribution", target=1, exact=True)
    assert (expl.relevance_total - 1).abs().max() < 1e-6
    # the zero-shot generic attention for class k is the pair (image, prompt k) explanation of the image part
    pair = relevancy.explain(model, (images[:1], prompts[1:2]), method="generic_attention", start_layer=0)
    zero_shot = relevancy.explain(classifier, images[:1], method="generic_attention", target=1, start_layer=0)
    assert close(zero_shot.scores, pair.parts["image"].scores) < 1e-10
    concept = relevancy.Concept(classifier, images[1:])
    expl = relevancy.explain(classifier, images[:1], method="cdam", target=concept)
    assert torch.isfinite(expl.scores).all() and expl.scores.abs().sum() > 0


def test_model_restored_after_an_error_and_under_threads(setup):
    """An exception inside a call leaves nothing switched; calls from several threads give the one-thread maps."""
    from concurrent.futures import ThreadPoolExecutor

    from relevancy.families._shared import transformers_configs

    case, model = setup
    configs = [(c, c._attn_implementation) for c in transformers_configs(model)]
    attributes = {id(m): set(vars(m)) for m in model.modules()}
    model.train()

    def failing(logits):
        raise RuntimeError("target failed")

    with pytest.raises(RuntimeError, match="target failed"):
        relevancy.explain(model, (case["images"][:1], case["input_ids"][:1]), method="generic_attention", target=failing)
    assert model.training and all(m.training for m in model.modules())
    assert all(c._attn_implementation == implementation for c, implementation in configs)
    assert all(set(vars(m)) == attributes[id(m)] for m in model.modules())
    model.eval()

    pairs = [(case["images"][i % len(case["images"])][None], case["input_ids"][i % len(case["input_ids"])][None]) for i in range(6)]
    alone = [relevancy.explain(model, p, method="generic_attention", start_layer=0).parts["image"].scores for p in pairs]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: relevancy.explain(model, p, method="generic_attention", start_layer=0).parts["image"].scores, pairs))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert all(c._attn_implementation == implementation for c, implementation in configs)
