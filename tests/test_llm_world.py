"""The generated retrieval world: deterministic splits, one supporting fact, evidence mapped to tokens."""
from __future__ import annotations

import pytest

from relevancy.worlds import language as llm_world


def test_prompts_are_deterministic_and_splits_differ():
    assert llm_world.prompts("train", 5) == llm_world.prompts("train", 5)
    train = {p.text for p in llm_world.prompts("train", 50)}
    test = {p.text for p in llm_world.prompts("test", 50)}
    assert len(train) == 50 and not train & test


@pytest.mark.parametrize("people", [1, 2, 3])
def test_exactly_one_fact_supports_the_answer(people):
    for item in llm_world.prompts("test", 30, n_people=people):
        assert len(item.facts) == 3 * people
        start, end = item.evidence_span
        fact = item.text[start:end]
        assert fact == item.facts[item.evidence_fact] and fact.startswith(item.name)
        assert item.text[slice(*item.value_span)] == item.answer.strip()
        # the answer's value appears in no other fact; the asked person and kind in no other fact either
        others = [f for k, f in enumerate(item.facts) if k != item.evidence_fact]
        assert not any(item.answer.strip() in f for f in others)
        template = llm_world.KINDS[item.kind][1]
        assert not any(f.startswith(template.split("{value}")[0].format(name=item.name)) for f in others)
        assert item.text.endswith(llm_world.KINDS[item.kind][3].format(name=item.name))


def test_evidence_maps_to_tokens_through_offsets():
    item = llm_world.prompt("test", 3)
    offsets, position = [], 0
    for word in item.text.split(" "):  # a whitespace "tokenizer" with exact offsets
        offsets.append((position, position + len(word)))
        position += len(word) + 1
    offsets.append((0, 0))  # a special token
    mask = item.token_mask(offsets)
    covered = " ".join(item.text[a:b] for (a, b), inside in zip(offsets, mask) if inside)
    assert item.facts[item.evidence_fact] in covered and not mask[-1]
    value = [item.text[a:b] for (a, b), inside in zip(offsets, item.token_mask(offsets, item.value_span)) if inside]
    assert len(value) == 1 and value[0].startswith(item.answer.strip())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown split 'dev'; valid splits: train, test"):
        llm_world.prompt("dev", 0)
    with pytest.raises(ValueError, match="n_people must be between 1 and"):
        llm_world.prompt("test", 0, n_people=0)
    with pytest.raises(ValueError, match="kinds must be some of place, colour, code, got \\('size',\\)"):
        llm_world.prompt("test", 0, kinds=["size"])


def test_prompts_of_some_kinds_hold_those_facts_only():
    """A trainer's easier prompts (`kinds`): each person's facts of those kinds alone, the answer of one of them; the
    benchmark's prompts (no `kinds`) are those of every kind, unchanged by the option."""
    assert llm_world.prompts("test", 20) == [llm_world.prompt("test", i, kinds=tuple(llm_world.KINDS)) for i in range(20)]
    for i in range(30):
        item = llm_world.prompt("train", i, n_people=3, kinds=["colour"])
        assert item.kind == "colour" and len(item.facts) == 3
        assert all("favourite colour" in fact for fact in item.facts)
        assert item.text[slice(*item.value_span)] == item.answer.strip()
