"""AttnLRP, CP-LRP and input x gradient on the encoders: equal in float64 to lxt's maps (tests/golden/
encoder_lxt_reference.pt: BERT, DINOv2, torchvision's ViT with its weights copied into timm's, CLIP's two towers),
single and batched; input x gradient equal to autograd through the model's own forward; CP-LRP conserving on a
bias-free ViT; open_clip equal to transformers for the same CLIP weights, the zero-shot classifier to the pair."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
import transformers

import relevancy
from relevancy.families.clip.batch import ImageTextBatch
from relevancy.families.clip.zero_shot import ZeroShotClassifier
from clip_leaves import clip_embedding_maps
from test_clip import CASES as CLIP_CASES, LIBRARIES as CLIP_LIBRARIES, build as build_clip, close

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
    elif name == "clip":
        model = transformers.CLIPModel(transformers.CLIPConfig(**GOLDEN["clip"]["config"]))
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


INPUT_RELEVANCE = ("attnlrp", "cp_lrp", "input_x_gradient")


def _clip_pairs(batch: dict) -> tuple[torch.Tensor, dict]:
    """A CLIP reference input as relevancy takes it: image r with text r."""
    return batch["pixel_values"], {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _clip_maps(explanation) -> dict[str, torch.Tensor]:
    return {"image": explanation.image_scores.flatten(1), "text": explanation.text_scores}


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_clip_equal_to_lxt_single_and_batched(method):
    """Both towers' maps of the pair logit; a padded text's row equals the pair alone, padding at 0."""
    entry, model = GOLDEN["clip"], _model("clip")
    found = {}
    for part, batch in entry["inputs"].items():
        explanation = relevancy.explain(model, _clip_pairs(batch), method=method)
        found[part] = ours = _clip_maps(explanation)
        for tower, theirs in entry[method][part].items():
            theirs = theirs * batch["attention_mask"] if tower == "text" else theirs
            assert ours[tower].shape == theirs.shape
            assert close(ours[tower], theirs) <= TOLERANCE, (method, part, tower)
        assert explanation.relevance_total.shape == (len(batch["input_ids"]), 2)  # columns: image, text
    for row in range(2):
        for tower, single in found[f"single{row}"].items():
            single = single[0]
            assert close(found["batch"][tower][row, :len(single)], single) <= 1e-10
    assert (found["batch"]["text"][1, 6:] == 0).all()


def test_clip_input_x_gradient_is_autograd_through_the_models_own_forward():
    model, batch = _model("clip"), GOLDEN["clip"]["inputs"]["batch"]
    _, expected = clip_embedding_maps(model, lambda: model(**batch).logits_per_image.diagonal())
    expected["text"] = expected["text"] * batch["attention_mask"]
    ours = _clip_maps(relevancy.explain(model, _clip_pairs(batch), method="input_x_gradient"))
    for tower in expected:
        assert close(ours[tower], expected[tower]) <= 1e-12
    attnlrp = _clip_maps(relevancy.explain(model, _clip_pairs(batch), method="attnlrp"))
    assert close(attnlrp["image"], expected["image"]) > 1e-3  # the rules change the map


@pytest.mark.parametrize("method", INPUT_RELEVANCE)
def test_clip_open_clip_equals_transformers_and_zero_shot_equals_the_pair(method):
    """The same weights in both libraries give the same maps; the zero-shot classifier's image map is the pair's
    with the prompt as text, doubled (the prompt's features are constants: the similarity's uniform rule gives
    the image tower half of the pair logit, the zero-shot head all of the class logit)."""
    case = CLIP_CASES[0]
    grid = ImageTextBatch.grid(case["images"], case["input_ids"])
    pairs = {}
    for library in CLIP_LIBRARIES:
        model = build_clip(case, library)
        pairs[library] = _clip_maps(relevancy.explain(model, grid, method=method))
        classifier = ZeroShotClassifier(model, case["input_ids"])
        zero_shot = relevancy.explain(classifier, case["images"], method=method, target=[1, 1]).scores.flatten(1)
        in_pairs = pairs[library]["image"][grid.pairs[:, 1] == 1]  # image i with text 1
        assert close(zero_shot, 2 * in_pairs if method != "input_x_gradient" else in_pairs) < 1e-10, library
    for tower in ("image", "text"):
        assert close(pairs["open_clip"][tower], pairs["transformers"][tower]) < 1e-10
