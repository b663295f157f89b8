"""Tokens left out of a decoder's explanation: chained calls equal one call with every token, and a name that picks
no token says so (issue 44's probes)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from language_models import build

import relevancy


@pytest.fixture(scope="module")
def explanation():
    return relevancy.explain(build("llama"), torch.tensor([[1, 5, 9, 13, 2, 7], [3, 8, 6, 10, 12, 14]]), method="attnlrp")


def fields_of(result) -> dict:
    return {field.name: getattr(result, field.name) for field in dataclasses.fields(result)}


@pytest.mark.parametrize("first, second", [("first", "last"), ("last", 0), (("first",), (-1, 1))])
def test_chained_excluding_equals_excluding_the_union(explanation, first, second):
    chained = explanation.excluding(first).excluding(second)
    union = explanation.excluding(chained.excluded)
    for name, value in fields_of(union).items():
        other = fields_of(chained)[name]
        if isinstance(value, torch.Tensor):
            assert torch.allclose(other, value, rtol=1e-12, atol=0), name
        else:
            assert other == value, name
    assert not torch.allclose(chained.relevance_total_kept, explanation.relevance_total)


def test_a_name_that_picks_no_token_says_so(explanation):
    with pytest.warns(UserWarning, match=r"exclude='special', 'bos' matches no token.*placeholders \[id\]"):
        explanation.excluding(("special", "bos", "first"))
    with pytest.warns(UserWarning, match="matches no token"):
        relevancy.explain(build("llama"), torch.tensor([[1, 5, 9]]), method="attnlrp", exclude="template")
