"""Decoder language models (transformers `LlamaForCausalLM` and the models sharing its layout, `GPT2LMHeadModel`).

Inputs are the tokenizer's output (`input_ids`, `attention_mask`, left or right padding). One stream `text`, read
at each row's last real token: the explained score is a logit of the token that comes next. Position ids count the
real tokens only, so a padded row is the same computation as the row alone. The model runs from its token
embeddings without a KV cache; for a relevance pass the configs are switched to relevancy's exact eager attention
under the rule set and the MLPs and norms run the rule set's forwards (instance attributes), all restored after.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ...conventions import Conventions, GradCamConventions
from ...explanation import TextExplanation
from ...guard import recomputed_as_this_thread, this_thread_only
from ...messages import quoted
from ...lrp.attnlrp import RuleSet, attention, fused_attention
from ...streams import AttentionSite, Hookable, Stream
from .._shared import OutputPart, transformers_configs
from ..base import Adapter, UnsupportedModelError
from ..hf_attention import attention_probabilities, explaining_call, register_gated, switch_attention
from ..hf_bert.adapter import _from_encoding, _token_strings, _token_tensor
from ..hf_bert.batch import TextBatch
from .layouts import Layout, layout_of
from .targets import Contrast, target_scores

#: the attention implementation relevancy registers in transformers per rule set (None: the plain gradient)
ATTENTION_NAMES = {None: "relevancy_causal_exact", "attnlrp": "relevancy_attnlrp", "cp_lrp": "relevancy_cp_lrp"}


def _registered_attention(rules: RuleSet | None, probabilities: bool) -> str:
    """The name under which the attention under `rules` is registered: with `probabilities`, the exact eager one
    (and transformers' eager mask); without, torch's fused kernel (and transformers' sdpa mask), which keeps no
    `(T, T)` matrix for the backward."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if probabilities:
            return attention(rules, query, key, value, attention_mask, scale)  # transformers' eager mask: additive
        return fused_attention(rules, query, key, value, attention_mask, scale), None

    name = ATTENTION_NAMES[None if rules is None else rules.name] + ("" if probabilities else "_fused")
    register_gated(name, attention_forward, eager_mask if probabilities else sdpa_mask)
    return name


def context_window(model: nn.Module) -> int | None:
    """The most positions the model reads, whatever its position scheme: GPT-2's learned table (`n_positions`), the
    window RoPE was trained for (`max_position_embeddings`); None where the config names none."""
    window = getattr(model.config, "max_position_embeddings", None)  # GPT-2's config maps it to n_positions
    return window if isinstance(window, int) and window > 0 else None


def widened(x: torch.Tensor) -> torch.Tensor:
    """`x` detached, in float32 at least: what a half-precision model's maps and scores are reported in."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def input_times_gradient(embeddings: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """`(..., T)` input x gradient summed over the width, in float32 at least (a half-precision model's relevance
    is a sum of many small terms)."""
    return torch.linalg.vecdot(widened(embeddings), widened(gradient))


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting the real tokens only (0 at padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """`(B,)` the index of each row's last real token (left or right padding)."""
    return mask.shape[1] - 1 - mask.flip(-1).argmax(-1)


class CausalLMAdapter(Adapter):
    family = "decoder language model"
    examples = "transformers LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel"
    explanation_class = TextExplanation
    #: Grad-CAM averages the gradient over the real token pairs, so that padding cannot change a row's map
    # Grad-CAM over the real (query, key) pairs, as for BERT: padding does not change a row's map
    conventions = Conventions(attention_gradcam=GradCamConventions(region="matrix"))

    def named_target(self, target: Any) -> Any:
        """Strings are tokens here, resolved with the tokenizer (see `targets`)."""
        return target

    def check_method_target(self, target: Any, method: str, token_methods: Sequence[str]) -> None:
        """The attention and gradient methods take token ids; token texts and `Contrast`s are the decoder methods'."""
        entries = target if isinstance(target, (list, tuple)) else [target]
        given = next((entry for entry in entries if isinstance(entry, (str, Contrast))), None)
        if method not in token_methods and given is not None:
            raise TypeError(f"method '{method}' takes token ids as targets on a decoder (an int, one per row, or a tensor of "
                            f"ids), got {type(given).__name__} {quoted(given)}; token texts and Contrast targets are taken "
                            f"by {', '.join(token_methods)} (texts with tokenizer=)")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        layout = layout_of(model)
        if layout is None:
            raise UnsupportedModelError(f"not a decoder language model of a known layout: {type(model).__name__}")
        self.layout: Layout = layout
        self.decoder: nn.Module = getattr(model, layout.decoder)
        self.blocks = list(getattr(self.decoder, layout.layers))

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return layout_of(model) is not None

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> TextBatch:
        """A `TextBatch` on the model's device from the tokenizer's output (or `input_ids` alone: no padding)."""
        if isinstance(inputs, Mapping):
            batch = _from_encoding(inputs, None)
        elif isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            ids = _token_tensor(inputs[None] if inputs.ndim == 1 else inputs, "input_ids")
            batch = TextBatch(ids, torch.ones_like(ids))
        else:
            raise TypeError(
                f"inputs must be the tokenizer's output (input_ids, attention_mask) or a LongTensor of token ids, got {type(inputs).__name__}"
            )
        ids, mask = batch.input_ids, batch.attention_mask
        if ids.ndim != 2 or len(ids) == 0 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (B, T) with B, T >= 1, got shape {tuple(ids.shape)}")
        if ((mask != 0) & (mask != 1)).any() or (mask.sum(1) == 0).any():
            raise ValueError("attention_mask must hold 1 at real tokens and 0 at padding, and every row at least one real token")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"input_ids must be in the model's vocabulary, 0..{vocab - 1}: was the text tokenised with this model's tokenizer?")
        window = context_window(self.model)
        if window is not None and int(mask.sum(1).max()) > window:
            raise ValueError(f"a row has {int(mask.sum(1).max())} real tokens but the model's context window is {window} tokens: shorten the text")
        device = next(self.model.parameters()).device
        return replace(batch, input_ids=ids.to(device), attention_mask=mask.to(device),
                       tokens=batch.tokens or _token_strings(ids, mask))

    def describe_inputs(self, inputs: TextBatch) -> dict:
        return {"input_size": (inputs.input_ids.shape[1],), "tokens": inputs.tokens, "word_ids": inputs.word_ids,
                "attention_mask": inputs.attention_mask.detach().cpu()}

    def batches(self, inputs: TextBatch, size: int) -> Iterator[TextBatch]:
        return (inputs.rows(slice(start, start + size)) for start in range(0, len(inputs), size))

    def streams(self, inputs: TextBatch) -> dict[str, Stream]:
        return {"text": Stream("text", "text", 0, last_real(inputs.attention_mask), valid=inputs.valid)}

    def attention_sites(self) -> list[AttentionSite]:
        """Each layer's causal self-attention; its second output is the probabilities under the exact attention."""
        return [AttentionSite("text", "text", OutputPart(getattr(layer, self.layout.attention), attention_probabilities))
                for layer in getattr(self.decoder, self.layout.layers)]

    def relevance_rule_map(self) -> dict:
        """The layout's rule map for the seeds' LRP methods (transformer attribution, LRP, partial LRP)."""
        return self.layout.rule_map(self.model, self.decoder, self.blocks)

    def attention_inputs(self) -> dict[str, Hookable]:
        """The normalised tokens entering the last layer's attention (the output of the norm before it)."""
        return {"text": getattr(getattr(self.decoder, self.layout.layers)[-1], self.layout.attention_norm)}

    # -- running ----------------------------------------------------------------------------------------------
    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """Eval mode for the call and, if asked, the exact eager attention (it returns the probabilities); the LRP
        methods switch the attention per pass instead (`rules_applied`)."""
        with explaining_call(self.model, None):
            if attention_probabilities:
                with self.rules_applied(None, probabilities=True):
                    yield
            else:
                yield

    def shared_state(self) -> list[object]:
        return transformers_configs(self.model)

    @contextmanager
    def rules_applied(self, rules: RuleSet | None, probabilities: bool = False) -> Iterator[None]:
        """The attention under `rules` in every config (the exact eager one where the call reads the
        `probabilities`, else torch's fused kernel) and, with rules, the layout's rule forwards on its MLPs and norms
        (instance attributes); everything restored after, also after an exception."""
        rule_forwards = [] if rules is None else [
            (module, forward(module, rules)) for module in self.decoder.modules()
            if (forward := self.layout.rule_forward(module)) is not None]
        restore = switch_attention(transformers_configs(self.model), _registered_attention(rules, probabilities))
        try:
            with forwards_replaced(rule_forwards):
                yield
        finally:
            restore()

    def embed(self, inputs: TextBatch, graph: bool = False) -> dict[str, torch.Tensor]:
        """The token embeddings `(B, T, D)` (positions are added inside the decoder: RoPE, or GPT-2's table);
        `graph`: a leaf on the autograd graph even when the weights are frozen."""
        embeddings = getattr(self.decoder, self.layout.embeddings)(inputs.input_ids)
        if graph and torch.is_grad_enabled() and not embeddings.requires_grad:
            embeddings = embeddings.detach().requires_grad_(True)
        return {"text": embeddings}

    def forward_tokens(self, inputs: TextBatch, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
                       positions: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(next-token logits (B, V), final hidden state (B, D))` after each sequence's last real token. A selection
        (token ablation) keeps the mask of the kept positions; positions are counted anew (the token is deleted)."""
        mask = inputs.attention_mask
        if rows is not None:
            mask = mask[rows]
            if positions is not None and "text" in positions:
                mask = mask.gather(1, positions["text"])
        return self._next_token(tokens["text"], mask)

    def forward_shared(self, inputs: TextBatch, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Rows that are prefixes of one sequence (the same token ids in every row, each row's mask the start of the
        longest's: `explain_generation`'s rows, one per generated token) read one forward of that sequence, each
        at its own last real token: under the causal mask a position's hidden state depends on the positions
        before it only, so this is each prefix's own forward. None for any other batch."""
        ids, mask = inputs.input_ids, inputs.attention_mask
        lengths = mask.sum(1)
        prefixes = mask.bool() == (torch.arange(ids.shape[1], device=ids.device) < lengths[:, None])
        if len(ids) < 2 or not bool(prefixes.all()) or not bool((ids == ids[:1]).all()):
            return None
        longest = int(lengths.argmax())
        one = inputs.rows(slice(longest, longest + 1))
        read = self.hidden_states(self.embed(one, graph)["text"], one.attention_mask)[0, lengths - 1]
        return self.model.lm_head(read), read, torch.zeros(len(ids), dtype=torch.long, device=ids.device)

    def hidden_states(self, embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states `(B, T, D)` from token embeddings and their mask, without a KV cache,
        positions counted over the real tokens."""
        return self.decoder(inputs_embeds=embeddings, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).last_hidden_state

    def _next_token(self, embeddings: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From token embeddings and their mask: `(logits (B, V), hidden (B, D))` after each row's last real token;
        the head runs on those rows only."""
        hidden = self.hidden_states(embeddings, mask)
        last = hidden[torch.arange(len(hidden), device=hidden.device), last_real(mask)]
        return self.model.lm_head(last), last

    def input_relevance(self, inputs: TextBatch, target: Any, rules: RuleSet | None, tokenizer: object | None = None,
                        checkpoint: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(scores (B, T), token ids (B,), logits (B, V), explained scores (B,))`: input x gradient of the target
        score at the token embeddings, summed over the width, with the backward under `rules` (None: the plain
        gradient). One forward and one backward for the whole batch (rows are independent); `checkpoint`: each
        layer's activations recomputed in the backward instead of kept (`layers_recomputed`)."""
        embed = getattr(self.decoder, self.layout.embeddings)
        embeddings = embed(inputs.input_ids).detach().requires_grad_(True)
        with self.rules_applied(rules), self.weights_frozen(), self.layers_recomputed(checkpoint):
            logits, _ = self._next_token(embeddings, inputs.attention_mask)
            scores, ids = target_scores(logits, target, tokenizer)
            (gradient,) = torch.autograd.grad(scores.sum(), embeddings)
        return input_times_gradient(embeddings, gradient) * inputs.attention_mask, ids, logits.detach(), widened(scores)

    @contextmanager
    def weights_frozen(self) -> Iterator[None]:
        """The model's Linear layers (those running `nn.Linear`'s own forward) read their weights detached for one
        call: a backward to the input needs no weight's gradient, and autograd then keeps no layer's input for one,
        whatever the weights' `requires_grad` (the model's flags are not touched: a user's training step in another
        thread still gets its gradients). Instance attributes, in the calling thread only, removed after."""
        frozen = [(module, lambda x, _m=module: F.linear(x, _m.weight.detach(), None if _m.bias is None else _m.bias.detach()))
                  for module in self.model.modules() if type(module).forward is nn.Linear.forward]
        with forwards_replaced(frozen):
            yield

    @contextmanager
    def layers_recomputed(self, enabled: bool = True) -> Iterator[None]:
        """Gradient checkpointing for one call: each decoder layer keeps only its input for the backward and runs
        again there (torch's non-reentrant checkpoint), so the activations held at once are one layer's, at about
        one more forward of time. transformers' own switch acts in training mode only; this one acts in eval mode
        and is removed after (instance attributes). The recomputation runs this call's forwards in whatever thread
        autograd runs the backward (CUDA's device threads: `guard.recomputed_as_this_thread`)."""
        context = recomputed_as_this_thread()
        recomputed = [(layer, lambda *args, _run=layer.forward, **kwargs: torch.utils.checkpoint.checkpoint(
            _run, *args, use_reentrant=False, context_fn=context, **kwargs)) for layer in self.blocks] if enabled else []
        with forwards_replaced(recomputed):
            yield


@contextmanager
def forwards_replaced(replacements: list[tuple[nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Each module's `forward` replaced by an instance attribute for the block, in the calling thread only (a
    forward of the user's from another thread runs the module's own); what the module had before (its class's
    forward, or an instance attribute of its own) given back after, also after an exception."""
    patched: list[tuple[nn.Module, object]] = []
    try:
        for module, forward in replacements:
            patched.append((module, module.__dict__.get("forward")))
            module.forward = this_thread_only(forward, otherwise=module.forward)
        yield
    finally:
        for module, own in reversed(patched):
            if own is None:
                del module.forward
            else:
                module.forward = own
