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


def test_non_finite_inputs_and_scores_are_refused_and_a_zero_score_shares_nothing():
    """issue 44's probes: NaN pixels of a vision-language model, a target function giving NaN or infinity (on a
    decoder and on a ViT) are one-line refusals before any map; a score of exactly 0 reports relevance_total 0."""
    from vlm_models import build as build_vlm, inputs as vlm_inputs

    from relevancy.worlds import load_model, make_scenes

    batch = vlm_inputs("llava")
    batch["pixel_values"] = batch["pixel_values"].clone()
    batch["pixel_values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="pixel_values holds 1 NaN or infinite value"):
        relevancy.explain(build_vlm("llava"), batch, method="attnlrp")
    decoder, ids = build("llama"), torch.tensor([[1, 5, 9, 13]])
    with pytest.raises(ValueError, match="explained score is NaN or infinite for row 0"):
        relevancy.explain(decoder, ids, method="attnlrp", target=lambda logits: logits[:, 3] * float("nan"))
    with pytest.raises(ValueError, match="explained score is NaN or infinite for rows 0, 1"):
        relevancy.explain(load_model(), make_scenes(2, seed=0).images, method="generic_attention", target=lambda z: z[:, 0] / 0)
    zero = relevancy.explain(decoder, ids, method="attnlrp", target=lambda logits: logits[:, 3] * 0)
    assert torch.equal(zero.relevance_total, torch.zeros(1, dtype=zero.relevance_total.dtype))


def test_unclear_errors_of_the_probes_name_the_argument(explanation, tmp_path):
    """numpy integers are positions in exclude; Span(None) and Span([]) are refused at once; save() refuses bytes
    paths, NUL characters and names longer than a file system takes, in one line each, writing nothing."""
    import numpy as np

    from relevancy.core.files import OutputError

    assert torch.equal(explanation.excluding(np.int64(1)).excluded, explanation.excluding(1).excluded)
    for tokens in (None, [1.5], [True], b"x"):
        with pytest.raises(TypeError, match="a Span is a text .* or token ids"):
            relevancy.Span(tokens)
    for tokens in ([], ""):
        with pytest.raises(ValueError, match="needs at least one token"):
            relevancy.Span(tokens)
    for path, said in ((b"x.json", "a str or a pathlib.Path, got bytes"), (str(tmp_path / "a\x00b.json"), "NUL character"),
                       (str(tmp_path / ("x" * 300 + ".json")), "305 bytes long; a file or folder name takes at most 255")):
        with pytest.raises(OutputError, match=said):
            explanation.save(path)
    assert list(tmp_path.iterdir()) == []
