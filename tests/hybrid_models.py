"""Tiny random float64 hybrid decoders of linear and full attention (transformers' `Qwen3NextForCausalLM`,
`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) built from fixed seeds and configs: both layer types, the MoE and the
dense MLPs, grouped value heads in the linear attention (two value heads per key head) and grouped-query full
attention, RoPE on part of each head."""
from __future__ import annotations

import torch
import transformers

VOCAB = 96
#: the layers' token mixers: linear attention first and last, full attention between
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
_SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)
_MIXTURE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
#: family -> (config class, model class, config options, seed)
FAMILIES: dict[str, tuple[str, str, dict, int]] = {
    # the middle layer's MLP dense (`mlp_only_layers`), the others mixtures with a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(_SHARED, **_MIXTURE, mlp_only_layers=[1], rope_parameters=_ROPE), 40),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_SHARED, rope_parameters=dict(_ROPE, mrope_section=[2, 1, 1])), 41),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(_SHARED, **_MIXTURE, rope_parameters=dict(_ROPE, mrope_section=[2, 1, 1])), 42),
}


def build(family: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The family's tiny model: transformers' own initialisation from the family's seed, then the norms' weights
    (transformers starts Gemma-like ones at 0 and the gated norm's at 1), the decays' `A_log` and `dt_bias` and the
    routers drawn at random too, in `dtype`, eval mode."""
    config_name, model_name, options, seed = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**options, **overrides})
    config._experts_implementation = "eager"  # torch's grouped matrix product (transformers' default) has no float64
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight") or name.endswith(("A_log", "dt_bias")):
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif name.endswith("gate.weight"):
                parameter.copy_(torch.randn_like(parameter) * 0.2)
    return model.to(dtype).eval()
