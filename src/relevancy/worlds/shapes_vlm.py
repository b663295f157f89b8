"""A small LLaVA that describes shapes scenes and answers questions about them in words (an unmodified
``transformers.LlavaForConditionalGeneration``: CLIP vision tower, projector, Llama decoder).

>>> from relevancy.worlds.shapes_vlm import load_shapes_llava
>>> model, processor = load_shapes_llava()      # shipped weights, eval mode, offline
>>> inputs = processor(images=picture, text="<image> what color is the star", return_tensors="pt")
>>> ids = model.generate(**inputs, max_new_tokens=12)          # "... red </s>"

The vision tower is the shipped shapes CLIP's (:mod:`relevancy.worlds.shapes_clip`: 64x64 scenes, 8x8 patches, so
65 image tokens: [CLS], kept, and the 64 patches), trained further with the rest (see ``vlm_train``); the projector reads its layers 1 and 6; the decoder is a six-layer Llama with grouped
query attention over a word-level vocabulary (:func:`build_tokenizer`: the words of
:data:`~relevancy.worlds.vision_language.VOCABULARY` and ``<pad> <s> </s> <unk> <image>``, a ``PreTrainedTokenizerFast``
built offline with the ``tokenizers`` package); :func:`build_processor` is the ``LlavaProcessor`` around it and a
``CLIPImageProcessor`` that takes the scenes' pixels as they are (mean = std = 0.5).  A prompt is
``<s> <image> x 65`` and the prompt's words; the answer follows, ended by ``</s>``.

Evaluation (:func:`evaluate_vlm`) generates greedily for ``make_vlm(n, VLM_TEST_SEED)`` and counts exact answers;
training seeds are all below ``EVAL_SEED_BASE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .shapes_vit import EVAL_SEED_BASE, WEIGHTS_DIR
from .scenes import IMAGE_SIZE, MEAN, PATCH_SIZE, STD
from .vision_language import TASKS, VOCABULARY, VlmBatch, make_vlm

__all__ = ["VLM_CONFIG", "VLM_WEIGHTS_PATH", "VLM_TEST_SEED", "VLM_VAL_SEED", "SPECIAL_TOKENS", "IMAGE_TOKEN",
           "build_tokenizer", "build_processor", "build_shapes_llava", "load_shapes_llava", "encode", "generate",
           "evaluate_vlm"]

VLM_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_llava.safetensors"
#: make_vlm seed of the test items (scene seeds this, +1, +2)
VLM_TEST_SEED = EVAL_SEED_BASE + 50_000
#: make_vlm seed of the validation items logged during training
VLM_VAL_SEED = EVAL_SEED_BASE + 60_000
IMAGE_TOKEN = "<image>"
#: the special tokens, ids 0..4: padding, begin and end of a sequence, unknown words, the image placeholder
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", IMAGE_TOKEN)
GRID = IMAGE_SIZE // PATCH_SIZE
#: the tower's [CLS] and its patches ("full": [CLS] is kept, the tower's summary of the scene)
IMAGE_TOKENS = GRID * GRID + 1
#: the most words an answer holds (three objects described) and the generation's limit in tokens
MAX_NEW_TOKENS = 16

#: keyword arguments of :class:`transformers.LlavaConfig` (the vision tower: the shapes CLIP's).  The projector reads
#: the tower's first and last layers side by side (LLaVA's list of feature layers): the last layer says what each
#: patch shows but has all but lost where it is (a linear probe of the patch's row and column on object patches:
#: R^2 0.83 at the embeddings, 0.70 after layer 1, 0.19 after layer 6), which the relations ("left of", "what is
#: above the circle") need.
VLM_CONFIG = dict(
    vision_config=dict(model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3,
                       hidden_size=96, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                       hidden_act="quick_gelu", projection_dim=128),
    text_config=dict(model_type="llama", vocab_size=len(SPECIAL_TOKENS) + len(VOCABULARY), hidden_size=96,
                     intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2),
    image_token_index=SPECIAL_TOKENS.index(IMAGE_TOKEN),
    image_seq_length=IMAGE_TOKENS,
    vision_feature_layer=[-6, -1],
    vision_feature_select_strategy="full",
    projector_hidden_act="gelu",
    pad_token_id=0,
)


def build_tokenizer(words: tuple[str, ...] = VOCABULARY):
    """The word-level tokenizer (``PreTrainedTokenizerFast``): ids 0..4 :data:`SPECIAL_TOKENS`, then ``words``;
    text splits at whitespace, ``<s>`` is put first, padding goes left (for batched generation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS + tuple(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN},
                                   padding_side="left")


def build_processor(tokenizer=None):
    """``LlavaProcessor``: the tokenizer and a ``CLIPImageProcessor`` resizing to 64x64 (scenes stay as they are),
    rescaling to [0, 1] and normalising with the shapes world's mean and std."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=False,
                                image_mean=list(MEAN), image_std=list(STD), do_convert_rgb=True)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer or build_tokenizer(), patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="full", num_additional_image_tokens=1,
                          image_token=IMAGE_TOKEN)


def _config(cfg: dict):
    from transformers import LlavaConfig

    return LlavaConfig(**json.loads(json.dumps(cfg)))  # a copy: LlavaConfig takes its sub-configs' dicts over


def build_shapes_llava(config: dict | None = None, vision_from_clip: bool = False):
    """Untrained ``LlavaForConditionalGeneration`` with :data:`VLM_CONFIG` (or ``config``); ``vision_from_clip``
    starts its vision tower from the shipped shapes CLIP's."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(_config(config or VLM_CONFIG))
    if vision_from_clip:
        from .shapes_clip import load_clip

        clip, _ = load_clip()
        model.model.vision_tower.load_state_dict(clip.vision_model.state_dict())
    return model


def load_shapes_llava(path: str | Path | None = None, device: str | torch.device = "cpu"):
    """The shipped shapes LLaVA in eval mode and its processor, ``(model, processor)``.

    Reads ``shapes_llava.safetensors`` and, beside it, ``shapes_llava.json`` (config, vocabulary); no network access.
    """
    from safetensors.torch import load_file

    path = Path(path) if path is not None else VLM_WEIGHTS_PATH
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no weights/config at {path} / {meta_path}; run `python -m training.shapes_vlm`")
    meta = json.loads(meta_path.read_text())
    if tuple(meta["vocab"]) != SPECIAL_TOKENS + VOCABULARY:
        raise ValueError(f"{meta_path}: vocabulary differs from relevancy.worlds.vision_language's")
    model = build_shapes_llava(meta["config"])
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state)
    model.eval()
    model.image_mean, model.image_std = MEAN, STD  # what explanations undo to show the scenes
    return model.to(device), build_processor()


def encode(tokenizer, prompts: list[str], answers: list[str] | None = None, turns: int = 1) -> dict[str, torch.Tensor]:
    """Token ids as the processor writes them for ``"<image> " + prompt`` (``<s>``, 65 image tokens, the prompt's
    words), left-padded, for generation; with ``answers``, for training: each answer and ``</s>`` after its prompt,
    ``turns`` consecutive items (about one scene) one conversation per row (the image once, then prompt, answer,
    ``</s>``, prompt, ...), right padding, ``labels`` -100 but on the answers' tokens and their ``</s>``."""
    image = " ".join([IMAGE_TOKEN] * IMAGE_TOKENS)
    if answers is None:
        rows = [tokenizer(f"{image} {p}")["input_ids"] for p in prompts]
        _check_words(tokenizer, prompts, rows)
        length = max(map(len, rows))
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, length - len(r):] = torch.tensor(r)
            mask[b, length - len(r):] = 1
        return {"input_ids": ids, "attention_mask": mask}
    if len(prompts) % turns:
        raise ValueError(f"{len(prompts)} prompts do not make conversations of {turns} turns")
    rows, scored = [], []
    for start in range(0, len(prompts), turns):
        ids = tokenizer(image)["input_ids"]
        label = [-100] * len(ids)
        for p, a in zip(prompts[start:start + turns], answers[start:start + turns]):
            asked = tokenizer(p, add_special_tokens=False)["input_ids"]
            said = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            _check_words(tokenizer, [p, a], [asked, said])
            ids, label = ids + asked + said, label + [-100] * len(asked) + said
        rows.append(ids)
        scored.append(label)
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for b, (r, label) in enumerate(zip(rows, scored)):
        ids[b, :len(r)] = torch.tensor(r)
        labels[b, :len(r)] = torch.tensor(label)
        mask[b, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _check_words(tokenizer, texts: list[str], rows: list[list[int]]) -> None:
    """A ValueError naming the first text with a word outside the vocabulary (tokenized as ``<unk>``)."""
    unknown = [t for t, r in zip(texts, rows) if tokenizer.unk_token_id in r]
    if unknown:
        raise ValueError(f"{unknown[0]!r} has words outside the shapes world's vocabulary")


@torch.no_grad()
def generate(model, tokenizer, images: torch.Tensor, prompts: list[str], batch_size: int = 256) -> list[str]:
    """The greedy answer (words, without ``</s>``) to each prompt about each image (normalised (n, 3, 64, 64))."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, len(prompts), batch_size):
        enc = encode(tokenizer, prompts[s:s + batch_size])
        ids = model.generate(**{k: v.to(device) for k, v in enc.items()}, pixel_values=images[s:s + batch_size].to(device),
                             max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [" ".join(a.split()) for a in out]


@torch.no_grad()
def evaluate_vlm(model, tokenizer, n: int = 1000, seed: int = VLM_TEST_SEED, batch: VlmBatch | None = None) -> dict:
    """Exact-match accuracy of the greedy answers on ``n`` unseen scenes (one task each, ``make_vlm(n, seed)``):
    ``{"overall", "per_task", "count_per_task", "object_words", "n", "seed"}``; ``object_words`` is the share of the
    answers' colour and shape words (those naming an object) that are right, word by word."""
    was_training = model.training
    model.eval()
    try:
        batch = batch if batch is not None else make_vlm(n, seed)
        said = generate(model, tokenizer, batch.images, batch.prompts)
    finally:
        model.train(was_training)
    right = np.array([a == b for a, b in zip(said, batch.answers)])
    words_right = words = 0
    for s, truth, named in zip(said, batch.answers, batch.named):
        got, want = s.split(), truth.split()
        for p, j in enumerate(named):
            if j >= 0:
                words += 1
                words_right += p < len(got) and got[p] == want[p]
    per_task, counts = {}, {}
    for t, name in enumerate(TASKS):
        sel = batch.task == t
        counts[name] = int(sel.sum())
        per_task[name] = float(right[sel].mean()) if sel.any() else float("nan")
    return {"overall": float(right.mean()), "per_task": per_task, "count_per_task": counts,
            "object_words": words_right / max(words, 1), "n": len(batch), "seed": seed}
