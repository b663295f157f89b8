"""The models shipped with relevancy, one row each: the name the command line's `--model` and the web page give
for it, how the page titles it, and where its weights live and what trains them. The apps ask this table whether
a name means a shipped model (`Shipped.means`) instead of comparing names in each command (no torch imported)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError


@dataclass(frozen=True)
class Shipped:
    """A shipped model: `name` (what `--model` says; not given means it too), `title` (the page's), `weights`
    (`"module:ATTRIBUTE"` of its weights file, read when asked), `trainer` (the module that writes them) and whether
    its loader reads a `.json` of settings beside the weights (`settings`)."""

    name: str
    title: str
    weights: str | None = None
    trainer: str | None = None
    settings: bool = False

    def means(self, model: str | None) -> bool:
        """Whether `--model model` (None: not given) names this shipped model."""
        return model is None or model == self.name

    def weights_path(self) -> Path:
        """The weights file; a UsageError naming the trainer when it is missing."""
        module, attribute = str(self.weights).split(":")
        path = Path(getattr(importlib.import_module(module), attribute))
        if not path.is_file() or (self.settings and not path.with_suffix(".json").is_file()):
            raise UsageError(f"the shipped {self.title} is missing ({path}): train it with python -m {self.trainer}, "
                             "or give --model PATH.safetensors")
        return path


#: the shipped model of each kind an app explains (`relevancy.models.SHIPPED`, `SHIPPED_CLIP` and
#: `SHIPPED_LANGUAGE_MODEL` name the same ones; a test keeps them equal)
SHIPPED = {
    "image": Shipped("shapes", "shapes ViT (shipped, 64 px)", "relevancy.worlds:WEIGHTS_PATH", "training.shapes_vit"),
    "text": Shipped("sentiment", "drug-review sentiment (shipped)"),
    "pairs": Shipped("shapes-clip", "shapes CLIP (shipped; its words: colours, sizes, positions, the 12 shapes)",
                     "relevancy.worlds.shapes_clip:CLIP_WEIGHTS_PATH", "training.shapes_clip"),
    "questions": Shipped("shapes", "shapes LXMERT", "relevancy.worlds.shapes_lxmert:VQA_WEIGHTS_PATH", "training.shapes_lxmert",
                         settings=True),
    "detector": Shipped("shapes", "shapes detector", "relevancy.worlds.detection:DETECTOR_WEIGHTS_PATH", "training.shapes_detr"),
    "language": Shipped("smollm2", "SmolLM2-135M-Instruct (weights dequantised from 4 bits)"),
    "vision-language": Shipped("shapes", "shapes LLaVA", "relevancy.worlds.shapes_vlm:VLM_WEIGHTS_PATH",
                               "training.shapes_vlm", settings=True),
}
#: the shipped shapes Qwen2.5-VL, the vlm-shapes benchmark's second model (`--model shapes-qwen-vl`) beside the LLaVA
SHAPES_QWEN_VL = Shipped("shapes-qwen-vl", "shapes Qwen2.5-VL", "relevancy.worlds.shapes_vlm:QWEN_VL_WEIGHTS_PATH",
                         "training.shapes_qwen_vl", settings=True)
