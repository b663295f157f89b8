"""A generated text world whose evidence is known: retrieval prompts for decoder language models.

Each prompt is a question about one person and one kind of fact, a context of short facts about people (where
they live, their favourite colour, their code word), and the start of the answer sentence, so that the answer is
the next token. Exactly one fact supports the answer: the others are distractors, facts of the same kind about
other people (with other values) and facts of other kinds about the same person. The evidence is that fact's
character span (and its value's), mapped to token positions through the tokenizer's offsets.

Values are words that SmolLM2's tokenizer keeps whole after a space, so each answer is one token. Splits draw
from disjoint seeds (`SPLIT_SEEDS`), so train and test prompts never coincide by construction.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

NAMES = ("Anna", "Ben", "Carl", "Emma", "Finn", "Hugo", "Ivan", "Jack", "Kate", "Leo", "Mia", "Nina", "Omar", "Paul")
#: kind -> (values, fact template, question template, answer prefix)
KINDS: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "place": (("Paris", "Rome", "Oslo", "Cairo", "Tokyo", "Berlin", "Madrid", "Vienna", "Dublin", "Athens", "London"),
              "{name} lives in {value}.", "Where does {name} live?", "{name} lives in"),
    "colour": (("red", "blue", "green", "black", "white", "yellow", "pink", "brown", "orange", "purple"),
               "{name}'s favourite colour is {value}.", "What is {name}'s favourite colour?", "{name}'s favourite colour is"),
    "code": (("Alpha", "Delta", "Echo", "Hotel", "Oscar", "Romeo", "Victor", "Tiger", "Falcon", "Orion"),
             "{name}'s code word is {value}.", "What is {name}'s code word?", "{name}'s code word is"),
}
MAX_PEOPLE = min(len(NAMES), *(len(values) for values, *_ in KINDS.values()))
SPLIT_SEEDS = {"train": 0, "test": 1}
SEED_STRIDE = 1_000_003  # index i of split s uses seed SPLIT_SEEDS[s] * SEED_STRIDE + seed * 7919 + i


@dataclass(frozen=True)
class RetrievalPrompt:
    """One prompt: `text` ends where the answer's token starts; `answer` is that token's text (with its space)."""

    text: str
    answer: str
    kind: str
    name: str
    facts: tuple[str, ...]
    evidence_fact: int  # index into `facts`
    evidence_span: tuple[int, int]  # characters of the supporting fact in `text`
    value_span: tuple[int, int]  # characters of the answer's value inside that fact

    def token_mask(self, offsets: Sequence[tuple[int, int]], span: tuple[int, int] | None = None) -> list[bool]:
        """For each token (its `(start, end)` character offsets), whether it overlaps `span` (default: the
        supporting fact). Special tokens with empty offsets never do."""
        start, end = span or self.evidence_span
        return [a < b and a < end and b > start for a, b in offsets]


def prompt(split: str, index: int, seed: int = 0, n_people: int = 2, kinds: Sequence[str] | None = None) -> RetrievalPrompt:
    """The `index`-th prompt of `split` ("train" or "test"): `n_people` people, one fact of every kind each (of the
    `kinds` given, a trainer's easier prompts; the benchmark's have all of `KINDS`)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split '{split}'; valid splits: {', '.join(SPLIT_SEEDS)}")
    if not 1 <= n_people <= MAX_PEOPLE:
        raise ValueError(f"n_people must be between 1 and {MAX_PEOPLE}, got {n_people}")
    kinds = tuple(KINDS) if kinds is None else tuple(kinds)
    if not kinds or not set(kinds) <= set(KINDS):
        raise ValueError(f"kinds must be some of {', '.join(KINDS)}, got {kinds!r}")
    rng = random.Random(SPLIT_SEEDS[split] * SEED_STRIDE + seed * 7919 + index)
    people = rng.sample(NAMES, n_people)
    values = {kind: rng.sample(options, n_people) for kind, (options, *_) in KINDS.items() if kind in kinds}
    facts = [(kind, person, values[kind][k]) for k, person in enumerate(people) for kind in values]
    rng.shuffle(facts)
    kind, name, value = facts[rng.randrange(len(facts))]
    sentences = [KINDS[k][1].format(name=p, value=v) for k, p, v in facts]
    _, _, question, prefix = KINDS[kind]
    head = f"Question: {question.format(name=name)}\n"  # asked first: the tiny model then finds the fact far more often
    text = f"{head}{' '.join(sentences)}\nAnswer: {prefix.format(name=name)}"
    evidence = next(i for i, (k, p, _) in enumerate(facts) if (k, p) == (kind, name))
    start = len(head) + sum(len(s) + 1 for s in sentences[:evidence])
    fact = sentences[evidence]
    value_start = start + fact.rindex(value)
    return RetrievalPrompt(
        text=text, answer=" " + value, kind=kind, name=name, facts=tuple(sentences), evidence_fact=evidence,
        evidence_span=(start, start + len(fact)), value_span=(value_start, value_start + len(value)),
    )


def prompts(split: str, n: int, seed: int = 0, n_people: int = 2) -> list[RetrievalPrompt]:
    """The first `n` prompts of `split`."""
    return [prompt(split, i, seed, n_people) for i in range(n)]
