"""The interface every model family implements; the methods only talk to this."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
from torch import nn

from ..core.conventions import VIT_REFERENCE, Conventions
from ..results.explanation import Explanation, ImageExplanation
from ..core.guard import this_thread_only
from ..core.streams import AttentionSite, Feed, Hookable, Stream
from ..core.class_names import named_classes
from ._shared import UnsupportedModelError, checked_images


#: the methods of the seed papers (CVPR'21, ICCV'21, CDAM) and the token ablation reference, in the registry's
#: order: what a one-stream image or text family with a relevance rule map offers
SEED_METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution",
                "partial_lrp", "lrp", "cdam", "token_ablation")


#: the input-relevance methods (AttnLRP, CP-LRP, input x gradient) that an encoder family with a rule map and
#: `embedding_leaves` offers beside the seeds' methods, in the registry's order
INPUT_RELEVANCE_METHODS = ("attnlrp", "cp_lrp", "input_x_gradient")

#: what an image encoder family offers: the seeds' methods, Grad-CAM on its tokens and the input-relevance methods, in
#: the registry's order
IMAGE_ENCODER_METHODS = SEED_METHODS + ("gradcam",) + INPUT_RELEVANCE_METHODS


@dataclass(frozen=True)
class EmbeddingLeaf:
    """Where an encoder's input relevance is measured for one stream (lxt's choice: the token or patch embeddings):
    the output of `module` (a tuple's first item), whose embedding width is dimension `width` (-1 for tokens
    `(B, ..., D)`, 1 for a convolution's `(B, D, h, w)`); the other dimensions after the batch are the stream's
    content tokens in order."""

    module: nn.Module
    width: int = -1


class Adapter:
    """Declares a model family: its token streams, its attention sites, how to run it in pieces.

    Subclasses set `family` and `examples` (shown in error messages) and implement the methods below. The
    adapter keeps no state between calls: everything that depends on a batch travels in the batch object
    (`check_inputs` returns it) or in the `Stream`s of that batch.
    """

    family: ClassVar[str] = ""
    examples: ClassVar[str] = ""
    explanation_class: ClassVar[type[Explanation]] = ImageExplanation
    # where the family's reference code makes other choices than the ViT reference, per method (see conventions)
    conventions: ClassVar[Conventions] = VIT_REFERENCE
    # the registered methods the family offers (`relevancy.methods.REGISTRY`), in the registry's order: what
    # `explain` runs, the command line and the web page list and the evaluation measures; others are refused by name
    methods: ClassVar[tuple[str, ...]] = ()
    # whether `explain_generation` explains the family's generations (decoders: `input_relevance`, `forward_shared`)
    generates: ClassVar[bool] = False
    # whether its generations read an image beside the prompt (`explain_generation(..., image=...)`)
    reads_images: ClassVar[bool] = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        raise NotImplementedError

    # -- what the model is made of -------------------------------------------------------------------------
    def streams(self, inputs: Any) -> dict[str, Stream]:
        """The token streams of a checked batch, in the order the model reads them."""
        raise NotImplementedError

    def attention_sites(self) -> list[AttentionSite]:
        """Every attention of the model in forward order (per stream, block by block)."""
        raise NotImplementedError

    def attention_inputs(self) -> dict[str, Hookable]:
        """Per stream, where the normalised tokens entering its last attention come out (CDAM's X)."""
        raise NotImplementedError

    # one-stream families: their blocks in order, where the LRP methods record what enters each block (see
    # `relevance_rule_map`) and the last-block methods start their graph (`capture.record_forward`)
    blocks: Sequence[nn.Module] = ()

    def relevance_rule_map(self) -> dict:
        """Module type -> relevance rule (see relevancy.lrp) for the propagation methods."""
        raise UnsupportedModelError(f"no relevance rules for the {self.family} family yet")

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """Per stream, where the encoder's input relevance is measured (attnlrp, cp_lrp, input_x_gradient)."""
        raise UnsupportedModelError(f"no embedding leaves for the {self.family} family yet")

    def class_names(self) -> list[str] | None:
        return None

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> Any:
        """The batch in the family's input type, on the model's device and dtype; a clear error for anything else.

        Every method runs on what this returns, so the checks here hold for all of them alike.
        """
        raise NotImplementedError

    def named_target(self, target: Any) -> Any:
        """`target` with class names (a str, or str items of a list) turned into class indices, as the command
        line's `--target` takes them; families whose strings mean something else (a token) keep them."""
        return named_classes(target, self.class_names)

    def check_method_target(self, target: Any, method: str, token_methods: Sequence[str]) -> None:
        """Refuse a target that `method` cannot take on this family, naming the methods that can (`token_methods`:
        the decoder language models' methods, which take token texts and contrasts); by default every target
        goes on to the method's own checks."""

    def bind_target(self, inputs: Any, target: Any) -> tuple[Any, Any]:
        """The checked batch and target as the methods take them. Families whose target picks a token (DETR: a
        query per explained object) make one row per explained object here; the others change nothing."""
        return inputs, target

    def batches(self, inputs: Any, size: int) -> Iterator[Any]:
        """Checked inputs in consecutive batches of at most `size`."""
        raise NotImplementedError

    def describe_inputs(self, inputs: Any) -> dict:
        """Fields of the Explanation that depend on the inputs (input size, normalisation, tokens)."""
        return {}

    def arrange(self, stream: Stream, scores: torch.Tensor) -> torch.Tensor:
        """Content-token scores `(B, N)` of `stream` as the family shows them: an image stream's grid `(B, h, w)`,
        a text stream's tokens with padding at 0."""
        if stream.grid is not None:
            return scores.reshape(len(scores), *stream.grid)
        valid = stream.content_valid()
        return scores if valid is None else torch.where(valid, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))

    def explanation(self, scores: dict[str, torch.Tensor], inputs: Any, **fields: Any) -> Explanation:
        """The Explanation of a one-stream family from its arranged scores; multi-stream families override."""
        (stream_scores,) = scores.values()
        return self.explanation_class(scores=stream_scores, class_names=self.class_names(), **self.describe_inputs(inputs), **fields)

    # -- running --------------------------------------------------------------------------------------------
    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """Eval mode (and, if asked, explicit attention probabilities) for one call; everything restored after."""
        raise NotImplementedError
        yield

    def shared_state(self) -> list[object]:
        """Objects besides the model whose state `explaining` switches and that other models may share (weakly
        referenceable); calls on models sharing one are serialised (see `relevancy.core.guard`)."""
        return []

    def forward(self, inputs: Any, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits, pre_logits)`; pre_logits is what the model returns with its head removed. `graph`: the
        output is differentiable with respect to the input tokens even when every weight is frozen."""
        return self.forward_tokens(inputs, self.embed(inputs, graph))

    def independent_groups(self, inputs: Any) -> list[tuple[torch.Tensor, Any]] | None:
        """Groups of rows `(row indices, inputs of those rows)` that are cheaper to explain one group at a time
        (DETR on a CPU: one image with its objects); None (the default): the whole batch at once."""
        return None

    def forward_shared(self, inputs: Any, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where several rows explain scores of one forward pass (DETR: several objects of one image), that pass
        run once: `(logits, pre_logits, sources)` per row, `sources` (R,) the batch entry of the recorded tensors
        that row reads. None (the default): every row is its own forward."""
        return None

    def embed(self, inputs: Any, graph: bool = False) -> dict[str, torch.Tensor]:
        """Per stream, the tokens `(B, T, D)` entering its first block (position embedding added)."""
        raise NotImplementedError

    def forward_tokens(
        self, inputs: Any, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the streams' first-block tokens to `(logits, pre_logits)`.

        For token ablation the sequences may be a selection: sequence `r` comes from batch row `rows[r]` and
        holds the tokens at `positions[stream][r]` of that stream (a stream missing from `positions`: all).
        """
        raise NotImplementedError

    def feeds(self, inputs: Any) -> list[Feed]:
        """The streams fed by a model of their own before their first attention (`Feed`: a vision-language
        decoder's vision tower), whose relevance `generic_attention` and `transformer_attribution` carry on into that
        model; none by default."""
        return []

    def ablated(self, inputs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Stream]]:
        """What token ablation removes one at a time: per unit the tokens `(B, T, ...)` that `forward_tokens` takes and
        the unit's `Stream` (its prefix tokens are kept, its tokens that are not `valid` are not removed); by default
        `embed`'s tokens and `streams`, each content token dropped before the first block."""
        return self.embed(inputs), self.streams(inputs)


def only_stream(adapter: Adapter, inputs: Any, method: str) -> Stream:
    """The stream of a one-stream family; a clear error for the methods not written for several streams."""
    streams = adapter.streams(inputs)
    if len(streams) != 1:
        raise UnsupportedModelError(
            f"method '{method}' explains one-stream models (ViT, BERT); {adapter.family} has the streams "
            f"{', '.join(streams)}"
        )
    return next(iter(streams.values()))


@contextmanager
def forward_hooks(modules: Sequence[Hookable], hook: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Call `hook(index, output)` on each module's forward output in this thread for the duration of the block."""
    handles = [m.register_forward_hook(this_thread_only(lambda _m, _i, out, k=k: hook(k, out))) for k, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class ImageAdapter(Adapter):
    """An adapter whose inputs are one tensor of images `(B, C, H, W)` (the vision transformers): checked against
    the model by `check_image_shape`, run in batches of consecutive images."""

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """A one-line error where the model cannot take images of `shape`."""
        raise NotImplementedError

    def check_inputs(self, inputs: object) -> torch.Tensor:
        return checked_images(inputs, self.model, self.check_image_shape)

    def batches(self, inputs: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
        return iter(inputs.split(size))
