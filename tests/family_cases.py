"""One small float64 model and a batch of two or more inputs per family (every adapter relevancy ships), for the
family contract (test_family_contract.py): a new family adds its case here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from timm.layers import SwiGLU
from timm.models.vision_transformer import Attention

from relevancy.families.clip.batch import ImageTextBatch
from bimodal_golden import bimodal_case, build as build_bimodal, padded
from hf_vit_models import tiny_dinov2_swiglu, tiny_hf

from decoder_families import FAMILIES as DECODER_FAMILIES, build as build_decoder
from state_space_models import FAMILIES as STATE_SPACE_FAMILIES, build as build_state_space
from hybrid_models import FAMILIES as HYBRID_FAMILIES, build as build_hybrid
from conv_hybrid_models import FAMILIES as CONV_HYBRID_FAMILIES, build as build_conv_hybrid
from vlm_models import FAMILIES as VLM_FAMILIES, INTERN_TILED, SIZED as SIZED_VLM_FAMILIES, TILED as TILED_VLM_FAMILIES, alone, build as build_vlm, \
    inputs as vlm_inputs
from qwen_vl_models import SEEDS as QWEN_VL_FAMILIES, alone as qwen_alone, build as build_qwen_vl, inputs as qwen_inputs
from test_causal_lm import batch as llm_batch, build as build_llm
from test_clip import CASES as CLIP_CASES, build as build_clip
from models import hf_swin_from, hf_swinv2_from, tiny_swin, tiny_swinv2, tiny_vit
from test_detr_family import build as build_detr, images as detr_images, targets_per_image
from test_text_adapter import tiny as tiny_text
from golden import GOLDEN

Call = tuple[Any, Any]  # (inputs, target) for relevancy.explain


def to_device(value: Any, device: str) -> Any:
    """Tensors, dicts, lists, tuples and dataclasses (the families' typed batches) with every tensor on `device`: a
    case's inputs for a model moved there (tests/test_device.py, benchmarks/gpu.py)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def explain_once(case: "FamilyCase"):
    """One explanation of the case's batch by a method its family offers: rollout, or the family's first method
    where it has no rollout (warnings ignored: a family's notes about its method are not under test here)."""
    import warnings

    import relevancy
    from relevancy.families import adapter_for

    inputs, target = case.batch()
    model = case.build()
    offered = adapter_for(model).methods
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relevancy.explain(model, inputs, method="rollout" if "rollout" in offered else offered[0], target=target)


@dataclass(frozen=True)
class FamilyCase:
    """`build()`: the model in float64, eval mode. `batch()`: one call's inputs and target. `singles()`: the same
    rows one call at a time, in the batch's row order (a call may give several rows: DETR's objects)."""

    build: Callable[[], torch.nn.Module]
    batch: Callable[[], Call]
    singles: Callable[[], list[Call]]
    #: how far a batch's maps may be from each input's alone, relative to the map's maximum
    tolerance: float = 1e-9
    #: the same for the LRP methods, where their rules' divisions amplify the model's own rounding more (None: `tolerance`)
    relevance_tolerance: float | None = None


def _images(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _image_case(build: Callable[[], torch.nn.Module], size: int = 32) -> FamilyCase:
    return FamilyCase(build, lambda: (_images(size), None), lambda: [(image[None], None) for image in _images(size)])


_TEXTS = torch.tensor([[2, 11, 12, 13, 14, 3], [2, 21, 22, 23, 24, 3]])


def _text_case(family: str) -> FamilyCase:
    return FamilyCase(
        lambda: tiny_text(family).double(),
        lambda: ({"input_ids": _TEXTS}, None),
        lambda: [({"input_ids": ids[None]}, None) for ids in _TEXTS],
    )


def _clip_case(library: str) -> FamilyCase:
    case = CLIP_CASES[0]
    images, ids = case["images"], case["input_ids"]
    pairs = [(i, j) for i in range(len(images)) for j in range(len(ids))]
    return FamilyCase(
        lambda: build_clip(case, library),
        lambda: (ImageTextBatch.grid(images, ids), None),
        lambda: [((images[i:i + 1], ids[j:j + 1]), None) for i, j in pairs],
    )


def _bimodal_case(family: str) -> FamilyCase:
    case = bimodal_case(family)
    return FamilyCase(lambda: build_bimodal(case), lambda: (padded(case["inputs"]), None),
                      lambda: [(inputs, None) for inputs in case["inputs"]])


def _detr_case() -> FamilyCase:
    case = torch.load(GOLDEN / "detr_reference.pt", weights_only=True)[0]
    objects = targets_per_image(case)
    return FamilyCase(
        lambda: build_detr(case),
        lambda: (detr_images(case), objects),
        lambda: [(detr_images(case, i), [objects[i]]) for i in range(len(objects))],
    )


def _decoder_case(arch: str, build: Callable[[str], torch.nn.Module] = build_llm, tolerance: float = 1e-9) -> FamilyCase:
    """A right-padded batch of three prompts (a padded batch's columns start with each row's own tokens)."""
    return FamilyCase(lambda: build(arch), lambda: (llm_batch("right"), None),
                      lambda: [(llm_batch(f"single{row}"), None) for row in range(3)], tolerance)


#: GLM-4.5's and DeepSeek-V3's routers compute in float32 (transformers' own), Llama 4's rotation and router too: a
#: gradient through them differs between a batch and a row alone by about 1e-7 of the map, in autograd's own input x
#: gradient too; HunYuan's query and key norms compute in float32 after the rotation (about 1e-8: generic attention's
#: 9.4e-9 measured)
_DECODER_TOLERANCE = {"glm4_moe": 1e-6, "deepseek_v3": 1e-6, "llama4": 1e-6, "hunyuan_v1_dense": 1e-7}


def _run_once(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model after one plain forward of its own: transformers adds its own output-recording hooks to a vision
    tower on its first forward (LLaVA reads a hidden layer), which the contract must not take for relevancy's."""
    with torch.no_grad():
        model(**inputs)
    return model


def _vision_language_case(family: str) -> FamilyCase:
    """Two right-padded prompts, each with its image. Gemma's RMSNorms (Gemma 3's, PaliGemma's Gemma and Gemma 2) compute in float32 even in a float64 model
    (also the projector's, on the image's features), which turns a batch's 1e-16 differences of summation order into
    1e-8 ones: its batch is held to 1e-7 (padded rows equal lxt's single ones to 1e-6 in test_vision_language.py), and
    to 1e-6 under the paper's LRP rules (transformer attribution's tower map: 2.4e-7 of its maximum measured)."""
    gemma = family in ("gemma3", "paligemma", "paligemma2")
    return FamilyCase(lambda: _run_once(build_vlm(family), vlm_inputs(family)), lambda: (vlm_inputs(family), None),
                      lambda: [(alone(vlm_inputs(family), row), None) for row in range(2)], 1e-7 if gemma else 1e-9, 1e-6 if gemma else None)


def _qwen_vl_case(family: str) -> FamilyCase:
    """Two right-padded prompts, each with its image (one patch grid for the batch); each row alone with its own
    patches and grid."""
    return FamilyCase(lambda: build_qwen_vl(family), lambda: (qwen_inputs(family), None),
                      lambda: [(qwen_alone(qwen_inputs(family), row), None) for row in range(2)], 1e-9)


class GatedAttention(Attention):
    """timm's attention with its sigmoid output gate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, gated=True, **kwargs)


FAMILIES: dict[str, FamilyCase] = {
    "timm_vit": _image_case(lambda: tiny_vit().double()),
    "timm_vit_gated_attention": _image_case(lambda: tiny_vit(attn_layer=GatedAttention).double()),
    "timm_vit_swiglu": _image_case(lambda: tiny_vit(mlp_layer=SwiGLU).double()),
    "timm_swin": _image_case(tiny_swin),
    "timm_swinv2": _image_case(tiny_swinv2),
    "hf_swin": _image_case(lambda: hf_swin_from(tiny_swin())),
    "hf_swinv2": _image_case(lambda: hf_swinv2_from(tiny_swinv2())),
    "hf_vit": _image_case(lambda: tiny_hf("vit", dtype=torch.float64)),
    "hf_dinov2_swiglu": _image_case(lambda: tiny_dinov2_swiglu(torch.float64), size=42),
    "hf_bert": _text_case("bert"),
    "hf_roberta": _text_case("roberta"),
    "hf_distilbert": _text_case("distilbert"),
    "clip_open_clip": _clip_case("open_clip"),
    "clip_transformers": _clip_case("transformers"),
    "lxmert": _bimodal_case("lxmert"),
    "visual_bert": _bimodal_case("visualbert"),
    "detr": _detr_case(),
    "causal_lm_llama": _decoder_case("llama"),
    "causal_lm_gpt2": _decoder_case("gpt2"),
    **{f"causal_lm_{family}": _decoder_case(family, build_decoder, _DECODER_TOLERANCE.get(family, 1e-9)) for family in DECODER_FAMILIES},
    # Falcon-H1's gated norm and its scan compute in float32 in its own forward (transformers'): a batch's rows differ
    # from the rows alone by about 6e-7 of the map in autograd's own input x gradient
    **{f"state_space_{family}": _decoder_case(family, build_state_space, 1e-6 if family == "falcon_h1" else 1e-9)
       for family in STATE_SPACE_FAMILIES},
    # transformers computes the delta rule and the norms in float32 even in a float64 model: autograd's own input x
    # gradient differs between a batch and a row alone by about 1e-7 of the map (1.01e-7 measured)
    **{f"hybrid_{family}": _decoder_case(family, build_hybrid, 1e-6) for family in HYBRID_FAMILIES},
    # LFM2's norms compute in float32 in its own forward (transformers'): its input x gradient too
    **{f"hybrid_{family}": _decoder_case(family, build_conv_hybrid, 1e-6) for family in CONV_HYBRID_FAMILIES},
    **{f"vision_language_{family}": _vision_language_case(family) for family in {**VLM_FAMILIES, **TILED_VLM_FAMILIES, **SIZED_VLM_FAMILIES, **INTERN_TILED}},
    **{f"vision_language_{family}": _qwen_vl_case(family) for family in QWEN_VL_FAMILIES},
}
