"""Tiny random float64 hybrid decoders of attention and another token mixer beyond Qwen3-Next's (transformers'
`Lfm2ForCausalLM`: gated short convolutions; `MiniMaxForCausalLM`: lightning attention) built from fixed seeds and
configs: both layer types, grouped-query attention (LFM2's with query and key norms), no bias anywhere."""
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
    # lightning attention first and last (blocks of 2 positions in the model's own forward, which the test batches' left
    # padding of 2 and 4 positions keeps aligned: its float32 norms round a realigned block's float64 sums otherwise,
    # 9e-4 of the input x gradient map measured with blocks of 4), softmax attention between,
    # a mixture of experts (top 2 of 4) in every layer, the residuals and the branches times constants other than 1
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=128, block_size=2,
                     layer_types=["linear_attention", "full_attention", "linear_attention"], num_local_experts=4, num_experts_per_tok=2,
                     full_attn_alpha_factor=0.9, full_attn_beta_factor=1.2, linear_attn_alpha_factor=1.1, linear_attn_beta_factor=0.8,
                     mlp_alpha_factor=0.7, mlp_beta_factor=1.3, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                     initializer_range=0.2, experts_implementation="eager"), 60),  # eager: torch's grouped product has no float64
}


def build(family: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The family's tiny model: transformers' own initialisation from the family's seed, the norms' weights drawn at
    random too (`state_space_models.from_spec`)."""
    return from_spec(FAMILIES[family], dtype, **overrides)
