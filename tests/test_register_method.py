"""`register_method`: a user's method joins the registry only whole, after its checks; a refusal changes nothing."""
from __future__ import annotations

import pytest

from relevancy.families import BUILT_IN, CausalLMAdapter, TimmViTAdapter
from relevancy.methods import REGISTRY, Method, register_method


pytestmark = pytest.mark.usefixtures("registry_restored")  # each test's registrations undone after it


def mine(name: str = "mine", run=lambda adapter, inputs, target: None) -> Method:
    return Method(name, run, signed=False, reads_class_token=False)


def unchanged(before: dict, offered: dict) -> bool:
    return dict(REGISTRY) == before and {family: family.methods for family in BUILT_IN} == offered


@pytest.mark.parametrize("method, families, error, words", [
    (mine("rollout"), [TimmViTAdapter], ValueError, ("'rollout' is registered already", "replace=True")),
    (mine(""), [TimmViTAdapter], ValueError, ("non-empty identifier", "''")),
    (mine(5), [TimmViTAdapter], ValueError, ("non-empty identifier", "5")),
    (mine("with space"), [TimmViTAdapter], ValueError, ("identifier",)),
    (mine(run="not callable"), [TimmViTAdapter], TypeError, ("callables", "str")),
    (mine(), [TimmViTAdapter, "vit"], TypeError, ("adapter classes", "'vit'")),
    ("mine", [TimmViTAdapter], TypeError, ("relevancy.methods.Method", "str")),
])
def test_a_refused_method_changes_nothing(method, families, error, words):
    before, offered = dict(REGISTRY), {family: family.methods for family in BUILT_IN}
    with pytest.raises(error) as refused:
        register_method(method, families)
    assert all(word in str(refused.value) for word in words) and "\n" not in str(refused.value)
    assert unchanged(before, offered)


def test_a_method_is_offered_by_its_families_and_a_built_in_replaced_only_when_asked():
    method = mine()
    register_method(method, [TimmViTAdapter, CausalLMAdapter])
    assert REGISTRY["mine"] is method and "mine" in TimmViTAdapter.methods and "mine" in CausalLMAdapter.methods
    register_method(method, [TimmViTAdapter])  # the same method again: nothing to refuse
    replacement = mine("rollout")
    register_method(replacement, [TimmViTAdapter], replace=True)
    assert REGISTRY["rollout"] is replacement
