import math

import numpy as np
import pytest
import torch

from relevancy.evaluation.metrics import AgreementTest, pearson, sparsity


def _scores(b=6, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tam = torch.randn(b, n, generator=g)
    return {
        "token_ablation": tam,
        "cdam": 0.8 * tam + 0.3 * torch.randn(b, n, generator=g),
        "raw_attention": torch.rand(b, n, generator=g) / n + 1.0,
    }


def test_pearson_matches_numpy():
    s = _scores()
    x, y = s["cdam"], s["token_ablation"]
    want = np.corrcoef(x.double().flatten().numpy(), y.double().flatten().numpy())[0, 1]
    assert pearson(x, y) == pytest.approx(want, rel=1e-12)
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert math.isnan(pearson(x, torch.ones_like(x)))


def test_accumulator_pools_tokens_of_all_images():
    acc = AgreementTest()
    s = _scores()
    acc.update({k: v[:4] for k, v in s.items()})
    acc.update({k: v[4:] for k, v in s.items()})
    out = acc.compute()
    for a in s:
        for b in s:
            if a != b:
                want = np.corrcoef(s[a].double().flatten().numpy(), s[b].double().flatten().numpy())[0, 1]
                assert out["pearson"][a][b] == pytest.approx(want, rel=1e-12)
    assert out["num_images"] == 6


def test_sparsity_hand_made():
    scores = torch.tensor([[1.0, -0.04, 0.05, 0.0], [-2.0, 0.09, 0.11, 1.0]])
    # image 0: |s| < 0.05 -> -0.04 and 0 (0.05 is not below); image 1: |s| < 0.1 -> 0.09
    assert sparsity(scores).tolist() == [0.5, 0.25]
    acc = AgreementTest()
    acc.update({"a": scores, "b": scores.flip(1)})
    assert acc.compute()["sparsity"] == {"a": pytest.approx(0.375), "b": pytest.approx(0.375)}


def test_merge_is_bit_identical_and_associative():
    s = _scores(b=9, seed=3)
    single = AgreementTest()
    single.update(s)
    parts = []
    for sl in (slice(0, 2), slice(2, 7), slice(7, 9)):
        acc = AgreementTest()
        acc.update({k: v[sl] for k, v in s.items()})
        parts.append(acc)
    left = AgreementTest.from_state(parts[0].state_dict()).merge(parts[1]).merge(parts[2])
    right = AgreementTest.from_state(parts[2].state_dict()).merge(
        AgreementTest.from_state(parts[1].state_dict()).merge(parts[0])
    )
    assert left.compute() == single.compute() == right.compute()
    assert AgreementTest().merge(parts[0]).compute() == parts[0].compute()


def test_rejects_mismatched_methods_and_shapes():
    acc = AgreementTest()
    acc.update({"a": torch.ones(1, 4), "b": torch.zeros(1, 4)})
    with pytest.raises(ValueError):
        acc.update({"a": torch.ones(1, 4), "c": torch.zeros(1, 4)})
    with pytest.raises(ValueError):
        acc.update({"a": torch.ones(1, 4), "b": torch.zeros(1, 5)})
