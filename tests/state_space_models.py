"""Tiny random float64 state-space decoders (transformers' `MambaForCausalLM`, `Mamba2ForCausalLM` and the hybrid
`FalconH1ForCausalLM`) built from fixed
seeds and configs, with no relevancy import: `benchmarks/mamba_lrp_reference.py` builds the same models in MambaLRP's
venv. The residual stays in the model's dtype (`residual_in_fp32=False`: transformers' default rounds a float64
model's residual stream to float32)."""
from __future__ import annotations

import torch
import transformers

VOCAB = 96
#: family -> (config class, model class, config options, seed)
FAMILIES: dict[str, tuple[str, str, dict, int]] = {
    # two layers, a state of 8 per channel, a convolution over 4 positions, no Linear bias (the convolution has one)
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                   time_step_rank=4, use_bias=False, use_conv_bias=True, residual_in_fp32=False, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True), 30),
    # 8 heads of 8 in 2 groups of B and C, a state of 8 per head
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, num_heads=8,
                    head_dim=8, n_groups=2, chunk_size=4, use_bias=False, use_conv_bias=True, residual_in_fp32=False,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True), 31),
    # Falcon-H1: a Mamba-2 mixer (4 heads of 8, 2 groups) beside attention (4 heads, 2 key-value heads) in each layer,
    # its gated norm, and every muP multiplier away from 1
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                       mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, mamba_rms_norm=True, mamba_norm_before_gate=False,
                       embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9,
                       attention_in_multiplier=1.1, attention_out_multiplier=0.7, ssm_multipliers=[1.0, 1.1, 0.9, 1.2, 0.8],
                       ssm_in_multiplier=1.3, ssm_out_multiplier=0.6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=True, initializer_range=0.2), 32),
}


def build(family: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The family's tiny model (`from_spec`)."""
    return from_spec(FAMILIES[family], dtype, **overrides)


def from_spec(spec: tuple[str, str, dict, int], dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The tiny model of `spec` (config class, model class, config options, seed): transformers' own initialisation
    from the seed, then the norms' weights, the skips `D` and the convolutions' biases drawn at random too
    (transformers starts them at 1, 1 and 0), in `dtype`, eval mode."""
    config_name, model_name, options, seed = spec
    config = getattr(transformers, config_name)(**{**options, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight") or name.endswith(".D"):
                parameter.copy_(torch.randn_like(parameter) * 0.3 + 1.0)
            elif name.endswith("conv1d.bias"):
                parameter.copy_(torch.randn_like(parameter) * 0.1)
    return model.to(dtype).eval()
