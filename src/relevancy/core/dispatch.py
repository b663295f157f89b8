"""Models dispatched by accelerate (`device_map=...`, layers offloaded to the CPU or to disk, or spread over
devices): each module carries an `AlignDevicesHook` that moves its inputs to its execution device and, where its
weights are offloaded, loads them for its forward and puts them back on the meta device after.

A forward relevancy puts on such a module for a call runs inside that hook (`within_hook`), as the module's own
forward does; code that reads a module's weights outside a forward (a rule in the backward, a recognition probe)
reads them inside `loaded`. accelerate is never imported here: a model whose modules carry no hook is untouched.
"""
from __future__ import annotations

import sys
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .guard import this_thread_only


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


def _offloaded(module: nn.Module) -> list[nn.Module]:
    """`module` and those of its children whose weights accelerate offloads (none where accelerate was never imported)."""
    if "accelerate" not in sys.modules:
        return []
    return [m for m in module.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]


@contextmanager
def loaded(module: nn.Module) -> Iterator[None]:
    """The weights of `module` and its children on their execution device for the block, where accelerate keeps
    them offloaded (on the meta device between forwards); offloaded again after, also after an exception."""
    offloaded = _offloaded(module)
    if not offloaded:
        yield
        return
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for child in offloaded:
            stack.enter_context(align_module_device(child))
        yield


def dispatched(model: nn.Module) -> bool:
    """Whether accelerate dispatched `model` (a module of it carries a hook: offloaded, or spread over devices)."""
    return any(hook_of(module) is not None for module in model.modules())


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device, else its first parameter's or buffer's
    device that is not the meta device, else the CPU."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)  # an int is an accelerator's index
    found = (t.device for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta")
    return next(found, torch.device("cpu"))


@dataclass(frozen=True)
class _Reread:
    """A weight autograd saved for the backward, kept as where to read it again (the module whose accelerate hook
    offloads it, its name there) and the view autograd saved of it."""

    module: nn.Module
    name: str
    dtype: torch.dtype
    device: torch.device
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def read(self) -> torch.Tensor:
        value = self.module._hf_hook.weights_map[self.name]  # a fresh read from disk, or the CPU's copy
        return value.to(self.device, self.dtype).as_strided(self.size, self.stride, self.offset)


@contextmanager
def offloaded_weights_reread(model: nn.Module) -> Iterator[None]:
    """For the block, in the calling thread: the weights of layers accelerate offloads are not kept by autograd for
    the backward (a gradient through a Linear saves its weight): each is saved as where to read it again, and read
    when the backward reaches its layer, so that the host holds about one offloaded layer's weights at a time in the
    backward as in the forward, not the whole model. Models without offloaded layers are untouched."""
    offloaded = _offloaded(model)
    if not offloaded:
        yield
        return
    loaded: dict[int, tuple[weakref.ref, nn.Module, str]] = {}  # storage address -> (the loaded tensor, module, name)

    def recording(module: nn.Module, own: Callable[..., Any]) -> Callable[..., Any]:
        def pre_forward(hooked: nn.Module, *args: Any, **kwargs: Any) -> Any:
            result = own(hooked, *args, **kwargs)
            hook = module._hf_hook
            named = [*module.named_parameters(recurse=hook.place_submodules),
                     *(module.named_buffers(recurse=hook.place_submodules) if hook.offload_buffers else ())]
            for name, tensor in named:
                if tensor.device.type != "meta":
                    loaded[tensor.untyped_storage().data_ptr()] = (weakref.ref(tensor), module, name)
            return result

        return this_thread_only(pre_forward, otherwise=own)

    def pack(tensor: torch.Tensor) -> torch.Tensor | _Reread:
        entry = loaded.get(tensor.untyped_storage().data_ptr()) if tensor.device.type != "meta" else None
        source = entry[0]() if entry is not None else None
        if source is None or source.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            return tensor
        return _Reread(entry[1], entry[2], tensor.dtype, tensor.device, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def unpack(saved: torch.Tensor | _Reread) -> torch.Tensor:
        return saved.read() if isinstance(saved, _Reread) else saved

    hooks = [module._hf_hook for module in offloaded]
    try:
        for module, hook in zip(offloaded, hooks):
            hook.pre_forward = recording(module, hook.pre_forward)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for hook in hooks:
            vars(hook).pop("pre_forward", None)
