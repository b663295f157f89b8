"""AttnLRP, CP-LRP and input x gradient at the token embeddings: on decoder language models for a next token, an
answer span or a function of the logits, with the relevance inside the decoder on request (`latent`); on the
encoders for a class, a concept or a function of the logits (`embeddings.embedding_relevance`)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..families.base import Adapter
from ..lrp import RULE_SETS, RuleSet
from ..core.messages import quoted
from ..results.parts import LATENT_PARTS
from .embeddings import embedding_relevance

#: the input-relevance methods of decoders and the rule set of their backward (None: the plain gradient)
INPUT_RELEVANCE_RULES: dict[str, RuleSet | None] = {"attnlrp": RULE_SETS["attnlrp"], "cp_lrp": RULE_SETS["cp_lrp"], "input_x_gradient": None}


def latent_parts(latent: object) -> frozenset[str]:
    """`latent=` as the parts of `LatentRelevance` it asks for: False / None (none), True (all), a part's name or a
    tuple of names; a one-line error otherwise."""
    if latent is None or latent is False:
        return frozenset()
    if latent is True:
        return frozenset(LATENT_PARTS)
    names = (latent,) if isinstance(latent, str) else latent
    if not isinstance(names, (tuple, list)) or not names or any(name not in LATENT_PARTS for name in names):
        raise ValueError(f"latent must be True, False or some of {', '.join(LATENT_PARTS)} (a name or a tuple), got {quoted(latent)}")
    return frozenset(names)


def _input_relevance(adapter: Adapter, inputs: Any, target: Any, rules: RuleSet | None, tokenizer: object | None,
                     checkpoint: bool, score: object, latent: object) -> tuple:
    """The method's `(scores, ids, logits, fields)` on a decoder; fp16 / bf16 models run in their own dtype (no copy
    of their weights: the rules keep what needs the precision in float32, `lrp.gradient`), the maps come in float32;
    the rule-based ones report `relevance_total`. `checkpoint`:
    recompute the layers in the backward instead of keeping their activations (less memory on long prompts and deep
    models, `CausalLMAdapter.layers_recomputed`; the same map)."""
    if getattr(adapter, "input_relevance", None) is None:  # an encoder: its class, concept or function of the logits
        decoder_only = [name for name, given in (("checkpoint", checkpoint), ("score", score != "logit"), ("latent", bool(latent))) if given]
        if decoder_only:
            named = ", ".join(f"{name}=" for name in decoder_only)
            raise ValueError(f"{named} {'is' if len(decoder_only) == 1 else 'are'} for decoder language models only; the "
                             f"{adapter.family} family takes inputs and a target alone")
        return embedding_relevance(adapter, inputs, target, rules)
    parts = latent_parts(latent)
    if checkpoint and "heads" in parts:
        raise ValueError("latent heads are read inside each layer, which checkpoint=True runs again in the backward: ask for them without checkpoint")
    found = adapter.input_relevance(inputs, target, rules, tokenizer, checkpoint, score, parts)
    fields: dict[str, Any] = {name: value for name, value in (("span", found.span), ("latent", found.latent)) if value is not None}
    if found.leaves:  # a vision-language model's pixels: its adapter makes the image's maps of them
        fields["leaves"] = found.leaves
    if rules is not None:  # the share of the explained score that reaches the tokens read (biases and positions keep the rest)
        # 0 where the explained score is 0 (no share of nothing)
        nonzero = found.explained != 0
        fields["relevance_total"] = (found.total / found.explained.where(nonzero, 1)) * nonzero
    return found.scores, found.ids, found.logits, fields


def attnlrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False,
            score: str | Callable = "logit", latent: bool | str | tuple = False) -> tuple[torch.Tensor, ...]:
    """AttnLRP (Achtibat et al., ICML 2024): relevance of each input token for the target's score."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["attnlrp"], tokenizer, checkpoint, score, latent)


def cp_lrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False,
           score: str | Callable = "logit", latent: bool | str | tuple = False) -> tuple[torch.Tensor, ...]:
    """CP-LRP (Ali et al., ICML 2022): AttnLRP's rules with no relevance through queries, keys and gates."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["cp_lrp"], tokenizer, checkpoint, score, latent)


def input_x_gradient(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False,
                     score: str | Callable = "logit", latent: bool | str | tuple = False) -> tuple[torch.Tensor, ...]:
    """Input x gradient at the token embeddings, summed over the width."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["input_x_gradient"], tokenizer, checkpoint, score, latent)
