"""The LXMERT and VisualBERT cases of the authors' float64 outputs (tests/golden/bimodal_reference.pt, see its README):
loading, the models they came from, padded batches of their inputs, and a snapshot of everything an explanation
could leave changed on a model."""
from __future__ import annotations

import torch
import transformers

from golden import GOLDEN

# questions are right-padded with these; regions all have the same count in the reference inputs
TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids")


def bimodal_case(family: str) -> dict:
    cases = torch.load(GOLDEN / "bimodal_reference.pt", weights_only=True)
    return next(case for case in cases if case["family"] == family)


def build(case: dict, cls: type | None = None) -> torch.nn.Module:
    """The case's model class in float64 with the case's weights (strictly); or `cls` built from the same config
    with every weight of the case loaded (its own further heads keep their initialisation)."""
    if case["family"] == "lxmert":
        config, default = transformers.LxmertConfig(**case["config"]), transformers.LxmertForQuestionAnswering
    else:
        config, default = transformers.VisualBertConfig(**case["config"]), transformers.VisualBertForQuestionAnswering
    model = (cls or default)(config).double()
    _, unexpected = model.load_state_dict(case["state_dict"], strict=cls is None)
    assert not unexpected, unexpected
    return model.eval()


def padded(inputs: list[dict]) -> dict[str, torch.Tensor]:
    """The reference's batch-1 inputs as one batch: questions right-padded with 0, region tensors stacked."""
    length = max(inp["input_ids"].shape[1] for inp in inputs)
    batch = {}
    for name in inputs[0]:
        parts = [inp[name] for inp in inputs]
        if name in TEXT_FIELDS:
            parts = [torch.nn.functional.pad(p, (0, length - p.shape[1])) for p in parts]
        batch[name] = torch.cat(parts)
    return batch


def snapshot(model: torch.nn.Module) -> dict:
    """Weights, modes, hooks, gradients and every config's attention implementation."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        },
        "patched": {name: sorted(k for k in vars(m) if k == "forward") for name, m in model.named_modules()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "grads": {k: p.grad for k, p in model.named_parameters()},
        "attention": sorted(str(c._attn_implementation) for c in configs.values()),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "weights":
            for name in before[key]:
                assert torch.equal(before[key][name], after[key][name]), name
        else:
            assert before[key] == after[key], key
