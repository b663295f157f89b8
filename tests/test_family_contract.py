"""The contract every family passes (docs/adding-a-family.md): one parametrised test per promise, run on each
family's case in `family_cases.py`.

- every registered method the family offers (`Adapter.methods`) runs (finite maps), every other one is refused with
  an error that names it;
- a batch's maps equal each input's alone (float64), also with `exact=True` for the LRP methods;
- the model is handed back unchanged after a success, after a failure inside the forward, and after concurrent
  calls from several threads (which also agree with the calls one at a time).
"""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import relevancy
from bimodal_golden import assert_same, snapshot
from family_cases import FAMILIES, FamilyCase
from relevancy.families import adapter_for
from relevancy.families.base import UnsupportedModelError

LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp")
MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    """The family's float64 model, built once per session."""
    if family not in MODELS:
        MODELS[family] = FAMILIES[family].build()
    return MODELS[family]


def explain(family: str, call: tuple, method: str, **options) -> relevancy.Explanation:
    inputs, target = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # conservation warnings of random weights
        return relevancy.explain(model_of(family), inputs, method=method, target=target, **options)


def maps(explanation) -> dict[str, torch.Tensor]:
    return {name: part.scores for name, part in explanation.parts.items()}


def runs(family: str, method: str) -> bool:
    """Whether the family offers `method` (`Adapter.methods`); an offered method must run, any other must be refused
    by name."""
    if method in adapter_for(model_of(family)).methods:
        explain(family, FAMILIES[family].singles()[0], method)
        return True
    with pytest.raises(UnsupportedModelError) as refusal:
        explain(family, FAMILIES[family].singles()[0], method)
    assert f"'{method}'" in str(refusal.value), f"{family} refuses {method} without naming it: {refusal.value}"
    return False


def assert_batch_equals_singles(family: str, case: FamilyCase, method: str, **options) -> None:
    batched = maps(explain(family, case.batch(), method, **options))
    tolerance = case.relevance_tolerance if method in LRP_METHODS and case.relevance_tolerance is not None else case.tolerance
    row = 0
    for call in case.singles():
        single = maps(explain(family, call, method, **options))
        rows = len(next(iter(single.values())))
        for name, scores in single.items():
            # a padded batch has more columns than a short input: compare the input's own
            part = batched[name][(slice(row, row + rows), *(slice(0, n) for n in scores.shape[1:]))]
            scale = scores.abs().max().clamp(min=1e-30)
            assert ((part - scores).abs().max() / scale).item() < tolerance, f"{family} {method} {name} rows {row}.."
        row += rows
    assert row == len(next(iter(batched.values())))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", relevancy.METHODS)
def test_every_method_runs_or_is_refused_by_name(family, method):
    if runs(family, method):
        for name, scores in maps(explain(family, FAMILIES[family].batch(), method)).items():
            assert torch.isfinite(scores).all(), f"{family} {method} {name}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", relevancy.METHODS)
def test_a_batch_equals_its_inputs_alone(family, method):
    if runs(family, method):
        assert_batch_equals_singles(family, FAMILIES[family], method)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", LRP_METHODS)
def test_float64_exact_arithmetic_batch_equals_its_inputs_alone(family, method):
    """`exact=True` (the authors' arithmetic, what every float64 reference comparison uses) is batch-independent."""
    if runs(family, method):
        assert_batch_equals_singles(family, FAMILIES[family], method, exact=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_unchanged_after_success_and_failure(family):
    model = model_of(family)
    before = snapshot(model)
    for method in relevancy.METHODS:
        if runs(family, method):
            explain(family, FAMILIES[family].batch(), method)
            assert_same(before, snapshot(model))

    # a failure inside the forward, under whatever the methods switched or patched
    first_norm = next(m for m in model.modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm")))

    def fail(*_args) -> None:
        raise RuntimeError("failing on purpose")

    offered = adapter_for(model).methods
    handle = first_norm.register_forward_hook(fail)
    try:
        failing = snapshot(model)
        for method in ("rollout", "transformer_attribution", "attnlrp"):
            if method in offered:
                with pytest.raises(RuntimeError, match="failing on purpose"):
                    explain(family, FAMILIES[family].batch(), method)
                assert_same(failing, snapshot(model))
    finally:
        handle.remove()
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_calls_agree_and_leave_the_model_unchanged(family):
    model = model_of(family)
    method = next(m for m in ("transformer_attribution", "rollout", "attnlrp") if runs(family, m))
    expected = maps(explain(family, FAMILIES[family].batch(), method))
    before = snapshot(model)
    results: list[dict[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(maps(explain(family, FAMILIES[family].batch(), method)))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for result in results:
        for name in expected:
            assert torch.equal(result[name], expected[name]), f"{family} {method} {name}"
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_result_is_an_explanation_with_one_protocol(family, tmp_path):
    import json

    method = "rollout" if runs(family, "rollout") else "attnlrp"  # a family without rollout: an LRP method
    explanation = explain(family, FAMILIES[family].batch(), method)
    assert isinstance(explanation, relevancy.Explanation)
    parts = maps(explanation)
    scores = explanation.scores
    # the parts by stream name, or one part's tensor: the only part's, or a vision-language decoder's text part (its
    # image part is `image_scores` beside it, the API of issue 34)
    assert scores.keys() == parts.keys() if isinstance(scores, dict) else any(scores is part for part in parts.values())
    rows = len(explanation.target)
    assert all(len(part) == rows for part in parts.values())
    content = json.loads(json.dumps(explanation.to_json()))
    assert content["method"] == method and content["scores"].keys() == parts.keys()
    assert all(torch.tensor(content["scores"][name], dtype=torch.float64).shape == parts[name].shape for name in parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_declares_registered_methods_in_the_registry_order(family):
    offered = adapter_for(model_of(family)).methods
    assert offered and list(offered) == [m for m in relevancy.METHODS if m in offered]
