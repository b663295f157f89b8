"""Decoder language models: transformers' `...ForCausalLM` of the layouts in `layouts.py` (Llama, Qwen2/3, Mistral,
Mixtral, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3, Llama 4, gpt-oss, Cohere, Gemma 2/3, Phi-3, OLMo 2, GPT-NeoX, GPT-2),
each checked on its modules before it is ruled.

Inputs are the tokenizer's output (`input_ids`, `attention_mask`, left or right padding). One stream `text`, read
at each row's last real token: the explained score is a logit of the token that comes next. Position ids count the
real tokens only, so a padded row is the same computation as the row alone. The model runs from its token
embeddings without a KV cache; for a relevance pass the configs are switched to relevancy's exact eager attention
under the rule set and the MLPs and norms run the rule set's forwards (instance attributes), all restored after.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ...core import dispatch, linears
from ...core.conventions import Conventions, GradCamConventions
from ...results.explanation import DecoderExplanation, GenerationExplanation
from ...results.parts import LATENT_PARTS, LatentRelevance, SpanRelevance
from ...core.guard import recomputed_as_this_thread, this_thread_only
from ...lrp.attention import SCALED_QUERIES, attend
from ...lrp.engine import Session, passthrough, relevance_session, replaced
from ...lrp.rule_sets import ATTNLRP, PAPER, RuleSet
from ...lrp.segments import stacks_recomputed
from ...core.messages import quoted
from ...core.streams import AttentionSite, Hookable, Stream
from .._shared import OutputPart, eval_mode, transformers_configs
from ..base import SEED_METHODS, Adapter, UnsupportedModelError
from ..hf_attention import attention_probabilities, explaining_call, register_gated, switch_attention
from ..text_batch import TextBatch, from_encoding, placeholder_tokens, token_tensor
from .layouts import DECODER_CLASSES, SESSION, Layout, is_causal_lm, recognised, rotation_replacements, rule_map
from ...core.scores import checked_scores, token_score
from .targets import Contrast, Reading, RowTarget, Span, reading, row_targets

#: the name under which relevancy's attention is registered in transformers (with `_fused`: torch's fused kernel)
ATTENTION_NAME = "relevancy_causal"
#: the methods a decoder with layers that mix tokens without attention offers (a state-space decoder: Mamba;
#: Falcon-H1's mixers beside attention; a hybrid's linear-attention layers: Qwen3-Next, MiniMax): those that read no attention
#: matrix (which would miss what those layers mix) and no explicit relevance pass (no map of a recurrence), in the
#: registry's order
RECURRENT_METHODS = ("token_ablation", "attnlrp", "cp_lrp", "input_x_gradient")
#: the tokens of the probe on which a model's explaining forwards are checked against its own (`own_forward_problems`)
PROBE_TOKENS = 6
#: per model, the structure its explaining forwards were checked on (`layouts.structure`) and what differed, by path
_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict[str, tuple[type[Exception], str]]]] = weakref.WeakKeyDictionary()


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of `a` and `b` relative to `b`'s largest value."""
    b = b.double()
    return float((a.double().to(b.device) - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is not `b` to their dtype's precision (1e-4 of the largest value; 3e-2 in half precision)."""
    return a.shape != b.shape or not _difference(a, b) <= (3e-2 if b.element_size() < 4 else 1e-4)


def _registered_attention(probabilities: bool) -> str:
    """The name of relevancy's attention (`lrp.attention.attend`) under the session the attention module's config
    holds for the call (`layouts.SESSION`; none: the plain gradient): with `probabilities`, the exact eager one (and
    transformers' eager mask); without, torch's fused kernel where the session's rule set allows (and transformers'
    sdpa mask), which keeps no `(T, T)` matrix for the backward. A layer's sliding window is in the mask the model
    builds for its layer type; gpt-oss's sinks (`s_aux`) go to the softmax."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        session = vars(module).get(SESSION) or vars(getattr(module, "config", None) or object).get(SESSION)
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True))  # a vision tower attends everywhere
        context, weights = attend(session, query, key, value, scale, attention_mask, style=SCALED_QUERIES,
                                  causal=causal, softcap=kwargs.get("softcap"), probabilities=probabilities,
                                  sinks=kwargs.get("s_aux"))  # gpt-oss's per-head sinks
        return context.transpose(1, 2).contiguous(), weights

    name = ATTENTION_NAME + ("" if probabilities else "_fused")
    register_gated(name, attention_forward, eager_mask if probabilities else sdpa_mask)
    return name


def context_window(model: nn.Module) -> int | None:
    """The most positions the model's decoder reads (a vision-language model's: its text config's), whatever its
    position scheme: GPT-2's learned table (`n_positions`), the window RoPE was trained for (`max_position_embeddings`);
    None where the config names none."""
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)  # GPT-2's config maps it to n_positions
    return window if isinstance(window, int) and window > 0 else None


def widened(x: torch.Tensor) -> torch.Tensor:
    """`x` detached, in float32 at least: what a half-precision model's maps and scores are reported in."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def input_times_gradient(embeddings: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """`(..., T)` input x gradient summed over the width, in float32 at least (a half-precision model's relevance
    is a sum of many small terms)."""
    return torch.linalg.vecdot(widened(embeddings), widened(gradient))


class LayerInput:
    """The hidden states entering a layer, hookable like a module's output (`hook(module, args, hidden_states)`)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def register_forward_hook(self, hook: Callable) -> torch.utils.hooks.RemovableHandle:
        def observe(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hook(module, args, args[0] if args else kwargs["hidden_states"])  # never replaces the input

        return self.layer.register_forward_pre_hook(this_thread_only(observe), with_kwargs=True)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting the real tokens only (0 at padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """`(B,)` the index of each row's last real token (left or right padding)."""
    return mask.shape[1] - 1 - mask.flip(-1).argmax(-1)


@dataclass
class Recorded:
    """The tensors `CausalLMAdapter.latent_recorded` keeps during one forward: layer outputs and heads' outputs."""

    hidden: list[torch.Tensor]
    heads: list[torch.Tensor]
    on: bool = True
    #: the hidden states entering the first layer, where they are not the token embeddings (a vision-language
    #: model's: the image's features in place of its placeholder tokens)
    entering: list[torch.Tensor] = field(default_factory=list)

    def keep(self, found: list[torch.Tensor], tensor: torch.Tensor) -> None:
        if self.on:
            found.append(tensor)


@dataclass
class InputRelevance:
    """What `CausalLMAdapter.input_relevance` finds: `scores` `(B, T)` over the prompt, `ids` `(B,)` each row's first
    explained token (-1 for a callable target), `logits` `(B, V)` the next-token logits, `explained` `(B,)` the
    explained scores, `total` `(B,)` the relevance reaching every token read (prompt and span), `span` and `latent`
    where asked for; `leaves`: per further input of the model (a vision-language model's pixels) its input x gradient
    element by element, reading rows summed into the batch's rows."""

    scores: torch.Tensor
    ids: torch.Tensor
    logits: torch.Tensor
    explained: torch.Tensor
    total: torch.Tensor
    span: SpanRelevance | None
    latent: LatentRelevance | None
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)


def _span_texts(ids: torch.Tensor, tokenizer: object | None) -> list[list[str]]:
    """Each row's span tokens as the tokenizer writes them (`[id]` without one)."""
    rows = [[int(i) for i in row if i >= 0] for row in ids.tolist()]
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return [[f"[{i}]" for i in row] for row in rows]
    return [list(tokenizer.convert_ids_to_tokens(row)) for row in rows]


class CausalLMAdapter(Adapter):
    family = "decoder language model"
    methods = (*SEED_METHODS, "attnlrp", "cp_lrp", "input_x_gradient")
    generates = True
    examples = "transformers " + DECODER_CLASSES
    explanation_class = DecoderExplanation
    #: Grad-CAM averages the gradient over the real token pairs, so that padding cannot change a row's map
    # Grad-CAM over the real (query, key) pairs, as for BERT: padding does not change a row's map
    conventions = Conventions(attention_gradcam=GradCamConventions(region="matrix"))
    #: True while `own_forward_problems` runs its probe (its forwards are not refused)
    _checking = False
    #: the position id of a row's first real token (PaliGemma's decoder counts from 1)
    first_position = 0

    def named_target(self, target: Any) -> Any:
        """Strings are tokens here, resolved with the tokenizer (see `targets`)."""
        return target

    def check_method_target(self, target: Any, method: str, token_methods: Sequence[str]) -> None:
        """The attention and gradient methods take token ids (one next-token logit); token texts, answer spans (a
        `Span`, a row's list of ids) and `Contrast`s are the decoder methods'."""
        entries = target if isinstance(target, (list, tuple)) else [target]
        given = next((entry for entry in entries if isinstance(entry, (str, Span, Contrast, list, tuple))), None)
        if method not in token_methods and given is not None:
            raise TypeError(f"method '{method}' takes token ids as targets on a decoder (an int, one per row, or a tensor of "
                            f"ids), got {type(given).__name__} {quoted(given)}; token texts, answer spans and Contrast targets "
                            f"are taken by {', '.join(token_methods)} (texts with tokenizer=)")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # checked on the model's modules (once per structure); a refusal names what does not fit
        self.layout: Layout
        self.structure, self.layout, self.ruled = recognised(model)
        self.decoder: nn.Module = getattr(model, self.layout.decoder)
        self.blocks = list(getattr(self.decoder, self.layout.layers))
        if self.layout.state_space is not None or self.attentionless:  # no attention matrix to read, no explicit rule map of a recurrence
            self.methods = RECURRENT_METHODS
            self.family = (f"{self.layout.name} decoder ({self.layout.state_space})" if self.layout.state_space is not None else
                           f"hybrid decoder ({self.layout.name}: its {self.layout.mixer} layers {', '.join(map(str, self.attentionless))} "
                           "have no attention matrix)")

    @functools.cached_property
    def attentionless(self) -> list[int]:
        """The indices of the decoder's layers without softmax attention (every layer of a state-space decoder, a
        hybrid's linear-attention layers: `Layout.attentionless`)."""
        return self.layout.attentionless(self.decoder)

    @functools.cached_property
    def configs(self) -> list[object]:
        """The model's transformers configs a call switches (`transformers_configs`), found once per adapter, i.e.
        per call: a walk over every module, a few milliseconds of Python on SmolLM2."""
        return transformers_configs(self.model)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Any transformers decoder language model: one of no known layout is refused by `__init__`, naming why."""
        return is_causal_lm(model)

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> TextBatch:
        """A `TextBatch` on the model's device from the tokenizer's output (or `input_ids` alone: no padding)."""
        if isinstance(inputs, Mapping):
            batch = from_encoding(inputs, None)
        elif isinstance(inputs, torch.Tensor):  # a float tensor is named by `token_tensor`
            ids = token_tensor(inputs[None] if inputs.ndim == 1 else inputs, "input_ids")
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
        vocab = self.text_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"input_ids must be in the model's vocabulary, 0..{vocab - 1}: was the text tokenised with this model's tokenizer?")
        window = context_window(self.model)
        if window is not None and int(mask.sum(1).max()) > window:
            raise ValueError(f"a row has {int(mask.sum(1).max())} real tokens but the model's context window is {window} tokens: shorten the text")
        device = dispatch.execution_device(getattr(self.decoder, self.layout.embeddings))  # not an offloaded weight's meta device
        return replace(batch, input_ids=ids.to(device), attention_mask=mask.to(device),
                       tokens=batch.tokens or placeholder_tokens(ids, mask))

    def describe_inputs(self, inputs: TextBatch) -> dict:
        return {"input_size": (inputs.input_ids.shape[1],), "tokens": inputs.tokens, "word_ids": inputs.word_ids,
                "attention_mask": inputs.attention_mask.detach().cpu()}

    def batches(self, inputs: TextBatch, size: int) -> Iterator[TextBatch]:
        return (inputs.rows(slice(start, start + size)) for start in range(0, len(inputs), size))

    def streams(self, inputs: TextBatch) -> dict[str, Stream]:
        return {"text": Stream("text", "text", 0, last_real(inputs.attention_mask), valid=inputs.valid)}

    def attention_sites(self) -> list[AttentionSite]:
        """Each layer's causal self-attention; its second output is the probabilities under the exact attention (none
        in a decoder with layers without attention: a state-space or a hybrid one)."""
        if self.attentionless:
            return []
        return [AttentionSite("text", "text", OutputPart(getattr(layer, self.layout.attention), attention_probabilities))
                for layer in getattr(self.decoder, self.layout.layers)]

    def relevance_rule_map(self) -> dict:
        """The layout's rule map for the seeds' LRP methods (transformer attribution, LRP, partial LRP), with the
        logits' scale and soft-cap (Granite, Gemma 2) passing relevance; refused where it is not the model's own forward."""
        self.refuse_unless_own("explicit")
        own = self.finished

        def finished(_model: nn.Module, session: Session) -> dict:
            return {(self, "finished"): lambda logits: passthrough(session, own, logits)}

        return {**self.model_rule_map(), type(self.model): finished}

    def model_rule_map(self) -> dict:
        """The rule map of the model's modules under an explicit rule set: the decoder layout's (a vision-language
        model adds its tower and projector)."""
        return rule_map(self.layout, self.model, self.ruled)

    def attention_inputs(self) -> dict[str, Hookable]:
        """The tokens entering the last layer's attention: the output of the norm before it, or where attention
        reads the residual stream itself (OLMo 2), the last layer's input."""
        last = self.blocks[-1]
        if self.layout.attention_norm is None:
            return {"text": LayerInput(last)}
        return {"text": getattr(last, self.layout.attention_norm)}

    # -- running ----------------------------------------------------------------------------------------------
    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """Eval mode for the call and relevancy's exact attention: eager where the call reads the probabilities,
        else torch's fused kernel (never the model's own: transformers' eager Gemma 2 gives NaN to a padded row
        whose sliding window holds padding only); the LRP methods switch the attention per pass (`rules_applied`)."""
        with explaining_call(self.model, None):
            self.refuse_unless_own("plain")
            with self.rules_applied(None, probabilities=attention_probabilities):
                yield

    def causal_probe(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What else the model's own forward takes for the probe's text `ids` to run its decoder causally, as the
        decoder runs alone (`hidden_states`): nothing for a decoder (a vision-language model's own, PaliGemma's token types)."""
        return {}

    def refuse_unless_own(self, path: str) -> None:
        """Refuse, naming where they differ, where the forward a method explains (`path`: "plain", "gradient",
        "explicit") is not the model's own (`own_forward_problems`)."""
        if not self._checking:
            problem = self.own_forward_problems().get(path)
            if problem is not None:
                kind, message = problem
                raise kind(message)

    def own_forward_problems(self) -> dict[str, tuple[type[Exception], str]]:
        """Where the forwards the methods explain differ from the model's own, by path: "plain" (the attention and
        gradient methods, input x gradient), "gradient" (under AttnLRP's and CP-LRP's rules), "explicit" (under the
        seeds' LRP rules), each compared with the model's own logits on a probe of `PROBE_TOKENS` tokens to the
        dtype's precision, the message naming the first layer whose output differs (or the head), or the refusal of a
        layer the path cannot rule (`core.linears.UnreadableLinearError`), as `(error type, message)`. Found once per
        model, again when its structure or a module's own forward changes (`layouts.structure`): a patched layer or
        a multiplier the layout does not map gets no map of a function the model does not compute."""
        key = self.structure
        known = _CHECKED.get(self.model)
        if known is None or known[0] != key:
            self._checking = True
            try:
                known = (key, self._forward_problems())
            finally:
                self._checking = False
            _CHECKED[self.model] = known
        return known[1]

    def _forward_problems(self) -> dict[str, tuple[type[Exception], str]]:
        device = dispatch.execution_device(getattr(self.decoder, self.layout.embeddings))
        ids = (torch.arange(PROBE_TOKENS, device=device) % self.text_config.vocab_size)[None]
        mask = torch.ones_like(ids)
        paths = {"plain": ("as relevancy runs it", contextlib.nullcontext),
                 "gradient": ("under the gradient rules (attnlrp, cp_lrp)", lambda: self.rules_applied(ATTNLRP))}
        if self.layout.residual is not None:  # a layout with an explicit rule map
            paths["explicit"] = ("under the explicit rules (transformer_attribution, lrp, partial_lrp)",
                                 lambda: relevance_session(self.model, self.relevance_rule_map(), PAPER, gradient_pass=False))
        problems = {}
        with eval_mode(self.model), torch.no_grad():
            own_layers, own = self._layers_recorded(lambda: self.model(input_ids=ids, attention_mask=mask, use_cache=False,
                                                                       **self.causal_probe(ids)).logits[:, -1])
            for path, (said, context) in paths.items():
                try:
                    with self.rules_applied(None, probabilities=True), context():
                        layers, logits = self._layers_recorded(lambda: self._next_token(self.embed(TextBatch(ids, mask))["text"], mask)[0])
                except linears.UnreadableLinearError as error:  # a layer this path cannot rule: refused by name when used
                    problems[path] = (type(error), str(error))
                    continue
                where = next((f"{self.layout.decoder}.{self.layout.layers}.{index}" for index, (a, b) in enumerate(zip(layers, own_layers))
                              if _differ(a, b)), "the head (the logits from the final hidden states)" if _differ(logits, own) else None)
                if where is not None:
                    problems[path] = (UnsupportedModelError, (
                        f"cannot explain {type(self.model).__name__}: its forward {said} differs from the model's own from {where} "
                        f"on (logits off by {_difference(logits, own):.3g} of their largest): the model computes something its "
                        f"{self.layout.name} layout does not map (a patched layer or forward, a scale or an extra operation); "
                        "explain the model as transformers defines it, or add a layout (docs/adding-a-family.md)"))
        return problems

    def _layers_recorded(self, run: Callable[[], torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`(each decoder layer's output, run())`: the layers' outputs kept by forward hooks for the one run."""
        outputs: list[torch.Tensor] = []
        handles = [layer.register_forward_hook(this_thread_only(lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out)))
                   for layer in self.blocks]
        try:
            result = run()
        finally:
            for handle in handles:
                handle.remove()
        return outputs, result

    def shared_state(self) -> list[object]:
        return self.configs

    @contextmanager
    def rules_applied(self, rules: RuleSet | None, probabilities: bool = False) -> Iterator[None]:
        """Every config switched to relevancy's attention (the exact eager one where the call reads the
        `probabilities`, else torch's fused kernel) and, with a rule set that carries a gradient (AttnLRP, CP-LRP),
        its session on every config (read by every attention the configs switch) and the rule forwards on its MLPs and norms (instance
        attributes; the layers run as they are); everything restored after, also after an exception."""
        if rules is not None and rules.explicit:
            raise ValueError(f"the {rules.name} rules carry relevance: they run in a relevance session (relevance_rule_map)")
        if rules is not None:
            self.refuse_unless_own("gradient")
        replacements: list[tuple[object, str, object]] = []
        if rules is not None:
            session = Session(rules)
            replacements = [(module, "forward", forward(module, session)) for module, forward in self.ruled]
            replacements += [(config, SESSION, session) for config in self.configs]
            attentions = [getattr(layer, self.layout.attention) for index, layer in enumerate(self.blocks) if index not in self.attentionless]
            if attentions:
                replacements += rotation_replacements(attentions[0])
        restore = switch_attention(self.configs, _registered_attention(probabilities))
        try:
            with replaced(replacements):
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
        return self.head(read), read, torch.zeros(len(ids), dtype=torch.long, device=ids.device)

    def hidden_states(self, embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states `(B, T, D)` from token embeddings and their mask, without a KV cache,
        positions counted over the real tokens."""
        scale = self.layout.embedding_scale
        entering = embeddings if scale is None else embeddings * getattr(self.decoder, scale)
        return self.decoder(inputs_embeds=entering, attention_mask=mask, position_ids=position_ids(mask) + self.first_position,
                            use_cache=False).last_hidden_state

    def _next_token(self, embeddings: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From token embeddings and their mask: `(logits (B, V), hidden (B, D))` after each row's last real token;
        the head runs on those rows only."""
        hidden = self.hidden_states(embeddings, mask)
        last = hidden[torch.arange(len(hidden), device=hidden.device), last_real(mask)]
        return self.head(last), last

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states: the output embeddings, finished as the model finishes them (`finished`)."""
        return self.finished(self.model.get_output_embeddings()(hidden))

    def picked_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`(N,)` the logit of token `ids[n]` after `hidden[n]` (`(N, D)`), finished as the model finishes them: the
        head's numbers at those ids from their rows of the output embeddings (weights detached), so that the backward
        reads N rows of the `(V, D)` matrix rather than all of it (SmolLM2's 49,152 rows: about 5 % of a forward
        at 100 tokens on one CPU thread)."""
        rows, bias = self.head_rows(ids, hidden.device)
        logits = torch.linalg.vecdot(hidden, rows)
        return self.finished(logits if bias is None else logits + bias)

    def class_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`(P, K)` the logit of every token of `ids` `(K,)` after every hidden state of `hidden` `(P, D)`, finished
        as the model finishes them: one matrix product with those K rows of the output embeddings (no `(P, vocabulary)`
        logits)."""
        rows, bias = self.head_rows(ids, hidden.device)
        logits = hidden @ rows.T
        return self.finished(logits if bias is None else logits + bias)

    def head_rows(self, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output embeddings' rows (and bias entries, where it has a bias) of the tokens `ids`, detached, on `device`."""
        head = self.model.get_output_embeddings()
        with dispatch.loaded(head):  # where accelerate offloads the head: its rows read while it is loaded
            rows, bias = head.weight.detach()[ids], None if head.bias is None else head.bias.detach()[ids]
        return rows.to(device), None if bias is None else bias.to(device)

    def finished(self, logits: torch.Tensor) -> torch.Tensor:
        """The output embeddings' logits as the model finishes them: scaled where the layout says so (Granite's
        division by `logits_scaling`, Cohere's product with `logit_scale`), soft-capped `c tanh(z / c)` where the
        model caps them (Gemma 2), each with its own gradient (lxt leaves the head as the model has it)."""
        scale = self.layout.logit_scale
        logits = logits if scale is None else scale(logits, self.text_config)
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def input_relevance(self, inputs: TextBatch, target: Any, rules: RuleSet | None, tokenizer: object | None = None,
                        checkpoint: bool = False, score: object = "logit", latent: frozenset[str] = frozenset()) -> InputRelevance:
        """Input x gradient of the explained score at the token embeddings, summed over the width, with the backward
        under `rules` (None: the plain gradient). The target (`targets.row_targets`: a token, a span read
        teacher-forced after the prompt, a `Contrast`; or a callable `f(next-token logits (B, V)) -> (B,)`) is
        scored per explained token by `score` ("logit", "log_prob" or `f(logits (N, V), ids (N,)) -> (N,)`) and
        summed per row. One forward and one backward for the whole batch (rows are independent); `checkpoint`: the
        layers' activations recomputed in the backward instead of kept (`layers_recomputed`: by bisection, per layer
        with `latent`); `latent`: the parts
        of `LatentRelevance` ("layers", "neurons", "heads") read in the same backward."""
        vocab = self.text_config.vocab_size
        function = callable(target) and not isinstance(target, torch.Tensor)
        if function and score != "logit":
            raise ValueError("score= scores token targets; a callable target is its own score: give one or the other")
        scorer = token_score(score)
        mask = inputs.attention_mask
        plan = reading(inputs.input_ids, mask, last_real(mask), [RowTarget(())] * len(inputs) if function
                       else row_targets(target, len(inputs), tokenizer, vocab))
        window, read_length = context_window(self.model), int(plan.mask.sum(1).max())
        if window is not None and read_length > window:
            raise ValueError(f"a row's prompt and the span's tokens read after it take {read_length} positions but the model's "
                             f"context window is {window} tokens: shorten the prompt or the span")
        rows = len(inputs)
        with self.rules_applied(rules), self.weights_frozen(), self.last_mlp_at(plan.term_rows, plan.term_positions), \
                self.layers_recomputed(checkpoint, per_layer=bool(latent)), self.latent_recorded(latent) as recorded:
            leaves, hidden = self.read_forward(inputs, plan)
            embeddings = leaves["text"]
            recorded.on = False  # a layer run again in the backward (checkpoint) records nothing
            read = hidden[plan.term_rows, plan.term_positions]
            # a logit score differentiates the explained tokens' logits only (`picked_logits`); the head's whole
            # (N, V) output is then read without a graph: it names the predicted tokens and is reported
            picked = not function and isinstance(score, str) and score == "logit" and linears.plain(self.model.get_output_embeddings())
            logits = self.head(read.detach() if picked else read)  # (N, V): what predicts each token
            next_token = logits[:rows]  # each row's first term: its next-token logits
            if function:
                explained = checked_scores(target(next_token), "target=f(logits)", rows, graph=True)
                ids = torch.full((rows,), -1, dtype=torch.long, device=logits.device)
            else:
                predicted = plan.term_ids < 0  # the target None: each row's most probable next token
                term_ids = torch.where(predicted, logits.detach().argmax(-1), plan.term_ids)
                values = checked_scores(self.picked_logits(read, term_ids) if picked else scorer(logits, term_ids),
                                        f"score={score!r}" if isinstance(score, str) else "score=f(logits, ids)", len(term_ids),
                                        graph=True, per="explained token")
                explained = values.new_zeros(rows).index_add(0, plan.source[plan.term_rows], values * plan.term_signs)
                plan.span_ids[:, 0] = torch.where(plan.span_ids[:, 0] < 0, term_ids[:rows], plan.span_ids[:, 0])
                ids = plan.span_ids[:, 0]
            gradients = torch.autograd.grad(explained.sum(), [*leaves.values(), *recorded.hidden, *recorded.heads, *recorded.entering])
        read = plan.mask[..., None].to(embeddings.dtype)
        relevance = plan.gathered(input_times_gradient(embeddings, gradients[0]) * plan.mask)
        further = {name: widened(x * g).new_zeros(rows, *x.shape[1:]).index_add_(0, plan.source, widened(x * g))
                   for (name, x), g in list(zip(leaves.items(), gradients))[1:]}
        entering = list(zip(recorded.entering, gradients[len(gradients) - len(recorded.entering):]))
        gradients = (gradients[0], *gradients[len(leaves):len(gradients) - len(recorded.entering)])
        length = inputs.input_ids.shape[1]
        span = None
        if plan.ids.shape[1] > length:
            size = plan.span_ids.shape[1]
            span = SpanRelevance(plan.span_ids, relevance[:, length:length + size], plan.foil_ids, relevance[:, length + size:],
                                 _span_texts(plan.span_ids, tokenizer))
        found = None
        width = plan.width if span is not None else length  # the prompt's columns, then the span's and the foil's
        if latent:
            hidden_gradients, head_gradients = gradients[1:1 + len(recorded.hidden)], gradients[1 + len(recorded.hidden):]
            # layer 0: the decoder's input, the token embeddings (a vision-language model's with its image's features)
            first, first_gradient = entering[0] if entering else (embeddings, gradients[0])
            states = [plan.gathered((h * g * read).detach())[:, :width] for h, g in
                      zip([first, *recorded.hidden], [first_gradient, *hidden_gradients])] if recorded.hidden else []
            heads = None
            if recorded.heads:
                count = self.text_config.num_attention_heads
                per_head = [(x * g * read).detach().view(*x.shape[:2], count, -1).sum((1, 3)) for x, g in zip(recorded.heads, head_gradients)]
                heads = torch.stack([h.new_zeros(rows, count).index_add(0, plan.source, h) for h in per_head])
            neurons = torch.stack(states) if states else None
            found = LatentRelevance(layers=None if neurons is None or "layers" not in latent else neurons.sum(-1),
                                    neurons=neurons if "neurons" in latent else None, heads=heads)
        total = relevance.sum(1) + sum((value.flatten(1).sum(1) for value in further.values()), torch.zeros((), device=relevance.device))
        return InputRelevance(relevance[:, :length], ids, next_token.detach(), widened(explained), total, span, found, further)

    def read_forward(self, inputs: TextBatch, plan: Reading) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The relevance pass's forward over the reading rows: `(leaves, last hidden states (R, T + A, D))`, the leaves
        the inputs whose relevance is read, the token embeddings `"text"` first."""
        return self.leaves_forward(inputs, plan.ids, plan.mask, plan.source)

    def leaves_forward(self, inputs: TextBatch, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The forward over the token rows `ids` `(R, N)` (`mask`), row `r` belonging to input row `source[r]`:
        `(leaves, last hidden states)`; a decoder's one leaf is the token embeddings (a vision-language decoder adds
        its row's pixels)."""
        embeddings = getattr(self.decoder, self.layout.embeddings)(ids).detach().requires_grad_(True)
        return {"text": embeddings}, self.hidden_states(embeddings, mask)

    def decoding_inputs(self, inputs: TextBatch) -> dict[str, torch.Tensor]:
        """What the model's `generate` reads besides the token ids and their mask (`explain_generation`'s decoding):
        nothing for a decoder of text."""
        return {}

    def generation_explanation(self, fields: dict[str, Any], ids: torch.Tensor, images: dict[str, torch.Tensor],
                               picture: torch.Tensor | None, inputs: TextBatch) -> GenerationExplanation:
        """`explain_generation`'s result for one sequence `ids` `(T + G,)` from `fields` (what every generation
        holds); a decoder reads no image (`images`, `picture` empty; `inputs`, the call's, unread)."""
        return GenerationExplanation(**fields)

    @property
    def text_config(self) -> Any:
        """The config of the decoder language model (the model's own; a vision-language model's text config)."""
        return self.model.config.get_text_config()

    @contextmanager
    def latent_recorded(self, parts: frozenset[str]) -> Iterator[Recorded]:
        """Forward hooks (this thread only, removed after, also after an exception) that keep each decoder layer's
        output ("layers", "neurons"; for a model that reads images, also the first layer's input, where the image's
        features stand in place of its placeholder tokens) and each attention's heads' outputs, the input of its
        output projection ("heads"), while `Recorded.on`."""
        recorded = Recorded([], [])
        if parts & {"layers", "neurons"}:
            hidden_hooks = [(layer, lambda _m, _i, out: recorded.keep(recorded.hidden, out[0] if isinstance(out, tuple) else out))
                            for layer in self.blocks]
        else:
            hidden_hooks = []
        entering = LayerInput(self.blocks[0]) if hidden_hooks and self.reads_images else None
        if "heads" in parts and self.attentionless:  # `latent=True`: all the model has
            if parts != frozenset(LATENT_PARTS):
                raise ValueError(f"latent relevance of heads reads attention heads; the {self.family} has no attention "
                                 "layers there: ask for 'layers' or 'neurons'")
            parts = parts - {"heads"}
        projections = [getattr(getattr(layer, self.layout.attention), self.layout.attention_output) for layer in self.blocks] if "heads" in parts else []
        handles = []
        try:
            for module, hook in hidden_hooks:
                handles.append(module.register_forward_hook(this_thread_only(hook)))
            if entering is not None:
                handles.append(entering.register_forward_hook(lambda _m, _i, states: recorded.keep(recorded.entering, states)))
            for module in projections:
                handles.append(module.register_forward_pre_hook(this_thread_only(lambda _m, args: recorded.keep(recorded.heads, args[0]))))
            yield recorded
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def weights_frozen(self) -> Iterator[None]:
        """The model's Linear layers (those running `nn.Linear`'s own forward) read their weights detached for one
        call: a backward to the input needs no weight's gradient, and autograd then keeps no layer's input for one,
        whatever the weights' `requires_grad` (the model's flags are not touched: a user's training step in another
        thread still gets its gradients). Instance attributes, in the calling thread only, removed after."""
        frozen = [(module, lambda x, _m=module: F.linear(x, _m.weight.detach(), None if _m.bias is None else _m.bias.detach()))
                  for module in self.model.modules() if type(module).forward is nn.Linear.forward]
        with replaced([(module, "forward", forward) for module, forward in frozen]):
            yield

    @contextmanager
    def last_mlp_at(self, rows: torch.Tensor, positions: torch.Tensor) -> Iterator[None]:
        """The last layer's MLP (whatever forward it runs for the call: the rule set's) computed at the read
        positions only, `(rows, positions)` of the hidden states, its output 0 elsewhere: the final norm and the head
        act position by position, so no other position of the last layer's MLP reaches a read logit, and the scores
        and every gradient are those of the whole MLP (a position that is not read gets none). About a layer's
        MLP less in the forward and in the backward. A mixture of experts runs whole (it routes the batch as one).
        An instance attribute, in the calling thread only, removed after."""
        if self.layout.residual is None:  # a state-space layer mixes positions: run whole
            yield
            return
        mlp = getattr(self.blocks[-1], self.layout.residual.mlp)
        own = mlp.forward
        columns = None

        def forward(x: torch.Tensor) -> torch.Tensor:
            nonlocal columns
            if columns is None:  # each read position once (a target and its foil may read the same one)
                columns = torch.unique(rows * x.shape[1] + positions)
            flat = x.flatten(0, 1)
            return flat.new_zeros(flat.shape).index_put((columns,), own(flat[columns][None])[0]).view_as(x)

        with replaced([] if hasattr(mlp, "experts") else [(mlp, "forward", forward)]):
            yield

    def recomputed_layers(self) -> list[nn.Module]:
        """The layers `checkpoint=True` runs again in the backward: the decoder's."""
        return self.blocks

    @contextmanager
    def layers_recomputed(self, enabled: bool = True, per_layer: bool = False) -> Iterator[None]:
        """Gradient checkpointing for one call, in eval mode (transformers' own switch acts in training mode only),
        removed after (instance attributes). By default only each stack's input is kept and the backward runs its
        layers again by bisection (`lrp.segments`): about log2(L) + 1 layer inputs held at once instead of L, at
        about log2(L) / 2 + 1 forwards more. `per_layer`: each layer under torch's non-reentrant checkpoint, every
        layer's input kept, about one forward more, and every layer's output and what it computes inside on the
        graph (latent relevance reads the gradient there). Either
        recomputation runs this call's forwards in whatever thread autograd runs the backward (CUDA's device
        threads: `guard.recomputed_as_this_thread`)."""
        layers = self.recomputed_layers() if enabled else []
        if not per_layer:
            with stacks_recomputed(layers):
                yield
            return
        context = recomputed_as_this_thread()
        recomputed = [(layer, lambda *args, _run=layer.forward, **kwargs: torch.utils.checkpoint.checkpoint(
            _run, *args, use_reentrant=False, context_fn=context, **kwargs)) for layer in layers]
        with replaced([(module, "forward", forward) for module, forward in recomputed]):
            yield
