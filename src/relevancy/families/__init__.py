"""Model families: one folder per family (adapter, rule map, batch type), declaring where a model keeps what the methods need."""
from __future__ import annotations

from torch import nn

from ._shared import adapted_base
from .base import Adapter, UnsupportedModelError
from .causal_lm import CausalLMAdapter
from .clip.adapter import ClipAdapter, ZeroShotAdapter
from .detr.adapter import DetrAdapter
from .hf_bert.adapter import HFBertAdapter
from .hf_vit.adapter import HFViTAdapter
from .lxmert.adapter import LxmertAdapter
from .swin.adapter import SwinAdapter
from .swin.hf import HFSwinAdapter, HFSwinv2Adapter
from .timm_vit.adapter import TimmViTAdapter
from .visual_bert.adapter import VisualBertAdapter
from .vision_language import InternVLAdapter, Mistral3VisionLanguageAdapter, QwenVisionLanguageAdapter, TiledVisionLanguageAdapter, VisionLanguageAdapter

BUILT_IN: tuple[type[Adapter], ...] = (
    TimmViTAdapter, SwinAdapter, HFBertAdapter, HFViTAdapter, HFSwinAdapter, HFSwinv2Adapter, ClipAdapter, ZeroShotAdapter, DetrAdapter, LxmertAdapter, VisualBertAdapter,
    CausalLMAdapter, QwenVisionLanguageAdapter, TiledVisionLanguageAdapter, Mistral3VisionLanguageAdapter, InternVLAdapter,
    VisionLanguageAdapter,
)
# families registered by users, the latest first; checked before the built-in ones
_REGISTERED: list[type[Adapter]] = []


def register_adapter(adapter: type[Adapter]) -> None:
    """Make a new model family available to `relevancy.explain` (checked before the built-in ones; registering a
    family again moves it to the front)."""
    if adapter in _REGISTERED:
        _REGISTERED.remove(adapter)
    _REGISTERED.insert(0, adapter)


def adapters() -> list[type[Adapter]]:
    """Every family in the order `adapter_for` asks them: registered ones first, then the built-in ones."""
    return [*_REGISTERED, *(a for a in BUILT_IN if a not in _REGISTERED)]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of the first family that recognises `model` (a peft `PeftModel`: its base model, whose layers hold
    the adapters); a clear error listing the families if none does."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module of a supported family, got {type(model).__name__}")
    model = adapted_base(model)
    for adapter in adapters():
        if adapter.supports(model):
            return adapter(model)
    families = "; ".join(a.family for a in adapters())
    raise UnsupportedModelError(
        f"relevancy does not support models of type {type(model).__module__}.{type(model).__name__}. "
        f"Supported families: {families} (relevancy.families.adapters() with examples; docs/adding-a-family.md adds one)."
    )


__all__ = ["Adapter", "UnsupportedModelError", "adapted_base", "adapter_for", "adapters", "register_adapter", "TimmViTAdapter", "HFBertAdapter", "HFViTAdapter", "ClipAdapter", "ZeroShotAdapter", "DetrAdapter", "LxmertAdapter", "VisualBertAdapter", "CausalLMAdapter", "VisionLanguageAdapter", "QwenVisionLanguageAdapter", "TiledVisionLanguageAdapter", "Mistral3VisionLanguageAdapter", "InternVLAdapter"]
