"""timm's Swin Transformer (V1, V2), and transformers' with the same weights, against a float64 reference written
with full matrices: every block's attention a `(N, N)` token matrix of its stage in image coordinates (zero outside
the windows, each shifted window's mask and the relative position bias placed through the shift's permutation
matrix), each patch merging a matrix from the finer grid's tokens to the coarser. The reference reads the model's
own modules (qkv, the bias table and index, norms, MLPs, the merge's Linear) and none of the Swin family's code; its
LRP passes run the library's rules (the engine's operations, `attend` over the full matrix), so what is checked is
the family's windows, shifts, merges and pooled readout. Single and batched; the model unchanged after, also after
an exception; refusals named; AttnLRP, CP-LRP and input x gradient the same in both libraries."""
from __future__ import annotations

import functools
import math
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.swin_transformer_v2 import SwinTransformerV2
from torch import nn

import relevancy
from relevancy.families import adapter_for
from relevancy.lrp import PAPER, VANILLA, relevance_session
from relevancy.lrp import engine
from relevancy.lrp.attention import attend
from relevancy.lrp.engine import GRADIENT, RELEVANCE
from bimodal_golden import assert_same, snapshot
from models import hf_swin_from, hf_swinv2_from, tiny_swin, tiny_swinv2

TOLERANCE = 1e-10  # float64: the same sums in another order


def images(count: int = 2) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


# -- the reference: full matrices ------------------------------------------------------------------------------
def shift_permutation(height: int, width: int, shift: tuple[int, int]) -> torch.Tensor:
    """`P` `(N, N)`: `P @ x` is the grid rolled by `-shift` (token `t` of the rolled grid is the image's token at
    `t`'s place plus the shift)."""
    perm = torch.zeros(height * width, height * width, dtype=torch.float64)
    for r in range(height):
        for c in range(width):
            perm[r * width + c, ((r + shift[0]) % height) * width + (c + shift[1]) % width] = 1
    return perm


def window_scores(block: nn.Module, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(additive, inside)`: in image coordinates, the relative position bias plus the shifted windows' mask `(heads,
    N, N)` (0 outside the windows), and where two tokens share a window `(N, N)` bool. Written in the rolled grid's
    coordinates from the paper's definition and carried to the image's through the shift's permutation matrix."""
    (wh, ww), shift = tuple(block.window_size), tuple(block.shift_size)
    attn = block.attn
    n = height * width
    rows, cols = torch.arange(n) // width, torch.arange(n) % width
    window = (rows // wh) * (width // ww) + cols // ww
    place = (rows % wh) * ww + cols % ww
    same = window[:, None] == window[None, :]
    if hasattr(attn, "cpb_mlp"):  # V2: 16 sigmoid of the continuous position bias's MLP at each relative offset
        offsets = 16 * torch.sigmoid(attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads))
    else:
        offsets = attn.relative_position_bias_table
    table = offsets[attn.relative_position_index[place[:, None], place[None, :]]]  # (N, N, heads)
    additive = table.permute(2, 0, 1) * same
    if any(shift):
        def region(index: torch.Tensor, size: int, w: int, s: int) -> torch.Tensor:
            return (index >= size - w).long() + (index >= size - s).long()
        regions = region(rows, height, wh, shift[0]) * 3 + region(cols, width, ww, shift[1])
        additive = additive + (-100.0) * (same & (regions[:, None] != regions[None, :]))
    perm = shift_permutation(height, width, shift)
    image_additive = perm.T @ additive @ perm
    inside = (perm.T @ same.double() @ perm) > 0
    return image_additive, inside


def merge_selections(height: int, width: int) -> list[torch.Tensor]:
    """The four `(N / 4, N)` 0/1 matrices of patch merging's concatenation, in timm's order (rows, then columns, of
    each 2 x 2 group: (0, 0), (1, 0), (0, 1), (1, 1))."""
    selections = []
    for dc in (0, 1):
        for dr in (0, 1):
            s = torch.zeros(height * width // 4, height * width, dtype=torch.float64)
            for i in range(height // 2):
                for j in range(width // 2):
                    s[i * (width // 2) + j, (2 * i + dr) * width + 2 * j + dc] = 1
            selections.append(s)
    return selections


def reference_forward(model: nn.Module, pixels: torch.Tensor, session=None, zero: int | None = None) -> dict:
    """The model's computation with full matrices: logits, every block's attention `(B, heads, N, N)`, the tokens
    entering the last attention, each block's grid and the merge matrices `(N_coarse, N_fine)` (each coarse token
    the mean of its four). `zero`: a patch token set to 0 after the embedding (token ablation). V2: cosine attention
    (q, k normalised, the clamped logit scale), post-norm blocks, the merge's norm after its reduction."""
    v2 = isinstance(model, SwinTransformerV2)
    tokens = model.patch_embed(pixels)
    batch, height, width, channels = tokens.shape
    x = tokens.reshape(batch, height * width, channels)
    if zero is not None:
        x = x.clone()
        x[:, zero] = 0
    attentions, grids, merges, last_input = [], [], [], None
    for stage in model.layers:
        if not isinstance(stage.downsample, nn.Identity):
            selections = merge_selections(height, width)
            merges.append(sum(selections) / 4)
            x = torch.cat([s @ x for s in selections], -1)
            merge = stage.downsample
            x = merge.norm(merge.reduction(x)) if v2 else merge.reduction(merge.norm(x))
            height, width = height // 2, width // 2
        for block in stage.blocks:
            attn = block.attn
            additive, inside = window_scores(block, height, width)
            mask = additive.masked_fill(~inside, float("-inf"))
            x = engine.branch(session, x)
            attended = x if v2 else block.norm1(x)
            last_input = attended
            if v2:
                bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
                qkv = engine.linear(session, lambda t: F.linear(t, attn.qkv.weight, bias), attended, attn.qkv.weight)
            else:
                qkv = attn.qkv(attended)
            q, k, v = qkv.reshape(batch, height * width, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            if v2:
                unit = lambda t: engine.normalisation(session, lambda u: u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12), None, t)  # noqa: E731
                q, k, scale = unit(q), unit(k), attn.logit_scale.clamp(max=math.log(100)).exp()
            else:
                scale = attn.scale
            context, probabilities = attend(session, q, k, v, scale, mask)
            attentions.append(probabilities)
            grids.append((height, width))
            out = attn.proj(context.transpose(1, 2).reshape(batch, height * width, -1))
            x = engine.add(session, x, block.norm1(out) if v2 else out)
            x = engine.branch(session, x)
            x = engine.add(session, x, block.norm2(block.mlp(x)) if v2 else block.mlp(block.norm2(x)))
    pooled = engine.mean_tokens(session, model.norm(x))
    return {"logits": model.head.fc(pooled), "attentions": attentions, "last_input": last_input, "grids": grids,
            "merges": merges, "pixels": pixels}


def reference_rule_map(model: nn.Module) -> dict:
    """The rules of the operations the reference calls (Linear, LayerNorm and timm's subclass of it, GELU and timm's
    own, the pixel convolution); every other module of the model is a container here (the reference calls none of
    their forwards)."""
    from timm.layers.activations import GELU

    rules = {**engine.default_leaves(), nn.Conv2d: engine.PIXEL_CONV, GELU: engine.ACTIVATION}
    return {**rules, **{type(m): engine.unchanged for m in model.modules() if not isinstance(m, tuple(rules))}}


def chained(model: nn.Module, run: dict, matrices: list[torch.Tensor], identity: bool) -> torch.Tensor:
    """The pooled token's row of `prod (I + M)` (or `prod M`), through the merge matrices, on the first grid: with
    full `(N, N)` products, the joint matrix from the first stage's tokens to the last's."""
    blocks_per_stage = [len(stage.blocks) for stage in model.layers]
    merges = iter(run["merges"])
    joint, index = None, 0
    for stage, depth in zip(model.layers, blocks_per_stage):
        if not isinstance(stage.downsample, nn.Identity):
            joint = next(merges) if joint is None else next(merges) @ joint
            joint = joint.expand(len(matrices[0]), -1, -1)
        for _ in range(depth):
            m = matrices[index]
            if identity:
                m = m + torch.eye(m.shape[-1], dtype=m.dtype)
            joint = m if joint is None else m @ joint
            index += 1
    return joint.mean(1)  # the pooled token: the mean of the last stage's rows


def to_grid(run: dict, row: torch.Tensor) -> torch.Tensor:
    """A row over the last stage's tokens carried to the first grid through the merge matrices (`row @ M`)."""
    for merge in reversed(run["merges"]):
        row = row @ merge
    return row


def score_of(run: dict) -> torch.Tensor:
    logits = run["logits"]
    return logits.gather(1, logits.argmax(1, keepdim=True)).sum()


def reference_maps(model: nn.Module, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every method the family offers, from the full-matrix reference (exact=True for the LRP-based methods)."""
    maps = {}
    with torch.enable_grad():
        run = reference_forward(model, pixels)
        attentions = run["attentions"]
        grads = torch.autograd.grad(score_of(run), attentions + [run["last_input"]])
    attentions, last_input = [a.detach() for a in attentions], run["last_input"].detach()
    last, last_grad = attentions[-1], grads[-2]
    inside = last != 0  # the windows' entries (the shifted mask's -100 leaves positive probabilities)
    means = [a.mean(1) for a in attentions]
    maps["raw_attention"] = to_grid(run, means[-1].mean(1))
    rolled = [(m + torch.eye(m.shape[-1], dtype=m.dtype)) / (m + torch.eye(m.shape[-1], dtype=m.dtype)).sum(-1, keepdim=True)
              for m in means]
    maps["rollout"] = chained(model, run, rolled, identity=False)
    pooled = torch.full((last.shape[-1],), 1 / last.shape[-1], dtype=torch.float64)
    cam = pooled @ last  # (B, H, N)
    weights = (pooled @ (last_grad * inside)).mean(-1, keepdim=True)
    maps["attention_gradcam"] = to_grid(run, (weights * cam).mean(1).clamp(min=0))
    maps["generic_attention"] = chained(model, run, [(g * a).clamp(min=0).mean(1) for g, a in zip(grads, attentions)], identity=True)
    maps["cdam"] = to_grid(run, (last_input * grads[-1]).sum(-1))
    for rule_set, method in ((PAPER, "transformer_attribution"), (VANILLA, "partial_lrp"), (VANILLA, "lrp")):
        leaf = pixels.detach().requires_grad_(True)
        with relevance_session(model, reference_rule_map(model), rule_set.with_exact(True)) as session, torch.enable_grad():
            run = reference_forward(model, leaf, session)
            recorded = list(session.attentions)
            seed = torch.ones((), dtype=torch.float64)
            if method == "transformer_attribution":
                gradients = session.backward(GRADIENT, score_of(run), recorded, seed)
                relevances = session.backward(RELEVANCE, score_of(run), recorded, seed)
                matrices = [(g * r).clamp(min=0).mean(1) for g, r in zip(gradients, relevances)]
                maps[method] = chained(model, run, matrices, identity=True)
            elif method == "partial_lrp":
                (relevance,) = session.backward(RELEVANCE, score_of(run), recorded[-1:], seed)
                maps[method] = to_grid(run, relevance.clamp(min=0).mean(1).mean(1))
            else:
                (relevance,) = session.backward(RELEVANCE, score_of(run), [leaf], seed)
                maps[method] = relevance.sum(1)
    with torch.no_grad():
        full = reference_forward(model, pixels)["logits"]
        target = full.argmax(1)
        height, width = run["grids"][0]
        score = full.gather(1, target[:, None])[:, 0]
        drops = [score - reference_forward(model, pixels, zero=i)["logits"].gather(1, target[:, None])[:, 0]
                 for i in range(height * width)]
    maps["token_ablation"] = torch.stack(drops, 1)
    return maps


METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution", "partial_lrp",
           "lrp", "cdam", "token_ablation")
LRP_BASED = ("transformer_attribution", "partial_lrp", "lrp")
MODEL = tiny_swin()
HF_MODEL = hf_swin_from(MODEL)  # transformers' Swin with timm's weights: the same reference
V2_MODEL = tiny_swinv2()
HF_V2_MODEL = hf_swinv2_from(V2_MODEL)  # transformers' Swin V2 with timm V2's weights
MODELS = {"timm": MODEL, "transformers": HF_MODEL, "timm_v2": V2_MODEL, "transformers_v2": HF_V2_MODEL}
# whose modules the reference reads
REFERENCE_OF = {"timm": "timm", "transformers": "timm", "timm_v2": "timm_v2", "transformers_v2": "timm_v2"}
HF_OF = {"timm": ("transformers", hf_swin_from), "timm_v2": ("transformers_v2", hf_swinv2_from)}  # timm's -> transformers'


@functools.cache
def reference(library: str = "timm") -> dict[str, torch.Tensor]:
    return reference_maps(MODELS[REFERENCE_OF[library]], images())


def explained(method: str, pixels: torch.Tensor, model: nn.Module = MODEL, **options) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # conservation notes of random weights
        options = {"exact": True, **options} if method in LRP_BASED else options
        return relevancy.explain(model, pixels, method=method, **options).scores


@pytest.mark.parametrize("library", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_each_method_equals_the_full_matrix_reference_single_and_batched(method, library):
    model = MODELS[library]
    expected = reference(library)[method].reshape(2, *explained(method, images()[:1], model).shape[1:])
    batched = explained(method, images(), model)
    scale = expected.abs().max().item()
    assert scale > 0
    error = (batched - expected).abs().max().item()
    assert error <= TOLERANCE * scale, f"{method}: max error {error:.3g} of {scale:.3g}"
    for row in range(2):
        alone = explained(method, images()[row:row + 1], model)
        assert (alone[0] - expected[row]).abs().max().item() <= TOLERANCE * scale, f"{method} row {row} alone"


def test_the_readout_is_the_pooled_token_and_maps_are_on_the_first_grid():
    adapter = adapter_for(MODEL)
    (stream,) = adapter.streams(images()).values()
    assert stream.readout is None and stream.pooled and stream.grid == (8, 8)
    assert [w.shape for w in stream.layout.windows] == [(16, 4), (16, 4), (4, 4), (4, 4)]
    assert [m is None for m in stream.layout.merges] == [True, True, False, True]
    assert explained("rollout", images()).shape == (2, 8, 8)


def test_the_default_rules_run_finite():
    for method in LRP_BASED:
        assert torch.isfinite(explained(method, images(), exact=False)).all(), method


def assert_unchanged_by_a_failure_inside(model: torch.nn.Module, module: torch.nn.Module, before: dict) -> None:
    """An error raised inside `module`'s forward reaches the caller of two methods, and `model` is as `before`."""
    def fail(*_args):
        raise RuntimeError("inside the forward")

    handle = module.register_forward_hook(fail)
    try:
        for method in ("generic_attention", "transformer_attribution"):
            with pytest.raises(RuntimeError, match="inside the forward"):
                relevancy.explain(model, images(), method=method)
    finally:
        handle.remove()
    assert_same(before, snapshot(model))


def test_model_unchanged_after_success_and_after_an_exception():
    model = tiny_swin()
    model.train()
    for block in adapter_for(model).blocks:
        block.attn.fused_attn = True
    before = snapshot(model)
    for method in ("rollout", "transformer_attribution", "lrp", "cdam"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            relevancy.explain(model, images(), method=method)
        assert_same(before, snapshot(model))
    assert all(block.attn.fused_attn for block in adapter_for(model).blocks) and model.training

    assert_unchanged_by_a_failure_inside(model, model.layers[-1].blocks[-1].mlp, before)
    assert all(block.attn.fused_attn for block in adapter_for(model).blocks) and model.training


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="region='matrix'"):
        relevancy.explain(MODEL, images(), method="attention_gradcam", region="matrix")
    with pytest.raises(relevancy.families.UnsupportedModelError, match="merges its tokens"):
        relevancy.explain(MODEL, images(), method="generic_attention", checkpoint=True)
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\)"):
        relevancy.explain(MODEL, torch.zeros(1, 3, 48, 48, dtype=torch.float64), method="rollout")
    with pytest.raises(ValueError, match="latent= is for decoder language models only"):
        relevancy.explain(MODEL, images(), method="attnlrp", latent="layers")


def test_a_grid_the_windows_do_not_divide_is_refused():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4, embed_dim=8,
                              depths=(2, 2), num_heads=(2, 2), window_size=2, num_classes=5, strict_img_size=False).double()
    with pytest.raises(ValueError, match="not a multiple of its 2 x 2 windows"):
        relevancy.explain(model, torch.zeros(1, 3, 40, 40, dtype=torch.float64), method="rollout")


@pytest.mark.parametrize("timm_name", HF_OF)
def test_transformers_swin_computes_timms_logits_and_is_handed_back_unchanged(timm_name):
    hf_name, hf_from = HF_OF[timm_name]
    assert (MODELS[hf_name](pixel_values=images()).logits - MODELS[timm_name](images())).abs().max().item() < 1e-12
    model = hf_from(MODELS[timm_name])
    model.config._attn_implementation = "sdpa"
    model.train()
    before = snapshot(model)
    for method in ("rollout", "lrp", "token_ablation"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            relevancy.explain(model, images(), method=method)
    assert_same(before, snapshot(model))
    assert model.config._attn_implementation == "sdpa" and model.training

    assert_unchanged_by_a_failure_inside(model, model.base_model.encoder.layers[-1].blocks[-1].layernorm_after, before)
    assert model.config._attn_implementation == "sdpa" and model.training


@pytest.mark.parametrize("timm_name", HF_OF)
@pytest.mark.parametrize("method", ("attnlrp", "cp_lrp", "input_x_gradient"))
def test_transformers_swin_gives_timms_maps_under_the_gradient_rule_sets(method, timm_name):
    """The encoders' AttnLRP, CP-LRP and input x gradient: one set of weights, the same map in both libraries."""
    expected = explained(method, images(), MODELS[timm_name])
    scale = expected.abs().max().item()
    assert scale > 0
    assert (explained(method, images(), MODELS[HF_OF[timm_name][0]]) - expected).abs().max().item() <= TOLERANCE * scale


@pytest.mark.parametrize("library", ("transformers", "transformers_v2"))
def test_transformers_swin_refuses_what_it_would_pad(library):
    model = MODELS[library]
    with pytest.raises(ValueError, match="multiple of 4"):
        relevancy.explain(model, torch.zeros(1, 3, 30, 32, dtype=torch.float64), method="rollout")
    with pytest.raises(ValueError, match="stage 0's 5 x 8 grid is not a multiple of its 2 x 2 windows"):
        relevancy.explain(model, torch.zeros(1, 3, 20, 32, dtype=torch.float64), method="rollout")
    with pytest.raises(ValueError, match="stage 1's 5 x 4 grid is not a multiple of its 2 x 2 windows"):
        relevancy.explain(model, torch.zeros(1, 3, 40, 32, dtype=torch.float64), method="rollout")
