"""AttnLRP, CP-LRP and input x gradient on the encoders: equal in float64 to lxt's maps (tests/golden/
encoder_lxt_reference.pt: BERT, DINOv2, torchvision's ViT with its weights copied into timm's), single and batched;
input x gradient equal to autograd through the model's own forward; CP-LRP conserving on a bias-free ViT."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
import transformers

import relevancy

GOLDEN = torch.load(Path(__file__).parent / "golden" / "encoder_lxt_reference.pt", weights_only=True)["models"]
BERT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=40, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DINOV2 = dict(image_size=28, patch_size=14, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
              num_labels=5, layerscale_value=0.5)
#: of the map's largest magnitude; measured at most 1.0e-8 (BERT CP-LRP), from lxt's 1e-10 stabiliser in the identity
#: rule's `f(x) / (x + 1e-10)` (relevancy divides exactly)
TOLERANCE = 1e-7


def _timm_from_torchvision(state: dict) -> torch.nn.Module:
    """torchvision's `VisionTransformer` weights in timm's (the same computation: pre-norm blocks, eps 1e-6, [CLS]
    readout)."""
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                                             mlp_ratio=2, num_classes=5).double().eval()
    renamed = {"patch_embed.proj.weight": state["conv_proj.weight"], "patch_embed.proj.bias": state["conv_proj.bias"],
               "cls_token": state["class_token"], "pos_embed": state["encoder.pos_embedding"],
               "norm.weight": state["encoder.ln.weight"], "norm.bias": state["encoder.ln.bias"],
               "head.weight": state["heads.head.weight"], "head.bias": state["heads.head.bias"]}
    pairs = {"norm1": "ln_1", "attn.qkv": "self_attention.in_proj", "attn.proj": "self_attention.out_proj", "norm2": "ln_2",
             "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.3"}
    for block in range(2):
        for ours, theirs in pairs.items():
            for part in ("weight", "bias"):
                infix = "_" if theirs.endswith("in_proj") else "."
                renamed[f"blocks.{block}.{ours}.{part}"] = state[f"encoder.layers.encoder_layer_{block}.{theirs}{infix}{part}"]
    model.load_state_dict(renamed)
    return model


def _model(name: str) -> torch.nn.Module:
    state = GOLDEN[name]["state_dict"]
    if name == "torchvision_vit":
        return _timm_from_torchvision(state)
    if name == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
    else:
        model = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(**DINOV2))
    model.load_state_dict(state)
    return model.double().eval()


def _explain(model: torch.nn.Module, batch: dict, target: torch.Tensor, method: str) -> torch.Tensor:
    inputs = batch.get("pixel_values", batch)
    return relevancy.explain(model, inputs, method=method, target=target.tolist()).scores.flatten(1)


CASES = [(name, method) for name in ("bert", "dinov2") for method in ("attnlrp", "cp_lrp")] + [("torchvision_vit", "cp_lrp")]


@pytest.mark.parametrize("name,method", CASES)
def test_equal_to_lxt_single_and_batched(name, method):
    entry, model = GOLDEN[name], _model(name)
    found = {}
    for part, batch in entry["inputs"].items():
        ours, theirs = _explain(model, batch, entry["targets"][part], method), entry[method][part]
        if "attention_mask" in batch:  # padding: 0 in ours
            theirs = theirs * batch["attention_mask"]
        assert ours.shape == theirs.shape
        assert float((ours - theirs).abs().max()) <= TOLERANCE * float(theirs.abs().max()), (name, method, part)
        found[part] = ours
    for row in range(2):  # a batch's rows (a padded one too) equal each row alone
        single = found[f"single{row}"][0]
        assert float((found["batch"][row, :len(single)] - single).abs().max()) <= 1e-10 * float(single.abs().max())


def test_the_rules_change_the_map():
    """lxt's rules are applied in the reference: its AttnLRP map is not the plain input x gradient."""
    entry, model = GOLDEN["bert"], _model("bert")
    plain = _explain(model, entry["inputs"]["single0"], entry["targets"]["single0"], "input_x_gradient")
    assert float((plain - entry["attnlrp"]["single0"]).abs().max()) > 1e-3 * float(plain.abs().max())


def test_input_x_gradient_is_autograd_through_the_models_own_forward():
    model = _model("torchvision_vit")
    images = GOLDEN["torchvision_vit"]["inputs"]["batch"]["pixel_values"]
    kept = {}

    def leaf(_module, _args, output):
        kept["x"] = output.detach().requires_grad_(True)
        return kept["x"]

    handle = model.patch_embed.register_forward_hook(leaf)
    try:
        logits = model(images)
    finally:
        handle.remove()
    target = logits.argmax(-1)
    logits.gather(1, target[:, None]).sum().backward()
    expected = (kept["x"] * kept["x"].grad).sum(-1).detach()
    ours = _explain(model, {"pixel_values": images}, target, "input_x_gradient")
    assert torch.allclose(ours, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_cp_lrp_conserves_on_a_bias_free_vit():
    """No biases, no [CLS] or position embedding, average pooling: every relevance reaches the patch embeddings."""
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2, num_classes=5, class_token=False,
        global_pool="avg", pos_embed="none", qkv_bias=False).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") and not name.startswith("patch_embed"):
                parameter.zero_()
    explanation = relevancy.explain(model, torch.randn(2, 3, 32, 32, dtype=torch.float64), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(2, dtype=torch.float64), atol=1e-12)


def test_decoder_options_are_refused_on_encoders():
    with pytest.raises(ValueError, match="decoder language models only"):
        relevancy.explain(_model("torchvision_vit"), torch.zeros(1, 3, 32, 32, dtype=torch.float64), method="attnlrp", checkpoint=True)
