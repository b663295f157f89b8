"""Make tests/golden/qwen_vl_lxt_reference.pt: lxt's AttnLRP and CP-LRP composed over whole Qwen2-VL, Qwen2.5-VL and
Qwen3-VL models (tiny random, `tests/qwen_vl_models.py`), text and pixel maps, in float64.

    /tmp/lxt/bin/python benchmarks/qwen_vl_lxt_reference.py [--out tests/golden/qwen_vl_lxt_reference.pt]

Run it in a venv with lxt 2.1 (never a dependency of relevancy; see `vlm_lxt_reference.py`). lxt has no Qwen2-VL
map; its rules are composed over the model's own modules as its Qwen2 map and `vlm_lxt_reference.py` compose them:
- the modeling module's attention functions (decoder and tower alike: both call the module's
  `ALL_ATTENTION_FUNCTIONS`, the tower once per image or window of `cu_seqlens`) wrapped by `patch_attention`
  (AttnLRP: queries and keys 1/4, values 1/2) or `patch_cp_attention` (CP-LRP: queries and keys detached);
- the decoder's `Qwen2MLP` by `gated_mlp_forward` / `cp_gated_mlp_forward`, its RMSNorm by `rms_norm_forward`;
- Qwen2-VL's tower: `torch.nn.LayerNorm` (blocks and merger) by `layer_norm_forward`, QuickGELU (the blocks' MLP)
  and GELU (the merger's MLP) by `non_linear_forward` (the identity rule); Qwen2.5-VL's tower: its RMSNorm (the same
  class as the decoder's) by `rms_norm_forward`, its SwiGLU MLP (`Qwen2_5_VLMLP`) by `gated_mlp_forward` /
  `cp_gated_mlp_forward`, the merger's GELU by `non_linear_forward`;
- Qwen3-VL: the decoder by lxt's Qwen3 map on Qwen3-VL's own classes (`Qwen3VLTextMLP` by `gated_mlp_forward` /
  `cp_gated_mlp_forward`, `Qwen3VLTextRMSNorm`, the query and key norms among them, by `rms_norm_forward`); the
  tower's `torch.nn.LayerNorm` (blocks, merger, the DeepStack mergers' norm over 2 x 2 tokens side by side) by
  `layer_norm_forward` and its tanh GELU (`GELUTanh`, the blocks' MLP) and the mergers' GELU by `non_linear_forward`;
  the DeepStack features added to the decoder's hidden states as the model adds them (a sum: no rule);
- the rotations (the tower's 2-D one, the decoder's multimodal one) are left as the model computes them: a
  constant linear map whose gradient passes relevance coordinate by coordinate.
The model (float64, eval, attention through transformers' `sdpa`) runs its own forward from `input_ids`,
`pixel_values`, `image_grid_thw` and `mm_token_type_ids` (its own 3-D positions), the token embeddings made a leaf by
a hook on the embedding's output; each row's target is the plain model's most probable next token after its last
real token. The maps: input x gradient summed over the width at the embeddings `(B, T)`, and at the flattened
patches `(B, h * w, C * T * P * P)` as the processor orders them (laid on the pixels by the test, with the image
processor's own `patchify`). Inputs: two rows padded right and left, and each row alone; padded rows equal single
ones to 1e-10 (checked). The file holds the models' checksums, the inputs, the targets and the maps.
"""
from __future__ import annotations

import importlib
import sys
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from llm_lxt_reference import last_real, lxt_applied, lxt_models, write_golden  # noqa: E402
from qwen_vl_models import FAMILIES, IMAGE_TOKEN, alone, build, checksum, inputs  # noqa: E402
from vlm_lxt_reference import batches, out_path, recorded, sdpa_models  # noqa: E402
from vlm_models import embedding_leaf  # noqa: E402

VARIANTS = {"attnLRP": "attnlrp", "cp_LRP": "cp_lrp"}


def patch_map(family: str, variant: str) -> tuple[object, dict]:
    """The modeling module and lxt's patches composed over its modules (module docstring)."""
    lxt_models("qwen2")  # lxt.efficient entered as a bare namespace
    from lxt.efficient.patches import (cp_gated_mlp_forward, gated_mlp_forward, layer_norm_forward, non_linear_forward,
                                       patch_attention, patch_cp_attention, patch_method, rms_norm_forward)
    from transformers import activations

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    attn = variant == "attnLRP"
    mlp = partial(patch_method, gated_mlp_forward if attn else cp_gated_mlp_forward)
    identity = partial(patch_method, non_linear_forward, keep_original=True)
    norms = {torch.nn.LayerNorm: partial(patch_method, layer_norm_forward)}
    patches = {module: patch_attention if attn else patch_cp_attention, torch.nn.GELU: identity}
    if family == "qwen2_vl":
        patches.update({module.Qwen2MLP: mlp, module.Qwen2VLRMSNorm: partial(patch_method, rms_norm_forward), **norms,
                        activations.QuickGELUActivation: identity})
    elif family == "qwen2_5_vl":
        patches.update({module.Qwen2MLP: mlp, module.Qwen2_5_VLRMSNorm: partial(patch_method, rms_norm_forward), module.Qwen2_5_VLMLP: mlp})
    else:
        patches.update({module.Qwen3VLTextMLP: mlp, module.Qwen3VLTextRMSNorm: partial(patch_method, rms_norm_forward), **norms,
                        activations.GELUTanh: identity})
    return module, patches


def run(model: torch.nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor | None):
    """`(logits at each row's last real token, text map (B, T), patch map (B, h * w, C * T * P * P))`; with `target`
    None no backward."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pixels = batch["pixel_values"].clone().requires_grad_(True)
    with embedding_leaf(model) as leaf:
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=batch["image_grid_thw"], attention_mask=mask,
                       mm_token_type_ids=(ids == IMAGE_TOKEN).int(), use_cache=False).logits
    logits = logits[torch.arange(len(ids)), last_real(mask)]
    if target is None:
        return logits.detach(), None, None
    logits.gather(1, target[:, None]).sum().backward()
    text = (leaf["text"] * leaf["text"].grad).sum(-1).detach()
    return logits.detach(), text, (pixels * pixels.grad).detach().view(len(ids), -1, pixels.shape[-1])


def main() -> None:
    out = out_path(__doc__, "qwen_vl_lxt_reference.pt")
    import transformers

    golden: dict = {"transformers": transformers.__version__, "models": {}}
    for family, model in sdpa_models(FAMILIES, build):
        data = batches(family, inputs, alone)
        entry = {"checksum": checksum(model), "inputs": data,
                 "targets": {name: run(model, batch, None)[0].argmax(-1) for name, batch in data.items()}}
        for variant, key in VARIANTS.items():
            module, patches = patch_map(family, variant)
            with ExitStack() as stack:
                stack.enter_context(lxt_applied(module, patches))
                maps = {name: run(model, batch, entry["targets"][name])[1:] for name, batch in data.items()}
            entry[key] = recorded(family, variant, data, maps)
        golden["models"][family] = entry
    write_golden(golden, out)


if __name__ == "__main__":
    main()
