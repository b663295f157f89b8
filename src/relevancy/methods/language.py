"""The methods of decoder language models: AttnLRP, CP-LRP and input x gradient at the token embeddings."""
from __future__ import annotations

from typing import Any

import torch

from ..families.base import Adapter, UnsupportedModelError
from ..families.causal_lm import CausalLMAdapter
from ..lrp.attnlrp import ATTNLRP, CP_LRP, RuleSet


def _input_relevance(adapter: Adapter, inputs: Any, target: Any, rules: RuleSet | None, tokenizer: object | None, method: str) -> tuple:
    if not isinstance(adapter, CausalLMAdapter):
        raise UnsupportedModelError(f"method '{method}' explains decoder language models ({CausalLMAdapter.examples}), not the {adapter.family} family")
    scores, ids, logits, explained = adapter.input_relevance(inputs, target, rules, tokenizer)
    if rules is None:
        return scores, ids, logits
    # the share of the explained score that reaches the token embeddings (biases and positions keep the rest)
    return scores, ids, logits, {"relevance_total": scores.sum(1) / explained}


def attnlrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None) -> tuple[torch.Tensor, ...]:
    """AttnLRP (Achtibat et al., ICML 2024): relevance of each input token for the target logit."""
    return _input_relevance(adapter, inputs, target, ATTNLRP, tokenizer, "attnlrp")


def cp_lrp(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None) -> tuple[torch.Tensor, ...]:
    """CP-LRP (Ali et al., ICML 2022): AttnLRP's rules with no relevance through queries, keys and gates."""
    return _input_relevance(adapter, inputs, target, CP_LRP, tokenizer, "cp_lrp")


def input_x_gradient(adapter: Adapter, inputs: Any, target: Any, tokenizer: object | None = None) -> tuple[torch.Tensor, ...]:
    """Input x gradient at the token embeddings, summed over the width."""
    return _input_relevance(adapter, inputs, target, None, tokenizer, "input_x_gradient")
