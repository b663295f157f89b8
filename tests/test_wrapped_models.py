"""Models as people run them: quantized by bitsandbytes (4-bit NF4 / FP4, double quantization; LLM.int8()), LoRA
adapters (peft: several adapters, the active one, merged, disabled; DoRA), offloaded by accelerate (layers on disk
and on the CPU), Granite's multipliers, and the check that every explained forward is the model's own. Each map is
compared with the plain float model that computes the same function (dequantized weights, merged adapters, the
undispatched model), in float32 as these layers run."""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import bitsandbytes
import peft
import pytest
import torch
import transformers
from torch import nn

import relevancy
from language_models import save_tiny_llama, tiny_tokenizer
from relevancy.core.linears import UnreadableLinearError, effective
from relevancy.families import CausalLMAdapter, UnsupportedModelError
from relevancy.models import load_language_model

METHODS = CausalLMAdapter.methods
IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 11, 4], [3, 8, 6, 10, 12, 14, 15, 16]])
TARGET = 3
#: the methods whose explicit rules divide by sums of the forward's values (LRP) or read differences of logits
#: (ablation): LLM.int8() rounds every layer's input to 8 bits, and these maps amplify that rounding
AMPLIFYING = ("lrp", "partial_lrp", "token_ablation")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama (grouped-query attention, widths bitsandbytes quantizes in blocks of 64) saved as a user would."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def load(folder: Path, **options) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes on casting and on the CPU backend
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **options).eval()


def maps(model: nn.Module, method: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relevancy.explain(model, IDS, method=method, target=TARGET).scores


def assert_same_maps(model: nn.Module, reference: nn.Module, tolerance: float, methods=METHODS, looser: dict | None = None) -> None:
    """Every method's map on `model` within `tolerance` of its largest value of the map on `reference`."""
    for method in methods:
        ours, theirs = maps(model, method), maps(reference, method)
        difference = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-12))
        assert difference <= (looser or {}).get(method, tolerance), (method, difference)


def dequantized_copy(quantized: nn.Module, folder: Path) -> nn.Module:
    """The float model with each quantized layer's dequantized weight (`core.linears.effective`)."""
    reference = load(folder)
    for name, module in quantized.named_modules():
        if isinstance(module, (bitsandbytes.nn.Linear4bit, bitsandbytes.nn.Linear8bitLt)):
            reference.get_submodule(name).weight.data = effective(module)[0].float()
    return reference


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_a_4bit_model_gives_the_maps_of_its_dequantized_weights(folder, kind):
    quantized = load(folder, quantization_config=transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=kind == "nf4", bnb_4bit_compute_dtype=torch.float32))
    assert isinstance(quantized.model.layers[0].mlp.gate_proj, bitsandbytes.nn.Linear4bit)
    assert_same_maps(quantized, dequantized_copy(quantized, folder), 1e-4)


def repacked_for_the_cpu(model: nn.Module) -> list[nn.Module]:
    """What bitsandbytes does at a 4-bit layer's first inference forward on a CPU with AVX512-BF16 (any CPU here: its
    own conversion called directly): the weights repacked for its bfloat16 kernel. The layers."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    for layer in layers:
        layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(layer.weight.data, layer.weight.quant_state)
    return layers


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_a_4bit_model_repacked_by_its_own_inference_is_explained_and_stays_repacked(folder, kind):
    """A user's `generate` repacks the 4-bit layers (bfloat16 scales, no gradient to their inputs): the maps are those of
    the repacked weights, every method's; an explanation's own decoding repacks nothing; the packed layers kept as they were."""
    options = dict(quantization_config=transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=kind == "nf4", bnb_4bit_compute_dtype=torch.float32))
    unpacked, packed = load(folder, **options), load(folder, **options)
    layers = repacked_for_the_cpu(packed)
    before = [(layer.weight.quant_state, layer.weight.data_ptr(), layer.support_avx512bf16_for_cpu) for layer in layers]
    for name, layer in packed.named_modules():  # the same codes, the scales rounded to bfloat16 by the packing
        if layer in layers:
            original = effective(unpacked.get_submodule(name))[0]
            assert (effective(layer)[0] - original).abs().max() <= 1e-2 * original.abs().max()
    assert_same_maps(packed, dequantized_copy(packed, folder), 1e-4)
    after = [(layer.weight.quant_state, layer.weight.data_ptr(), layer.support_avx512bf16_for_cpu) for layer in layers]
    assert all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(after, before))
    assert all(layer.weight.quant_state.packing_format_for_cpu for layer in layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        relevancy.explain_generation(unpacked, tiny_tokenizer(), IDS[0].tolist(), max_new_tokens=2, method="attnlrp")
    assert not any(vars(m.weight.quant_state).get("packing_format_for_cpu") for m in unpacked.modules()
                   if isinstance(m, bitsandbytes.nn.Linear4bit))


def test_an_8bit_model_gives_the_maps_of_its_dequantized_weights_to_its_activations_rounding(folder):
    quantized = load(folder, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    assert isinstance(quantized.model.layers[0].mlp.gate_proj, bitsandbytes.nn.Linear8bitLt)
    assert_same_maps(quantized, dequantized_copy(quantized, folder), 2e-2, looser={method: 1e-1 for method in AMPLIFYING})


def lora(model: nn.Module, name: str = "default", seed: int = 0, **options) -> nn.Module:
    """`model` with a LoRA adapter `name` of random (not zero) weights on its attention and MLP projections."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                             init_lora_weights=False, **options)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, config)
        return model
    return peft.get_peft_model(model, config, adapter_name=name)


def test_a_lora_model_gives_the_maps_of_its_merged_weights_with_the_active_adapter(folder):
    adapted = lora(lora(load(folder), "first", seed=1), "second", seed=2)
    adapted.set_adapter("second")
    merged = copy.deepcopy(adapted).merge_and_unload()  # the active adapter, merged into plain Linear layers
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    assert_same_maps(adapted, merged, 1e-4)
    # the base model of the adapter, its projections now LoRA layers, is taken as it is
    assert_same_maps(adapted.get_base_model(), merged, 1e-4, methods=("attnlrp", "transformer_attribution"))


def test_lora_merged_in_place_and_disabled(folder):
    adapted = lora(load(folder))
    merged = copy.deepcopy(adapted).merge_and_unload()
    with adapted.disable_adapter():
        assert_same_maps(adapted, load(folder), 1e-4, methods=("attnlrp", "transformer_attribution", "lrp"))
    adapted.merge_adapter()  # the adapter's weights added to the base layers, the LoRA layers kept
    assert_same_maps(adapted, merged, 1e-4, methods=("attnlrp", "transformer_attribution", "lrp"))


def test_lora_on_a_4bit_model(folder):
    quantized = load(folder, quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    reference = dequantized_copy(quantized, folder)
    adapted = lora(quantized)
    for name, module in adapted.get_base_model().named_modules():  # the same adapter's weights on the float model
        if isinstance(module, peft.tuners.lora.LoraLayer):
            reference.get_submodule(name).weight.data = effective(module)[0].float()
    assert_same_maps(adapted, reference, 1e-4, methods=("attnlrp", "input_x_gradient", "transformer_attribution", "lrp"))


def test_dora_runs_the_gradient_methods_and_the_explicit_rules_name_it(folder):
    adapted = lora(load(folder), use_dora=True)
    merged = copy.deepcopy(adapted).merge_and_unload()
    assert_same_maps(adapted, merged, 1e-4, methods=("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention"))
    with pytest.raises(UnreadableLinearError, match="DoRA"):
        maps(adapted, "transformer_attribution")


OFFLOADED = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
             "model.rotary_emb": "cpu", "lm_head": "disk"}


def hooks_state(model: nn.Module) -> dict:
    """Where each weight is, and which forward and hook each module has: what accelerate set, to be found again."""
    return {name: (id(vars(module).get("forward")), id(getattr(module, "_hf_hook", None)), id(vars(module).get("_old_forward")),
                   sorted(k for k in vars(module) if callable(vars(module)[k])),
                   tuple(p.device.type for p in module.parameters(recurse=False)))
            for name, module in model.named_modules()}


def test_an_offloaded_model_gives_the_maps_of_the_undispatched_one_and_stays_offloaded(folder, tmp_path, monkeypatch):
    dispatched = load(folder, device_map=OFFLOADED, offload_folder=str(tmp_path))
    before = hooks_state(dispatched)
    assert dispatched.model.layers[0].mlp.gate_proj.weight.device.type == "meta"  # loaded by its hook for each forward
    assert_same_maps(dispatched, load(folder), 1e-5)
    assert hooks_state(dispatched) == before
    monkeypatch.setattr("relevancy.lrp.rules.linear_alpha1_beta0", lambda *_a, **_k: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        maps(dispatched, "transformer_attribution")
    assert hooks_state(dispatched) == before


def granite() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GraniteConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=0.3,
                                        residual_multiplier=0.22, logits_scaling=2.0)
    return transformers.GraniteForCausalLM(config).double().eval()


def test_granite_is_explained_with_its_own_logits():
    model = granite()
    own = model(IDS).logits[:, -1, TARGET].detach()
    for method in METHODS:
        explanation = relevancy.explain(model, IDS, method=method, target=TARGET)
        assert torch.allclose(explanation.logits[:, TARGET], own, rtol=1e-6, atol=0), method
    conserved = relevancy.explain(model, IDS, method="transformer_attribution", target=TARGET).relevance_total
    assert torch.allclose(conserved, torch.ones_like(conserved), atol=1e-6)


def test_a_patched_layer_is_refused_where_a_method_would_explain_another_function():
    model = granite()
    layer = model.model.layers[1]
    own = layer.forward
    layer.forward = lambda *args, **kwargs: own(*args, **kwargs) * 1.5  # the layers run as they are under the gradient rules
    assert maps(model, "attnlrp").shape == (2, 8)
    with pytest.raises(UnsupportedModelError, match=r"explicit rules .* from model\.layers\.1 on"):
        maps(model, "transformer_attribution")
    del layer.forward
    norm = model.model.norm  # a ruled part whose forward computes otherwise: refused by the recognition's probe
    norm_forward = norm.forward
    norm.forward = lambda x: norm_forward(x) + 1.0
    with pytest.raises(UnsupportedModelError, match=r"model\.norm \(GraniteRMSNorm\) is not an RMSNorm"):
        maps(model, "attnlrp")
    del norm.forward
    model_forward = model.forward  # logits the model scales in a forward of its own: refused for every method

    def scaled(*args, **kwargs):
        output = model_forward(*args, **kwargs)
        output.logits = output.logits * 3.0
        return output

    model.forward = scaled
    for method in ("input_x_gradient", "attnlrp", "transformer_attribution"):
        with pytest.raises(UnsupportedModelError, match=r"as relevancy runs it .* the head"):
            maps(model, method)
    del model.forward
    assert maps(model, "transformer_attribution").shape == (2, 8)


class Int8Linear(nn.Linear):
    """A quantized linear layer relevancy has never seen: int8 weights and a scale, its own forward."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.scale = linear.weight.abs().max().item() / 127
        self.weight = nn.Parameter((linear.weight / self.scale).round().to(torch.int8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype) * self.scale)


def test_an_unknown_quantized_linear_runs_through_its_forward_and_the_explicit_rules_name_it(folder):
    model, reference = load(folder), load(folder)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Int8Linear(mlp.up_proj)
    reference.model.layers[0].mlp.up_proj.weight.data = mlp.up_proj.weight.float() * mlp.up_proj.scale
    assert_same_maps(model, reference, 1e-4, methods=("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention"))
    with pytest.raises(UnreadableLinearError, match="Int8Linear.*dequantize"):
        maps(model, "transformer_attribution")


class PackedLinear(nn.Module):
    """A GPTQ-like layer: the features of a Linear, packed integer weights, a kernel of its own; no nn.Linear."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", (linear.weight * 100).round().to(torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.qweight.to(x.dtype) / 100)


def test_a_linear_of_a_kind_relevancy_does_not_read_is_named(folder):
    model = load(folder)
    attention = model.model.layers[1].self_attn
    attention.k_proj = PackedLinear(attention.k_proj)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.k_proj \(.*PackedLinear\) is a linear layer .* dequantize"):
        maps(model, "attnlrp")


def test_an_adapter_folder_loads_with_its_base_model(tmp_path, capsys):
    base = save_tiny_llama(tmp_path / "base")
    adapted = lora(load(base))
    adapted.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    model, tokenizer = load_language_model(str(tmp_path / "adapter"))
    assert isinstance(model, peft.PeftModel)
    inputs = tokenizer(["the cat sat on"], return_tensors="pt")
    expected = relevancy.explain(copy.deepcopy(adapted).merge_and_unload(), inputs, method="attnlrp").scores
    assert torch.allclose(relevancy.explain(model, inputs, method="attnlrp").scores, expected, atol=1e-5 * float(expected.abs().max()))
    from relevancy.apps.cli import main

    assert main(["explain-generation", "the cat sat on", "--model", str(tmp_path / "adapter"), "--max-new-tokens", "2", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["method"] == "attnlrp" and len(result["generated_ids"]) == 2


def assert_same_results(model: nn.Module, reference: nn.Module, inputs, methods, tolerance: float, target=None) -> None:
    """Every result part (`scores`, and a vision-language model's `pixel_scores`) within `tolerance` of its maximum."""
    for method in methods:
        ours, theirs = (relevancy.explain(m, inputs, method=method, target=target) for m in (model, reference))
        for part in ("scores", "pixel_scores"):
            a, b = getattr(ours, part, None), getattr(theirs, part, None)
            if b is not None:
                assert float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) <= tolerance, (method, part)


def test_an_encoder_with_lora_and_offloaded(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    inputs = {"input_ids": torch.tensor([[2, 5, 9, 13, 7, 3]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    methods = relevancy.families.HFBertAdapter.methods
    adapted = lora_on(copy.deepcopy(model), ["query", "value", "dense"])
    assert_same_results(adapted, copy.deepcopy(adapted).merge_and_unload(), inputs, methods, 1e-4, target=1)
    model.save_pretrained(tmp_path / "bert")
    dispatched = load_dispatched(transformers.AutoModelForSequenceClassification, tmp_path / "bert", tmp_path / "offload", {
        "bert.embeddings": "cpu", "bert.encoder.layer.0": "disk", "bert.encoder.layer.1": "cpu", "bert.pooler": "disk", "classifier": "cpu"})
    assert_same_results(dispatched, model, inputs, methods, 1e-5, target=1)


def test_a_vision_language_model_with_lora_and_offloaded(tmp_path):
    from vlm_models import build, inputs as vlm_inputs

    model, inputs = build("llava", dtype=torch.float32), vlm_inputs("llava")
    methods = relevancy.families.VisionLanguageAdapter.methods
    adapted = lora_on(copy.deepcopy(model), r".*language_model.*\.(q_proj|v_proj|gate_proj)|.*vision_tower.*\.(q_proj|fc1)")
    assert_same_results(adapted, copy.deepcopy(adapted).merge_and_unload(), inputs, methods, 1e-4)
    model.save_pretrained(tmp_path / "llava")
    dispatched = load_dispatched(transformers.LlavaForConditionalGeneration, tmp_path / "llava", tmp_path / "offload", {
        "model.vision_tower": "disk", "model.multi_modal_projector": "cpu", "model.language_model.embed_tokens": "cpu",
        "model.language_model.layers.0": "disk", "model.language_model.layers.1": "cpu", "model.language_model.norm": "cpu",
        "model.language_model.rotary_emb": "cpu", "lm_head": "disk"})
    assert_same_results(dispatched, model, inputs, methods, 1e-5)


def lora_on(model: nn.Module, targets) -> nn.Module:
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def load_dispatched(auto: type, folder: Path, offload: Path, device_map: dict) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_pretrained(folder, device_map=device_map, offload_folder=str(offload)).eval()


def test_a_half_precision_quantized_model_runs_the_gradient_methods_and_the_seeds_ones_say_how(folder):
    quantized = load(folder, dtype=torch.bfloat16, quantization_config=transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    assert torch.isfinite(maps(quantized, "attnlrp")).all()
    with pytest.raises(UnsupportedModelError, match="quantized: load it to compute in float32"):
        maps(quantized, "transformer_attribution")
