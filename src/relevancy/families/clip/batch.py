"""The typed input of image-text models: images, tokenised texts and which image goes with which text."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ImageTextBatch:
    """Images `(n, C, H, W)`, texts `input_ids (m, T)` (with an optional `attention_mask`), and `pairs` `(P, 2)`:
    pair `p` explains the logit of image `pairs[p, 0]` with text `pairs[p, 1]`.

    `tokens[j]` are the token strings of text `j` when a tokenizer gave them: its positions up to its end token,
    or the whole row (`tokenizer.tokens(ids)`, padding included), which the explanation cuts at the end token.
    """

    images: torch.Tensor
    input_ids: torch.Tensor
    pairs: torch.Tensor
    attention_mask: torch.Tensor | None = None
    tokens: list[list[str]] | None = None

    @classmethod
    def of(cls, images: torch.Tensor, texts: object, pairs: torch.Tensor | None = None, tokens: list[list[str]] | None = None) -> "ImageTextBatch":
        """A batch from images and the tokenizer's output (or `input_ids`): image `i` with text `i` when the counts
        agree, one image with every text or every image with one text; `pairs` chooses others."""
        ids, mask = text_ids(texts)
        device = getattr(images, "device", None)  # the pairs index the images: on their device (others: checked later)
        if pairs is None:
            n, m = len(images), len(ids)
            if n == m:
                pairs = torch.arange(n, device=device)[:, None].expand(n, 2)
            elif n == 1 or m == 1:
                count = max(n, m)
                pairs = torch.arange(count, device=device)[:, None] * torch.tensor([n > 1, m > 1], device=device)
            else:
                raise ValueError(
                    f"{n} images and {m} texts: give as many texts as images (image i with text i), one image or one "
                    "text, or every combination with ImageTextBatch.grid(images, texts)"
                )
        return cls(images, ids, torch.as_tensor(pairs, dtype=torch.long, device=device).reshape(-1, 2), mask, tokens)

    @classmethod
    def grid(cls, images: torch.Tensor, texts: object, tokens: list[list[str]] | None = None) -> "ImageTextBatch":
        """Every image with every text: `n * m` pairs, image-major (pair `i * m + j` is image `i`, text `j`)."""
        ids, _ = text_ids(texts)
        n, m = len(images), len(ids)
        device = getattr(images, "device", None)
        steps = torch.arange(n, device=device), torch.arange(m, device=device)
        pairs = torch.stack(torch.meshgrid(*steps, indexing="ij"), -1).reshape(-1, 2)
        return cls.of(images, texts, pairs, tokens)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def pair_images(self) -> torch.Tensor:
        """`(P, C, H, W)`: the image of each pair."""
        return self.images[self.pairs[:, 0]]

    @property
    def pair_ids(self) -> torch.Tensor:
        """`(P, T)`: the text of each pair."""
        return self.input_ids[self.pairs[:, 1]]

    def pair_tokens(self) -> list[list[str]] | None:
        return None if self.tokens is None else [self.tokens[j] for j in self.pairs[:, 1].tolist()]

    def rows(self, part: slice) -> "ImageTextBatch":
        """The pairs of `part` (images and texts kept whole)."""
        return replace(self, pairs=self.pairs[part])


def text_ids(texts: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(input_ids, attention_mask or None)` from the tokenizer's output or a LongTensor of ids; a clear error else."""
    if isinstance(texts, Mapping):
        if "input_ids" not in texts:
            raise ValueError(f"the tokenizer's output must hold 'input_ids' (got keys {sorted(texts.keys())})")
        ids, mask = texts["input_ids"], texts.get("attention_mask")
    else:
        ids, mask = texts, None
    if isinstance(ids, str) or isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str):
        raise TypeError("texts must be tokenised: pass the model's tokenizer output (input_ids) for the captions, not strings")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"texts must be the tokenizer's output or a LongTensor of token ids (m, T), got {type(ids).__name__}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got {ids.dtype}")
    ids = ids[None] if ids.ndim == 1 else ids
    if mask is not None:
        mask = torch.as_tensor(mask)
        mask = mask[None] if mask.ndim == 1 else mask
    return ids.long(), mask
