"""Small decoders trained on the retrieval world (`worlds.language`), one per kind of token mixer, so that the
llm-retrieval benchmark tells how the rules of each mixer find the supporting fact:

- `attention`: a Llama decoder (attention only);
- `deltanet`: a Qwen3.5 text decoder, gated DeltaNet (linear attention) layers beside full attention;
- `mamba2`: a Falcon-H1 decoder, a Mamba-2 mixer beside attention in every layer.

All three read the world through one word-level tokenizer of the world's own vocabulary (`world_tokenizer`: each
word and punctuation mark a token, offsets kept, so the benchmark maps the facts' character spans to tokens), have
the same width and depth, and are trained by `training/retrieval_models.py` to answer the next token after
`Answer: <name> lives in`. A trained model ships as a transformers folder (`save_pretrained`: config, weights,
tokenizer, its card and training log) under `weights/retrieval_<mixer>/` (`shipped()`: the Mamba-2 hybrid's, which
answers all of 1,000 test prompts; the other two did not learn to bind a person to a value yet).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from . import language

WEIGHTS = Path(__file__).parent / "weights"
#: the tokenizer's special tokens: padding (never read: rows are masked) and unknown words
PAD, UNK = "[PAD]", "[UNK]"
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)
#: mixer -> (transformers config class, model class, config options beyond the common ones)
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "attention": ("LlamaConfig", "LlamaForCausalLM", {}),
    # linear attention in layers 0 and 2, full attention (with its output gate) in 1 and 3
    "deltanet": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                 dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [2, 1, 1]})),
    # a Mamba-2 mixer (4 heads of 16, a state of 16) beside attention in each layer; muP multipliers at 1
    "mamba2": ("FalconH1Config", "FalconH1ForCausalLM",
               dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
                    mamba_rms_norm=True, mamba_norm_before_gate=False)),
}


def world_vocabulary() -> list[str]:
    """Every word and punctuation mark the world writes, in a fixed order: its templates filled with every name and
    value, split as the tokenizer's pre-tokenizer splits them."""
    from tokenizers.pre_tokenizers import Whitespace

    split = Whitespace().pre_tokenize_str
    texts = ["Question: Answer:"]
    for values, fact, question, prefix in language.KINDS.values():
        texts += [template.format(name=name, value=value) for name in language.NAMES for value in values
                  for template in (fact, question, prefix)]
    return [PAD, UNK, *sorted({piece for text in texts for piece, _ in split(text)})]


@functools.lru_cache(maxsize=1)
def world_tokenizer():
    """A transformers fast tokenizer of the world's words (word-level; spaces and newlines separate, never tokens)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = world_vocabulary()
    tokenizer = Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, unk_token=UNK)


def build(mixer: str, seed: int = 0, **sizes: int) -> nn.Module:
    """An untrained model of `mixer` ("attention", "deltanet", "mamba2") over the world's vocabulary, float32;
    `sizes` override the common config's (`hidden_size=128, intermediate_size=256`: a wider model)."""
    import transformers

    if mixer not in ARCHITECTURES:
        raise ValueError(f"unknown mixer {mixer!r}; the retrieval models: {', '.join(ARCHITECTURES)}")
    config_name, model_name, options = ARCHITECTURES[mixer]
    config = getattr(transformers, config_name)(vocab_size=len(world_vocabulary()), **{**_COMMON, **options, **sizes})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def folder(mixer: str) -> Path:
    """Where the trained model of `mixer` ships."""
    return WEIGHTS / f"retrieval_{mixer}"


def shipped() -> tuple[str, ...]:
    """The mixers whose trained model ships (a folder with its config)."""
    return tuple(mixer for mixer in ARCHITECTURES if (folder(mixer) / "config.json").is_file())


def load(mixer: str) -> tuple[nn.Module, object]:
    """`(model, tokenizer)`: the shipped retrieval model of `mixer`, eval mode."""
    if mixer not in shipped():
        raise ValueError(f"no shipped retrieval model {mixer!r}; the retrieval models: {', '.join(shipped())}")
    return load_folder(folder(mixer))


def load_folder(path: Path) -> tuple[nn.Module, object]:
    """`(model, tokenizer)` saved by the trainer in `path`, eval mode."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    return AutoModelForCausalLM.from_pretrained(path).eval(), PreTrainedTokenizerFast.from_pretrained(path)
