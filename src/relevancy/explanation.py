"""The result of `explain()`: raw scores plus what is needed to show them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .targets import Concept


@dataclass
class Explanation:
    """Relevance of each patch (`scores`, `(B, h, w)`) or pixel (`(B, H, W)`, method `lrp`) for `target`.

    Scores are raw, as the method defines them; `signed` says whether negative values carry meaning.
    `target` holds the explained class per image (-1 where a `concept` was explained).
    `relevance_total` (LRP-based methods only, `(B,)`): the total relevance reaching the level the map is read at,
    for a relevance of 1 at the explained score; the paper's rules conserve it (1), see docs/methods.md.
    """

    scores: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor
    method: str
    signed: bool
    input_size: tuple[int, int]
    class_names: list[str] | None = None
    mean: Sequence[float] = (0.0, 0.0, 0.0)
    std: Sequence[float] = (1.0, 1.0, 1.0)
    concept: Concept | None = field(default=None, repr=False)
    relevance_total: torch.Tensor | None = field(default=None, repr=False)

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the scores upsampled bilinearly to the input size (raw values)."""
        if tuple(self.scores.shape[-2:]) == tuple(self.input_size):
            return self.scores
        return F.interpolate(self.scores[:, None].float(), size=self.input_size, mode="bilinear", align_corners=False)[:, 0]

    def labels(self) -> list[str]:
        """A caption per image: the concept, or the class name (or index) with its logit."""
        if self.concept is not None:
            return ["concept"] * len(self.target)
        captions = []
        for i, k in enumerate(self.target.tolist()):
            name = self.class_names[k] if self.class_names and k < len(self.class_names) else f"class {k}"
            captions.append(f"{name} ({self.logits[i, k]:.2f})")
        return captions

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised input images back to `[0, 1]` pictures `(B, H, W, 3)`."""
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return (images.detach().float().cpu() * std + mean).clamp(0, 1).permute(0, 2, 3, 1)

    def save(self, path: str | Path, images: torch.Tensor | None = None) -> Path:
        """Write an overlay PNG (one panel per image); the file appears whole or not at all."""
        from .viz import overlay_figure, save_figure

        pictures = self.pixels(images) if images is not None else None
        figure = overlay_figure(self.heatmap().cpu(), pictures, self.signed, [f"{self.method}: {c}" for c in self.labels()])
        return save_figure(figure, path)
