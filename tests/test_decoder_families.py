"""The decoder families beyond Llama and GPT-2 (tiny random float64 models of `decoder_families.py`): AttnLRP and
CP-LRP equal to lxt's own maps where lxt has a map (tests/golden/llm_lxt_families.pt, made by
benchmarks/llm_lxt_families.py), every family's methods run or are refused by name (the family contract runs
them all, `family_cases.py`), and a model is recognised by its modules: one whose name says one layout and whose
layers say another is refused, naming the part."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from decoder_families import FAMILIES, build, checksum
from test_causal_lm import assert_close_to

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.families.causal_lm.layouts import ROTATIONS

GOLDEN = torch.load(Path(__file__).parent / "golden" / "llm_lxt_families.pt", weights_only=False)
NAMES = ("right", "left", "single0", "single1", "single2")
#: (family, method) pairs lxt has a map of
LXT = [(family, method) for family, entry in GOLDEN["models"].items() for method in ("attnlrp", "cp_lrp") if method in entry]
MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in MODELS:
        MODELS[family] = build(family)
    return MODELS[family]


def batch(name: str) -> dict[str, torch.Tensor]:
    ids, mask = GOLDEN["inputs"][name]
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", list(GOLDEN["models"]))
def test_the_models_are_lxts(family):
    """The same seed and config give the weights lxt explained (else transformers initialises otherwise now)."""
    assert checksum(model_of(family)) == GOLDEN["models"][family]["checksum"], (
        f"{family}: transformers {GOLDEN['transformers']} made other weights from the same seed; rerun benchmarks/llm_lxt_families.py")


@pytest.mark.parametrize("family,method", LXT)
def test_lrp_equals_lxt(family, method):
    """Within 1e-6 of each map's maximum, single and padded (left and right), the targets lxt's, relevance_total
    the share of the explained logit reaching the embeddings."""
    model = model_of(family)
    for name in NAMES:
        expected = GOLDEN["models"][family][method][name]
        explanation = relevancy.explain(model, batch(name), method=method)
        assert torch.equal(explanation.target, GOLDEN["models"][family]["targets"][name])
        assert explanation.scores.dtype == torch.float64
        assert_close_to(explanation.scores, expected, f"{family} {method} {name}")
        explained = explanation.logits.gather(1, explanation.target[:, None])[:, 0]
        assert torch.allclose(explanation.relevance_total * explained, explanation.scores.sum(1))
    # the rules are applied: the plain gradient is another map
    plain = relevancy.explain(model, batch("single0"), method="input_x_gradient").scores
    assert not torch.allclose(plain, GOLDEN["models"][family][method]["single0"], rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_part_runs_its_rule_and_the_model_is_unchanged(family):
    """The rules touch every norm and MLP (or expert mixture) of the model and nothing else; CP-LRP conserves the
    logit on the families without biases or soft-capping; the model is as it was after."""
    model = build(family)
    adapter = CausalLMAdapter(model)
    ruled = {type(module).__name__ for module, _ in adapter.ruled}
    names = {type(m).__name__ for m in model.modules()}
    assert {n for n in names if n.endswith(("RMSNorm", "LayerNorm"))} <= ruled | {"LayerNorm"} and ruled
    assert {n for n in names if n.endswith(("MLP", "Experts"))} <= ruled | {"GptOssMLP"}  # gpt-oss's mixture: its experts
    before = snapshot(model)
    explanation = relevancy.explain(model, batch("left"), method="cp_lrp")
    assert_same(before, snapshot(model))
    # GPT-NeoX's biases and LayerNorm shifts, Gemma 2's caps, gpt-oss's biases and its SwiGLU's `+ 1` keep a share
    if family not in ("gpt_neox", "gemma2", "gpt_oss"):
        assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-8)


#: family -> (the model type it is given, the part then named)
MISNAMED = {
    "gemma3": ("llama", "model.layers.0.input_layernorm (Gemma3RMSNorm) is not an RMSNorm"),
    "qwen3": ("llama", "model.layers.0.self_attn.q_norm.weight belongs to no part of the llama layout"),
    "cohere": ("llama", "model.layers.0.input_layernorm (CohereLayerNorm) is not an RMSNorm"),
    "glm4_moe": ("qwen3_moe", "model.layers.1.mlp (Glm4MoeMoE) is not a mixture of experts"),
    "gpt_oss": ("mixtral", "model.layers.0.mlp (GptOssMLP) is not a mixture of experts"),
    "deepseek_v3": ("llama", "model.layers.0.self_attn (DeepseekV3Attention) is not self-attention with q_proj"),
    "llama4": ("llama", "model.layers.0.mlp (nothing) is not a gated MLP"),
}


@pytest.mark.parametrize("family", MISNAMED)
def test_a_model_whose_name_says_another_layout_is_refused_naming_the_part(family):
    """A Gemma 3, Qwen3 or Cohere whose model type reads "llama", a GLM-4.5 MoE whose reads "qwen3_moe", a gpt-oss
    whose reads "mixtral", a DeepSeek-V3 or a Llama 4 whose reads "llama": its layers are not that layout's (Gemma's
    norm computes `x / rms(x) * (1 + w)`, Qwen3's attention has query and key norms, Cohere's norm is a LayerNorm,
    GLM's mixture has shared experts, gpt-oss's experts are stored otherwise, with biases, DeepSeek's attention is
    latent, Llama 4's MLP is its `feed_forward`), so it is refused, naming the part, the decoder families by their
    classes and the page on adding one."""
    model = build(family)
    model_type, part = MISNAMED[family]
    model.config.model_type = model_type
    with pytest.raises(UnsupportedModelError, match=rf"^cannot map .*model type '{model_type}' says the {model_type} layout, but ") as error:
        relevancy.explain(model, batch("single0"), method="attnlrp")
    message = str(error.value)
    assert part in message and "\n" not in message
    assert "Gemma3ForCausalLM, Gemma2ForCausalLM" in message and "GPTNeoXForCausalLM" in message and "docs/adding-a-family.md" in message
    assert "DeepseekV3ForCausalLM" in message and "Llama4ForCausalLM" in message
    assert "ViT" not in message  # the decoder families only


def test_an_unknown_model_type_is_recognised_by_its_modules():
    """A Qwen3 under a name relevancy does not know is taken by the layout its modules fit (Qwen3's: the Llama
    layout has no place for its query and key norms) and gives lxt's map."""
    model = build("qwen3")
    model.config.model_type = "my_qwen"
    assert CausalLMAdapter(model).layout.name == "qwen3"
    assert_close_to(relevancy.explain(model, batch("left"), method="attnlrp").scores, GOLDEN["models"]["qwen3"]["attnlrp"]["left"], "renamed")


def test_a_model_is_checked_once_until_its_structure_changes(monkeypatch):
    """The probes of every norm and MLP (reads back to the host, what a GPU at batch 1 would wait on) run at the
    first call only; a changed module (another type) is checked again."""
    import transformers

    from relevancy.families.causal_lm import layouts

    model = build("olmo2")
    relevancy.explain(model, batch("single0"), method="attnlrp")
    probes = []
    real = layouts._computes
    monkeypatch.setattr(layouts, "_computes", lambda *args: probes.append(1) or real(*args))
    relevancy.explain(model, batch("single0"), method="attnlrp")
    assert probes == []
    model.model.layers[1].post_attention_layernorm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(32).double()
    with pytest.raises(UnsupportedModelError, match=r"post_attention_layernorm \(Gemma3RMSNorm\) is not an RMSNorm"):
        relevancy.explain(model, batch("single0"), method="attnlrp")
    assert probes


def test_a_norm_that_computes_otherwise_is_refused():
    """The norms are checked by what they compute: a Llama norm replaced by one of Gemma's (same parameters) is
    named."""
    import transformers

    model = build("olmo2")
    gemma_norm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(32).double()
    model.model.layers[1].post_attention_layernorm = gemma_norm
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.post_attention_layernorm \(Gemma3RMSNorm\) is not an RMSNorm computing x / rms\(x\) \* w"):
        CausalLMAdapter(model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["transformer_attribution", "lrp", "partial_lrp"])
def test_every_layout_runs_the_seeds_lrp_methods(family, method):
    """Every layout's one rule map serves the seeds' methods too (the CVPR'21 rules: RoPE, query and key norms,
    Gemma's norms around both branches and its soft-caps, OLMo 2's norms after them, GPT-NeoX's parallel branches,
    a mixture's experts and router weights; DeepSeek's latent attention and interleaved rotation, Llama 4's complex
    rotation and query temperature): the rules conserve the explained 1 on every row of a padded batch, a padded
    row's map is the row's alone, and the model is as it was after. Llama 4's padding is on the right: its query
    temperature reads each query's place in the padded sequence, not its position id (the model's own; its default
    `floor_scale` of 8192 makes the factor 1 for shorter prompts), so left padding changes a row there."""
    options = {"rules": "paper"} if method != "transformer_attribution" else {}
    model = model_of(family)
    before, modeling = snapshot(model), vars(sys.modules[type(model).__module__])
    rotations = {name: modeling[name] for name in ROTATIONS if name in modeling}  # replaced in this thread for the call
    padding = "right" if family == "llama4" else "left"
    explanation = relevancy.explain(model, batch(padding), method=method, **options)
    assert_same(before, snapshot(model))
    assert all(modeling[name] is rotation for name, rotation in rotations.items())
    # partial LRP reads the last attention's relevance, not the input's; gpt-oss's clamps cut some relevance
    # (test_gpt_oss: conserved where they cut nothing)
    if method != "partial_lrp" and family != "gpt_oss":
        assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)
    single = relevancy.explain(model, batch("single2"), method=method, **options).scores
    row = explanation.scores[2, :3] if padding == "right" else explanation.scores[2, -3:]
    assert_close_to(row, single[0], f"{family} {method}", 1e-6 if family == "llama4" else 1e-9)  # Llama 4 rotates in float32


def test_gemma2_soft_caps_attention_and_logits():
    """Gemma 2's logits are the model's own (soft-capped); the attention's soft-cap is in relevancy's attention
    too: the plain gradient equals autograd's on transformers' own eager forward."""
    model = build("gemma2")
    ids = batch("single0")["input_ids"]
    model.config._attn_implementation = "eager"
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, use_cache=False).logits[0, -1]
    explanation = relevancy.explain(model, batch("single0"), method="input_x_gradient")
    assert torch.allclose(explanation.logits[0], logits.detach(), atol=1e-12)
    assert logits.abs().max() < model.config.final_logit_softcapping
    (gradient,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores[0], (gradient * embeddings).sum(-1)[0].detach(), "gemma2 input x gradient", 1e-6)  # transformers: float32 softmax


def test_gemma_is_mapped_with_its_own_logits_and_gradient():
    """Gemma (PaliGemma 1's decoder; no lxt map, its lxt-equality is PaliGemma's in test_vision_language.py): the
    `gemma` layout; the plain gradient equals autograd's on transformers' own forward (sdpa, exact in float64) to
    1e-10, a row padded left and right equals it alone under AttnLRP, and the explicit rules' methods run."""
    import transformers

    torch.manual_seed(7)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, initializer_range=0.2, pad_token_id=0)).double().eval()
    ids = torch.tensor([[5, 17, 40, 52, 66, 8]])
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, use_cache=False).logits[0, -1]
    explanation = relevancy.explain(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, method="input_x_gradient")
    assert CausalLMAdapter(model).layout.name == "gemma"
    (gradient,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores[0], (gradient * embeddings).sum(-1)[0].detach(), "gemma input x gradient", 1e-10)
    single = relevancy.explain(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, method="attnlrp")
    for padded, mask in ((torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], 1), torch.tensor([[1] * 6 + [0] * 2])),
                         (torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1), torch.tensor([[0] * 2 + [1] * 6]))):
        found = relevancy.explain(model, {"input_ids": padded, "attention_mask": mask}, method="attnlrp")
        assert_close_to(found.scores[0, mask[0].bool()], single.scores[0], "gemma attnlrp padded", 1e-10)
    assert relevancy.explain(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, method="transformer_attribution").scores.shape == (1, 6)


@pytest.mark.parametrize("method", ["cdam", "token_ablation"])
def test_a_padded_row_beyond_the_sliding_window_is_explained(method):
    """The third row pads 4 positions past its 3 tokens, so a padding query's window of 4 holds padding only:
    transformers' own eager Gemma 2 gives that row NaN logits; every method runs relevancy's attention, and the
    row's map is the row's alone."""
    model = build("gemma2")
    inputs = batch("right")
    with torch.no_grad():
        own = model(**inputs, position_ids=(inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0), use_cache=False).logits
    assert torch.isnan(own[2]).all() and not torch.isnan(own[:2]).any()
    batched = relevancy.explain(model, inputs, method=method).scores
    single = relevancy.explain(model, batch("single2"), method=method).scores
    assert torch.isfinite(batched).all()
    assert_close_to(batched[2, :3], single[0], f"gemma2 {method}", 1e-10)
