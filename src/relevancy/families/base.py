"""The interface every model family implements; the methods only talk to this."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ClassVar, Iterator, Sequence

import torch
from torch import nn

from ..explanation import Explanation


class UnsupportedModelError(TypeError):
    """The model is not of a family relevancy knows, or lacks what a method needs."""


class Adapter:
    """Declares a model family's layout: blocks, attention probabilities, prefix tokens, grid, head.

    Subclasses set `family` and `examples` (shown in error messages) and implement the methods below.
    """

    family: ClassVar[str] = ""
    examples: ClassVar[str] = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        raise NotImplementedError

    # -- layout -------------------------------------------------------------------------------------------
    num_prefix_tokens: int
    has_class_token: bool
    blocks: Sequence[nn.Module]

    def attention_probability_modules(self) -> list[nn.Module]:
        """One module per block whose forward output is that block's attention probabilities `(B, heads, T, T)`."""
        raise NotImplementedError

    def last_attention_input_module(self) -> nn.Module:
        """The module whose output is the normalised tokens entering the last attention (CDAM's X)."""
        raise NotImplementedError

    def relevance_rule_map(self) -> dict:
        """Module type -> relevance rule (see relevancy.lrp) for the propagation methods."""
        raise UnsupportedModelError(f"no relevance rules for the {self.family} family yet")

    def grid_size(self, inputs: torch.Tensor) -> tuple[int, int]:
        raise NotImplementedError

    def class_names(self) -> list[str] | None:
        return None

    explanation_class: ClassVar[type] = Explanation

    def arrange_token_scores(self, scores: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Token scores `(B, N)` as the family shows them (an image grid `(B, h, w)` for vision models)."""
        return scores.reshape(len(scores), *self.grid_size(inputs))

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        """Extra fields of the Explanation that depend on the inputs (input size, normalisation)."""
        return {"input_size": tuple(inputs.shape[-2:])}

    def check_inputs(self, inputs: object) -> torch.Tensor:
        """The batch as a float tensor on the model's device and dtype; a clear error for anything else.

        Every method runs on what this returns, so the checks here (one image or more, finite values, the
        shape the model takes) hold for all of them alike.
        """
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs must be a torch.Tensor batch (B, C, H, W) of normalised images, got {type(inputs).__name__}")
        if inputs.ndim == 3:
            inputs = inputs[None]
        if inputs.ndim != 4 or not inputs.is_floating_point():
            raise ValueError(f"inputs must be a float batch (B, C, H, W), got {inputs.dtype} of shape {tuple(inputs.shape)}")
        if len(inputs) == 0:
            raise ValueError(
                f"the batch holds no images (shape {tuple(inputs.shape)}): explanations and concepts need at least one "
                "example, (B, C, H, W) with B >= 1"
            )
        self.check_image_shape(tuple(inputs.shape))
        param = next(self.model.parameters(), None)
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

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """Refuse a `(B, C, H, W)` batch the model cannot take, naming the shape it takes (default: any)."""

    def batches(self, inputs: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
        """Checked inputs in consecutive batches of at most `size`."""
        return iter(inputs.split(size))

    # -- running ------------------------------------------------------------------------------------------
    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """Eval mode (and, if asked, explicit attention probabilities) for one call; everything restored after."""
        raise NotImplementedError
        yield

    def shared_state(self) -> list[object]:
        """Objects besides the model whose state `explaining` switches and that other models may share (weakly
        referenceable); calls on models sharing one are serialised (see `relevancy.guard`)."""
        return []

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Tokens `(B, T, D)` entering the first block (position embedding added)."""
        raise NotImplementedError

    def forward_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the first block's input tokens to `(logits, pre_logits)`."""
        raise NotImplementedError

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits, pre_logits)`; pre_logits is what the model returns with its head removed."""
        return self.forward_tokens(self.embed(inputs))


@contextmanager
def forward_hooks(modules: Sequence[nn.Module], hook: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Call `hook(index, output)` on each module's forward output for the duration of the block."""
    handles = [m.register_forward_hook(lambda _m, _i, out, k=k: hook(k, out)) for k, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
