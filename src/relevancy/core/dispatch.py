"""Models dispatched by accelerate (`device_map=...`, layers offloaded to the CPU or to disk, or spread over
devices): each module carries an `AlignDevicesHook` that moves its inputs to its execution device and, where its
weights are offloaded, loads them for its forward and puts them back on the meta device after.

A forward relevancy puts on such a module for a call runs inside that hook (`within_hook`), as the module's own
forward does; code that reads a module's weights outside a forward (a rule in the backward, a recognition probe)
reads them inside `loaded`. accelerate is never imported here: a model whose modules carry no hook is untouched.
"""
from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn


def hook_of(module: object) -> Any | None:
    """The accelerate hook whose forward wraps `module`'s own (`module._old_forward`), or None."""
    hook = getattr(module, "_hf_hook", None)
    return hook if hook is not None and isinstance(module, nn.Module) and "_old_forward" in vars(module) else None


def within_hook(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run as accelerate runs the module's own: inputs moved and weights loaded by the hook's
    `pre_forward`, the output handed to its `post_forward` (which offloads the weights again); `forward` itself
    where the module carries no hook."""
    hook = hook_of(module)
    if hook is None:
        return forward

    def hooked(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return hook.post_forward(module, forward(*args, **kwargs))

    hooked.__wrapped__ = forward  # the signature transformers inspects
    return hooked


def _offloads(module: nn.Module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return bool(getattr(hook, "offload", False)) and hasattr(hook, "pre_forward")


@contextmanager
def loaded(module: nn.Module) -> Iterator[None]:
    """The weights of `module` and its children on their execution device for the block, where accelerate keeps
    them offloaded (on the meta device between forwards); offloaded again after, also after an exception."""
    offloaded = [m for m in module.modules() if _offloads(m)] if "accelerate" in sys.modules else []
    if not offloaded:
        yield
        return
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for child in offloaded:
            stack.enter_context(align_module_device(child))
        yield


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device, else its first parameter's or buffer's
    device that is not the meta device, else the CPU."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)  # an int is an accelerator's index
    found = (t.device for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta")
    return next(found, torch.device("cpu"))
