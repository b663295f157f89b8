"""Decoder language models on tiny random Llama (grouped-query attention, tied embeddings) and GPT-2 configs:
AttnLRP and CP-LRP equal to lxt's own maps (tests/golden/llm_lxt_reference.pt, made by
benchmarks/llm_lxt_reference.py), batched equal to single, targets, the model unchanged after every call."""
from __future__ import annotations

import pytest
import torch
import transformers
from bimodal_golden import assert_same, snapshot
from language_models import GOLDEN, build

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter

ARCHS = ("llama", "gpt2")
LRP_METHODS = ("attnlrp", "cp_lrp")
VOCAB = 96
METHODS = LRP_METHODS + ("input_x_gradient",)
#: the seeds' LRP methods, under the layouts' rule maps (families/causal_lm/layouts.py)
PROPAGATION_METHODS = ("transformer_attribution", "lrp", "partial_lrp")
#: the image and text families' methods that decoders take (read at the last real token, under the causal mask)
SEED_METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "cdam", "token_ablation") + PROPAGATION_METHODS


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(arch):
    return build(arch)


def batch(name: str) -> dict[str, torch.Tensor]:
    ids, mask = GOLDEN["inputs"][name]
    return {"input_ids": ids, "attention_mask": mask}


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float = 1e-6) -> None:
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= tolerance * scale, f"{what}: largest difference {error:.3g} for a map maximum {scale:.3g}"


@pytest.mark.parametrize("method", LRP_METHODS)
@pytest.mark.parametrize("name", ["right", "left", "single0", "single1", "single2"])
def test_lrp_equals_lxt(arch, model, method, name):
    expected = GOLDEN["models"][arch][method][name]
    explanation = relevancy.explain(model, batch(name), method=method)
    assert torch.equal(explanation.target, GOLDEN["models"][arch]["targets"][name])  # default: the predicted next token
    assert explanation.scores.shape == expected.shape and explanation.scores.dtype == torch.float64
    assert_close_to(explanation.scores, expected, f"{arch} {method} {name}")
    assert explanation.relevance_total.shape == (expected.shape[0],)
    explained = explanation.logits.gather(1, explanation.target[:, None])[:, 0]
    assert torch.allclose(explanation.relevance_total * explained, explanation.scores.sum(1))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_any_attention_implementation_gives_the_exact_maps(arch, implementation):
    model = build(arch, implementation=implementation)
    explanation = relevancy.explain(model, batch("left"), method="attnlrp")
    assert_close_to(explanation.scores, GOLDEN["models"][arch]["attnlrp"]["left"], f"{arch} {implementation}")
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("method", METHODS + SEED_METHODS)
def test_batched_equals_single_and_padding_is_zero(arch, model, method):
    for side in ("right", "left"):
        batched = relevancy.explain(model, batch(side), method=method)
        mask = GOLDEN["inputs"][side][1].bool()
        assert (batched.scores[~mask] == 0).all()
        for row in range(len(mask)):
            single = relevancy.explain(model, batch(f"single{row}"), method=method).scores[0]
            assert_close_to(batched.scores[row][mask[row]], single, f"{method} {side} row {row}", 1e-10)


def test_input_x_gradient_is_the_plain_gradient(arch, model):
    ids, mask = GOLDEN["inputs"]["single0"]
    target = int(GOLDEN["models"][arch]["targets"]["single0"])
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, attention_mask=mask, use_cache=False).logits
    (gradient,) = torch.autograd.grad(logits[0, -1, target], embeddings)
    expected = (embeddings * gradient).sum(-1).detach()
    explanation = relevancy.explain(model, batch("single0"), method="input_x_gradient")
    assert_close_to(explanation.scores, expected, "input x gradient", 1e-10)
    assert explanation.relevance_total is None
    # AttnLRP's rules change the map: the rules are really applied
    assert not torch.allclose(relevancy.explain(model, batch("single0"), method="attnlrp").scores, expected)


def test_targets_ids_lists_and_contrast(arch, model):
    inputs = batch("right")
    per_row = relevancy.explain(model, inputs, method="attnlrp", target=[5, 6, 7])
    assert per_row.target.tolist() == [5, 6, 7]
    for row, token in enumerate((5, 6, 7)):
        alone = relevancy.explain(model, batch(f"single{row}"), method="attnlrp", target=token)
        length = int(inputs["attention_mask"][row].sum())
        assert_close_to(per_row.scores[row, :length], alone.scores[0], f"target {token}", 1e-10)
    everyone = relevancy.explain(model, inputs, method="attnlrp", target=9)
    assert everyone.target.tolist() == [9, 9, 9]
    # why 5 rather than 9: the difference of the two maps (every rule is linear in the relevance it passes on)
    contrast = relevancy.explain(model, inputs, method="attnlrp", target=relevancy.Contrast(5, 9))
    five = relevancy.explain(model, inputs, method="attnlrp", target=5)
    assert_close_to(contrast.scores, five.scores - everyone.scores, "contrast", 1e-10)
    assert contrast.target.tolist() == [5, 5, 5]


class Characters:
    """A tokenizer of one character per token (ids: `ord(c) - 32`), enough to turn token texts into ids."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) - 32 for c in text]}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i + 32) for i in ids]


def test_token_text_targets_need_the_tokenizer(model):
    inputs = batch("single0")
    by_text = relevancy.explain(model, inputs, method="cp_lrp", target="%", tokenizer=Characters())
    assert by_text.target.tolist() == [5]
    contrast = relevancy.explain(model, inputs, method="cp_lrp", target=relevancy.Contrast("%", 9), tokenizer=Characters())
    assert contrast.target.tolist() == [5]
    with pytest.raises(ValueError, match="is text: pass the tokenizer too"):
        relevancy.explain(model, inputs, method="cp_lrp", target="%")
    # a text of several tokens is an answer span (tests/test_causal_lm_spans.py)
    assert relevancy.explain(model, inputs, method="cp_lrp", target="%&", tokenizer=Characters()).span.ids.tolist() == [[5, 6]]


def test_bad_targets_and_inputs_are_named(model):
    with pytest.raises(ValueError, match="outside the vocabulary 0..95"):
        relevancy.explain(model, batch("right"), method="attnlrp", target=96)
    with pytest.raises(ValueError, match="target lists 2 tokens for a batch of 3 sequences"):
        relevancy.explain(model, batch("right"), method="attnlrp", target=[1, 2])
    with pytest.raises(ValueError, match="vocabulary, 0..95"):
        relevancy.explain(model, {"input_ids": torch.tensor([[1, 200]])}, method="attnlrp")
    with pytest.raises(ValueError, match="every row at least one real token"):
        relevancy.explain(model, {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[0, 0]])}, method="attnlrp")
    # every position scheme: GPT-2's learned table and Llama's rotary window (16 positions each here)
    with pytest.raises(ValueError, match="a row has 17 real tokens but the model's context window is 16 tokens"):
        relevancy.explain(model, {"input_ids": torch.ones(1, 17, dtype=torch.long)}, method="attnlrp")
    with pytest.raises(ValueError, match="unknown method 'atnlrp'. Did you mean 'attnlrp'"):
        relevancy.explain(model, batch("right"), method="atnlrp")


def test_other_families_refuse_the_language_methods():
    """A family without the gradient rule sets (LXMERT) refuses them by name, listing the families that have them."""
    from family_cases import FAMILIES

    from relevancy.families.base import UnsupportedModelError

    case = FAMILIES["lxmert"]
    inputs, target = case.batch()
    with pytest.raises(UnsupportedModelError, match="method 'attnlrp' does not apply to the Hugging Face LXMERT .*'attnlrp' explains: .*decoder language model"):
        relevancy.explain(case.build(), inputs, method="attnlrp", target=target)


@pytest.mark.parametrize("method", ["transformer_attribution", "lrp"])
def test_the_paper_rules_conserve_relevance_through_the_decoder(arch, model, method):
    """The CVPR'21 rules conserve: the relevance reaching the first block's input is the explained 1, on every row
    of a padded batch, with the stable default and with the reference's arithmetic (`exact=True`) alike, and the two
    maps agree (they differ where sums cancel, e.g. in `q k^T`: the stable default holds those at a floor). (`lrp`'s
    default is the vanilla baseline, which does not conserve: the paper's rules are asked for.)"""
    options = {"rules": "paper"} if method == "lrp" else {}
    maps = {}
    for exact in (False, True):
        explanation = relevancy.explain(model, batch("left"), method=method, exact=exact, **options)
        assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6), (method, exact)
        maps[exact] = explanation.scores
    agreement = torch.nn.functional.cosine_similarity(maps[False], maps[True], dim=1)
    assert (agreement > 0.99).all(), f"{method}: stable and exact maps disagree, cosine {agreement.tolist()}"


def test_transformer_attribution_reads_the_past_only_and_differs_from_rollout(model):
    """Under the causal mask the last real token's row covers the real tokens only; the relevance-weighted rollout
    is not the plain rollout."""
    mask = batch("right")["attention_mask"].bool()
    attribution = relevancy.explain(model, batch("right"), method="transformer_attribution").scores
    assert (attribution[~mask] == 0).all() and (attribution[mask] >= 0).all() and (attribution.sum(1) > 0).all()
    rollout = relevancy.explain(model, batch("right"), method="rollout").scores
    assert not torch.allclose(attribution / attribution.sum(1, keepdim=True), rollout / rollout.sum(1, keepdim=True))


def test_the_rule_maps_cover_every_module_and_refuse_a_cache(arch, model):
    """Every module of the model has a rule (the session refuses a module without one); a KV cache is refused by
    name, and the model is left as it was. (The attention is relevancy's through the configs, as every call has it:
    `explaining`.)"""
    from relevancy.lrp import PAPER, relevance_session
    from relevancy.lrp.engine import MissingRuleError

    adapter = CausalLMAdapter(model)
    before = snapshot(model)
    ids = batch("single0")["input_ids"]
    with adapter.explaining(True), relevance_session(model, adapter.relevance_rule_map(), PAPER) as session:
        model(input_ids=ids, use_cache=False)
        assert len(session.attentions) == len(adapter.attention_sites())
        with pytest.raises(MissingRuleError, match="no KV cache"):
            model(input_ids=ids, use_cache=True)
    assert_same(before, snapshot(model))


def test_rollout_reads_only_the_past(model):
    """Under the causal mask the last token's row covers every real token; a token added after a row's last real
    token (right padding) gets nothing."""
    explanation = relevancy.explain(model, batch("right"), method="rollout")
    mask = batch("right")["attention_mask"].bool()
    assert (explanation.scores[mask] > 0).all() and (explanation.scores[~mask] == 0).all()


@pytest.mark.parametrize("method", METHODS + SEED_METHODS)
def test_model_unchanged_also_after_an_error_and_under_no_grad(arch, method):
    model = build(arch, implementation="eager")
    model.train()  # the call runs in eval mode and gives the mode back
    before = snapshot(model)
    with torch.no_grad():
        relevancy.explain(model, batch("left"), method=method)
    assert_same(before, snapshot(model))
    with pytest.raises((ValueError, TypeError)):  # the language methods fail inside the relevance pass
        relevancy.explain(model, batch("left"), method=method, target="x")
    assert_same(before, snapshot(model))


def test_float32_model(arch):
    model = build(arch, dtype=torch.float32)
    explanation = relevancy.explain(model, batch("right"), method="attnlrp")
    assert explanation.scores.dtype == torch.float32
    assert_close_to(explanation.scores.double(), GOLDEN["models"][arch]["attnlrp"]["right"], "float32", 1e-4)


#: the largest difference of a half-precision map from the float64 map of the same model, over the map's maximum
HALF_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", HALF_TOLERANCE)
@pytest.mark.parametrize("method", METHODS)
def test_half_precision_models_are_explained_in_their_own_dtype(arch, method, dtype):
    """fp16 / bf16 models run in their own dtype, no float32 copy of their weights (the layers see the model's
    dtype); the maps come in float32, within `HALF_TOLERANCE` of the float64 maps (measured: bf16 0.7-1.6 %, fp16
    0.08-0.17 % of the maximum; SmolLM2's figures are in docs/language_models.md)."""
    model = build(arch, dtype=dtype)
    before = snapshot(model)
    seen = []
    layer = (model.model.layers if arch == "llama" else model.transformer.h)[0]
    handle = layer.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).dtype),
                                             with_kwargs=True)
    try:
        explanation = relevancy.explain(model, batch("left"), method=method)
    finally:
        handle.remove()
    assert_same(before, snapshot(model))
    assert seen and set(seen) == {dtype}
    assert explanation.scores.dtype == torch.float32
    reference = relevancy.explain(build(arch), batch("left"), method=method).scores
    assert_close_to(explanation.scores.double(), reference, f"{dtype} {method}", HALF_TOLERANCE[dtype])
    if method in LRP_METHODS:
        assert torch.isfinite(explanation.relevance_total).all()


@pytest.mark.parametrize("name", ["Qwen2", "Mistral"])
def test_models_sharing_the_llama_layout(name):
    """Qwen2 (biases on q, k, v) and Mistral run under the Llama layout's rules: batched equals single, the rules
    change the map, the model is unchanged."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, initializer_range=0.2)
    model = getattr(transformers, f"{name}ForCausalLM")(config).double().eval()
    adapter = CausalLMAdapter(model)
    assert adapter.layout.name == "llama"
    matched = [type(m).__name__ for m, _ in adapter.ruled]
    assert sorted(matched) == [f"{name}MLP"] * 2 + [f"{name}RMSNorm"] * 5  # per layer an MLP and two norms; the final norm
    before = snapshot(model)
    batched = relevancy.explain(model, batch("left"), method="attnlrp").scores
    single = relevancy.explain(model, batch("single2"), method="attnlrp").scores
    assert_close_to(batched[2, -3:], single[0], name, 1e-10)
    assert not torch.allclose(single, relevancy.explain(model, batch("single2"), method="input_x_gradient").scores)
    assert_same(before, snapshot(model))


def test_threads_on_one_model_give_the_serial_maps(arch, model):
    """Calls from several threads on one model (serialised by the model's lock) give the maps of serial calls."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(method, name) for method in METHODS + ("generic_attention",) for name in ("left", "right")]
    serial = [relevancy.explain(model, batch(name), method=method).scores for method, name in jobs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda job: relevancy.explain(model, batch(job[1]), method=job[0]).scores, jobs))
    for (method, name), one, other in zip(jobs, serial, threaded):
        assert torch.equal(one, other), f"{method} {name}"


@pytest.mark.parametrize("method", METHODS)
def test_checkpointing_gives_the_same_map_and_is_removed_after(arch, model, method):
    """`checkpoint=True` recomputes each layer in the backward (less memory on long prompts): the same map, and the
    layers' forwards are the model's own again after the call."""
    before = snapshot(model)
    plain = relevancy.explain(model, batch("left"), method=method)
    recomputed = relevancy.explain(model, batch("left"), method=method, checkpoint=True)
    assert_close_to(recomputed.scores, plain.scores, f"{method} checkpointed", 1e-12)
    assert all("forward" not in layer.__dict__ for layer in model.modules())
    assert_same(before, snapshot(model))


def test_the_gradient_methods_match_transformers_own_attentions(arch):
    """generic_attention from transformers' own eager attention (`output_attentions=True`, float64) and autograd,
    independently of relevancy's attention: `R = prod_l (I + E_h (dy/dA_l * A_l)^+)`, the last token's row (the
    attention relevancy records must be the one the output is computed from, or its gradient is nothing).
    transformers' eager softmax runs in float32, hence the tolerance."""
    model = build(arch, implementation="eager")
    ids = batch("single0")["input_ids"]
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    attentions = out.attentions
    target = out.logits[0, -1].argmax()
    gradients = torch.autograd.grad(out.logits[0, -1, target], attentions)
    tokens = ids.shape[1]
    relevance = torch.eye(tokens, dtype=torch.float64)
    for attention, gradient in zip(attentions, gradients):
        relevance = relevance + (gradient * attention).clamp(min=0).mean(1)[0] @ relevance
    explanation = relevancy.explain(model, batch("single0"), method="generic_attention")
    assert_close_to(explanation.scores[0], relevance[-1].detach(), f"{arch} generic_attention", 1e-6)
    assert (explanation.scores[0, :-1] > 0).any()


def test_weights_are_frozen_for_the_calls_thread_only(arch, model):
    """For an input-relevance call the Linear layers read their weights detached (no layer input is kept for a
    weight's gradient) in the calling thread only: another thread's forward still reaches the weights, the flags
    are not touched, and nothing is left on the model after."""
    import threading

    from relevancy.families.causal_lm import CausalLMAdapter

    head, x = model.lm_head, torch.randn(2, model.lm_head.in_features, dtype=torch.float64)
    elsewhere = []
    with CausalLMAdapter(model).weights_frozen():
        here = head(x).requires_grad
        thread = threading.Thread(target=lambda: elsewhere.append(head(x).requires_grad))
        thread.start()
        thread.join()
    assert not here and elsewhere == [True]
    assert head(x).requires_grad and all(p.requires_grad for p in model.parameters())
    assert all("forward" not in module.__dict__ for module in model.modules())
