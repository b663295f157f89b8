"""Load the authors' reference outputs (../shared/golden) and build the models they came from."""
from __future__ import annotations

from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"


def vit_cases() -> list[dict]:
    return torch.load(GOLDEN / "vit_reference.pt", weights_only=True)


def build_vit(case: dict) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**case["config"], class_token=True, global_pool="token")
    model.load_state_dict(case["state_dict"], strict=True)
    return model.eval()


def assert_map_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Equal within `rtol` of the reference map's largest magnitude (the tolerance the golden README states)."""
    actual, expected = actual.reshape(expected.shape).double(), expected.double()
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rtol * scale + atol, f"max error {error:.3g} > {rtol} x {scale:.3g} + {atol}"


def bert_cases() -> list[dict]:
    return torch.load(GOLDEN / "bert_reference.pt", weights_only=True)


def build_bert(case: dict) -> torch.nn.Module:
    """`transformers.BertForSequenceClassification` with the case's weights, dropout 0 (as the README says)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**case["config"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
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
