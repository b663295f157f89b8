import pytest
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture()
def registry_restored(monkeypatch):
    """The method registry and the built-in families' method lists are given back after the test (`register_method`)."""
    from relevancy.families import BUILT_IN
    from relevancy.methods import REGISTRY

    kept = dict(REGISTRY)
    for family in BUILT_IN:
        monkeypatch.setattr(family, "methods", family.methods)
    yield
    REGISTRY.clear()
    REGISTRY.update(kept)


@pytest.fixture()
def forbid(monkeypatch):
    """`forbid("module.name", ...)`: the test fails if any of these is called (a command working before its checks)."""
    def forbidden(*_args, **_kwargs):
        raise AssertionError("the command did work before checking its request")

    def patch(*targets: str) -> None:
        for target in targets:
            monkeypatch.setattr(target, forbidden)

    return patch
