"""The methods of decoder language models: AttnLRP, CP-LRP and input x gradient at the token embeddings."""
from __future__ import annotations

from typing import Any

import torch

from ..families.base import Adapter, UnsupportedModelError
from ..families.causal_lm import CausalLMAdapter
from ..lrp.attnlrp import ATTNLRP, CP_LRP, RuleSet

#: the input-relevance methods of decoders and the rule set of their backward (None: the plain gradient)
INPUT_RELEVANCE_RULES: dict[str, RuleSet | None] = {"attnlrp": ATTNLRP, "cp_lrp": CP_LRP, "input_x_gradient": None}


def _input_relevance(adapter: Adapter, inputs: Any, target: Any, rules: RuleSet | None, tokenizer: object | None, method: str,
                     checkpoint: bool) -> tuple:
    """The method's `(scores, ids, logits[, fields])` on a decoder; fp16 / bf16 models run in their own dtype (no
    copy of their weights: the rules keep what needs the precision in float32, `lrp.attnlrp`), the maps come in
    float32; the rule-based ones report `relevance_total`. `checkpoint`:
    recompute each layer in the backward instead of keeping its activations (less memory on long prompts, about
    one more forward of time; the same map)."""
    if not isinstance(adapter, CausalLMAdapter):
        raise UnsupportedModelError(f"method '{method}' explains decoder language models ({CausalLMAdapter.examples}), not the {adapter.family} family")
    scores, ids, logits, explained = adapter.input_relevance(inputs, target, rules, tokenizer, checkpoint)
    if rules is None:
        return scores, ids, logits
    # the share of the explained score that reaches the token embeddings (biases and positions keep the rest)
    return scores, ids, logits, {"relevance_total": scores.sum(1) / explained}


def attnlrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False) -> tuple[torch.Tensor, ...]:
    """AttnLRP (Achtibat et al., ICML 2024): relevance of each input token for the target logit."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["attnlrp"], tokenizer, "attnlrp", checkpoint)


def cp_lrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False) -> tuple[torch.Tensor, ...]:
    """CP-LRP (Ali et al., ICML 2022): AttnLRP's rules with no relevance through queries, keys and gates."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["cp_lrp"], tokenizer, "cp_lrp", checkpoint)


def input_x_gradient(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None, checkpoint: bool = False) -> tuple[torch.Tensor, ...]:
    """Input x gradient at the token embeddings, summed over the width."""
    return _input_relevance(adapter, inputs, target, INPUT_RELEVANCE_RULES["input_x_gradient"], tokenizer, "input_x_gradient", checkpoint)
