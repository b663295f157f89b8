"""Load the authors' float64 reference outputs (tests/golden/, see its README) and build the models they came from."""
from __future__ import annotations

from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "golden"
# maps of timm models agree with the authors' float64 code to ~1e-15; Hugging Face's eager attention computes
# its softmax in float32 even for float64 models, which costs ~1e-8 wherever the model's own attention runs
TIMM_RTOL, HF_RTOL = 1e-8, 1e-6
# the LRP-based methods reproduce the authors' arithmetic (their 1e-9 stabiliser placements) with exact=True
LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp")


def vit_cases() -> list[dict]:
    return torch.load(GOLDEN / "vit_reference64.pt", weights_only=True)


def build_vit(case: dict) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**case["config"], class_token=True, global_pool="token")
    model.load_state_dict(case["state_dict"], strict=True)
    return model.double().eval()


def assert_map_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = TIMM_RTOL) -> None:
    """Equal within `rtol` of the reference map's largest magnitude. A NaN reference is the authors' min-max of an
    all-zero map (0/0): there the map must be finite and all zero."""
    actual, expected = actual.reshape(expected.shape).double(), expected.double()
    if torch.isnan(expected).any():
        assert torch.isfinite(actual).all() and (actual == 0).all(), "an all-zero raw map must normalise to zeros"
        return
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rtol * scale, f"max error {error:.3g} > {rtol} x {scale:.3g} (relative {error / scale:.3g})"


def exact_options(method: str, options: dict) -> dict:
    """The options that reproduce the reference: its stabiliser placements for the LRP-based methods."""
    return {**options, "exact": True} if method in LRP_METHODS else options


def bert_cases() -> list[dict]:
    return torch.load(GOLDEN / "bert_reference64.pt", weights_only=True)


def build_bert(case: dict) -> torch.nn.Module:
    """`transformers.BertForSequenceClassification` with the case's weights in float64, dropout 0."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**case["config"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config).double()
    model.load_state_dict(case["state_dict"], strict=True)
    return model.eval()


def pad_ids(sequences: list[torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch `{input_ids, attention_mask}` of 1-D id sequences (what a tokenizer returns)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask}
