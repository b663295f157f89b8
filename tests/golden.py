"""Load the authors' reference outputs (../shared/golden) and build the models they came from."""
from __future__ import annotations

from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"


def vit_cases() -> list[dict]:
    return torch.load(GOLDEN / "vit_reference.pt", weights_only=True)


def build_vit(case: dict) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**case["config"], class_token=True, global_pool="token")
    model.load_state_dict(case["state_dict"], strict=True)
    return model.eval()


def assert_map_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Equal within `rtol` of the reference map's largest magnitude (the tolerance the golden README states)."""
    actual, expected = actual.reshape(expected.shape).double(), expected.double()
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rtol * scale + atol, f"max error {error:.3g} > {rtol} x {scale:.3g} + {atol}"
