import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision import transforms

from relevancy.evaluation.datasets import PAPER_DATA_CONFIG, ImageNetSegmentation, imagenet_folder, timm_transform
from data_files import write_gtsegs


def _image_folder(root):
    rng = np.random.default_rng(0)
    arrays = {}
    for wnid in ("n01440764", "n01443537"):
        (root / wnid).mkdir(parents=True)
        for i in range(2):
            arr = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / wnid / f"ILSVRC2012_val_{wnid}_{i}.png")
            arrays[(wnid, i)] = arr
    return arrays


def test_imagenet_folder_with_paper_config(tmp_path):
    arrays = _image_folder(tmp_path)
    ds = imagenet_folder(tmp_path, {**PAPER_DATA_CONFIG, "input_size": (3, 16, 16)})
    assert len(ds) == 4 and ds.classes == ["n01440764", "n01443537"]
    img, label = ds[2]
    assert label == 1 and img.shape == (3, 16, 16)
    want = transforms.Compose([
        transforms.Resize((16, 16)), transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3),
    ])(Image.fromarray(arrays[("n01443537", 0)]))
    assert torch.allclose(img, want, atol=1e-6)


def test_timm_transform_from_model_config():
    model = nn.Linear(1, 1)
    model.pretrained_cfg = {"input_size": (3, 24, 24), "mean": (0.1, 0.2, 0.3), "std": (1, 1, 1),
                            "crop_pct": 1.0, "interpolation": "bicubic"}
    t = timm_transform(model=model)
    out = t(Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)))
    assert out.shape == (3, 24, 24)
    assert torch.allclose(out[:, 0, 0], -torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError):
        timm_transform()


def test_imagenet_segmentation_reader(tmp_path):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (12, 20, 3), dtype=np.uint8), rng.integers(0, 256, (30, 10, 3), dtype=np.uint8)]
    masks = [np.zeros((12, 20), dtype=np.uint8), np.zeros((30, 10), dtype=np.uint8)]
    masks[0][2:8, 5:15] = 1
    masks[1][10:, :5] = 1
    path = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(path, images, masks)

    ds = ImageNetSegmentation(path, size=(16, 16))
    assert len(ds) == 2
    for i in range(2):
        img, mask = ds[i]
        want_img = transforms.Compose([
            transforms.Resize((16, 16)), transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3),
        ])(Image.fromarray(images[i]))
        want_mask = np.array(transforms.Resize((16, 16), transforms.InterpolationMode.NEAREST)(
            Image.fromarray(masks[i])))
        assert torch.equal(img, want_img)
        assert mask.dtype == torch.long and mask.shape == (16, 16)
        assert np.array_equal(mask.numpy(), want_mask) and set(mask.unique().tolist()) == {0, 1}
    clone = pickle.loads(pickle.dumps(ds))  # picklable into DataLoader workers after use
    assert torch.equal(clone[1][1], ds[1][1])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert batch[0].shape == (2, 3, 16, 16) and batch[1].shape == (2, 16, 16)
