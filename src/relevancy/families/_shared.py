"""What the families share below their adapters: the error for unsupported models, hookable parts of a module's
output, image checks, eval mode, the transformers configs a call switches and what an image model's config records
(class names, normalisation). Private to
`families`; it imports no family and no presentation code (explanations, pictures)."""
from __future__ import annotations

import sys

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ..core.guard import this_thread_only


class UnsupportedModelError(TypeError):
    """The model is not of a family relevancy knows, or lacks what a method needs."""


class OutputPart:
    """One part of a module's forward output (e.g. the attention probabilities in `(context, probabilities)`),
    hookable like a module: `register_forward_hook(hook)` calls `hook(module, args, part)`."""

    def __init__(self, module: nn.Module, pick: Callable[[object], torch.Tensor]) -> None:
        self.module, self.pick = module, pick

    def register_forward_hook(self, hook: Callable) -> torch.utils.hooks.RemovableHandle:
        def observe(module: nn.Module, args: tuple, output: object) -> None:
            hook(module, args, self.pick(output))  # never replaces the module's output

        return self.module.register_forward_hook(this_thread_only(observe))

    def __repr__(self) -> str:
        return f"OutputPart({type(self.module).__name__}, {getattr(self.pick, '__name__', 'part')})"


def checked_images(inputs: object, model: nn.Module, check_shape: Callable[[tuple[int, ...]], None]) -> torch.Tensor:
    """An image batch `(B, C, H, W)` (one image `(C, H, W)` accepted) as a finite float tensor on the model's device
    and dtype; `check_shape` refuses the shapes the model cannot take."""
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor batch (B, C, H, W) of normalised images, got {type(inputs).__name__}")
    if inputs.ndim == 3:
        inputs = inputs[None]
    if inputs.ndim != 4 or not inputs.is_floating_point():
        raise ValueError(f"images must be a float batch (B, C, H, W), got {inputs.dtype} of shape {tuple(inputs.shape)}")
    if len(inputs) == 0:
        raise ValueError(
            f"the batch holds no images (shape {tuple(inputs.shape)}): explanations and concepts need at least one "
            "example, (B, C, H, W) with B >= 1"
        )
    check_shape(tuple(inputs.shape))
    param = next(model.parameters(), None)
    if param is not None:
        inputs = inputs.to(param.device, param.dtype)
    finite = torch.isfinite(inputs).flatten(1).all(1)
    if not finite.all():
        index = int((~finite).nonzero()[0])
        raise ValueError(
            f"image {index} of the batch holds NaN or infinite values (in {inputs.dtype}): inputs must be finite, "
            "normalised pixel values"
        )
    return inputs


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode for the block; every module's own train/eval flag restored after, also after an
    exception (a user's model is never left changed)."""
    training = [(module, module.training) for module in model.modules()]
    try:
        if any(flag for _, flag in training):  # a model in eval mode already: no flag set (`nn.Module` sets are slow)
            model.eval()
        yield
    finally:
        for module, flag in training:
            if module.training != flag:
                module.training = flag


def transformers_configs(model: nn.Module) -> list:
    """Every distinct transformers config the model's modules read their attention implementation from (sub-configs
    too), parents first: what switching the attention implementation for a call must set and restore."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = vars(module).get("config")  # a plain attribute (a config is no module): no `nn.Module.__getattr__` miss per module
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
            for name in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, name, None)
                if sub is not None and hasattr(sub, "_attn_implementation"):
                    seen.setdefault(id(sub), sub)
    return list(seen.values())


def config_class_names(config: object) -> list[str] | None:
    """A transformers classifier's class names from its config's `id2label`; None where they do not cover its
    `num_labels`."""
    labels = getattr(config, "id2label", None) or {}
    count = getattr(config, "num_labels", len(labels))
    if len(labels) != count:
        return None
    return [str(labels.get(i, labels.get(str(i), f"class {i}"))) for i in range(count)]


def config_image_fields(config: object, inputs: torch.Tensor) -> dict:
    """The Explanation's input fields of a transformers image model: the input size, and the normalisation where
    the config records it (`image_mean`, `image_std`), so that `Explanation.pixels` can undo it."""
    fields = {"input_size": tuple(inputs.shape[-2:])}
    mean, std = getattr(config, "image_mean", None), getattr(config, "image_std", None)
    if mean is not None and std is not None:
        fields.update(mean=tuple(mean), std=tuple(std))
    return fields


def adapted_base(model: nn.Module) -> nn.Module:
    """A peft `PeftModel`'s base model (the user's model, its layers now holding the adapters: `core.linears` reads
    them), through nested wrappers; any other model as it is. peft is not imported: a `PeftModel` imported it."""
    wrapper = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    while wrapper is not None and isinstance(model, wrapper):
        model = model.get_base_model()
    return model
