"""Tiny random float64 decoders of every layout relevancy maps beyond Llama and GPT-2, built from fixed seeds and
configs (no relevancy import: `benchmarks/llm_lxt_families.py` builds the same models in lxt's venv). The
reference file records a checksum of each model's weights, so a transformers version that initialises them
otherwise is named as the cause rather than seen as a wrong map."""
from __future__ import annotations

import hashlib

import torch
import transformers

VOCAB = 96
_SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, initializer_range=0.2, tie_word_embeddings=True)
#: family -> (config class, model class, config options beyond `_SHARED`, seed)
FAMILIES: dict[str, tuple[str, str, dict, int]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8), 10),
    # a sliding-window layer (window 4 < the 7-token prompt) and a full one; Gemma's query scale
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8), 11),
    # a mixture of experts in the first layer, a dense MLP in the second; top 2 of 4 experts
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                       mlp_only_layers=[1], experts_implementation="eager"), 12),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"), 13),
    # soft-capped attention scores and logits (small weights: the capped logits stay off tanh's flat ends)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8, initializer_range=0.05,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0), 14),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, eos_token_id=2, bos_token_id=1, partial_rotary_factor=0.5), 15),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0, eos_token_id=2, bos_token_id=1), 16),
    # parallel residual, a quarter of each head rotated
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(num_key_value_heads=None, rotary_pct=0.25, use_parallel_residual=True, eos_token_id=2, bos_token_id=1), 17),
    # one weight-only LayerNorm before attention and the MLP side by side, per-head query and key norms, interleaved
    # RoPE, the logits times 0.5; no biases
    "cohere": ("CohereConfig", "CohereForCausalLM",
               dict(use_qk_norm=True, logit_scale=0.5, pad_token_id=0, eos_token_id=2, bos_token_id=1), 18),
    # a dense first layer, then routed experts (top 2 of 4 in 2 groups, a sigmoid router with a correction bias)
    # beside a shared expert; query and key norms, half of each head rotated
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                      first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5, use_qk_norm=True,
                      partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                      experts_implementation="eager"), 19),
    # attention sinks, a sliding-window layer (window 4 < the 7-token prompt) and a full one, a mixture of experts in
    # both (top 2 of 4, a router with a bias, experts with biases; the SwiGLU's clamp at 1 cuts some values)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0), pad_token_id=0, eos_token_id=2,
                     bos_token_id=1, experts_implementation="eager"), 20),
    # multi-head latent attention (low-rank queries, a latent of 16 for keys and values, 8 + 4 query and key dims of
    # which 4 rotated on interleaved pairs, values of 6; yarn's mscale in the scale), a dense first layer, then GLM's
    # mixture (top 2 of 4 in 2 groups, a sigmoid router with a correction bias, a shared expert)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                         v_head_dim=6, rope_interleave=True, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                         n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=8,
                                              mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0),
                         pad_token_id=0, eos_token_id=2, bos_token_id=1, experts_implementation="eager"), 21),
    # a chunked layer with RoPE and the query and key norm (chunks of 4 < the 7-token prompt) and a global one without
    # either, whose queries' temperature is tuned (floor_scale 2: factors above 1 from the second position on); a
    # mixture (top 2 of 4 routed experts fed their scored input, a shared expert) in the first layer, a dense MLP of
    # another width in the second
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(head_dim=8, intermediate_size=16, intermediate_size_mlp=40, num_local_experts=4, num_experts_per_tok=2,
                    moe_layers=[0], no_rope_layers=[1, 0], attention_chunk_size=4, use_qk_norm=True,
                    attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, pad_token_id=0, eos_token_id=2,
                    bos_token_id=1, experts_implementation="eager"), 22),
    # HunYuan-Dense V1: Llama's layer, its query and key norms per head after the rotation
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
                         dict(head_dim=8, pad_token_id=0, eos_token_id=2, bos_token_id=1), 23),
}


def build(family: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    """The family's tiny model (its config options changed by `overrides`; an option None: the config's default, an
    override None: None, DeepSeek's `q_lora_rank`): transformers' own initialisation from the
    family's seed, then every norm's weight drawn at random too (transformers starts them at 1, or 0 for Gemma's
    `1 + w`; GLM's router and its bias at 0; gpt-oss's experts' biases at 0), in `dtype`, eval mode."""
    config_name, model_name, options, seed = FAMILIES[family]
    settings = {**{key: value for key, value in {**_SHARED, **options}.items() if value is not None}, **overrides}
    experts = settings.pop("experts_implementation", None)
    config = getattr(transformers, config_name)(**settings)
    if experts is not None:  # torch's grouped matrix product (transformers' default for experts) has no float64
        config._experts_implementation = experts
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.ndim <= 2 and name.endswith("weight"):
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith("gate.weight") and not parameter.any():  # GLM's router starts at 0: every expert tied
                parameter.copy_(torch.randn_like(parameter) * 0.3)
            elif name.endswith("_proj_bias"):  # gpt-oss's experts' biases start at 0
                parameter.copy_(torch.randn_like(parameter) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's router bias starts at 0 too
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.to(dtype).eval()


def checksum(model: torch.nn.Module) -> str:
    """sha256 of the float64 weights, by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()
