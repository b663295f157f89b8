"""Linear layers as people load them: plain `nn.Linear`, quantized by bitsandbytes (`Linear4bit`: NF4 / FP4, double
quantization; `Linear8bitLt`), a weight that dequantizes itself (torchao's, quanto's tensor subclasses), and peft's
LoRA layers around any of these (one or several adapters, the active ones, merged or not).

The gradient rule sets run every such layer through its own forward (no copy of its weights). The explicit rules of
the seeds' methods read the layer's effective weight `W` of `x W^T + b`, one layer at a time when the relevance
reaches it (`effective`): dequantized, plus `scale * B A` for each active LoRA adapter not merged. A layer whose
weight cannot be read is refused naming its class and how to dequantize it. bitsandbytes and peft are never imported
here: a model holding their layers has imported them already.

bitsandbytes (0.49 and later) repacks a 4-bit layer's weights for its bfloat16 CPU kernel at the layer's first
inference forward on a CPU with AVX512-BF16 (an input without gradient, in eval mode: a user's `generate`, our own
decoding), and from then on computes in bfloat16 with no gradient to the layer's input. `cpu_packing_undone` holds such
layers in the ordinary layout for an explanation's block (the same numbers: the packing's bfloat16 scales), so that
gradients flow and nothing repacks; `_base_reader` reads either layout.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from .dispatch import loaded


class UnreadableLinearError(TypeError):
    """A quantized or wrapped linear layer whose effective weight relevancy cannot read."""


def _class(module_name: str, name: str) -> type | None:
    """A class of an already imported package (None where the package was never imported)."""
    return getattr(sys.modules.get(module_name), name, None)


def tuner_layer(module: object) -> bool:
    """Whether `module` is one of peft's adapter layers around a base layer (LoRA and the other tuners)."""
    base = _class("peft.tuners.tuners_utils", "BaseTunerLayer")
    return base is not None and isinstance(module, base)


def base_of(module: nn.Module) -> nn.Module:
    """The layer an adapter wraps (peft's `get_base_layer()`, through nested wrappers); the module itself otherwise."""
    return module.get_base_layer() if tuner_layer(module) else module


def is_linear(module: object) -> bool:
    """Whether `module` computes `x W^T + b` of an `nn.Linear` (plain, quantized, or inside an adapter layer)."""
    return isinstance(module, nn.Module) and isinstance(base_of(module), nn.Linear)


def unknown_linear(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first submodule `(path, module)` of `module` that has the features of a linear layer (`in_features`,
    `out_features`) and is none that relevancy reads (a GPTQ, AWQ or HQQ kernel's layer), or None."""
    return next(((name, child) for name, child in module.named_modules() if not is_linear(child) and not tuner_layer(child)
                 and isinstance(getattr(child, "in_features", None), int) and isinstance(getattr(child, "out_features", None), int)), None)


def features(module: nn.Module) -> tuple[int, int]:
    """`(in_features, out_features)` of a linear layer (`is_linear`)."""
    base = base_of(module)
    return base.in_features, base.out_features


def plain(module: nn.Module) -> bool:
    """Whether `module` runs `nn.Linear`'s own forward on an ordinary floating-point weight, so that its output is
    exactly `x W^T + b` (a quantized layer's or an adapter's forward computes it otherwise)."""
    return (type(module).forward is nn.Linear.forward and type(module.weight) in (torch.Tensor, nn.Parameter)
            and module.weight.is_floating_point())


def quantizes_activations(module: nn.Module) -> bool:
    """Whether the layer quantizes its input too (bitsandbytes' LLM.int8(); a 4-bit layer repacked for the CPU's
    bfloat16 kernel): its output then differs from `x W^T` with the dequantized weight by about 1 % of its largest
    value."""
    base = base_of(module)
    eight_bit = _class("bitsandbytes.nn", "Linear8bitLt")
    return (eight_bit is not None and isinstance(base, eight_bit)) or _cpu_packed(getattr(base, "weight", None))


def _cpu_packed(weight: object) -> bool:
    """Whether `weight` is a 4-bit weight that bitsandbytes repacked for its bfloat16 CPU kernel."""
    return bool(getattr(getattr(weight, "quant_state", None), "__dict__", {}).get("packing_format_for_cpu"))


def _cpu_packing_undone(data: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
    """The packed bytes and quantization state of a 4-bit weight in bitsandbytes' ordinary layout (two codes a byte,
    row-major, the first in the high nibble; float32 scales per block of a row), from its CPU packing (rows in blocks
    of 32, each block's byte holding row `b` in its low and row `b + 16` in its high nibble; bfloat16 scales
    `(K / blocksize, N)`). New tensors: the layer's own are untouched."""
    from bitsandbytes.functional import QuantState

    rows, half = data.shape
    low, high = data.reshape(-1, 32) & 0xF, data.reshape(-1, 32) >> 4
    codes = torch.cat([low, high], -1).reshape(rows // 32, half, 32, 2).transpose(1, 2).reshape(-1, 2)
    packed = ((codes[:, 0] << 4) | codes[:, 1]).to(torch.uint8).reshape(state.original_qshape)
    storage = state.__dict__.get("original_storage_type")
    unpacked = QuantState(absmax=state.absmax.T.reshape(-1).float(), shape=state.shape, code=state.code,
                          blocksize=state.blocksize, quant_type=state.quant_type, dtype=state.original_dtype)
    return (packed.view(storage) if storage else packed), unpacked


@contextmanager
def cpu_packing_undone(model: nn.Module) -> Iterator[None]:
    """For the block: no bitsandbytes 4-bit layer of `model` repacks its weights for the CPU's bfloat16 kernel, and
    one that did holds them in the ordinary layout (same numbers, gradients to its input); everything restored after,
    also after an exception. Models without such layers are untouched."""
    four_bit = _class("bitsandbytes.nn", "Linear4bit")
    layers = [m for m in model.modules() if four_bit is not None and isinstance(m, four_bit)]
    saved = [(m, m.__dict__.get("support_avx512bf16_for_cpu"), m.weight.data, m.weight.quant_state) for m in layers]
    try:
        for layer, _, data, state in saved:
            layer.support_avx512bf16_for_cpu = False
            if _cpu_packed(layer.weight):
                layer.weight.data, layer.weight.quant_state = _cpu_packing_undone(data, state)
        yield
    finally:
        for layer, flag, data, state in saved:
            layer.weight.data, layer.weight.quant_state = data, state
            if flag is None:
                layer.__dict__.pop("support_avx512bf16_for_cpu", None)
            else:
                layer.support_avx512bf16_for_cpu = flag


def quantized(model: nn.Module) -> bool:
    """Whether `model` holds quantized weights (a parameter that is not floating-point: packed 4-bit bytes, int8 rows,
    or a quantized tensor subclass)."""
    return any(not p.is_floating_point() or type(p.data) not in (torch.Tensor, nn.Parameter) for p in model.parameters())


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The floating dtype `module` computes in: its first floating-point parameter's (norms, adapters), else its first
    4-bit layer's compute dtype (its packed weights are bytes), else float32."""
    floating = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if floating is not None:
        return floating
    state = next((getattr(p, "quant_state", None) for p in module.parameters() if getattr(p, "quant_state", None) is not None), None)
    return getattr(state, "dtype", None) or torch.float32


def _base_reader(linear: nn.Linear) -> Callable[[], torch.Tensor]:
    """What reads the dequantized `(out, in)` weight of an `nn.Linear` (bitsandbytes' 4- and 8-bit layers, a tensor
    subclass with `dequantize()`, a plain weight), or a refusal naming the class."""
    weight = linear.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:  # bitsandbytes' Params4bit: packed bytes and their quantization state
        from bitsandbytes.functional import dequantize_4bit

        def four_bit() -> torch.Tensor:
            data, state = linear.weight.data, linear.weight.quant_state
            if _cpu_packed(linear.weight):
                data, state = _cpu_packing_undone(data, state)
            return dequantize_4bit(data, state).view(linear.out_features, linear.in_features)

        return four_bit
    if weight.dtype == torch.int8 and quantizes_activations(linear):  # LLM.int8(): rows of int8 and their scales
        from bitsandbytes.functional import int8_vectorwise_dequant

        def int8() -> torch.Tensor:
            scales = getattr(linear.weight, "SCB", None)
            return int8_vectorwise_dequant(linear.weight.data, linear.state.SCB if scales is None else scales)  # float32

        return int8
    if type(weight) not in (torch.Tensor, nn.Parameter) and callable(getattr(weight, "dequantize", None)):
        return lambda: linear.weight.dequantize()  # torchao's and quanto's quantized tensors
    if weight.is_floating_point() and type(weight) in (torch.Tensor, nn.Parameter):
        return lambda: linear.weight
    raise UnreadableLinearError(
        f"cannot read the weight of {type(linear).__module__}.{type(linear).__name__} ({type(weight).__name__} of {weight.dtype}) "
        "for the explicit LRP rules (transformer_attribution, lrp, partial_lrp); the gradient methods (attnlrp, cp_lrp, "
        "input_x_gradient, the attention methods) run through its own forward, or dequantize the model first "
        "(e.g. model.dequantize(), or load it without quantization)")


def _active_adapters(module: nn.Module) -> tuple[list[str], float]:
    """The LoRA adapters whose `scale * B A` a tuner layer's forward adds to its base layer's weight (with the sign: the
    merged ones subtracted where the adapters are disabled); DoRA and the other tuners refused by name."""
    if not hasattr(module, "get_delta_weight") or not hasattr(module, "lora_A"):
        raise UnreadableLinearError(
            f"{type(module).__module__}.{type(module).__name__} is an adapter relevancy reads only through its forward "
            "(the gradient methods); for the explicit LRP rules merge it first: model.merge_and_unload()")
    if module.disable_adapters:
        adapters, sign = list(module.merged_adapters), -1.0
    elif module.merged:
        adapters, sign = [], 1.0
    else:
        adapters, sign = [a for a in module.active_adapters if a in module.lora_A], 1.0
    variant = next((a for a in adapters if a in getattr(module, "lora_variant", {})), None)
    if variant is not None:
        raise UnreadableLinearError(
            f"adapter {variant!r} of {type(module).__module__}.{type(module).__name__} is a LoRA variant (DoRA) whose weight the "
            "explicit LRP rules (transformer_attribution, lrp, partial_lrp) do not read; the gradient methods run through "
            "it, or merge it first: model.merge_and_unload()")
    return adapters, sign


def check_readable(module: nn.Module) -> None:
    """Refuse, naming its class, a linear layer whose effective weight `effective` cannot read (before any work)."""
    _base_reader(base_of(module))
    if tuner_layer(module):
        _active_adapters(module)


def effective(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(W, b)` of the linear layer `module` as its forward applies them, read now (loaded where accelerate offloads
    it): the base layer's weight dequantized, plus `scale * B A` of each active LoRA adapter where they are not merged
    (minus the merged ones where the adapters are disabled). DoRA and the other tuners refused by name."""
    with loaded(module):
        base = base_of(module)
        weight, bias = _base_reader(base)(), base.bias
        if not tuner_layer(module):
            return weight, bias
        adapters, sign = _active_adapters(module)
        for adapter in adapters:
            weight = weight + sign * module.get_delta_weight(adapter).to(weight.dtype)
            lora_bias = getattr(module.lora_B[adapter], "bias", None)
            if lora_bias is not None:
                bias = sign * lora_bias * module.scaling[adapter] + (0 if bias is None else bias)
        return weight, bias
