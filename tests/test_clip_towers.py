"""ClipTowers (relevancy.families.clip.towers) against the ICCV'21 authors' CLIP outputs (golden/clip_reference.pt).

The generic attention rule is written here, in a few lines, from the towers' recorded attentions: if it reproduces
the authors' maps for open_clip and transformers, the towers give the right attentions, gradients and logits.
"""
from __future__ import annotations

import pytest
import open_clip
import torch
import transformers

from golden import GOLDEN  # noqa: E402
from relevancy.families.base import UnsupportedModelError  # noqa: E402
from relevancy.families.clip.towers import ClipTowers, clip_library, towers_of  # noqa: E402
from relevancy.families.hf_attention import EXACT_ATTENTION  # noqa: E402

CASES = torch.load(GOLDEN / "clip_reference.pt", weights_only=True)
LIBRARIES = ("open_clip", "transformers")
RTOL = 1e-8  # of each map's largest magnitude; measured ~1e-14 for both libraries


def build(case: dict, library: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The case's model in `library`, as the golden README builds it (float64 before loading for transformers)."""
    if library == "open_clip":
        model = open_clip.model.CLIP(**case["open_clip_config"]).to(dtype).eval()
        model.load_state_dict(case["state_dict_openai"], strict=True)
    else:
        model = transformers.CLIPModel(transformers.CLIPConfig(**case["hf_config"])).to(dtype).eval()
        model.load_state_dict(case["state_dict_hf"], strict=True)
    return model


@pytest.fixture(scope="module", params=[(c, lib) for c in range(len(CASES)) for lib in LIBRARIES],
                ids=lambda p: f"{CASES[p[0]]['name']}-{p[1]}")
def setup(request):
    case = CASES[request.param[0]]
    return case, build(case, request.param[1])


def generic_attention(attentions, gradients, start: int) -> torch.Tensor:
    """The ICCV'21 rule: R = I; R += mean_h(clamp(G * A, min=0)) @ R for blocks start..L-1; (B, N, N)."""
    n = attentions[0].shape[-1]
    relevance = torch.eye(n, dtype=attentions[0].dtype).repeat(attentions[0].shape[0], 1, 1)
    for a, g in list(zip(attentions, gradients))[start:]:
        relevance = relevance + (g * a).clamp(min=0).mean(1) @ relevance
    return relevance


def explain_pairs(towers: ClipTowers, images: torch.Tensor, input_ids: torch.Tensor) -> dict:
    """Per pair k (image k with text k) and S in last/all: the image CLS row over patches and the text readout row."""
    with towers.explaining() as recorder:
        logits = towers.pair_logits(towers.image_features(images), towers.text_features(input_ids))
        attentions = {t: list(recorder.attentions[t]) for t in ("image", "text")}
        grads = torch.autograd.grad(logits.sum(), attentions["image"] + attentions["text"])
    depth = towers.image_depth
    gradients = {"image": grads[:depth], "text": grads[depth:]}
    eot = towers.readout_index(input_ids)
    out = {}
    for s in ("last", "all"):
        r_img = generic_attention(attentions["image"], gradients["image"], depth - 1 if s == "last" else 0)
        r_txt = generic_attention(attentions["text"], gradients["text"], towers.text_depth - 1 if s == "last" else 0)
        out[f"image_relevance_{s}"] = r_img[:, 0, 1:]
        out[f"text_relevance_row_{s}"] = r_txt[torch.arange(len(eot)), eot]
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_clip_library_and_refusals():
    case = CASES[0]
    assert clip_library(build(case, "open_clip")) == "open_clip"
    assert clip_library(build(case, "transformers")) == "transformers"
    assert clip_library(torch.nn.Linear(2, 2)) is None
    with pytest.raises(UnsupportedModelError):
        towers_of(torch.nn.Linear(2, 2))
    resnet = open_clip.model.CLIP(
        embed_dim=16, vision_cfg={"layers": (1, 1, 1, 1), "width": 8, "head_width": 64, "image_size": 64},
        text_cfg={"context_length": 8, "vocab_size": 20, "width": 16, "heads": 2, "layers": 1},
    )
    with pytest.raises(UnsupportedModelError, match="ModifiedResNet"):
        towers_of(resnet)


def test_pair_logits_match_the_authors(setup):
    case, model = setup
    towers = towers_of(model)
    images, ids, expected = case["images"], case["input_ids"], case["logits_per_image"]
    n, m = expected.shape
    assert towers.grid_size(images) == (4, 4) and towers.context_length == ids.shape[1]
    assert torch.equal(towers.readout_index(ids), case["eot_index"])
    for inside in (False, True):
        with torch.no_grad():
            if inside:
                with towers.explaining():
                    logits = towers.pair_logits(towers.image_features(images.repeat_interleave(m, 0)),
                                                towers.text_features(ids.repeat(n, 1)))
            else:
                logits = towers.pair_logits(towers.image_features(images.repeat_interleave(m, 0)),
                                            towers.text_features(ids.repeat(n, 1)))
        assert relative_error(logits.reshape(n, m), expected) < 1e-12
    assert towers.logit_scale().ndim == 0


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_generic_attention_matches_the_authors(setup, batched):
    case, model = setup
    towers = towers_of(model)
    images, ids = case["images"], case["input_ids"]
    n, m = len(images), len(ids)
    if batched:  # all n*m pairs in one batch, one backward of the sum of the pair logits
        maps = explain_pairs(towers, images.repeat_interleave(m, 0), ids.repeat(n, 1))
        results = [{key: value[k] for key, value in maps.items()} for k in range(n * m)]
    else:
        results = []
        for record in case["records"]:
            maps = explain_pairs(towers, images[record["image"]][None], ids[record["text"]][None])
            results.append({key: value[0] for key, value in maps.items()})
    for record, result in zip(case["records"], results):
        assert record is case["records"][record["image"] * m + record["text"]]
        for key, value in result.items():
            assert relative_error(value, record[key]) < RTOL, key


def test_cdam_inputs_are_recorded_on_the_graph(setup):
    case, model = setup
    towers = towers_of(model)
    images, ids = case["images"], case["input_ids"]
    with towers.explaining() as recorder:
        logits = towers.pair_logits(towers.image_features(images[:1].expand(len(ids), -1, -1, -1)),
                                    towers.text_features(ids))
        x_img, x_txt = recorder.last_inputs["image"], recorder.last_inputs["text"]
        assert x_img.shape == (len(ids), 17, case["config"]["vision_width"])
        assert x_txt.shape == (len(ids), ids.shape[1], case["config"]["transformer_width"])
        g_img, g_txt = torch.autograd.grad(logits.sum(), (x_img, x_txt))
    assert recorder.passes == {"image": 1, "text": 1}
    assert g_img[:, 0].abs().sum() > 0 and g_txt.abs().sum() > 0
    # the text tower is causal: nothing after the end token reaches the pooled feature
    eot = case["eot_index"]
    for k in range(len(ids)):
        assert (g_txt[k, eot[k] + 1:] == 0).all()


def test_token_ablation_helpers(setup):
    case, model = setup
    towers = towers_of(model)
    images, ids = case["images"], case["input_ids"]
    with torch.no_grad():
        features = towers.image_features(images)
        tokens = towers.image_tokens(images)
        assert tokens.shape == (len(images), 17, case["config"]["vision_width"])
        assert relative_error(towers.image_features_from_tokens(tokens), features) < 1e-12
        assert not torch.allclose(towers.image_features_from_tokens(tokens[:, [0, *range(2, 17)]]), features)
        text = towers.text_features(ids)
        tokens = towers.text_tokens(ids)
        keep = torch.ones(ids.shape, dtype=torch.bool)
        assert relative_error(towers.text_features_from_tokens(tokens, ids, keep), text) < 1e-12
        assert relative_error(towers.text_features_from_tokens(tokens, ids, None), text) < 1e-12
        # padding after the end token never matters; a token before it does
        keep[0, -1] = False
        assert relative_error(towers.text_features_from_tokens(tokens, ids, keep), text) < 1e-12
        keep[:, 1] = False
        ablated = towers.text_features_from_tokens(tokens, ids, keep)
        assert ((ablated - text).abs().amax(-1) > 1e-6).all()
        # the padding mask of transformers, also given to open_clip
        assert relative_error(towers.text_features(ids, (ids != 0).long()), text) < 1e-12


def test_token_ablation_agrees_between_libraries():
    case = CASES[0]
    ids = case["input_ids"]
    keep = torch.ones(ids.shape, dtype=torch.bool)
    keep[:, 0] = False  # the start token: its own row attends to itself only
    keep[:, 2] = False
    out = {}
    for library in LIBRARIES:
        towers = towers_of(build(case, library))
        with torch.no_grad(), towers.explaining():
            out[library] = towers.text_features_from_tokens(towers.text_tokens(ids), ids, keep)
        assert torch.isfinite(out[library]).all()
    assert relative_error(out["open_clip"], out["transformers"]) < 1e-12


@pytest.mark.parametrize("library", LIBRARIES)
def test_model_left_unchanged(library):
    case = CASES[0]
    model = build(case, library).train()
    if library == "transformers":  # distinct implementations per sub-config must come back as they were
        model.config.vision_config._attn_implementation = "eager"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    configs = [model.config, model.config.vision_config, model.config.text_config] if library == "transformers" else []
    implementations = [c._attn_implementation for c in configs]
    towers = towers_of(model)

    def check() -> None:
        assert all(m.training for m in model.modules())
        assert [c._attn_implementation for c in configs] == implementations
        assert EXACT_ATTENTION not in implementations
        for module in model.modules():
            assert "attention" not in module.__dict__, type(module).__name__
            assert not module._forward_hooks and not module._forward_pre_hooks
        after = model.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)

    with towers.explaining():
        assert not model.training
        if library == "transformers":
            assert model.text_model.config._attn_implementation == EXACT_ATTENTION
            assert model.vision_model.config._attn_implementation == EXACT_ATTENTION
        images, texts = case["images"], case["input_ids"][:2]
        towers.pair_logits(towers.image_features(images), towers.text_features(texts)).sum().backward()
    check()
    with pytest.raises(RuntimeError, match="inside"):
        with towers.explaining():
            towers.image_features(case["images"])
            raise RuntimeError("inside")
    check()


def test_frozen_model_still_gives_attention_gradients():
    case = CASES[0]
    model = build(case, "open_clip").requires_grad_(False)
    towers = towers_of(model)
    with towers.explaining() as recorder:
        image, text = case["images"][:1], case["input_ids"][:1]
        logits = towers.pair_logits(towers.image_features(image), towers.text_features(text))
        grads = torch.autograd.grad(logits.sum(), recorder.attentions["image"] + recorder.attentions["text"])
    assert all(g.abs().sum() > 0 for g in grads)
    assert not any(p.requires_grad for p in model.parameters())


def test_float32_transformers_model():
    case = CASES[0]
    model = build(case, "transformers", torch.float32)
    towers = towers_of(model)
    images, ids = case["images"].float(), case["input_ids"]
    n, m = len(images), len(ids)
    with towers.explaining() as recorder:
        image_features = towers.image_features(images.repeat_interleave(m, 0))
        logits = towers.pair_logits(image_features, towers.text_features(ids.repeat(n, 1)))
        assert all(a.dtype == torch.float32 for a in recorder.attentions["image"] + recorder.attentions["text"])
        # the causal mask is there: text attention is lower-triangular
        assert (recorder.attentions["text"][0].triu(1) == 0).all()
        grads = torch.autograd.grad(logits.sum(), recorder.attentions["image"])
    assert relative_error(logits.double().reshape(n, m), case["logits_per_image"]) < 1e-5
    assert all(torch.isfinite(g).all() for g in grads)
