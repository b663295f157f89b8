"""Relevance passes under a family's rules, shared by the LRP-based methods: the rule sets by name, the float32 twin
of a half-precision model, the attention and block inputs a session records, conservation checks, and the
gradient and relevance at chosen attention sites (`site_relevance`)."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from .capture import Forward, record_forward
from ..core import dispatch, linears
from ..core.conventions import LrpConventions, given_or
from ..families.base import Adapter, UnsupportedModelError
from ..core.guard import this_thread_only
from ..lrp import GRADIENT, PAPER, RELEVANCE, RULE_SETS, RuleSet, Session, relevance_session
from ..core.streams import Feed, Stream
from .targets import Target

# the paper's rules conserve relevance: a total further than this from 1 marks a degenerate map (warned)
CONSERVATION_TOLERANCE = 1e-2
LOW_PRECISION = (torch.float16, torch.bfloat16)


def unit_seed(score: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=score.dtype, device=score.device)


def rule_set_for(rules: str | None, conventions: LrpConventions) -> RuleSet:
    """The LRP-baseline rules by name (`lrp.RULE_SETS`): "vanilla" (`layers_lrp`, the ViT reference) or "paper"
    (`layers_ours`: the BERT reference uses these for its baselines too); the family's convention when not given.
    The rule sets that carry a gradient (AttnLRP, CP-LRP) are methods of their own, named in the refusal."""
    name = given_or(rules, conventions.rules)
    explicit = [key for key, rule_set in RULE_SETS.items() if rule_set.explicit]
    if name not in explicit:
        others = [key for key in RULE_SETS if key not in explicit]
        raise ValueError(f"rules must be one of {', '.join(explicit)}; got {name!r} ({', '.join(others)} are methods of "
                         "their own, method=...)")
    return RULE_SETS[name]


def stream_depths(adapter: Adapter, streams: dict[str, Stream]) -> dict[str, int]:
    """Per stream, its number of self-attention blocks (from the adapter's attention sites)."""
    sites = adapter.attention_sites()
    return {name: sum(site.is_self and site.query == name for site in sites) for name in streams}


def stream_attentions(adapter: Adapter, session: Session, streams: dict[str, Stream], feeds: Sequence[Feed] = ()
                      ) -> dict[str, list[torch.Tensor]]:
    """Per stream, the self-attentions the rule map recorded, block by block: the session records every attention
    in forward order, the order of `adapter.attention_sites()`, after those of the models that feed a stream (`feeds`:
    a vision-language decoder's tower, every one of its sites, which run first), listed under their source stream."""
    sites = [*(site for feed in feeds for site in feed.sites), *adapter.attention_sites()]
    if len(sites) != len(session.attentions):
        raise RuntimeError(
            f"the relevance rules recorded {len(session.attentions)} attentions where the model has {len(sites)} "
            "attention sites: the rule map and the adapter disagree"
        )
    found: dict[str, list[torch.Tensor]] = {name: [] for name in [*(feed.source.name for feed in feeds), *streams]}
    for site, attention in zip(sites, session.attentions):
        if site.is_self:
            found[site.query].append(attention)
    return found


@contextmanager
def recording_block_inputs(adapter: Adapter, session: Session, streams: dict[str, Stream]) -> Iterator[None]:
    """One-stream families: hooks on `adapter.blocks` fill `session.block_inputs` (the tokens entering each block,
    where relevance is measured) during the block. The rule maps of multi-stream families record them themselves."""
    if not adapter.blocks:
        yield
        return
    (name,) = streams
    handles = [
        block.register_forward_pre_hook(this_thread_only(lambda _m, args: session.block_inputs.setdefault(name, []).append(args[0])))
        for block in adapter.blocks
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def entering(session: Session, stream: str, block: int) -> torch.Tensor:
    """The tokens that entered block `block` of `stream` in the session's forward pass."""
    recorded = session.block_inputs.get(stream, [])
    if not -len(recorded) <= block < len(recorded):
        raise RuntimeError(f"the relevance rules recorded no input of block {block} of the {stream} stream")
    return recorded[block]


def conservation(relevance: torch.Tensor, rule_set: RuleSet, method: str) -> dict:
    """`{"relevance_total": (B,)}`, the total relevance per input (1 enters at the explained score); a warning
    when it is not finite, or when rules that conserve (the paper's) lost more than `CONSERVATION_TOLERANCE`."""
    totals = relevance.detach().flatten(1).sum(1)
    if not torch.isfinite(totals).all():
        warnings.warn(f"{method}: the relevance total is not finite for some inputs; their maps are degenerate", stacklevel=4)
    elif rule_set is PAPER and ((totals - 1).abs() > CONSERVATION_TOLERANCE).any():
        worst = totals[(totals - 1).abs().argmax()].item()
        warnings.warn(
            f"{method}: the relevance total is {worst:.4g} where the paper's rules conserve 1 (tolerance "
            f"{CONSERVATION_TOLERANCE}); the map may be degenerate (see Explanation.relevance_total)", stacklevel=4,
        )
    return {"relevance_total": totals}


@contextmanager
def full_precision(adapter: Adapter, inputs) -> Iterator[tuple[Adapter, object]]:
    """fp16 / bf16 models are explained through a float32 copy (the model itself untouched): the LRP rules
    divide by sums that half precision cannot resolve; refused by name where the model cannot be copied and cast
    (quantized, or dispatched by accelerate). Other models are used as they are."""
    param = next(adapter.model.parameters(), None)
    if param is None or param.dtype not in LOW_PRECISION:
        yield adapter, inputs
        return
    held = "quantized" if linears.quantized(adapter.model) else "dispatched by accelerate" if dispatch.dispatched(adapter.model) else None
    if held is not None:
        raise UnsupportedModelError(
            f"the seeds' LRP methods explain a {param.dtype} model through a float32 copy, and this model is {held}: "
            "load it to compute in float32 (dtype=torch.float32, and bnb_4bit_compute_dtype=torch.float32 for 4 bits), which "
            "they explain with no copy, or use attnlrp, cp_lrp or input_x_gradient, which explain it in its own dtype")
    twin = copy.deepcopy(adapter.model).float()
    yield type(adapter)(twin), float32_copy(inputs)


def float32_copy(inputs):
    """A float input tensor in float32; a batch object (a dataclass, e.g. CLIP's images and texts) with its float
    tensors in float32; anything else as it is."""
    if isinstance(inputs, torch.Tensor):
        return inputs.float() if inputs.is_floating_point() else inputs
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        values = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs) if f.init}
        floats = {name: v.float() for name, v in values.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        return dataclasses.replace(inputs, **floats) if floats else inputs
    return inputs


def per_stream_result(scores: dict[str, torch.Tensor], totals: list[torch.Tensor], fwd) -> tuple:
    """A one-stream family's `(scores, indices, logits, {"relevance_total": (B,)})`; several streams: the scores
    per stream and the totals as `(B, streams)` columns, in stream order (one stream and the one that feeds it: the
    scores of both and one total `(B,)`)."""
    total = totals[0] if len(totals) == 1 else torch.stack(totals, 1)
    return next(iter(scores.values())) if len(scores) == 1 else scores, fwd.indices, fwd.logits, {"relevance_total": total}


def masked(stream: Stream, relevance: torch.Tensor) -> torch.Tensor:
    """Token relevance `(B, T, ...)` with padding tokens zeroed (families that pad)."""
    valid = stream.valid
    if valid is None:
        return relevance
    return relevance * valid.reshape(*valid.shape, *([1] * (relevance.ndim - 2))).to(relevance)


@dataclasses.dataclass
class SiteRelevance:
    """What one forward under a family's relevance rules gives at some attention sites: the forward, the sites'
    probabilities (detached), the score's gradient (None unless asked) and relevance at them, and per stream the
    relevance reaching its input tokens `(B, streams)`."""

    forward: Forward
    attentions: list[torch.Tensor]
    gradients: list[torch.Tensor] | None
    relevances: list[torch.Tensor]
    totals: torch.Tensor


def site_relevance(
    adapter: Adapter, inputs, target: Target, rule_set: RuleSet, exact: bool, picked: list[int], method: str,
    gradients: bool = True,
) -> SiteRelevance:
    """Gradient and relevance at the attention sites `picked` (indices into `adapter.attention_sites()`), from one
    forward under the family's rule map (which records every attention and each stream's input tokens)."""
    streams = adapter.streams(inputs)
    sites = adapter.attention_sites()
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set.with_exact(exact), gradient_pass=gradients) as session:
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            if len(session.attentions) != len(sites):
                raise RuntimeError(
                    f"the relevance rules recorded {len(session.attentions)} attentions where the model has {len(sites)} "
                    "attention sites: the rule map and the adapter disagree"
                )
            attentions = [session.attentions[k] for k in picked]
            seed = unit_seed(fwd.score)
            grads = session.backward(GRADIENT, fwd.score.sum(), attentions, seed) if gradients else None
            tokens = [entering(session, name, 0) for name in streams]
            found = session.backward(RELEVANCE, fwd.score.sum(), attentions + tokens, seed)
    relevances, arrived = found[:len(attentions)], found[len(attentions):]
    totals = torch.stack([masked(stream, r).flatten(1).sum(1) for stream, r in zip(streams.values(), arrived)], 1)
    if not torch.isfinite(totals).all():
        warnings.warn(f"{method}: the relevance total is not finite for some inputs; their maps are degenerate", stacklevel=3)
    return SiteRelevance(fwd, [a.detach() for a in attentions], grads, relevances, totals)
