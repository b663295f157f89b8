"""`relevancy.explain_generation` on the tiny random Llama and GPT-2 configs of test_causal_lm (float64): every row of
the one-forward matrix equals `explain` on that prefix with that token as target; the causal zeros; greedy decoding
and forced continuations; the result's JSON and HTML; the model unchanged; bad requests named."""
from __future__ import annotations

import json

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from test_causal_lm import GOLDEN, assert_close_to, build

import relevancy
from relevancy.families.causal_lm import generation
from relevancy.families.causal_lm.adapter import CausalLMAdapter
from relevancy.generation import GENERATION_METHODS, SHARED_FORWARD_METHODS
from relevancy.methods import REGISTRY

METHODS = tuple(m for m in GENERATION_METHODS if m in CausalLMAdapter.methods)  # token_activation_map: vision-language only


class Characters:
    """A tokenizer of one printable character per token (id `ord(c) - 32`), with an optional end-of-text id."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) - 32 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i + 32) for i in ids)


PROMPT = "".join(chr(i + 32) for i in GOLDEN["inputs"]["single0"][0][0].tolist())


@pytest.fixture(scope="module", params=("llama", "gpt2"))
def model(request):
    return build(request.param)


@pytest.mark.parametrize("method", METHODS)
def test_each_row_equals_explain_on_its_prefix(model, method, monkeypatch):
    monkeypatch.setattr(generation, "ROWS_PER_BACKWARD", 4)  # six rows: two batched backward passes, of 4 and 2
    tokenizer = Characters()
    result = relevancy.explain_generation(model, tokenizer, PROMPT, max_new_tokens=6, method=method)
    start = len(PROMPT)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"] + result.generated_ids.tolist()])
    assert result.scores.shape == (6, start + 6) and result.scores.dtype == torch.float64
    assert result.prompt_length == start and len(result.tokens) == start + 6
    for g in range(6):
        prefix = ids[:, : start + g]
        alone = relevancy.explain(model, prefix, method=method)  # the default target: the greedy token
        assert int(alone.target[0]) == int(result.generated_ids[g])
        assert_close_to(result.scores[g, : start + g], alone.scores[0], f"{method} row {g}", 1e-10)
        assert (result.scores[g, start + g:] == 0).all()  # the token itself and what comes after it
        if alone.relevance_total is not None:  # the LRP methods
            assert torch.allclose(result.relevance_total[g], alone.relevance_total[0])
        else:
            assert result.relevance_total is None
    logits = model(ids[:, :-1]).logits[0, start - 1:].gather(1, ids[0, start:, None])
    assert torch.allclose(result.logits, logits)


def test_a_forced_continuation_is_explained_as_given(model):
    result = relevancy.explain_generation(model, Characters(), PROMPT, method="attnlrp", continuation="abc")
    assert result.generated_ids.tolist() == [65, 66, 67] and result.text == "abc"
    ids = torch.tensor([Characters()(PROMPT + "ab")["input_ids"]])
    alone = relevancy.explain(model, ids, method="attnlrp", target=67)
    assert_close_to(result.scores[2, : len(PROMPT) + 2], alone.scores[0], "continuation", 1e-10)


def test_generation_stops_after_the_end_of_text_token(model):
    first = int(relevancy.explain_generation(model, Characters(), PROMPT, max_new_tokens=1).generated_ids[0])
    result = relevancy.explain_generation(model, Characters(eos_token_id=first), PROMPT, max_new_tokens=5)
    assert result.generated_ids.tolist() == [first] and result.scores.shape == (1, len(PROMPT) + 1)


def test_model_unchanged_also_under_no_grad_and_after_an_error():
    model = build("llama", implementation="sdpa")
    model.train()
    before = snapshot(model)
    with torch.no_grad():
        relevancy.explain_generation(model, Characters(), PROMPT, max_new_tokens=3)
    assert_same(before, snapshot(model))
    with pytest.raises(ValueError):
        relevancy.explain_generation(model, Characters(), PROMPT + "\x80", max_new_tokens=3)  # id 96: outside the vocabulary
    assert_same(before, snapshot(model))
    assert model.training and model.config._attn_implementation == "sdpa"


def test_half_precision_is_explained_in_its_own_dtype():
    """A bf16 model runs in bf16 (no float32 copy of its weights), the rows in float32, near the float64 model's."""
    model = build("gpt2", dtype=torch.bfloat16)
    before = snapshot(model)
    seen = []
    handle = model.transformer.h[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    try:
        result = relevancy.explain_generation(model, Characters(), PROMPT, method="attnlrp", continuation="ab")
    finally:
        handle.remove()
    assert set(seen) == {torch.bfloat16}
    assert result.scores.dtype == torch.float32
    assert_same(before, snapshot(model))
    reference = relevancy.explain_generation(build("gpt2"), Characters(), PROMPT, method="attnlrp", continuation="ab").scores
    assert (result.scores.double() - reference).abs().max() <= 3e-2 * reference.abs().max()


@pytest.mark.parametrize("method", SHARED_FORWARD_METHODS)
def test_the_attention_methods_read_one_forward_for_every_token(model, method, monkeypatch):
    """The prefixes of the generated tokens are one forward of the whole sequence (`forward_shared`), unsigned
    methods give unsigned rows; rows beyond the memory budget take another forward."""
    decoder = model.model if hasattr(model, "model") else model.transformer
    relevancy.families.adapter_for(model).own_forward_problems()  # the once-per-model check of its forwards, not counted
    forwards = []
    handle = decoder.register_forward_hook(lambda _m, _i, _o: forwards.append(1))
    try:
        result = relevancy.explain_generation(model, Characters(), PROMPT, method=method, continuation="abcde")
    finally:
        handle.remove()
    assert len(forwards) == 1 and result.scores.shape == (5, len(PROMPT) + 5)
    assert result.signed == REGISTRY[method].signed
    # a long prompt's rows in groups that fit the memory budget: a forward per group, the same rows
    sites = len(relevancy.families.adapter_for(model).attention_sites())
    forward, per_row = relevancy.generation.shared_forward_memory(model, sites, len(PROMPT) + 5, method)
    monkeypatch.setattr(relevancy.generation, "MEMORY_BUDGET", forward + 2 * per_row)
    forwards.clear()
    handle = decoder.register_forward_hook(lambda _m, _i, _o: forwards.append(1))
    try:
        grouped = relevancy.explain_generation(model, Characters(), PROMPT, method=method, continuation="abcde")
    finally:
        handle.remove()
    assert len(forwards) == 3 and torch.allclose(grouped.scores, result.scores, rtol=1e-10, atol=0)


def test_json_and_html(model, tmp_path):
    result = relevancy.explain_generation(model, Characters(), PROMPT, max_new_tokens=3, method="cp_lrp")
    numbers = json.loads(json.dumps(result.to_json()))
    assert numbers["kind"] == "GenerationExplanation" and numbers["prompt_length"] == len(PROMPT)
    assert numbers["target"] == result.generated_ids.tolist() and len(numbers["scores"]["text"]) == 3
    assert numbers["tokens"] == list(PROMPT) + list(result.text)
    assert result.token_scores(1) == list(zip(result.tokens[: len(PROMPT) + 1], result.scores[1, : len(PROMPT) + 1].tolist()))
    page = result.save(tmp_path / "generation.html").read_text()
    assert "function relevancyGeneration" in page and '"prompt_length": %d' % len(PROMPT) in page
    assert "http" not in page.replace("http-equiv", "")  # nothing loaded from the internet


def test_bad_requests_are_named(model):
    tokenizer = Characters()
    with pytest.raises(ValueError, match="unknown method 'smoothgrad'. Valid methods of explain_generation: attnlrp, cp_lrp, "
                                         "input_x_gradient, token_activation_map, raw_attention, rollout, attention_gradcam, generic_attention, cdam, "
                                         "transformer_attribution, partial_lrp, lrp, token_ablation"):
        relevancy.explain_generation(model, tokenizer, PROMPT, method="smoothgrad")
    with pytest.raises(ValueError, match="Did you mean 'attnlrp'"):
        relevancy.explain_generation(model, tokenizer, PROMPT, method="atnlrp")
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens must be a whole number from 1 to the model's context window"):
            relevancy.explain_generation(model, tokenizer, PROMPT, max_new_tokens=bad)
    with pytest.raises(ValueError, match="prompt must be a non-empty text"):
        relevancy.explain_generation(model, tokenizer, "  ")
    with pytest.raises(ValueError, match="prompt must be a text, token ids, chat messages"):
        relevancy.explain_generation(model, tokenizer, [PROMPT, 3.5])
    with pytest.raises(ValueError, match="a prompt is missing"):
        relevancy.explain_generation(model, tokenizer)
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer .* got NoneType"):
        relevancy.explain_generation(model, prompt=PROMPT)
    with pytest.raises(ValueError, match="continuation must be a text of at least 1 token, got 0"):
        relevancy.explain_generation(model, tokenizer, PROMPT, continuation="")
    with pytest.raises(ValueError, match=r"continuation must be one text or token ids per prompt \(2\)"):
        relevancy.explain_generation(model, tokenizer, [PROMPT, PROMPT], continuation="ab")
    with pytest.raises(ValueError, match="chat template"):
        relevancy.explain_generation(model, tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="each chat message is a dict with a 'role' and a 'content'"):
        relevancy.explain_generation(model, tokenizer, [{"role": "user"}])
    with pytest.raises(ValueError, match="temperature, seed act only when sampling: pass do_sample=True"):
        relevancy.explain_generation(model, tokenizer, PROMPT, temperature=0.5, seed=1)
    for name, bad in (("temperature", 0), ("top_k", 0), ("top_p", 1.5), ("seed", -1), ("top_k", 2.5)):
        with pytest.raises(ValueError, match=f"{name} must be"):
            relevancy.explain_generation(model, tokenizer, PROMPT, do_sample=True, **{name: bad})
    with pytest.raises(ValueError, match="a forced continuation is read as given: leave out do_sample"):
        relevancy.explain_generation(model, tokenizer, PROMPT, continuation="ab", do_sample=True)
    # every position scheme: GPT-2's learned table and Llama's rotary window (16 positions each here)
    with pytest.raises(ValueError, match="exceed the model's context window of 16 tokens"):
        relevancy.explain_generation(model, tokenizer, PROMPT, max_new_tokens=16)


def test_other_families_are_refused():
    import transformers

    from relevancy.families.base import UnsupportedModelError

    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=96, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)).eval()
    with pytest.raises(UnsupportedModelError, match="explain_generation explains decoder language models"):
        relevancy.explain_generation(bert, Characters(), PROMPT)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)).eval()
    with pytest.raises(UnsupportedModelError, match="not the .* family"):
        relevancy.explain_generation(vit, Characters(), PROMPT)


def test_terminal_rows(model, capsys):
    result = relevancy.explain_generation(model, Characters(), PROMPT, max_new_tokens=2)
    result.show()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"1. {result.labels()[0]}" and lines[1] == PROMPT
    assert lines[2] == f"2. {result.labels()[1]}" and lines[3] == PROMPT + result.text[0]


def test_threads_on_one_model_give_the_serial_results(model):
    """Calls from several threads (serialised by the model's lock) give what serial calls give."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [("attnlrp", 3), ("input_x_gradient", 2), ("cp_lrp", 4)]
    serial = [relevancy.explain_generation(model, Characters(), PROMPT, tokens, method) for method, tokens in jobs]
    with ThreadPoolExecutor(3) as pool:
        threaded = list(pool.map(lambda job: relevancy.explain_generation(model, Characters(), PROMPT, job[1], job[0]), jobs))
    for one, other in zip(serial, threaded):
        assert torch.equal(one.scores, other.scores) and torch.equal(one.generated_ids, other.generated_ids)
