"""The shapes Qwen2.5-VL (relevancy.worlds.shapes_vlm, trained by training.shapes_qwen_vl): its start from the shapes
LLaVA, the shipped weights answering unseen scenes, its processor writing what training encodes, explanations on its
8 x 8 patch grid, and `relevancy evaluate --benchmark vlm-shapes --model shapes-qwen-vl`."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import relevancy
from relevancy.models import shapes_qwen_vl
from relevancy.worlds.shapes_vlm import (QWEN_VL_CONFIG, QWEN_VL_WEIGHTS_PATH, VLM_TEST_SEED, VLM_WEIGHTS_PATH, build_shapes_qwen_vl, build_tokenizer, encode, evaluate_vlm,
                                       generate, image_token_count, load_shapes_llava, load_shapes_qwen_vl, load_shapes_vlm,
                                       model_inputs, qwen_vl_from_llava)
from relevancy.worlds.vision_language import make_vlm

#: the patch grid of a 64 x 64 scene (8-pixel patches) and the merged image tokens (2 x 2 patches each)
GRID, TOKENS = 8, 16


@pytest.fixture(scope="module")
def shipped():
    return load_shapes_qwen_vl()


def test_the_start_is_the_llavas_decoder_exactly_and_its_tower_mlps():
    """`qwen_vl_from_llava`: on text alone (M-RoPE's three positions equal) the Qwen2 decoder computes the LLaVA's
    Llama decoder; each tower block's gated MLP with `up x = 1` computes the CLIP block's MLP."""
    llava, _ = load_shapes_llava()
    qwen = build_shapes_qwen_vl().eval()
    qwen.load_state_dict(qwen_vl_from_llava(llava.state_dict(), qwen))
    ids = encode(build_tokenizer(), ["what color is the star", "how many objects are there"], image_tokens=0)
    with torch.no_grad():
        want = llava.model.language_model(**ids).last_hidden_state
        got = qwen.model.language_model(**ids).last_hidden_state
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        x = torch.randn(5, 96)
        torch.testing.assert_close(qwen.model.visual.blocks[3].mlp(x), llava.model.vision_tower.encoder.layers[3].mlp(x),
                                   atol=1e-5, rtol=0)


def test_shipped_model_answers_unseen_scenes(shipped):
    """What the model card measures on 1,000 unseen scenes (94.8 % exact), on a sample."""
    model, processor = shipped
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and image_token_count(model.config) == TOKENS
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    acc = evaluate_vlm(model, processor.tokenizer, n=100, seed=VLM_TEST_SEED)
    assert acc["overall"] > 0.85 and acc["per_task"]["color"] > 0.95, acc


def test_the_processor_writes_what_training_encodes_and_generates_alike(shipped):
    """The shipped `Qwen2_5_VLProcessor` on the scenes' pictures gives the ids, token types, flattened patches and
    grid that training and evaluation make (`encode`, `model_inputs`), and `model.generate` on its output the answer
    `generate` gives."""
    model, processor = shipped
    scene = make_vlm(4, seed=VLM_TEST_SEED + 7)
    out = processor(images=[Image.fromarray(p) for p in scene.pixels], text=[f"<image> {p}" for p in scene.prompts],
                    return_tensors="pt", padding=True)
    enc = model_inputs(model.config, encode(processor.tokenizer, scene.prompts, image_tokens=TOKENS), scene.images)
    assert set(out) == set(enc)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(out[key], enc[key]), key
    torch.testing.assert_close(out["pixel_values"], enc["pixel_values"], atol=1e-6, rtol=0)
    said = generate(model, processor.tokenizer, scene.images, scene.prompts)
    for i in range(4):
        one = processor(images=Image.fromarray(scene.pixels[i]), text=f"<image> {scene.prompts[i]}", return_tensors="pt")
        ids = model.generate(**one, max_new_tokens=16, do_sample=False)
        assert " ".join(processor.tokenizer.decode(ids[0, one["input_ids"].shape[1]:], skip_special_tokens=True).split()) == said[i]


def test_attnlrp_explains_it_on_the_patch_grid(shipped):
    """AttnLRP through the decoder, the merger and the windowed tower (whose MLPs' biases the layout check counts) to
    the pixels: image scores on the 8 x 8 patch grid, each patch's pixels summed."""
    model, processor = shipped
    assert any(bool(b.mlp.up_proj.bias.abs().max() > 0) for b in model.model.visual.blocks)
    scene = make_vlm(2, seed=VLM_TEST_SEED + 9)
    inputs = model_inputs(model.config, encode(processor.tokenizer, scene.prompts, image_tokens=TOKENS), scene.images)
    explanation = relevancy.explain(model, inputs, method="attnlrp")
    assert explanation.image_scores.shape == (2, GRID, GRID) and explanation.pixel_scores.shape == (2, 64, 64)
    patches = explanation.pixel_scores.unflatten(2, (GRID, 8)).unflatten(1, (GRID, 8)).sum((2, 4))
    torch.testing.assert_close(explanation.image_scores, patches)
    assert torch.isfinite(explanation.pixel_scores).all() and explanation.pixel_scores.abs().sum() > 0


def test_the_loader_picks_the_architecture_from_the_json(shipped):
    """`load_shapes_vlm` (the benchmark's loader) reads either shipped model by its .json; `relevancy.models` names it."""
    model, _ = load_shapes_vlm(QWEN_VL_WEIGHTS_PATH)
    assert type(model) is type(shipped[0])
    llava, _ = load_shapes_vlm(VLM_WEIGHTS_PATH)
    assert type(llava).__name__ == "LlavaForConditionalGeneration"
    vision = shapes_qwen_vl()[0].config.vision_config
    assert vision.fullatt_block_indexes == QWEN_VL_CONFIG["vision_config"]["fullatt_block_indexes"]


def test_a_step_exact_run_is_reproducible(tmp_path):
    from training import shapes_qwen_vl

    weights = []
    for name in ("a", "b"):
        shapes_qwen_vl.main(["--steps", "2", "--batch-size", "4", "--val-n", "4", "--threads", "1", "--log-every", "1",
                             "--train-tower", "--out", str(tmp_path / name)])
        model, _ = load_shapes_qwen_vl(tmp_path / name / "shapes_qwen_vl.safetensors")
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    meta = json.loads((tmp_path / "a" / "shapes_qwen_vl.json").read_text())
    assert meta["steps"] == 2 and meta["final"] and meta["config"] == QWEN_VL_CONFIG
    assert (tmp_path / "a" / "shapes_qwen_vl_train.log").is_file()


def test_the_command_evaluates_it_by_name(tmp_path):
    from relevancy.apps.cli import main

    out = tmp_path / "out"
    assert main(["evaluate", "--benchmark", "vlm-shapes", "--model", "shapes-qwen-vl", "-n", "3", "--methods", "attnlrp",
                 "--batch-size", "3", "--threads", "1", "--quiet", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == "shapes-qwen-vl" and results["grid"] == [GRID, GRID] and results["n"] == 3
    assert list(results["methods"]) == ["attnlrp", "patch_ablation", "random", "objects"]
