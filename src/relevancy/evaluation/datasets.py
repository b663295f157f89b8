"""Readers for the evaluation data sets: ImageNet validation folders and ImageNet-Segmentation.

(The ERASER text reader lives with its metric in :mod:`relevancy.evaluation.metrics.rationales`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset
from torchvision import transforms
from torchvision.datasets import ImageFolder

from ..core.extras import require

__all__ = ["PAPER_DATA_CONFIG", "ImageNetSegmentation", "imagenet_folder", "timm_transform"]

# The CVPR'21 evaluation input pipeline: Resize((224, 224)) (bilinear), ToTensor, Normalize(0.5, 0.5).
PAPER_DATA_CONFIG: dict[str, Any] = {
    "input_size": (3, 224, 224),
    "interpolation": "bilinear",
    "crop_pct": 1.0,
    "crop_mode": "squash",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
}


def timm_transform(data_config: Mapping[str, Any] | None = None, model: nn.Module | None = None) -> Any:
    """timm's evaluation transform for a data config, or for ``model``'s config (``data_config`` overrides it).

    Use :data:`PAPER_DATA_CONFIG` for the papers' pipeline (squash resize, no crop, mean = std = 0.5).
    """
    from timm.data import create_transform, resolve_data_config, resolve_model_data_config

    if model is not None:
        config = resolve_model_data_config(model, args=dict(data_config or {}))
    elif data_config is not None:
        config = resolve_data_config(args=dict(data_config))
    else:
        raise ValueError("give a data_config, a model, or both")
    return create_transform(**config, is_training=False)


def imagenet_folder(
    root: str | Path, data_config: Mapping[str, Any] | None = None, model: nn.Module | None = None
) -> ImageFolder:
    """ImageNet validation images in ``ImageFolder`` layout (``root/<wnid>/*.JPEG``), transformed as timm evaluates.

    Class indices follow the sorted folder names, which for the 1,000 WordNet ids is ImageNet's order.
    """
    return ImageFolder(str(root), transform=timm_transform(data_config, model))


class ImageNetSegmentation(Dataset):
    """ImageNet-Segmentation (Guillaumin et al.), ``gtsegs_ijcv.mat`` (MATLAB v7.3, i.e. HDF5).

    As the authors' ``data/Imagenet.py`` reads it: ``/value/img[i, 0]`` refers to a ``(3, W, H)`` uint8
    array (transposed to ``H, W, 3``); ``/value/gt[i, 0]`` refers to a cell whose ``[0, 0]`` refers to the
    ``(W, H)`` mask (transposed to ``H, W``). The image is resized to ``size`` (bilinear), turned into a
    tensor and normalised with ``mean``/``std``; the mask is resized with nearest-neighbour and returned
    as a ``LongTensor`` of 0 (background) and 1 (object).
    """

    def __init__(
        self,
        path: str | Path,
        size: tuple[int, int] = (224, 224),
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        h5py = require("h5py", extra="eval")

        self.path = str(path)
        self.image_transform = transforms.Compose([
            transforms.Resize(size), transforms.ToTensor(), transforms.Normalize(mean, std),
        ])
        self.mask_transform = transforms.Resize(size, interpolation=transforms.InterpolationMode.NEAREST)
        self._file: Any = None  # opened lazily, once per worker process
        try:
            with h5py.File(self.path, "r") as f:
                self._length = len(f["/value/img"])
        except OSError as error:  # h5py's own words name its internals, not the file
            raise ValueError(f"{self.path} is not an HDF5 (MATLAB v7.3) file: ImageNet-Segmentation needs gtsegs_ijcv.mat") from error
        except KeyError as error:
            raise ValueError(f"{self.path} is an HDF5 file without /value/img: ImageNet-Segmentation needs gtsegs_ijcv.mat") from error

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._file is None:
            h5py = require("h5py", extra="eval")

            self._file = h5py.File(self.path, "r")
        f = self._file
        image = np.array(f[f["/value/img"][index, 0]]).transpose((2, 1, 0))
        mask = np.array(f[f[f["/value/gt"][index, 0]][0, 0]]).transpose((1, 0))
        img = self.image_transform(Image.fromarray(image).convert("RGB"))
        target = np.array(self.mask_transform(Image.fromarray(mask))).astype("int32")
        return img, torch.from_numpy(target).long()

    def __getstate__(self) -> dict[str, Any]:
        # An open h5py file cannot be pickled into DataLoader workers; each worker reopens it.
        return {**self.__dict__, "_file": None}
