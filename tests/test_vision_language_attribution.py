"""`transformer_attribution` (CVPR'21) on LLaVA, carried into the vision tower (tiny random float64 LLaVA with a
Llama decoder and one tower layer read, [CLS] cropped; with a Qwen2 decoder and two tower layers side by side, [CLS]
kept: `vlm_models.py`), checked in two halves against code that does not run through the family's rule map:

- the text part equals the decoder family's `transformer_attribution` on the decoder alone: a `...ForCausalLM` with
  the LLaVA decoder's weights whose vocabulary holds the row's image features (the projector's output of the
  model's own forward) as the embeddings of token ids of their own, standing at the image's placeholders;
- the image part equals the paper's rule `v prod (I + E_h (G_l * R_l)^+)` built as full matrices, `v` the decoder
  alone's readout row at the image's tokens laid on the tower's tokens by hand, `R_l` and `G_l` the relevance and
  gradient at the tower's attentions under CLIP's rule map (`families/clip/rules.py`'s layer, attention and embedding
  entries on the tower), seeded at the tower's read layers with the relevance and gradient that reach the image's
  features in the decoder alone, carried back through the projector by a hand-written alpha1-beta0 rule (the
  identity at its GELU) and the projector's own gradient.

Each row of a batch padded right and left is checked against its row alone; the relevance reaching the text tokens and
the tower's input is 1 (the paper's rules conserve) and equals the decoder alone's text relevance plus the tower's
input relevance under CLIP's rules. What this does not check: the decoder alone is run by the decoder family's own
rule map (the one the vision-language map reuses), so a rule shared by both would not be caught here; the decoders'
tests check that map.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from test_model_unchanged import assert_same, snapshot
from test_vision_language_tower import model_of, rule
from torch import nn
from vlm_models import IMAGE_TOKEN, VOCAB, alone, inputs

import relevancy
from relevancy.families import adapter_for
from relevancy.families.base import UnsupportedModelError
from relevancy.families.clip import rules as clip_rules
from relevancy.families.hf_attention import transformers_leaves
from relevancy.lrp import GRADIENT, PAPER, RELEVANCE, relevance_session
from relevancy.lrp.engine import PIXEL_CONV, unchanged

FAMILIES = ("llava", "llava_full")


def decoder_alone(model: nn.Module, row: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model's decoder as a `...ForCausalLM` whose token ids from `VOCAB` on are the row's image features, and the
    row's inputs with those ids at the image's placeholders."""
    config = model.config
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=row["pixel_values"], vision_feature_layer=config.vision_feature_layer,
                                                  vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output[0]
    text = copy.deepcopy(config.text_config)
    text.vocab_size, text.tie_word_embeddings = VOCAB + len(features), False
    decoder = transformers.AutoModelForCausalLM.from_config(text).to(torch.float64).eval()
    state = {f"model.{name}": value for name, value in model.model.language_model.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.cat([state["model.embed_tokens.weight"], features])
    state["lm_head.weight"] = torch.cat([model.lm_head.weight.detach(), torch.zeros_like(features)])
    decoder.load_state_dict(state)
    ids = row["input_ids"].clone()
    image = ids == IMAGE_TOKEN
    ids[image] = VOCAB + torch.arange(int(image.sum()))
    return decoder, {"input_ids": ids, "attention_mask": row["attention_mask"]}


def at_embeddings(decoder: nn.Module, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(relevance, gradient)` `(T, D)` of the target's logit at the decoder alone's token embeddings under the paper's
    rules (the decoder family's rule map, as its `lrp` method runs it)."""
    adapter = adapter_for(decoder)
    batch = adapter.check_inputs(row)
    with adapter.explaining(False), relevance_session(decoder, adapter.relevance_rule_map(), PAPER) as session:
        embeddings = adapter.embed(batch)["text"].detach().requires_grad_(True)
        logits, _ = adapter.forward_tokens(batch, {"text": embeddings})
        one = torch.ones((), dtype=torch.float64)
        (relevance,) = session.backward(RELEVANCE, logits[0, target], [embeddings], one)
        (gradient,) = session.backward(GRADIENT, logits[0, target], [embeddings], one)
    return relevance[0], gradient[0]


def alpha1_beta0(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """The alpha1-beta0 rule written out: `R_i = sum_j (x_i w_ji)^+ / sum_i' (x_i' w_ji')^+ R_j` (bias ignored)."""
    positive = (x[:, None, :] * weight[None]).clamp(min=0)  # (N, out, in)
    return (positive / positive.sum(-1, keepdim=True) * relevance[..., None]).sum(1)


def clip_rule_map(tower: nn.Module) -> dict:
    """CLIP's rule map (`clip/rules.py`: its encoder layer, attention and embedding entries, transformers' leaves) for
    the tower on its own."""
    from transformers.models.clip import modeling_clip as clip

    layers = list(getattr(tower, "vision_model", tower).encoder.layers)
    return {**transformers_leaves(), **{kind: unchanged for kind in (clip.CLIPVisionModel, clip.CLIPEncoder, clip.CLIPMLP)},
            clip.CLIPVisionEmbeddings: clip_rules._hf_vision_embeddings, clip.CLIPEncoderLayer: clip_rules._blocks({"image": layers}, clip_rules._hf_layer),
            clip.CLIPAttention: clip_rules._hf_attention, nn.Conv2d: PIXEL_CONV}


def naive(family: str, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(text scores (T,), patch scores (4, 4), relevance reaching the text tokens and the tower's input)` of one
    unpadded row, in two halves: the decoder alone, the tower under CLIP's rules."""
    model = model_of(family)
    config = model.config
    decoder, ids = decoder_alone(model, row)
    text = relevancy.explain(decoder, ids, method="transformer_attribution", target=target).scores[0]
    image = row["input_ids"][0] == IMAGE_TOKEN
    relevance, gradient = at_embeddings(decoder, ids, target)
    # the projector: alpha1-beta0 at both Linears, the identity at the GELU; its own gradient
    projector = model.model.multi_modal_projector
    tower = copy.deepcopy(model.model.vision_tower)
    layers = [config.vision_feature_layer] if isinstance(config.vision_feature_layer, int) else config.vision_feature_layer
    depths = [k % (config.vision_config.num_hidden_layers + 1) for k in layers]
    with relevance_session(tower, clip_rule_map(tower), PAPER) as session:
        hidden = tower(row["pixel_values"], output_hidden_states=True).hidden_states
        crop = 1 if config.vision_feature_select_strategy == "default" else 0
        x = torch.cat([hidden[d][0, crop:] for d in depths], -1).detach().requires_grad_(True)
        middle = projector.linear_1(x)
        activated = projector.act(middle)
        out = projector.linear_2(activated)
        (into_gradient,) = torch.autograd.grad(out, x, gradient[image])
        into = alpha1_beta0(x.detach(), projector.linear_1.weight, alpha1_beta0(activated.detach(), projector.linear_2.weight, relevance[image]))
        # the tower's read layers seeded with what reaches them, each its block of the features side by side
        width = config.vision_config.hidden_size
        outputs = torch.cat([hidden[d][0, crop:].flatten() for d in depths])
        seeds = {mode: torch.cat([part.flatten() for part in found.split(width, -1)]) for mode, found in ((RELEVANCE, into), (GRADIENT, into_gradient))}
        attentions = session.attentions[:max(depths)]
        relevances = session.backward(RELEVANCE, outputs, attentions + [session.block_inputs["image"][0]], seeds[RELEVANCE])
        gradients = session.backward(GRADIENT, outputs, attentions, seeds[GRADIENT])
    tower_input = relevances.pop().sum()
    entering = text[image]
    if crop:
        entering = torch.cat([torch.zeros(1, dtype=torch.float64), entering])
    patches = sum(entering @ rule(relevances[:d], gradients[:d]) for d in depths)
    total = relevance[~image].sum() + tower_input
    return text.masked_fill(image, 0), patches[-16:].view(4, 4), total


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_attribution_through_the_tower_equals_its_two_halves(family):
    """Each row of a batch padded right and left equals the decoder alone (text) and CLIP's rules on the tower fed
    through the projector (patches); the relevance total is conserved and agrees; the model handed back as it was."""
    model = model_of(family)
    before = snapshot(model)
    implementations = [config._attn_implementation for config in adapter_for(model).configs]
    targets = [5, 7]
    for side in ("right", "left"):
        batch = inputs(family, side)
        explanation = relevancy.explain(model, batch, method="transformer_attribution", target=targets)
        assert explanation.image_scores.shape == (2, 4, 4) and explanation.scores.shape == batch["input_ids"].shape
        assert explanation.through_tower is True and explanation.pixel_scores is None
        assert bool((explanation.image_scores > 0).any())
        # conserved to the rules' arithmetic (`lrp.rules`' stable quotients: about 1e-9 lost per Linear here)
        assert torch.allclose(explanation.relevance_total, torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-7)
        for row in range(2):
            text, patches, total = naive(family, alone(batch, row), targets[row])
            keep = batch["attention_mask"][row].bool()
            assert torch.allclose(explanation.scores[row, keep], text, atol=1e-10), f"{side} row {row}"
            assert torch.allclose(explanation.image_scores[row], patches, atol=1e-10), f"{side} row {row}"
            assert bool((explanation.scores[row, ~keep] == 0).all())
            assert abs(explanation.relevance_total[row].item() - total.item()) < 1e-8  # the hand-written rule conserves exactly
    assert_same(before, snapshot(model))
    assert [config._attn_implementation for config in adapter_for(model).configs] == implementations
    assert not any("relevancy_session" in vars(module) for module in model.modules())


def test_refusals_by_name_and_failures_leave_the_model_unchanged(monkeypatch):
    """Options that do not carry into the tower are refused by name; Gemma 3 and Idefics3 refuse the method saying why;
    an error inside the relevance pass leaves the model as it was."""
    model, batch = model_of("llava_full"), inputs("llava_full")
    before = snapshot(model)
    for options, named in (({"checkpoint": True}, "checkpoint=True"), ({"blocks": "last"}, "blocks='last'"),
                           ({"row_normalize": True}, "row_normalize=True")):
        with pytest.raises(ValueError, match=named):
            relevancy.explain(model, batch, method="transformer_attribution", **options)
    for family in ("gemma3", "idefics3"):
        with pytest.raises(UnsupportedModelError, match="'transformer_attribution' does not apply .*average pooling.*pixel shuffle"):
            relevancy.explain(model_of(family), inputs(family), method="transformer_attribution")

    def fail(*args, **kwargs):
        raise RuntimeError("stop")

    monkeypatch.setattr("relevancy.methods.propagation.combine_on_arrival", fail)
    with pytest.raises(RuntimeError, match="stop"):
        relevancy.explain(model, batch, method="transformer_attribution")
    assert_same(before, snapshot(model))
    assert not any("relevancy_session" in vars(module) for module in model.modules())
