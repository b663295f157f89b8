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

Beside it, a small Qwen2.5-VL (:func:`load_shapes_qwen_vl`, :data:`QWEN_VL_CONFIG`: an unmodified
``Qwen2_5_VLForConditionalGeneration``, windowed tower, 2 x 2 merger, 16 image tokens, the same vocabulary and
prompts; :func:`build_qwen_processor`), started from the LLaVA (:func:`qwen_vl_from_llava`); :func:`model_inputs`
writes a batch of scenes as either model takes them, :func:`load_shapes_vlm` loads either by its .json.

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

__all__ = ["VLM_CONFIG", "VLM_WEIGHTS_PATH", "QWEN_VL_CONFIG", "QWEN_VL_WEIGHTS_PATH", "VLM_TEST_SEED", "VLM_VAL_SEED",
           "SPECIAL_TOKENS", "IMAGE_TOKEN", "build_tokenizer", "build_processor", "build_qwen_processor", "build_shapes_llava",
           "load_shapes_llava", "build_shapes_qwen_vl", "load_shapes_qwen_vl", "load_shapes_vlm", "qwen_vl_from_llava",
           "merges_patches", "image_token_count", "model_inputs", "encode", "generate", "evaluate_vlm"]

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


QWEN_VL_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_qwen_vl.safetensors"
#: keyword arguments of :class:`transformers.Qwen2_5_VLConfig`: 8 x 8 patches of 8 pixels, merged 2 x 2 into 16
#: image tokens; windows of 32 pixels (2 x 2 merged tokens, four windows a scene) in all tower blocks but 2 and 5,
#: which attend over the whole image; the decoder the shapes LLaVA's shape (M-RoPE sections 4 + 4 + 4 of its 12
#: rotary frequencies), the same vocabulary, ``<image>`` the image placeholder
QWEN_VL_CONFIG = dict(
    vision_config=dict(depth=6, hidden_size=96, intermediate_size=384, num_heads=4, out_hidden_size=96, hidden_act="quick_gelu",
                       in_channels=3, patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                       fullatt_block_indexes=[2, 5]),
    text_config=dict(vocab_size=len(SPECIAL_TOKENS) + len(VOCABULARY), hidden_size=96, intermediate_size=256,
                     num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}),
    image_token_id=SPECIAL_TOKENS.index(IMAGE_TOKEN),
    tie_word_embeddings=False,
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
    return _load(Path(path) if path is not None else VLM_WEIGHTS_PATH, build_shapes_llava, "shapes_vlm", device), build_processor()


def _load(path: Path, build, trainer: str, device: str | torch.device) -> torch.nn.Module:
    """The model ``build(config)`` makes from the config in ``path.with_suffix('.json')``, the weights of ``path``
    loaded, in eval mode on ``device``; ``trainer`` names the training module that writes them."""
    from safetensors.torch import load_file

    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no weights/config at {path} / {meta_path}; run `python -m training.{trainer}`")
    meta = json.loads(meta_path.read_text())
    if tuple(meta["vocab"]) != SPECIAL_TOKENS + VOCABULARY:
        raise ValueError(f"{meta_path}: vocabulary differs from relevancy.worlds.vision_language's")
    model = build(meta["config"])
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    model.eval()
    model.image_mean, model.image_std = MEAN, STD  # what explanations undo to show the scenes
    return model.to(device)


def build_shapes_qwen_vl(config: dict | None = None, from_llava: bool = False):
    """Untrained ``Qwen2_5_VLForConditionalGeneration`` with :data:`QWEN_VL_CONFIG` (or ``config``); ``from_llava``
    starts it from the shipped shapes LLaVA (:func:`qwen_vl_from_llava`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**json.loads(json.dumps(config or QWEN_VL_CONFIG))))
    if from_llava:
        llava, _ = load_shapes_llava()
        model.load_state_dict(qwen_vl_from_llava(llava.state_dict(), model))
    return model


def qwen_vl_from_llava(llava: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """``model``'s state dict with the shapes LLaVA's (``llava``) carried over where it fits.  The decoder exactly: a
    Llama decoder is a Qwen2 decoder without the biases of queries, keys and values (zero here), and M-RoPE is the
    Llama's RoPE on text, whose three positions are equal.  The tower approximately: the CLIP's patch convolution
    halved over the two temporal copies, each block's attention (queries, keys and values fused) and its MLP (the
    gated MLP ``down(act(gate x) * up x)`` with ``up x = 1``: weight zero, bias one), the LayerNorms' scales as the
    RMSNorms' (their shifts, the CLIP's [CLS], position embeddings and pre-norm have no place; merger: new)."""
    state = model.state_dict()
    for name in state:
        if name.startswith("model.language_model.") or name.startswith("lm_head."):
            state[name] = llava[name].clone() if name in llava else torch.zeros_like(state[name])
    clip = "model.vision_tower."
    conv = llava[clip + "embeddings.patch_embedding.weight"]
    state["model.visual.patch_embed.proj.weight"] = conv.unsqueeze(2).expand_as(state["model.visual.patch_embed.proj.weight"]) / conv.new_tensor(
        state["model.visual.patch_embed.proj.weight"].shape[2])
    for i in range(len(model.model.visual.blocks)):
        src, dst = f"{clip}encoder.layers.{i}.", f"model.visual.blocks.{i}."
        for part in ("weight", "bias"):
            state[dst + f"attn.qkv.{part}"] = torch.cat([llava[src + f"self_attn.{x}_proj.{part}"] for x in "qkv"])
            state[dst + f"attn.proj.{part}"] = llava[src + f"self_attn.out_proj.{part}"].clone()
            state[dst + f"mlp.gate_proj.{part}"] = llava[src + f"mlp.fc1.{part}"].clone()
            state[dst + f"mlp.down_proj.{part}"] = llava[src + f"mlp.fc2.{part}"].clone()
        state[dst + "mlp.up_proj.weight"] = torch.zeros_like(state[dst + "mlp.up_proj.weight"])
        state[dst + "mlp.up_proj.bias"] = torch.ones_like(state[dst + "mlp.up_proj.bias"])
        state[dst + "norm1.weight"] = llava[src + "layer_norm1.weight"].clone()
        state[dst + "norm2.weight"] = llava[src + "layer_norm2.weight"].clone()
    return state


def load_shapes_qwen_vl(path: str | Path | None = None, device: str | torch.device = "cpu"):
    """The shipped shapes Qwen2.5-VL in eval mode and its processor, ``(model, processor)``: reads
    ``shapes_qwen_vl.safetensors`` and ``shapes_qwen_vl.json`` beside it; no network access."""
    model = _load(Path(path) if path is not None else QWEN_VL_WEIGHTS_PATH, build_shapes_qwen_vl, "shapes_qwen_vl", device)
    return model, build_qwen_processor()


def build_qwen_processor(tokenizer=None):
    """``Qwen2_5_VLProcessor``: the tokenizer and a ``Qwen2VLImageProcessor`` that keeps the scenes' 64 x 64 pixels
    (no resize), rescales to [0, 1], normalises with the world's mean and std and flattens 8 x 8 patches in the
    merger's order; ``"<image>"`` in a text becomes :data:`QWEN_IMAGE_TOKENS` placeholders."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    vision = QWEN_VL_CONFIG["vision_config"]
    sizes = dict(do_resize=False, image_mean=list(MEAN), image_std=list(STD), patch_size=vision["patch_size"],
                 merge_size=vision["spatial_merge_size"], temporal_patch_size=vision["temporal_patch_size"])
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer or build_tokenizer(),
                               video_processor=Qwen2VLVideoProcessor(**sizes))  # the class asks for one; no videos here


def merges_patches(config) -> bool:
    """Whether a model of ``config`` is a Qwen2-VL (its tower merges patches, it takes flattened patches); otherwise a
    LLaVA (or a stand-in), which takes the images."""
    return getattr(config.vision_config, "spatial_merge_size", None) is not None


def image_token_count(config) -> int:
    """The image tokens a prompt holds for a model of ``config``: the LLaVA's ``image_seq_length``, a Qwen2-VL's
    merged patches."""
    if not merges_patches(config):
        return int(config.image_seq_length)
    vision = config.vision_config
    return (IMAGE_SIZE // vision.patch_size // vision.spatial_merge_size) ** 2


def model_inputs(config, enc: dict[str, torch.Tensor], images: torch.Tensor) -> dict[str, torch.Tensor]:
    """``enc`` (:func:`encode`'s ids) with ``images`` (normalised (n, 3, 64, 64)) as a model of ``config`` takes them:
    the LLaVA's ``pixel_values`` as they are; a Qwen2-VL's flattened patches (the image processor's own ``patchify``),
    one ``image_grid_thw`` row each and ``mm_token_type_ids`` (1 on the image tokens), as its processor writes them."""
    if not merges_patches(config):
        return dict(enc, pixel_values=images)
    from transformers import Qwen2VLImageProcessor

    vision = config.vision_config
    patches, h, w = Qwen2VLImageProcessor().patchify(images, vision.patch_size, vision.spatial_merge_size,
                                                     vision.temporal_patch_size)
    return dict(enc, pixel_values=patches.flatten(0, 1), image_grid_thw=torch.tensor([[1, h, w]] * len(images)),
                mm_token_type_ids=(enc["input_ids"] == config.image_token_id).int())


def load_shapes_vlm(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, processor)`` of a shapes vision-language model's weights file, the LLaVA or the Qwen2.5-VL as the
    config in its .json says (a Qwen2.5-VL's names ``image_token_id``, a LLaVA's ``image_token_index``)."""
    path = Path(path)
    meta_path = path.with_suffix(".json")
    config = json.loads(meta_path.read_text())["config"] if meta_path.is_file() else {}
    return (load_shapes_qwen_vl if "image_token_id" in config else load_shapes_llava)(path, device)


def encode(tokenizer, prompts: list[str], answers: list[str] | None = None, turns: int = 1,
           image_tokens: int = IMAGE_TOKENS) -> dict[str, torch.Tensor]:
    """Token ids as the processor writes them for ``"<image> " + prompt`` (``<s>``, ``image_tokens`` image tokens: the
    LLaVA's 65, the Qwen2.5-VL's 16; the prompt's words), left-padded, for generation; with ``answers``, for training:
    each answer and ``</s>`` after its prompt, ``turns`` consecutive items (about one scene) one conversation per row
    (the image once, then prompt, answer, ``</s>``, prompt, ...), right padding, ``labels`` -100 but on the answers'
    tokens and their ``</s>``."""
    image = " ".join([IMAGE_TOKEN] * image_tokens)
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
        enc = model_inputs(model.config, encode(tokenizer, prompts[s:s + batch_size], image_tokens=image_token_count(model.config)),
                           images[s:s + batch_size])
        ids = model.generate(**{k: v.to(device) for k, v in enc.items()}, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
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
