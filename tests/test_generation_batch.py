"""`explain_generation` as people run it (float64, tiny random models): a ragged batch of prompts in one call equals
each prompt alone; token ids, chat messages and a transformers pipeline as prompts and model; sampling with a seed
reproducible (the caller's random state untouched); no cap below the model's context window."""
from __future__ import annotations

import pytest
import torch
import transformers
from bimodal_golden import assert_same, snapshot
from language_models import tiny_tokenizer
from test_causal_lm import assert_close_to, build
from test_generation import PROMPT, Characters

import relevancy

#: one method of each way of explaining a generation: batched backward passes, one shared forward, a batch of prefixes
WAYS = ("attnlrp", "input_x_gradient", "generic_attention", "transformer_attribution", "token_ablation")
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module", params=("llama", "gpt2"))
def model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def chat_model():
    """A tiny random Llama with a byte-level BPE tokenizer (a chat template set) and a 512-token context window."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval(), tokenizer


def assert_same_generation(batched, alone, what: str) -> None:
    assert batched.tokens == alone.tokens and batched.prompt_length == alone.prompt_length, what
    assert torch.equal(batched.generated_ids, alone.generated_ids) and batched.text == alone.text, what
    assert batched.scores.shape == alone.scores.shape, what
    for g in range(len(alone.scores)):
        assert_close_to(batched.scores[g], alone.scores[g], f"{what} row {g}", 1e-10)
    assert torch.allclose(batched.logits, alone.logits, rtol=1e-10, atol=0), what
    assert (batched.relevance_total is None) == (alone.relevance_total is None), what
    if alone.relevance_total is not None:
        assert torch.allclose(batched.relevance_total, alone.relevance_total, rtol=1e-8, atol=1e-10), what


@pytest.mark.parametrize("method", WAYS)
def test_a_ragged_batch_equals_each_prompt_alone(model, method, monkeypatch):
    """Prompts of 8, 3 and 5 tokens (left-padded together), decoded in one call and explained: each result is what
    the prompt alone gives, itself equal row by row to `explain` on each prefix (tests/test_generation.py)."""
    from relevancy.families.causal_lm import generation

    monkeypatch.setattr(generation, "ROWS_PER_BACKWARD", 6)  # 3 rows: two steps per backward pass
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:7]]
    results = relevancy.explain_generation(model, Characters(), prompts, max_new_tokens=4, method=method)
    assert isinstance(results, list) and len(results) == 3
    for prompt, batched in zip(prompts, results):
        alone = relevancy.explain_generation(model, Characters(), prompt, max_new_tokens=4, method=method)
        assert_same_generation(batched, alone, f"{method} {prompt!r}")


def test_a_batch_of_forced_continuations_of_different_lengths(model):
    prompts = [PROMPT[:6], PROMPT[:2]]
    results = relevancy.explain_generation(model, Characters(), prompts, method="cp_lrp", continuation=["abc", "x"])
    assert [r.text for r in results] == ["abc", "x"] and results[1].scores.shape == (1, 3)
    for prompt, forced, batched in zip(prompts, ["abc", "x"], results):
        assert_same_generation(batched, relevancy.explain_generation(model, Characters(), prompt, method="cp_lrp", continuation=forced), prompt)


def test_token_ids_as_prompts(model):
    text = relevancy.explain_generation(model, Characters(), PROMPT, max_new_tokens=3)
    ids = Characters()(PROMPT)["input_ids"]
    assert_same_generation(relevancy.explain_generation(model, Characters(), ids, max_new_tokens=3), text, "list of ids")
    assert_same_generation(relevancy.explain_generation(model, Characters(), torch.tensor(ids), max_new_tokens=3), text, "1-D tensor")
    rows = relevancy.explain_generation(model, Characters(), torch.tensor([ids, ids]), max_new_tokens=3)  # a batch
    assert len(rows) == 2 and all(torch.allclose(r.scores, text.scores, rtol=1e-10, atol=1e-12) for r in rows)


def test_chat_messages_go_through_the_chat_template(chat_model):
    model, tokenizer = chat_model
    messages = [{"role": "user", "content": "where does the cat live?"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected)
    result = relevancy.explain_generation(model, tokenizer, messages, max_new_tokens=3)
    assert result.prompt_length == len(expected) and "".join(result.tokens[: len(expected)]).endswith("<assistant>")
    assert_same_generation(result, relevancy.explain_generation(model, tokenizer, expected, max_new_tokens=3), "chat")
    both = relevancy.explain_generation(model, tokenizer, [messages, "the dog"], max_new_tokens=3)  # a batch of two kinds
    assert_same_generation(both[0], result, "chat in a batch")


def test_a_text_generation_pipeline_is_taken_as_its_model_and_tokenizer(chat_model):
    model, tokenizer = chat_model
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    direct = relevancy.explain_generation(model, tokenizer, "the cat", max_new_tokens=3)
    assert_same_generation(relevancy.explain_generation(pipe, "the cat", max_new_tokens=3), direct, "pipeline")
    assert_same_generation(relevancy.explain_generation(pipe, prompt="the cat", max_new_tokens=3), direct, "pipeline, prompt=")
    with pytest.raises(relevancy.families.base.UnsupportedModelError, match="or a transformers text-generation pipeline, got str"):
        relevancy.explain_generation("gpt2", tokenizer, "the cat")


def test_sampling_with_a_seed_is_reproducible_and_leaves_the_random_state(chat_model):
    model, tokenizer = chat_model
    state = torch.random.get_rng_state()
    runs = [relevancy.explain_generation(model, tokenizer, "the cat", max_new_tokens=12, do_sample=True, temperature=2.0, seed=seed)
            for seed in (3, 3, 4)]
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state as it was
    assert torch.equal(runs[0].generated_ids, runs[1].generated_ids) and torch.equal(runs[0].scores, runs[1].scores)
    assert not torch.equal(runs[0].generated_ids, runs[2].generated_ids)  # another seed, other tokens (at temperature 2)
    greedy = relevancy.explain_generation(model, tokenizer, "the cat", max_new_tokens=12)
    top_one = relevancy.explain_generation(model, tokenizer, "the cat", max_new_tokens=12, do_sample=True, top_k=1, seed=0)
    assert torch.equal(top_one.generated_ids, greedy.generated_ids)  # sampling from the top token alone is greedy
    # a sampled token's row is still explain on its prefix with that token as target
    sampled = runs[2]
    ids = torch.tensor([tokenizer("the cat")["input_ids"] + sampled.generated_ids.tolist()])
    last = len(sampled.generated_ids) - 1
    alone = relevancy.explain(model, ids[:, :-1], method="attnlrp", target=int(sampled.generated_ids[last]))
    assert_close_to(sampled.scores[last, :-1], alone.scores[0], "sampled row", 1e-10)


def test_no_cap_below_the_context_window(chat_model):
    """300 tokens (more than the old cap of 256) in a 512-token window; the model unchanged."""
    model, tokenizer = chat_model
    before = snapshot(model)
    forced = [k % 250 + 1 for k in range(300)]
    result = relevancy.explain_generation(model, tokenizer, "the cat", method="input_x_gradient", continuation=forced)
    assert result.scores.shape == (300, result.prompt_length + 300) and result.generated_ids.tolist() == forced
    ids = torch.tensor([tokenizer("the cat")["input_ids"] + forced])
    alone = relevancy.explain(model, ids[:, :-1], method="input_x_gradient", target=forced[-1])
    assert_close_to(result.scores[-1, :-1], alone.scores[0], "row 300", 1e-10)
    assert_same(before, snapshot(model))
    with pytest.raises(ValueError, match="continuation token ids must be in the model's vocabulary"):
        relevancy.explain_generation(model, tokenizer, "the cat", continuation=[len(tokenizer) + 5])
