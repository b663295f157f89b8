"""Vision-language decoders: transformers' LLaVA (a CLIP or SigLIP tower, its projector, a Llama / Mistral / Qwen2
decoder), Gemma 3 with images (SigLIP, pooled projector, Gemma 3 decoder), Idefics3 / SmolVLM (SigLIP, pixel
shuffle, Llama decoder), PaliGemma 1 and 2 and InternVL (InternViT, pixel shuffle, a normed MLP, a Qwen2 / Qwen3 /
Llama decoder), unmodified.

Inputs are the processor's output (`input_ids` with the image's placeholder tokens, `attention_mask`, `pixel_values`:
one image per row). The model runs its own forward (tower, `vision_feature_layer` and select strategy as
configured, projector, the image's features put at its placeholder tokens, the decoder) with two leaves: the token
embeddings, which the embedding's output is made for the call, and the pixel values. The explained score is a logit
of the token that comes next after each row's last real token, as for decoders (`causal_lm`): the targets, the
reading of spans and contrasts and the backward under a rule set are the decoder adapter's, whose relevance pass
this adapter feeds (`read_forward`). The rules act in the tower and projector as in the decoder: the configs' attention
(the tower's too) is switched to the rule set's, the tower's norms and MLPs and the projector run the layout's rule
forwards. Text relevance is input x gradient at the token embeddings, image relevance input x gradient at the
pixels, summed over the channels (and over each patch's pixels for the patch grid).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ...core.guard import this_thread_only
from ...core.streams import AttentionSite, Feed, Stream
from .._shared import OutputPart
from ..hf_attention import attention_probabilities
from ..base import Adapter
from ...lrp.engine import by_type, unchanged
from ..causal_lm.adapter import CausalLMAdapter, last_real, position_ids
from ..causal_lm.layouts import recognised, rule_map as decoder_rule_map, structure
from ..text_batch import TextBatch
from .batch import ImageTextTokens
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation
from .layouts import (
    IDEFICS3, LAYOUTS, OWN_ADAPTER_LAYOUTS, VisionLanguageLayout, blocks_on_patches, decoder_view, is_vision_language, layout_named,
    layout_of, occluded, pixel_patches, square, tokens_on_patches,
)
from .rules import IMAGE, rule_map

#: what a processor's output may hold (token_type_ids: Gemma 3's, made again from the placeholder tokens; PaliGemma's
#: prefix, read as given; labels: PaliGemma's training targets, which it always writes and no method reads)
PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "token_type_ids", "mm_token_type_ids", "labels")


class VisionLanguageAdapter(CausalLMAdapter):
    family = "vision-language decoder"
    #: attnlrp, cp_lrp, input_x_gradient reach the pixels through the tower, generic_attention and
    #: transformer_attribution the tower's patch tokens (`feeds`), token_ablation occludes the tower's patches
    #: (`ablated`); raw_attention, rollout, attention_gradcam read the decoder's attention only and
    #: token_activation_map its logits at every position, the image's tokens laid back on the patch grid (the others
    #: are refused by name)
    methods = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution", "token_ablation",
               "attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map")
    generates = True
    reads_images = True
    #: the layouts this family maps: `supports` takes their classes, and the apps' loaders read the classes from here
    layouts: ClassVar[tuple[VisionLanguageLayout, ...]] = tuple(layout for layout in LAYOUTS if layout not in OWN_ADAPTER_LAYOUTS)
    examples = "transformers " + ", ".join(name for layout in layouts for name in layout.classes)
    explanation_class = VisionLanguageExplanation

    def __init__(self, model: nn.Module) -> None:
        self.mapped(model)
        self.image_tokens = self.vision.image_token_count(model)  # the placeholders of one image in a row
        self.patch = square(model.config.vision_config.patch_size)
        self.side = square(model.config.vision_config.image_size) // self.patch  # the tower's patch grid is side x side
        self.tower_prefix = self.vision.tower_prefix(model)  # CLIP's and InternViT's [CLS] (none for SigLIP)
        #: the image tokens before the patch tokens: LLaVA's [CLS] where its tower has one and its select strategy keeps it
        self.image_prefix = self.tower_prefix if getattr(model.config, "vision_feature_select_strategy", None) == "full" else 0

    def mapped(self, model: nn.Module) -> None:
        """What every vision-language adapter holds: the model's layout (`vision`: tower and projector, checked; a
        refusal names the part), the decoder's (`layout`, by the decoder layouts on the `DecoderView`), its layers, the
        rule forwards of both (`decoder_ruled`: the decoder's), the model's structure and its image token."""
        Adapter.__init__(self, model)
        self.vision = layout_of(model)
        view = decoder_view(model, self.vision)
        _, self.layout, self.decoder_ruled = recognised(view)
        self.structure = structure(model)  # the whole model's, on which its forwards are checked (`own_forward_problems`)
        self.decoder = view.model
        self.blocks = list(getattr(self.decoder, self.layout.layers))
        self.ruled = [*self.decoder_ruled, *self.vision.ruled(model)]
        self.image_token = int(model.config.image_token_id)
        self.first_position = self.vision.first_position

    def image_delimiters(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """The tokens around and among one sequence's image placeholders `image` `(N,)` (bool) of its tokens `ids`
        `(N,)` that are the image's own (the layout's `image_span`: Qwen2-VL's vision start and end, Gemma 3's begin
        and end of image, InternVL's `<img>` and `</img>`, Mistral 3's `[IMG_BREAK]` and `[IMG_END]`): part of the
        image's span, not words of the text (TAM leaves them out of its text)."""
        return self.vision.image_span.delimiters(ids, image, self.model.config)

    @staticmethod
    def image_separator(model: nn.Module) -> str:
        """What a generation's text prompt gets between the image's token, put first, and the text (the layout's)."""
        return layout_of(model).image_separator

    @staticmethod
    def image_size_inputs(size: tuple[int, int]) -> dict[str, torch.Tensor]:
        """What a generation's inputs need from the picture's `(height, width)` beside the processor's output (none
        here; InternVL's `image_sizes`, which its processor does not write)."""
        return {}

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Any transformers vision-language decoder but those with an adapter of their own (`qwen.py`, `tiled.py`,
        `mistral3.py`): one relevancy does not map is refused by `__init__`, naming those it maps."""
        return is_vision_language(model) and layout_named(model) not in OWN_ADAPTER_LAYOUTS

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> ImageTextTokens:
        """An `ImageTextTokens` on the model's device from the processor's output, the pixels in the model's dtype; a
        one-line error for anything but one image per row of the tower's size, its placeholders in every row (as many as
        the layout puts one image's features at), before the processor's or the model's own error."""
        if not isinstance(inputs, Mapping) or "pixel_values" not in inputs or "input_ids" not in inputs:
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise TypeError(f"inputs must be the processor's output, a dict with input_ids, attention_mask and pixel_values; got {got}")
        unknown = sorted(set(inputs) - set(PROCESSOR_KEYS))
        if unknown:
            raise ValueError(f"the processor's output holds {', '.join(unknown)}, which relevancy does not take; it takes {', '.join(PROCESSOR_KEYS)}")
        text = super().check_inputs({key: inputs[key] for key in ("input_ids", "attention_mask") if key in inputs})
        pixels = inputs["pixel_values"]
        if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
            raise TypeError(f"pixel_values must be a float tensor (the processor's output), got {type(pixels).__name__}")
        side = self.side * self.patch
        images = 1 if self.vision is IDEFICS3 else None
        shape = (len(text), 1, 3, side, side) if images else (len(text), 3, side, side)
        if tuple(pixels.shape) != shape:
            what = f"{'(B, 1, 3, H, W)' if images else '(B, 3, H, W)'}: one image per row{', ' + self.vision.one_image if self.vision.one_image else ''}"
            raise ValueError(f"pixel_values must be {what} of the tower's size {side} x {side}, i.e. {shape}; got {tuple(pixels.shape)}")
        placeholders = (text.input_ids == self.image_token).sum(1)
        if (placeholders != self.image_tokens).any():
            raise ValueError(f"input_ids must hold one image's {self.image_tokens} placeholder tokens (id {self.image_token}) in every row, "
                             f"as many as the model puts the image's features at; counted per row: {placeholders.tolist()}: make the "
                             "inputs with the model's processor, processor(images=image, text=prompt), the prompt holding its image "
                             "token (processor.image_token) once or made by its chat template (processor.apply_chat_template)")
        dtype = next(self.model.parameters()).dtype
        device = text.input_ids.device  # the embeddings' execution device (not an offloaded weight's meta device)
        mask = inputs.get("pixel_attention_mask")
        return ImageTextTokens(**{name: getattr(text, name) for name in ("input_ids", "attention_mask", "tokens", "word_ids")},
                               token_type_ids=self.prefix_types(inputs.get("token_type_ids"), text.input_ids),
                               pixel_values=pixels.to(device, dtype),
                               pixel_attention_mask=None if mask is None else torch.as_tensor(mask).to(device))

    def sized_output(self, inputs: object, size_key: str, width: int, taken: tuple[str, ...], note: str, sizes: str
                     ) -> tuple[TextBatch, torch.Tensor, torch.Tensor]:
        """`(text, pixel values, sizes)` of a processor's output whose images come with their sizes `size_key` `(B,
        width)` (Qwen2-VL's `image_grid_thw`, LLaVA-NeXT's `image_sizes`): a one-line error for a missing key, a key
        not `taken` (`note` after the list), pixels that are no float tensor, and rows whose images differ in size
        (named `sizes`: relevancy explains one per call)."""
        if not isinstance(inputs, Mapping) or not {"pixel_values", "input_ids", size_key} <= set(inputs):
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise TypeError(f"inputs must be the processor's output, a dict with input_ids, attention_mask, pixel_values and {size_key}; got {got}")
        unknown = sorted(set(inputs) - set(taken))
        if unknown:
            raise ValueError(f"the processor's output holds {', '.join(unknown)}, which relevancy does not take; it takes {', '.join(taken)}{note}")
        text = CausalLMAdapter.check_inputs(self, {key: inputs[key] for key in ("input_ids", "attention_mask") if key in inputs})
        pixels, given = inputs["pixel_values"], torch.as_tensor(inputs[size_key])
        if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
            raise TypeError(f"pixel_values must be a float tensor (the processor's output), got {type(pixels).__name__}")
        if tuple(given.shape) != (len(text), width):
            raise ValueError(f"{size_key} must be (B, {width}): one image per row, B = {len(text)}; got {tuple(given.shape)}")
        if bool((given != given[:1]).any()):
            raise ValueError(f"the rows' images have different {sizes} ({size_key} {given.tolist()}): relevancy explains one per call; "
                             "explain each size in a call of its own (or resize the images to one size)")
        return text, pixels, given

    def prefix_types(self, given: object, ids: torch.Tensor) -> torch.Tensor | None:
        """The processor's token types where the layout reads them (PaliGemma's prefix: 0 on the image and prompt, 1
        after), all 0 where none are given (the whole prompt a prefix, as the processor writes it without a suffix);
        None for the other layouts (Gemma 3's are made again from the placeholders)."""
        if self.vision.token_types != "prefix":
            return None
        if given is None:
            return torch.zeros_like(ids)
        types = torch.as_tensor(given).to(ids.device).long()
        if types.numel() != ids.numel() or not bool(((types == 0) | (types == 1)).all()):
            raise ValueError(f"token_type_ids must be 0 (the prefix: image and prompt) or 1 (after it) at each of input_ids' "
                             f"{tuple(ids.shape)} positions, as the processor writes them; got {tuple(types.shape)}")
        return types.view_as(ids)

    def causal_probe(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """PaliGemma's token types all 1 (no prefix): without them its decoder (`use_bidirectional_attention`) attends
        both ways where transformers leaves the mask out (a row without padding) and causally where not."""
        return {"token_type_ids": torch.ones_like(ids)} if self.vision.token_types == "prefix" else {}

    def hidden_states(self, embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states from token embeddings (the forward-check's text-only probe): PaliGemma's
        through the model's own forward with the probe's token types (causal, `causal_probe`), the others' alone."""
        if self.vision.token_types != "prefix":
            return super().hidden_states(embeddings, mask)
        return self.model.model(inputs_embeds=embeddings, attention_mask=mask, position_ids=position_ids(mask) + self.first_position,
                                use_cache=False, **self.causal_probe(mask)).last_hidden_state

    def describe_inputs(self, inputs: ImageTextTokens) -> dict:
        return {**super().describe_inputs(inputs), "image_tokens": (inputs.input_ids == self.image_token).cpu()}

    # -- running ----------------------------------------------------------------------------------------------
    def leaves_forward(self, inputs: ImageTextTokens, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's own forward over the token rows (each with its input row's image), the token embeddings and
        the pixels as leaves: `({"text": (R, N, D), "image": pixels}, last hidden states)`."""
        pixels = inputs.pixel_values[source].detach().requires_grad_(True)
        leaves: dict[str, torch.Tensor] = {}

        def leaf(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            leaves["text"] = output.detach().requires_grad_(True)
            return leaves["text"]

        handle = self.model.get_input_embeddings().register_forward_hook(this_thread_only(leaf))
        try:
            hidden = self.hidden_of(inputs, ids, mask, pixels, source)
        finally:
            handle.remove()
        return {"text": leaves["text"], "image": pixels}, hidden

    def hidden_of(self, inputs: ImageTextTokens, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor,
                  source: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own forward (tower, projector, decoder) over the token rows `ids` (`mask`) with the images
        `pixels`, row `r` of input row `source[r]` (its `image_sizes` where the inputs have them): the decoder's last hidden states `(R, N, D)`. `types`: the
        prefix's token types of `ids` (PaliGemma; None: the input rows', 1 at the positions after them, a
        generation's tokens)."""
        further: dict[str, torch.Tensor] = {}
        if inputs.pixel_attention_mask is not None:
            further["pixel_attention_mask"] = inputs.pixel_attention_mask[source]
        if getattr(inputs, "image_sizes", None) is not None:  # LLaVA-NeXT's, Mistral 3's (`SizedImageTextTokens`)
            further["image_sizes"] = inputs.image_sizes[source]
        if self.vision.token_types == "images":  # each image's tokens attend to each other
            further["token_type_ids"] = (ids == self.image_token).long()
        elif self.vision.token_types == "prefix":  # image and prompt attend to each other, what follows causally
            given = inputs.token_type_ids[source] if types is None else types
            further["token_type_ids"] = torch.nn.functional.pad(given, (0, ids.shape[1] - given.shape[1]), value=1)
        return self.model.model(input_ids=ids, pixel_values=self.model_pixels(pixels), attention_mask=mask,
                                position_ids=position_ids(mask) + self.first_position, use_cache=False, **further).last_hidden_state

    @staticmethod
    def model_pixels(pixels: torch.Tensor) -> torch.Tensor:
        """The rows' pixels as the model's forward takes them (InternVL's tiles: one after the other)."""
        return pixels

    def forward(self, inputs: ImageTextTokens, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward (tower, projector, decoder; what the attention methods record): `(next-token
        logits (B, V), final hidden state (B, D))` after each row's last real token."""
        mask = inputs.attention_mask
        _, hidden = self.leaves_forward(inputs, inputs.input_ids, mask, torch.arange(len(mask), device=mask.device))
        last = hidden[torch.arange(len(hidden), device=hidden.device), last_real(mask)]
        return self.head(last), last

    def feeds(self, inputs: ImageTextTokens) -> list[Feed]:
        """The image's tokens in the decoder, fed by the vision tower through the projector (`generic_attention`
        carries the decoder's relevance on into the tower): the tower's tokens (CLIP's [CLS] first, none for
        SigLIP) read after the layers `vision_feature_layer` names (LLaVA, InternVL: `hidden_states[k]`, one or several
        side by side; Gemma 3, Idefics3: the last layer's), each image token made of one tower token (LLaVA; a
        kept [CLS] of the tower's [CLS]) or of its block of patch tokens, pooled or pixel-shuffled, in equal shares
        (`tokens_on_patches`' layout)."""
        layers = self.vision.tower_layers(self.model)
        patches, prefix = self.side ** 2, self.tower_prefix
        selected = self.model.config.vision_feature_layer if self.vision.feature_layer else -1
        depths = tuple(sorted({k % (len(layers) + 1) for k in ([selected] if isinstance(selected, int) else selected)}))
        positions = inputs.input_ids == self.image_token
        count = self.image_tokens  # every row holds its image's tokens once (`check_inputs`)
        weights = torch.zeros(count, prefix + patches, dtype=torch.float64, device=positions.device)
        weights[:self.image_prefix, :self.image_prefix] = torch.eye(self.image_prefix, dtype=torch.float64, device=positions.device)  # LLaVA's kept [CLS]
        weights[self.image_prefix:, prefix:] = tokens_on_patches(torch.eye(count - self.image_prefix, dtype=torch.float64,
                                                                           device=positions.device), self.side).flatten(1)
        attention = self.vision.residual.attention
        sites = tuple(AttentionSite(IMAGE, IMAGE, OutputPart(getattr(layer, attention), attention_probabilities)) for layer in layers)
        return [Feed(Stream(IMAGE, "image", prefix, None, grid=(self.side, self.side)), sites, depths, "text", positions, weights)]

    def ablated(self, inputs: ImageTextTokens) -> tuple[dict[str, torch.Tensor], dict[str, Stream]]:
        """Token ablation's units: the prompt's text tokens (their ids `(B, T, 1)`), each removed from the sequence as
        a decoder's token is (the image's placeholders are not: they are the image's), and the tower's patches
        (their indices `(B, P, 1)` on the patch grid), each set to the processor's mean, 0 in its normalised pixel
        space: the patch grid is the tower's whatever the projector makes of it (Gemma 3's pooling, Idefics3's
        pixel shuffle), so one patch is one patch of pixels in every layout."""
        ids, mask = inputs.input_ids, inputs.attention_mask
        grid = self.patch_grid(inputs)
        patches = torch.arange(grid[0] * grid[1], device=ids.device).expand(len(ids), -1)
        units = {"text": Stream("text", "text", 0, last_real(mask), valid=inputs.valid & (ids != self.image_token)),
                 "image": Stream("image", "image", 0, None, grid=grid)}
        return {"text": ids[..., None], "image": patches[..., None]}, units

    def forward_tokens(self, inputs: ImageTextTokens, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
                       positions: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(next-token logits (R, V), final hidden state (R, D))` of token ablation's sequences (`ablated`'s units
        as selected): sequence `r` of input row `rows[r]` holds the text tokens `tokens["text"][r]` (the mask of the
        kept positions: positions are counted anew, the token is deleted) and that row's image with the patches
        not in `positions["image"][r]` set to 0."""
        mask, pixels = inputs.attention_mask, inputs.pixel_values
        rows = torch.arange(len(mask), device=mask.device) if rows is None else rows
        mask, pixels, positions = mask[rows], pixels[rows], positions or {}
        types = None if inputs.token_type_ids is None else inputs.token_type_ids[rows]
        if "text" in positions:
            mask = mask.gather(1, positions["text"])
            types = None if types is None else types.gather(1, positions["text"])
        if "image" in positions:
            grid = self.patch_grid(inputs)
            removed = torch.ones(len(rows), grid[0] * grid[1], dtype=torch.bool, device=mask.device).scatter_(1, positions["image"], False)
            pixels = self.without_patches(pixels, removed.view(-1, *grid))
        hidden = self.hidden_of(inputs, tokens["text"][..., 0], mask, pixels, rows, types)
        last = hidden[torch.arange(len(hidden), device=hidden.device), last_real(mask)]
        return self.head(last), last

    def patch_grid(self, inputs: ImageTextTokens) -> tuple[int, int]:
        """The rows and columns of the images' patch grid: the tower's square one (Qwen2-VL: the images' own)."""
        return self.side, self.side

    def without_patches(self, pixels: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
        """The rows' `pixels` `(R, ..., C, H, W)` with the patches `removed` `(R, rows, cols)` (bool) set to the
        processor's mean, 0 (tiles `(R, tiles, C, H, W)`: their grids one under the other, `patch_grid`)."""
        grid = (pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch)
        return occluded(pixels, removed.view(len(removed), *pixels.shape[1:-3], *grid), self.patch)

    def forward_shared(self, inputs: ImageTextTokens, graph: bool = False) -> None:
        """None: each row runs its own forward with its own image (`explain_generation` reads the methods of one
        forward only on this family)."""
        return None

    def model_rule_map(self) -> dict:
        """The whole model's rule map under an explicit rule set: decoder, projector and tower (`rules.py`)."""
        return rule_map(self.model, self.vision, self.layout, self.ruled)

    def recomputed_layers(self) -> list[nn.Module]:
        """`checkpoint=True` runs the tower's layers again in the backward too, not only the decoder's."""
        return [*self.vision.tower_layers(self.model), *self.blocks]

    def explanation(self, scores: dict[str, torch.Tensor], inputs: ImageTextTokens, **fields: Any) -> VisionLanguageExplanation:
        """The text scores and, from the pixels' relevance (`leaves`), the image's per pixel and per patch; where a
        method scored the tower's patch tokens themselves (`scores["image"]` `(B, P)`: token ablation, generic
        attention carried into the tower) those on the patch grid. Otherwise (the attention methods) the image's map is the decoder's scores at the image's tokens laid back
        on the patch grid (`tokens_on_patches`), not carried through the tower (`through_tower=False`), and the text
        scores hold 0 at the image's tokens."""
        described = self.describe_inputs(inputs)
        if "image" in scores:
            return VisionLanguageExplanation(scores=scores["text"].masked_fill(described["image_tokens"].to(scores["text"].device), 0), **described, **fields, image_size=inputs.image_size,
                                             image_scores=scores["image"].view(len(scores["image"]), *self.patch_grid(inputs)))
        if "leaves" not in fields:
            text, image = scores["text"], described["image_tokens"].to(scores["text"].device)
            on_tokens = text[image].view(len(text), -1)  # every row holds its image's tokens once (`check_inputs`)
            return VisionLanguageExplanation(scores=text.masked_fill(image, 0), **described, **fields, through_tower=False,
                                             image_scores=self.image_token_map(on_tokens, inputs), image_size=inputs.image_size)
        pixels = self.pixel_relevance(fields.pop("leaves")["image"], inputs)
        return VisionLanguageExplanation(scores=scores["text"], **described, **fields, image_size=inputs.image_size,
                                         image_scores=pixel_patches(pixels, self.patch), pixel_scores=pixels)

    def pixel_relevance(self, relevance: torch.Tensor, inputs: ImageTextTokens) -> torch.Tensor:
        """The pixels' relevance `(R, H, W)` from the image leaf's input x gradient (`pixel_values`' shape, R rows):
        summed over the colour channels (and Idefics3's one image per row)."""
        return relevance.flatten(1, -3).sum(1)

    def seen_pixels(self, inputs: ImageTextTokens) -> torch.Tensor:
        """The first row's image `(C, H, W)` as the model reads it (the processor's normalised pixels): what
        `explain_generation` draws its maps over."""
        return inputs.pixel_values.reshape(-1, *inputs.pixel_values.shape[-3:])[0]

    def decoding_inputs(self, inputs: ImageTextTokens) -> dict[str, torch.Tensor]:
        """What the model's `generate` reads besides the token ids and their mask: the pixels (and Idefics3's pixel
        mask, where the processor gave one)."""
        further = {"pixel_values": self.model_pixels(inputs.pixel_values)}
        if inputs.pixel_attention_mask is not None:
            further["pixel_attention_mask"] = inputs.pixel_attention_mask
        return further

    def image_token_grid(self, inputs: ImageTextTokens) -> tuple[int, int]:
        """`(rows, cols)` of the image's tokens after the prefix as the projector lays them out (`tokens_on_patches`:
        a square grid in these layouts), the one grid of `image_token_grids`, which TAM filters on."""
        side = math.isqrt(self.image_tokens - self.image_prefix)
        return side, side

    def image_token_grids(self, inputs: ImageTextTokens) -> tuple[tuple[torch.Tensor, tuple[int, int]], ...]:
        """The grids TAM filters on apart, each `(indices of its tokens among the image's placeholders, row-major;
        (rows, cols))`: here one, `image_token_grid`, after the prefix (LLaVA's kept [CLS] is no cell of it)."""
        rows, cols = self.image_token_grid(inputs)
        return (torch.arange(self.image_prefix, self.image_prefix + rows * cols, device=inputs.input_ids.device), (rows, cols)),

    def image_token_map(self, on_tokens: torch.Tensor, inputs: ImageTextTokens) -> torch.Tensor:
        """Scores of the image's tokens `(B, image tokens)` laid back on the tower's patch grid `(B, side, side)`
        through the projector's token layout (`tokens_on_patches`): the decoder-only methods' image map."""
        return tokens_on_patches(on_tokens, self.side, self.image_prefix)

    def generation_explanation(self, fields: dict[str, Any], ids: torch.Tensor, images: dict[str, torch.Tensor],
                               picture: torch.Tensor | None, inputs: ImageTextTokens) -> VisionLanguageGenerationExplanation:
        """A generation's result with its image part: `images["image"]` `(G, H, W)` the pixels' relevance per
        generated token, summed per patch, or `images["patches"]` `(G, rows, cols)` a map on the patch grid already
        (`token_activation_map`'s); `picture` `(H, W, 3)` the image as the model saw it; `inputs` the call's."""
        from ...results.viz import picture_url  # matplotlib, loaded when a page is drawn

        return VisionLanguageGenerationExplanation(**fields, image_scores=images["patches"] if "patches" in images else pixel_patches(images["image"], self.patch),
                                                   image_tokens=(ids == self.image_token).cpu(),
                                                   image_url=None if picture is None else picture_url(picture))


class MergedGridAdapter(VisionLanguageAdapter):
    """A vision-language adapter for images of their own patch grid (`patch_grid`), whose image tokens are that grid
    merged k x k (`merge`) in row-major order (Qwen-VL's patch merger, Mistral 3's): what the decoder-only methods'
    image map and TAM's filter read, and the whole model's rule map of the decoder alone."""

    merge: int = 1

    def image_token_grid(self, inputs: ImageTextTokens) -> tuple[int, int]:
        """`(rows, cols)` of the image's tokens: the patch grid merged k x k (the merger's order is row-major on it)."""
        rows, cols = self.patch_grid(inputs)
        return rows // self.merge, cols // self.merge

    def image_token_map(self, on_tokens: torch.Tensor, inputs: ImageTextTokens) -> torch.Tensor:
        """Scores of the image's tokens `(B, image tokens)` laid back on the image's patch grid `(B, h, w)`, each
        merged token's score shared equally by its k x k patches (sums kept)."""
        return blocks_on_patches(on_tokens, self.image_token_grid(inputs), self.merge)

    def model_rule_map(self) -> dict:
        """The decoder's rule map, the tower's and projector's modules as they are (the explicit rules' methods are
        not offered on these families: the map serves the decoder's own-forward check, whose probe is text)."""
        projector = getattr(self.model.model, self.vision.projector)
        return {**by_type([*self.vision.transformer(self.model).modules(), *projector.modules()], unchanged),  # first: the decoder's entries win a shared type
                **decoder_rule_map(self.layout, decoder_view(self.model, self.vision), self.decoder_ruled),
                **by_type([self.model.model], unchanged)}

