"""Tiny random float64 Qwen2-VL, Qwen2.5-VL (windowed attention in two of four tower blocks) and Qwen3-VL (DeepStack:
two of three tower blocks merged and added after the first two of three decoder layers) and their inputs,
built from fixed seeds and configs (no relevancy import: `benchmarks/qwen_vl_lxt_reference.py` builds the same
models in lxt's venv)."""
from __future__ import annotations

import torch
import transformers
from vlm_models import checksum, padded  # noqa: F401  (the reference's and the tests' one checksum)

VOCAB, IMAGE_TOKEN, VISION_START, VISION_END = 96, 95, 92, 93
PATCH, MERGE, TEMPORAL = 4, 2, 2
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
_SPECIAL = dict(image_token_id=IMAGE_TOKEN, video_token_id=94, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
#: family -> seed (the families of lxt's reference)
FAMILIES = {"qwen2_vl": 30, "qwen2_5_vl": 31, "qwen3_vl": 32}
#: Qwen3-VL-MoE: Qwen3-VL's tower, a Qwen3-MoE decoder (no lxt map of its mixture in lxt 2.1: not in the reference)
SEEDS = {**FAMILIES, "qwen3_vl_moe": 33}
#: the image's patch grid (t, h, w): 4 x 6 patches, 2 x 3 merged tokens; Qwen2.5-VL's 8-pixel windows: one 2 x 2
#: merge group each, the windows ordered apart from the raster
GRID = (1, 4, 6)


def build(family: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The family's tiny model from its seed, every norm's weight drawn at random too, in `dtype`, eval mode."""
    torch.manual_seed(SEEDS[family])
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                      temporal_patch_size=TEMPORAL, in_channels=3, initializer_range=0.2)
        model = transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(text_config=_TEXT, vision_config=vision, **_SPECIAL))
    elif family.startswith("qwen3_vl"):  # a Qwen3 decoder (query and key norms, interleaved multimodal RoPE), 4 x 4 learned positions interpolated
        text = {**_TEXT, "num_hidden_layers": 3, "head_dim": 8, "rope_parameters": {**_TEXT["rope_parameters"], "mrope_interleaved": True}}
        vision = dict(depth=3, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                      temporal_patch_size=TEMPORAL, in_channels=3, num_position_embeddings=16, deepstack_visual_indexes=[0, 1], initializer_range=0.2)
        if family == "qwen3_vl":
            model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **_SPECIAL))
        else:  # 4 experts, 2 a token, in every layer; torch's grouped matrix product (the default) has no float64
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
            config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_SPECIAL)
            config.get_text_config()._experts_implementation = "eager"
            model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    else:
        vision = dict(depth=4, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3, window_size=2 * PATCH * MERGE // 2,
                      fullatt_block_indexes=[1, 3], initializer_range=0.2)
        model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(text_config=_TEXT, vision_config=vision, **_SPECIAL))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and parameter.ndim == 1 and name.endswith("weight"):
                parameter.copy_(torch.randn_like(parameter) * 0.3 + 1.0)
    return model.to(dtype).eval()


def image_tokens(grid: tuple[int, int, int] = GRID) -> int:
    return grid[0] * grid[1] * grid[2] // MERGE ** 2


def inputs(family: str, side: str = "right", lengths: tuple[int, ...] = (5, 3), seed: int = 3,
           grid: tuple[int, int, int] = GRID) -> dict[str, torch.Tensor]:
    """A processor's output for rows of `[1, <vision_start>, the image's placeholders, <vision_end>]` and `lengths`
    text tokens, padded on `side` (pad id 0), one random image of `grid` per row (its flattened patches, each
    image's two temporal copies equal, as the processor repeats an image)."""
    generator = torch.Generator().manual_seed(seed)
    count = image_tokens(grid)
    rows = [torch.cat([torch.tensor([1, VISION_START] + [IMAGE_TOKEN] * count + [VISION_END]), torch.randint(2, 90, (n,), generator=generator)])
            for n in lengths]
    ids, mask = padded(rows, side)
    patches = torch.randn(len(rows) * grid[0] * grid[1] * grid[2], 3, 1, PATCH, PATCH, generator=generator, dtype=torch.float64)
    pixels = patches.expand(-1, -1, TEMPORAL, -1, -1).flatten(1)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": torch.tensor([grid] * len(rows))}


def alone(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """Row `row` of a batch on its own, without its padding."""
    keep = batch["attention_mask"][row].bool()
    count = len(batch["pixel_values"]) // len(batch["input_ids"])
    return {"input_ids": batch["input_ids"][row:row + 1, keep], "attention_mask": batch["attention_mask"][row:row + 1, keep],
            "pixel_values": batch["pixel_values"][row * count:(row + 1) * count], "image_grid_thw": batch["image_grid_thw"][row:row + 1]}
