"""Make tests/golden/gradcam_reference.pt: pytorch-grad-cam's own Grad-CAM maps of transformer image models, in float64,
with the target layers and reshape transforms its documentation gives for them:

    /tmp/gcenv/bin/python benchmarks/gradcam_reference.py [--out tests/golden/gradcam_reference.pt]

Run it in a venv with grad-cam 1.5.7 (never a dependency of relevancy; with ttach and opencv-python-headless).
- ViT (timm): `model.blocks[-1].norm1`, the [CLS] token dropped and the patch tokens laid on their grid.
- Swin (timm V1): the last block's `norm1`, whose output is already `(B, h, w, C)`, moved to `(B, C, h, w)`.
The file keeps the map pytorch-grad-cam computes on the token grid (after its ReLU, before it rescales and resizes
it for display: `scale_cam_image`'s input), its displayed map (min-max scaled, resized to the image with OpenCV,
float32), the models' weights, the images and the classes explained (each image's most likely one).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

from models import tiny_swin, tiny_vit  # noqa: E402


def vit_tokens_on_grid(tensor: torch.Tensor, prefix: int = 1) -> torch.Tensor:
    """pytorch-grad-cam's ViT reshape transform: the prefix tokens dropped, `(B, N, C)` -> `(B, C, h, w)`."""
    tokens = tensor[:, prefix:]
    side = int(round(tokens.shape[1] ** 0.5))
    return tokens.reshape(tokens.shape[0], side, side, tokens.shape[2]).permute(0, 3, 1, 2)


def swin_tokens_on_grid(tensor: torch.Tensor) -> torch.Tensor:
    """timm's Swin keeps its tokens as `(B, h, w, C)`: moved to `(B, C, h, w)`."""
    return tensor.permute(0, 3, 1, 2)


def grad_cam(model: torch.nn.Module, layer: torch.nn.Module, reshape, images: torch.Tensor) -> dict:
    """pytorch-grad-cam's GradCAM of each image's most likely class: the grid map and the displayed map."""
    import pytorch_grad_cam.base_cam as base_cam
    from pytorch_grad_cam import GradCAM

    grids: list = []
    scale = base_cam.scale_cam_image

    def recording(cam, target_size=None):
        grids.append(torch.as_tensor(cam).clone())
        return scale(cam, target_size)

    base_cam.scale_cam_image = recording
    try:
        with GradCAM(model=model, target_layers=[layer], reshape_transform=reshape) as cam:
            shown = cam(input_tensor=images, targets=None)
    finally:
        base_cam.scale_cam_image = scale
    with torch.no_grad():
        classes = model(images).argmax(1)
    return {"grid": grids[0], "shown": torch.as_tensor(shown), "classes": classes}


def main() -> None:
    from importlib.metadata import version

    import timm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden/gradcam_reference.pt")
    args = parser.parse_args()
    torch.manual_seed(0)
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    vit, swin = tiny_vit().double(), tiny_swin()
    golden = {"images": images, "versions": {"grad-cam": version("grad-cam"), "timm": timm.__version__, "torch": torch.__version__},
              "vit": {"state_dict": vit.state_dict(), **grad_cam(vit, vit.blocks[-1].norm1, vit_tokens_on_grid, images)},
              "swin": {"state_dict": swin.state_dict(),
                       **grad_cam(swin, swin.layers[-1].blocks[-1].norm1, swin_tokens_on_grid, images)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
