"""Input x gradient at the two embeddings of transformers' `CLIPModel`, for the references computed outside relevancy
(`benchmarks/encoder_lxt_reference.py` under lxt's rules, `tests/test_encoder_attnlrp.py` through the model's own
forward)."""
from __future__ import annotations

from typing import Callable

import torch


def clip_embedding_maps(model: torch.nn.Module, score: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`(scores (B,), {"image": (B, N), "text": (B, T)})`: `score()` run with the outputs of the patch convolution and
    of the token embedding made leaves, and input x gradient of its sum there, summed over the width."""
    leaves: dict[str, torch.Tensor] = {}

    def hook(tower: str):
        def keep(_module, _args, output):
            leaves[tower] = output.detach().requires_grad_(True)
            return leaves[tower]

        return keep

    handles = [model.vision_model.embeddings.patch_embedding.register_forward_hook(hook("image")),
               model.text_model.embeddings.token_embedding.register_forward_hook(hook("text"))]
    try:
        scores = score()
    finally:
        for handle in handles:
            handle.remove()
    scores.sum().backward()
    relevance = {tower: (leaf * leaf.grad).detach() for tower, leaf in leaves.items()}
    return scores.detach(), {"image": relevance["image"].sum(1).flatten(1), "text": relevance["text"].sum(-1)}
