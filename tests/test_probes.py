"""Hostile probes of the command line and the Python API: each gets a clear one-line error or the right result."""
from __future__ import annotations

import pytest
import torch

import relevancy
from models import tiny_vit

IMAGES = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# -- Python API ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [None, 3, ["rollout"]])
def test_a_method_that_is_not_a_name_is_refused_naming_the_methods(method):
    with pytest.raises(ValueError, match="method must be a method name") as error:
        relevancy.explain(tiny_vit(), IMAGES, method=method)
    assert "rollout" in one_line(error)
