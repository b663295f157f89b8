"""Loading the models the command line explains: timm names (hub weights), local checkpoints, the shipped model."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
SHIPPED = "shapes"


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            return state[key]
    return state


def load_image_model(name: str = SHIPPED, arch: str | None = None) -> nn.Module:
    """`name`: "shapes" (the model shipped in the package), a local checkpoint with `arch`, or a timm model name.

    timm names load with `pretrained=True`: the hub's weights for users with internet access.
    """
    import timm

    if name == SHIPPED:
        from .bench import load_model

        return load_model()
    path = Path(name)
    if path.suffix in CHECKPOINT_SUFFIXES or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {name} does not exist")
        if arch is None:
            raise ValueError(f"a local checkpoint needs its architecture: pass --arch (a timm model name such as vit_base_patch16_224) with {name}")
        state = _state_dict(path)
        head = state.get("head.weight")
        kwargs = {"num_classes": head.shape[0]} if head is not None else {}
        model = _create(timm, arch, pretrained=False, **kwargs)
        model.load_state_dict(state)
        return model.eval()
    return _create(timm, name, pretrained=True).eval()


def _create(timm, name: str, **kwargs) -> nn.Module:
    if not timm.is_model(name):
        import difflib

        close = difflib.get_close_matches(name, timm.list_models("*vit*") + timm.list_models("*deit*"), n=3)
        hint = f" Close timm names: {', '.join(close)}." if close else ""
        raise ValueError(f"unknown model '{name}': not a timm model name nor an existing checkpoint file.{hint}")
    try:
        return timm.create_model(name, **kwargs)
    except (OSError, RuntimeError) as error:  # hub unreachable, or weights missing
        raise RuntimeError(
            f"could not load pretrained weights for '{name}' ({error.__class__.__name__}: {error}). "
            "Without internet access, pass a local checkpoint file with --arch."
        ) from error
