"""Small files in the real data sets' formats, for tests."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np


def write_gtsegs(path: Path, images, masks) -> Path:
    """A file laid out like MATLAB v7.3's ``gtsegs_ijcv.mat``: cell arrays of object references."""
    with h5py.File(path, "w") as f:
        refs = f.create_group("#refs#")
        img_refs = np.empty((len(images), 1), dtype=h5py.ref_dtype)
        gt_refs = np.empty((len(images), 1), dtype=h5py.ref_dtype)
        for i, (img, mask) in enumerate(zip(images, masks)):
            img_refs[i, 0] = refs.create_dataset(f"img{i}", data=img.transpose((2, 1, 0))).ref  # (3, W, H)
            m = refs.create_dataset(f"mask{i}", data=mask.transpose((1, 0)))  # (W, H)
            cell = refs.create_dataset(f"cell{i}", shape=(1, 1), dtype=h5py.ref_dtype)
            cell[0, 0] = m.ref
            gt_refs[i, 0] = cell.ref
        value = f.create_group("value")
        value.create_dataset("img", data=img_refs)
        value.create_dataset("gt", data=gt_refs)
    return path
