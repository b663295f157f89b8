"""Tiny random float64 hybrid decoders of attention and another token mixer beyond Qwen3-Next's (transformers'
`Lfm2ForCausalLM`: gated short convolutions) built from fixed seeds and configs: both layer types, grouped-query
attention with query and key norms, no bias anywhere."""
from __future__ import annotations

import torch
from state_space_models import from_spec

VOCAB = 96
#: family -> (config class, model class, config options, seed)
FAMILIES: dict[str, tuple[str, str, dict, int]] = {
    # short convolutions (over 3 positions) first and last, attention between
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                  block_auto_adjust_ff_dim=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                  initializer_range=0.2), 50),
}


def build(family: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The family's tiny model: transformers' own initialisation from the family's seed, the norms' weights drawn at
    random too (`state_space_models.from_spec`)."""
    return from_spec(FAMILIES[family], dtype, **overrides)
