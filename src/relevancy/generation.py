"""`explain_generation()`: what a decoder language model read to write each token of a generation.

Greedy decoding (or a given continuation), then one forward over prompt + generated tokens: a causal `(G, T + G)`
matrix, row `g` the relevance of every token before generated token `g` for its logit. The input-relevance methods
take batched backward passes of that forward (`families.causal_lm.generation`); the attention and gradient methods
explain one row per generated token, the prefix before it, and the adapter runs those prefixes as the one forward
(`CausalLMAdapter.forward_shared`) with one backward per token.
"""
from __future__ import annotations

import difflib
from numbers import Integral
from typing import Any

import torch
from torch import nn

from .api import explain, get_method, prepared
from .cancel import cancellable, checkpoint
from .explanation import GenerationExplanation
from .families import adapter_for
from .families.base import UnsupportedModelError
from .families.causal_lm import CausalLMAdapter
from .families.causal_lm.adapter import context_window
from .families.causal_lm.generation import causal_rows, generation_relevance
from .messages import quoted
from .methods.language import INPUT_RELEVANCE_RULES

#: the methods that read the attention and gradients of one forward shared by every generated token's prefix
SHARED_FORWARD_METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "cdam")
#: the methods that explain every generated token from one forward: the decoders' input-relevance methods (batched
#: backward passes), then the shared-forward ones (a backward per token where they take gradients)
GENERATION_METHODS = (*INPUT_RELEVANCE_RULES, *SHARED_FORWARD_METHODS)
#: the memory a shared-forward method may take at once (`shared_forward_memory`): rows beyond it run in another
#: forward; a call whose one forward alone exceeds it is refused, naming the estimate
MEMORY_BUDGET = 2**30
#: per shared-forward method, what it holds in `(T + G, T + G)` matrices of the explained dtype, measured on CPU
#: (tests/test_generation_memory.py): `(for the forward: per attention site and head, per site; for each row: per
#: site, per head of the last site)`. Generic attention keeps every site's probabilities and their gradient for the
#: forward and a weighted head mean with its identity per row; Grad-CAM a full gradient of the last site per row;
#: rollout and raw attention each site's head mean, rollout a chain per site and row, raw attention a row of it
MATRICES = {
    "generic_attention": (4, 0, 3, 0),
    "attention_gradcam": (0, 0, 0, 3),
    "rollout": (0, 2, 3, 0),
    "raw_attention": (0, 3, 1, 0),
    "cdam": (0, 0, 0, 1),
}
#: the most tokens one call generates (or reads as a continuation): G backward passes, a (G, T + G) matrix
MAX_NEW_TOKENS = 256


def check_generation_method(method: object) -> str:
    """`method` if it explains generations; a one-line error naming the valid ones otherwise."""
    valid = ", ".join(GENERATION_METHODS)
    if not isinstance(method, str) or method not in GENERATION_METHODS:
        close = difflib.get_close_matches(method, list(GENERATION_METHODS), n=1) if isinstance(method, str) else []
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"explain_generation explains with one forward for every token: method must be one of {valid}, got {quoted(method)}.{hint}")
    return method


def check_max_new_tokens(value: object) -> int:
    """`max_new_tokens` as an int in 1..MAX_NEW_TOKENS (numpy's integers too); a one-line error naming the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {value!r}")
    return int(value)


def stop_tokens(model: nn.Module, tokenizer: Any) -> set[int]:
    """The end-of-text token ids of the tokenizer and the model's generation config (greedy decoding stops there)."""
    found = {getattr(tokenizer, "eos_token_id", None)}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return {int(token) for token in found if token is not None}


def greedy(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, stops: set[int]) -> torch.Tensor:
    """`(1, T + G)`: `ids` and up to `max_new_tokens` greedily decoded tokens (transformers' `generate`, its KV
    cache inside that call only), up to and including the first end-of-text token."""
    from transformers import GenerationConfig, StoppingCriteriaList

    stop = sorted(stops) or None
    settings = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=stop,
                                pad_token_id=stop[0] if stop else 0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=settings,
                              stopping_criteria=StoppingCriteriaList([_Checkpoint()]))


class _Checkpoint:
    """A stopping criterion that never stops a generation but asks the caller's should_stop after every token
    (`relevancy.cancel.checkpoint`, which raises `Cancelled`)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        checkpoint()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _token_ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text, decoded so that a character whose bytes span several tokens (an emoji, CJK in a byte-level
    or byte-fallback vocabulary) is written once, at the token that completes it, and the tokens before it are
    empty, never U+FFFD: tokens are decoded together until their text ends in a whole character (a token that
    ends in one decodes alone, as before). Joined, the texts are the decoded sequence."""
    texts: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[start:end])
        if text.endswith("\ufffd") and end < len(ids):  # bytes of a character still to come
            texts.append("")
            continue
        texts.append(text)
        start = end
    return texts


@cancellable
def explain_generation(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 32, method: str = "attnlrp",
                       continuation: str | None = None) -> GenerationExplanation:
    """Generate greedily from `prompt` (at most `max_new_tokens`, 1..256, stopping after an end-of-text token), or
    read `continuation` instead (a forced continuation: why the model would write this text), then explain every
    generated token over the prompt and the tokens generated before it.

    `method`: `attnlrp`, `cp_lrp`, `input_x_gradient` (one forward, batched backward passes), or `raw_attention`,
    `rollout`, `attention_gradcam`, `generic_attention`, `cdam` (one forward shared by every token's prefix, a
    backward per token where the method takes gradients); the LRP seeds' methods and token ablation, which need a
    pass per token, are refused (explain a prefix with `relevancy.explain`).
    Returns a `GenerationExplanation`: `scores` `(G, T + G)`, row `g` the relevance of each earlier token for the
    logit of generated token `g`, 0 at and after it; `tokens`, `generated_ids`, `text`, `relevance_total`. Row `g`
    equals `explain(model, prompt + first g generated tokens, method=method, target=token g)`. The model is left
    as it was; fp16 / bf16 models run in their own dtype (the maps in float32).
    `should_stop` (keyword): a callable asked before the work, after every generated token and before every
    backward round (a token's, for the attention methods) or group of rows; when it answers True the call raises
    `relevancy.cancel.Cancelled`.
    """
    method = check_generation_method(method)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt must be a non-empty text, got {quoted(prompt)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a decoder language model ({CausalLMAdapter.examples}), got {type(model).__name__}")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be the model's tokenizer (called on a text, with decode), got {type(tokenizer).__name__}")
    prompt_ids = _token_ids(tokenizer, prompt, special=True)
    forced = None
    if continuation is not None:
        forced = _token_ids(tokenizer, continuation, special=False) if isinstance(continuation, str) else []
        if not 1 <= len(forced) <= MAX_NEW_TOKENS:
            raise ValueError(f"continuation must be a text of 1 to {MAX_NEW_TOKENS} tokens, got {len(forced)} tokens from {quoted(continuation)}")
    family = adapter_for(model)
    if not isinstance(family, CausalLMAdapter):
        raise UnsupportedModelError(f"explain_generation explains decoder language models ({CausalLMAdapter.examples}), not the {family.family} family")
    with prepared(model, torch.tensor([prompt_ids]), attention_probabilities=False) as call:
        adapter, ids = call.adapter, call.inputs.input_ids
        window = context_window(model)
        wanted = len(prompt_ids) + (len(forced) if forced is not None else max_new_tokens)
        if window is not None and wanted > window:
            raise ValueError(f"the prompt's {len(prompt_ids)} tokens and {wanted - len(prompt_ids)} new ones exceed the model's context window of {window} tokens: shorten the prompt or generate fewer")
        if forced is None:
            ids = greedy(model, ids, max_new_tokens, stop_tokens(model, tokenizer))
        else:
            ids = torch.cat([ids, torch.tensor([forced], device=ids.device)], 1)
        if method in INPUT_RELEVANCE_RULES:
            rules = INPUT_RELEVANCE_RULES[method]
            scores, explained = generation_relevance(adapter, ids, len(prompt_ids), rules)
            totals = None if rules is None else scores.sum(1).cpu() / explained.cpu()
        else:
            scores, explained = _shared_forward_rows(model, len(adapter.attention_sites()), ids, len(prompt_ids), method)
            totals = None
    all_ids = ids[0].tolist()
    generated = ids[0, len(prompt_ids):].cpu()
    return GenerationExplanation(
        scores=scores.cpu(), generated_ids=generated, logits=explained.cpu()[:, None], method=method,
        signed=get_method(method).signed, tokens=token_texts(tokenizer, all_ids),
        prompt_length=len(prompt_ids), text=tokenizer.decode(generated.tolist(), skip_special_tokens=True),
        relevance_total=totals,
    )


def _shared_forward_rows(model: nn.Module, sites: int, ids: torch.Tensor, prompt_length: int, method: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scores (G, N), explained logits (G,))` of a shared-forward method on a model of `sites` attention sites:
    `explain` on one row per generated token,
    the sequence with the mask of the prefix before it (the adapter runs them as one forward), the token as target;
    padding at 0 is the causal mask."""
    length = ids.shape[1]
    rows = causal_rows(prompt_length, length, ids.device).long()
    generated = ids[0, prompt_length:]
    forward, per_row = shared_forward_memory(model, sites, length, method)
    if forward + per_row > MEMORY_BUDGET:
        raise ValueError(
            f"explain_generation with {method} on {length} tokens needs about {(forward + per_row) / 2**20:,.0f} MiB for one "
            f"forward's attention matrices, over the budget of {MEMORY_BUDGET / 2**20:,.0f} MiB "
            f"(relevancy.generation.MEMORY_BUDGET): shorten the prompt, generate fewer tokens, or use "
            f"{', '.join(INPUT_RELEVANCE_RULES)} (no (T, T) matrices)")
    # long prompts run the rows in groups that fit the budget, one forward per group
    explanation = explain(model, {"input_ids": ids.expand(len(generated), -1), "attention_mask": rows}, method=method,
                          target=generated.tolist(), rows_at_once=int((MEMORY_BUDGET - forward) // per_row) if per_row else None)
    return explanation.scores, explanation.logits.gather(1, generated[:, None].to(explanation.logits.device))[:, 0]


def shared_forward_memory(model: nn.Module, sites: int, length: int, method: str) -> tuple[int, int]:
    """`(bytes of the one forward, bytes per explained row)` that shared-forward `method` holds on a decoder of `sites`
    attention sites over a sequence of `length` tokens: `MATRICES` in `(length, length)` matrices of the dtype it
    is explained in (float32 for half precision), counted per head where the method keeps every head."""
    heads = model.config.num_attention_heads
    parameter = next(model.parameters())
    matrix = length * length * torch.promote_types(parameter.dtype, torch.float32).itemsize
    per_head_site, per_site, per_site_row, per_head_row = MATRICES[method]
    return (per_head_site * heads + per_site) * sites * matrix, (per_site_row * sites + per_head_row * heads) * matrix
