"""`relevancy.explain_generation` on the tiny random float64 LLaVA of `vlm_models.py` with the offline processor of
`vlm_processor.py`: every generated token's text and image maps, from one forward, equal `explain` on that prefix
with that token as target; the result's JSON, page and picture; the model left as it was; bad requests named."""
from __future__ import annotations

import json

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from test_causal_lm import assert_close_to
from vlm_models import IMAGE_TOKEN, build, inputs
from vlm_processor import picture, processor

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm import generation
from relevancy.families.vision_language import VisionLanguageGenerationExplanation

PROMPT = "what is in the image ?"


@pytest.fixture(scope="module")
def llava():
    return build("llava")


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "input_x_gradient"])
def test_each_tokens_maps_equal_explain_on_its_prefix(llava, method, monkeypatch):
    monkeypatch.setattr(generation, "ROWS_PER_BACKWARD", 3)  # five tokens: two batched backward passes
    made = processor()
    result = relevancy.explain_generation(llava, made, PROMPT, image=picture(), max_new_tokens=5, method=method)
    inputs = made(images=picture(), text=f"<image>\n{PROMPT}", return_tensors="pt")
    start = inputs["input_ids"].shape[1]
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.prompt_length == start
    assert result.scores.shape == (5, start + 5) and result.image_scores.shape == (5, 4, 4)
    assert result.scores.dtype == result.image_scores.dtype == torch.float64
    assert result.image_tokens.tolist() == [t == IMAGE_TOKEN for t in inputs["input_ids"][0].tolist()] + [False] * 5
    ids = torch.cat([inputs["input_ids"], result.generated_ids[None]], 1)
    for g in range(5):
        alone = relevancy.explain(llava, {"input_ids": ids[:, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long),
                                          "pixel_values": inputs["pixel_values"]}, method=method, target=int(result.generated_ids[g]))
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"{method} text {g}", 1e-10)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"{method} image {g}", 1e-10)
        assert (result.scores[g, start + g:] == 0).all()
        assert torch.allclose(result.logits[g, 0], alone.logits[0, result.generated_ids[g]])
        if alone.relevance_total is not None:
            assert torch.allclose(result.relevance_total[g], alone.relevance_total[0])
        else:
            assert result.relevance_total is None
    assert not torch.equal(result.image_scores[0], result.image_scores[1])  # each token has a map of its own


def test_a_forced_continuation_the_page_the_picture_and_the_json(llava, tmp_path):
    made = processor()
    result = relevancy.explain_generation(llava, made, PROMPT, continuation="a red star", image=picture(1), method="attnlrp")
    assert result.generated_ids.tolist() == made.tokenizer("a red star", add_special_tokens=False)["input_ids"]
    assert result.heatmap().shape == (3, 16, 16) and result.image_url.startswith("data:image/png;base64,")
    page = result.save(tmp_path / "generation.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "relevancyGeneration" in page and result.image_url in page
    assert "http://" not in page and "https://" not in page  # self-contained
    assert result.save(tmp_path / "generation.png").read_bytes()[:4] == b"\x89PNG"
    again = relevancy.load(json.loads(json.dumps(result.to_json())))
    assert type(again) is type(result) and again.to_json() == result.to_json()
    assert torch.equal(again.image_scores, result.image_scores) and torch.equal(again.image_tokens, result.image_tokens)


def test_the_model_is_left_as_it_was(llava):
    made = processor()
    relevancy.explain_generation(llava, made, PROMPT, image=picture(), max_new_tokens=1)  # transformers' own first-run hooks
    before = snapshot(llava)
    relevancy.explain_generation(llava, made, PROMPT, image=picture(), max_new_tokens=2, method="cp_lrp")
    with pytest.raises(ValueError, match="continuation token ids must be in the model's vocabulary"):
        relevancy.explain_generation(llava, made, PROMPT, continuation=[500], image=picture())
    asked = []  # should_stop answers True at its third question: inside the decoding, the model switched for the call
    with pytest.raises(relevancy.core.cancel.Cancelled):
        relevancy.explain_generation(llava, made, PROMPT, image=picture(), max_new_tokens=4,
                                     should_stop=lambda: asked.append(1) or len(asked) >= 3)
    assert_same(before, snapshot(llava))


def test_bad_requests_are_named(llava, tmp_path):
    from test_causal_lm import build as build_decoder
    from test_generation import Characters

    made = processor()
    with pytest.raises(ValueError, match="generates about an image: pass image="):
        relevancy.explain_generation(llava, made, PROMPT)
    with pytest.raises(ValueError, match="the prompt is one non-empty text"):
        relevancy.explain_generation(llava, made, [PROMPT, PROMPT], image=picture())
    with pytest.raises(TypeError, match="generates with its processor"):
        relevancy.explain_generation(llava, made.tokenizer, PROMPT, image=picture())
    with pytest.raises(ValueError, match="image= is read by vision-language decoders; the decoder language model family reads text only"):
        relevancy.explain_generation(build_decoder("llama"), Characters(), "abc", image=picture())
    with pytest.raises(ValueError, match="methods of explain_generation"):
        relevancy.explain_generation(llava, made, PROMPT, image=picture(), method="nope")
    with pytest.raises(UnsupportedModelError, match="explain_generation on a vision-language decoder takes the methods of one forward over "
                                                    "prompt, image and generation: attnlrp, cp_lrp, input_x_gradient, "
                                                    "token_activation_map; got 'rollout'"):
        relevancy.explain_generation(llava, made, PROMPT, image=picture(), method="rollout")
    with pytest.raises(ValueError, match="does not exist"):
        relevancy.explain_generation(llava, made, PROMPT, image=tmp_path / "missing.png")
    with pytest.raises(ValueError, match="the processor has no chat template"):
        relevancy.explain_generation(llava, made, [{"role": "user", "content": PROMPT}], image=picture())
    made.chat_template = "{% for message in messages %}{{ message['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="each chat message is a dict with a 'role' and a 'content'"):
        relevancy.explain_generation(llava, made, [{"role": "user", "content": 3}], image=picture())
    with pytest.raises(ValueError, match="chat messages about an image need a user message"):
        relevancy.explain_generation(llava, made, [{"role": "system", "content": PROMPT}], image=picture())


class GivenInputs:
    """A processor stand-in for the families `vlm_processor.py` has no processor for: it answers `vlm_models.inputs`
    (one row) whatever the prompt and image, with the word-level tokenizer and a [-1, 1] normalisation."""

    image_token = "<image>"

    def __init__(self, family: str) -> None:
        from vlm_processor import tokenizer

        self.family, self.tokenizer = family, tokenizer()
        self.image_processor = type("ImageProcessor", (), {"image_mean": [0.5] * 3, "image_std": [0.5] * 3})()

    def __call__(self, images: object, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return inputs(self.family, lengths=(4,))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("family", ["llava_full", "gemma3", "idefics3", "paligemma", "paligemma2", "internvl", "internvl_rms"])
def test_every_familys_generation_equals_explain(family):
    """LLaVA with [CLS] kept and two tower layers (Qwen2 decoder), Gemma 3 (pooled projector, each image's tokens
    attending to each other), Idefics3 (pixel shuffle, one image of shape (1, 3, H, W) per row), PaliGemma 1 and 2
    (image and prompt a prefix attending both ways: row g equals explain on the prefix with the g generated tokens
    typed 1, after the prefix, as the model's generate types them), InternVL (InternViT's layer scale, pixel shuffle,
    a normed projector; InternViT-6B's RMSNorms and query and key norms with a Llama decoder)."""
    model = build(family)
    result = relevancy.explain_generation(model, GivenInputs(family), PROMPT, image=picture(), max_new_tokens=3, method="cp_lrp")
    batch = inputs(family, lengths=(4,))
    start = batch["input_ids"].shape[1]
    ids = torch.cat([batch["input_ids"], result.generated_ids[None]], 1)
    assert result.image_scores.shape == (3, 4, 4) and result.image_url.startswith("data:image/png;base64,")
    for g in range(3):
        types = {"token_type_ids": torch.cat([batch["token_type_ids"], torch.ones(1, g, dtype=torch.long)], 1)} if "token_type_ids" in batch else {}
        alone = relevancy.explain(model, {"input_ids": ids[:, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long),
                                          "pixel_values": batch["pixel_values"], **types}, method="cp_lrp", target=int(result.generated_ids[g]))
        assert_close_to(result.scores[g, :start + g], alone.scores[0], f"{family} text {g}", 1e-10)
        assert_close_to(result.image_scores[g], alone.image_scores[0], f"{family} image {g}", 1e-10)
        assert torch.allclose(result.relevance_total[g], alone.relevance_total[0])
