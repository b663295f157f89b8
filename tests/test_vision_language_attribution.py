"""`transformer_attribution` (CVPR'21) carried into the vision tower, on the tiny random float64 models of
`vlm_models.py`: LLaVA with a Llama decoder and one tower layer read, [CLS] cropped; with a Qwen2 decoder and two tower
layers side by side, [CLS] kept; with a SigLIP tower (no [CLS], a pooling head); Idefics3 (pixel shuffle, a Linear),
Gemma 3 (average pooling, RMSNorm, a bare matrix) and PaliGemma 1 and 2 (one Linear), checked in two halves against code that does not run through the
family's rule map:

- the text part equals the decoder family's `transformer_attribution` on the decoder alone: a `...ForCausalLM` with
  the decoder's weights whose vocabulary holds the row's image features (the projector's output in the model's own
  forward) as the embeddings of token ids of their own, standing at the image's placeholders (Gemma 3 and PaliGemma,
  whose image's tokens, PaliGemma's prefix, attend to each other as no `...ForCausalLM`'s do: the decoder's readout
  row built as full matrices from the relevance and gradient at its attentions in one pass under the family's own map);
- the image part equals the paper's rule `v prod (I + E_h (G_l * R_l)^+)` built as full matrices, `v` the decoder
  alone's readout row at the image's tokens laid on the tower's tokens by hand, `R_l` and `G_l` the relevance and
  gradient at the tower's attentions under CLIP's rules (`families/clip/rules.py`'s layer and attention entries) on
  the tower alone, seeded at the tower's read layers with the relevance and gradient that reach the image's features
  in the decoder alone, carried back through the projector by a hand-written alpha1-beta0 rule (the identity at
  LLaVA's GELU and Gemma 3's RMSNorm, Idefics3's pixel shuffle routing it, Gemma 3's pooling sharing it equally) and
  the projector's own gradient.

Each row of a batch padded right and left is checked against its row alone; the relevance reaching the text tokens and
the tower's input is 1 (the paper's rules conserve) and equals the decoder alone's text relevance plus the tower's
input relevance under CLIP's rules. What this does not check: the decoder alone is run by the decoder family's own
rule map (the one the vision-language map reuses), so an error in a rule both share would not be caught here (the
decoders' tests check that map), and Gemma 3's and PaliGemma's decoder relevance is the family's own."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from test_model_unchanged import assert_same, assert_unchanged_by_a_failure, snapshot
from test_vision_language_tower import model_of, rule
from torch import nn
from vlm_models import IMAGE_TOKEN, VOCAB, alone, inputs

import relevancy
from relevancy.families import adapter_for
from relevancy.families.clip import rules as clip_rules
from relevancy.families.hf_attention import transformers_leaves
from relevancy.lrp import GRADIENT, PAPER, RELEVANCE, relevance_session
from relevancy.lrp.engine import unchanged

FAMILIES = ("llava", "llava_full", "llava_siglip", "idefics3", "gemma3", "paligemma", "paligemma2")
#: the families whose decoder attends both ways over part of the sequence (Gemma 3's image, PaliGemma's prefix): no
#: `...ForCausalLM` does, so their decoder half is read in one pass under the family's own map (`in_one_pass`)
BOTH_WAYS = ("gemma3", "paligemma", "paligemma2")
#: the families whose projector reads the tower's last layer (after its final LayerNorm), all its patch tokens
LAST_LAYER = ("idefics3", "gemma3", "paligemma", "paligemma2")


def decoder_alone(model: nn.Module, row: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model's decoder as a `...ForCausalLM` whose token ids from `VOCAB` on are the row's image features (the
    projector's output in the model's own forward), and the row's inputs with those ids at the image's placeholders."""
    adapter = adapter_for(model)
    found = []
    projector = getattr(model.model, adapter.vision.projector)
    handle = projector.register_forward_hook(lambda _m, _i, out: found.append(out))
    with torch.no_grad():
        model(**row)
    handle.remove()
    features = found[0][0]
    text = copy.deepcopy(model.config.text_config)
    text.vocab_size, text.tie_word_embeddings = VOCAB + len(features), False
    decoder = transformers.AutoModelForCausalLM.from_config(text).to(torch.float64).eval()
    state = {f"model.{name}": value for name, value in adapter.decoder.state_dict().items()}
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


def clip_rule_map(transformer: nn.Module, tower: nn.Module) -> dict:
    """CLIP's rule map for a tower on its own (`clip/rules.py`'s encoder layer and attention entries, transformers'
    leaves; its containers and embeddings as they are: the layers record their inputs), whatever the tower's classes
    (CLIP's, Idefics3's: the same layer and attention)."""
    layers = list(transformer.encoder.layers)
    containers = [tower, transformer, transformer.encoder, transformer.embeddings, *transformer.embeddings.children(), layers[0].mlp,
                  *(transformer.head.modules() if hasattr(transformer, "head") else ())]  # SigLIP's pooling head: not read
    return {**{type(module): unchanged for module in containers}, **transformers_leaves(),
            type(layers[0]): clip_rules._blocks({"image": layers}, clip_rules._hf_layer), type(layers[0].self_attn): clip_rules._hf_attention}


def projector_relevance(model: nn.Module, read: torch.Tensor, relevance: torch.Tensor, gradient: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(relevance, gradient)` at the tower's read features `read` `(P, W)` (several layers side by side) from those
    at the image's features: alpha1-beta0 at the projector's Linears (Gemma 3's matrix) by hand, the identity at its GELU
    and Gemma 3's RMSNorm, Idefics3's pixel shuffle routing it (a permutation), Gemma 3's average pooling sharing it
    equally (the pooling's own gradient); the gradient by autograd."""
    features = read.detach().requires_grad_(True)
    projector = getattr(model.model, "multi_modal_projector", None)
    if hasattr(projector, "avg_pool"):  # Gemma 3: average pooling (equal shares: its own gradient), RMSNorm, a bare matrix
        side, weight = projector.patches_per_image, projector.mm_input_projection_weight
        x = projector.avg_pool(features.T.reshape(1, -1, side, side)).flatten(2)[0].T
        normed = projector.mm_soft_emb_norm(x)
        out = normed @ weight
        into = alpha1_beta0(normed.detach(), weight.T, relevance)
    elif hasattr(projector, "linear"):  # PaliGemma: one Linear
        x = features
        out = projector.linear(x)
        into = alpha1_beta0(x.detach(), projector.linear.weight, relevance)
    elif hasattr(model.model, "connector"):  # Idefics3: pixel shuffle, one Linear
        connector = model.model.connector
        x = connector.pixel_shuffle(features[None], connector.scale_factor)[0]
        out = connector.modality_projection.proj(x)
        into = alpha1_beta0(x.detach(), connector.modality_projection.proj.weight, relevance)
    else:  # LLaVA: linear_2(gelu(linear_1(x)))
        x = features
        activated = projector.act(projector.linear_1(x))
        out = projector.linear_2(activated)
        into = alpha1_beta0(x.detach(), projector.linear_1.weight, alpha1_beta0(activated.detach(), projector.linear_2.weight, relevance))
    (routed,) = torch.autograd.grad(x, features, into, retain_graph=True)
    (through,) = torch.autograd.grad(out, features, gradient)
    return routed, through


def in_one_pass(model: nn.Module, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gemma 3 and PaliGemma, whose image's tokens (PaliGemma: image and prompt) attend to each other (no
    `...ForCausalLM` does): `(the decoder's readout row (T,),
    relevance, gradient (T, D) at its input tokens)`, the row built as full matrices (`rule`) from the relevance and
    gradient at the decoder's attentions in one pass under the family's own rule map."""
    adapter = adapter_for(model)
    batch = adapter.check_inputs(row)
    entered: list[torch.Tensor] = []
    handle = adapter.blocks[0].register_forward_pre_hook(
        lambda _m, args, kwargs: entered.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    try:
        with adapter.explaining(False), relevance_session(model, adapter.relevance_rule_map(), PAPER) as session:
            logits, _ = adapter.forward(batch)
            found = session.attentions[len(session.attentions) - len(adapter.blocks):] + entered[:1]
            one = torch.ones((), dtype=torch.float64)
            *relevances, relevance = session.backward(RELEVANCE, logits[0, target], found, one)
            *gradients, gradient = session.backward(GRADIENT, logits[0, target], found, one)
    finally:
        handle.remove()
    return rule(relevances, gradients)[-1], relevance[0], gradient[0]


def naive(family: str, row: dict[str, torch.Tensor], target: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(text scores (T,), patch scores (4, 4), relevance reaching the text tokens and the tower's input)` of one
    unpadded row, in two halves: the decoder alone (Gemma 3: `in_one_pass`), the tower under CLIP's rules."""
    model = model_of(family)
    config = model.config
    image = row["input_ids"][0] == IMAGE_TOKEN
    if family in BOTH_WAYS:
        text, relevance, gradient = in_one_pass(model, row, target)
    else:
        decoder, ids = decoder_alone(model, row)
        text = relevancy.explain(decoder, ids, method="transformer_attribution", target=target).scores[0]
        relevance, gradient = at_embeddings(decoder, ids, target)
    tower = copy.deepcopy(getattr(model.model, adapter_for(model).vision.tower))
    transformer = getattr(tower, "vision_model", tower)
    count = len(transformer.encoder.layers)
    pixels = row["pixel_values"].flatten(0, -4)  # Idefics3's one image per row
    with relevance_session(tower, clip_rule_map(transformer, tower), PAPER) as session:
        if family in LAST_LAYER:  # the last layer's patches, after the final LayerNorm
            depths, crop = [count], 0
            read = [tower(pixels).last_hidden_state[0]]
        else:  # LLaVA: the layers `vision_feature_layer` names, [CLS] cropped by "default"
            layers = [config.vision_feature_layer] if isinstance(config.vision_feature_layer, int) else config.vision_feature_layer
            depths, crop = [k % (count + 1) for k in layers], int(config.vision_feature_select_strategy == "default")
            hidden = tower(pixels, output_hidden_states=True).hidden_states
            read = [hidden[d][0, crop:] for d in depths]
        into, into_gradient = projector_relevance(model, torch.cat(read, -1), relevance[image], gradient[image])
        # the tower's read layers seeded with what reaches them, each its block of the features side by side
        width = config.vision_config.hidden_size
        outputs = torch.cat([r.flatten() for r in read])
        seeds = {mode: torch.cat([part.flatten() for part in found.split(width, -1)]) for mode, found in ((RELEVANCE, into), (GRADIENT, into_gradient))}
        attentions = session.attentions[:max(depths)]
        relevances = session.backward(RELEVANCE, outputs, attentions + [session.block_inputs["image"][0]], seeds[RELEVANCE])
        gradients = session.backward(GRADIENT, outputs, attentions, seeds[GRADIENT])
    tower_input = relevances.pop().sum()
    entering = text[image]
    if family in ("idefics3", "gemma3"):  # each of the 2 x 2 tokens made of its 2 x 2 block of patches, in equal shares (PaliGemma: one per patch)
        entering = entering.view(2, 2).repeat_interleave(2, 0).repeat_interleave(2, 1).flatten() / 4
    elif crop:
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
    """Options that do not carry into the tower are refused by name; an error inside the relevance pass leaves the
    model as it was."""
    model, batch = model_of("llava_full"), inputs("llava_full")
    before = snapshot(model)
    for options, named in (({"checkpoint": True}, "checkpoint=True"), ({"blocks": "last"}, "blocks='last'"),
                           ({"row_normalize": True}, "row_normalize=True")):
        with pytest.raises(ValueError, match=named):
            relevancy.explain(model, batch, method="transformer_attribution", **options)
    assert_unchanged_by_a_failure(monkeypatch, model, batch, "transformer_attribution",
                                  "relevancy.methods.propagation.combine_on_arrival", before=before)
    assert not any("relevancy_session" in vars(module) for module in model.modules())
