"""Hugging Face vision transformers (ViT, DeiT, DINOv2, DINOv2 with registers): every method on every layout, the
same maps as timm for the same weights, image sizes, and the model handed back as it was."""
from __future__ import annotations

import pytest
import torch

import relevancy
from relevancy.methods import capture
from relevancy.families import adapter_for
from relevancy.families.hf_attention import EXACT_ATTENTION
from relevancy.lrp import engine
from relevancy.families.base import SEED_METHODS
from hf_vit_models import BUILDERS, NATIVE, TWINS, timm_twin, tiny_hf
from test_model_unchanged import assert_same, snapshot

LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp")


def images(kind: str, batch: int = 2, size: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    height, width = size or (NATIVE[kind][0],) * 2
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(2), dtype=dtype)


@pytest.mark.parametrize("method", SEED_METHODS)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_every_method_on_every_layout(kind, method):
    model = tiny_hf(kind)
    size, patch = NATIVE[kind]
    expl = relevancy.explain(model, images(kind), method=method, target=[0, 3])
    expected = (2, size, size) if method == "lrp" else (2, size // patch, size // patch)
    assert tuple(expl.scores.shape) == expected
    assert torch.isfinite(expl.scores).all()
    assert tuple(expl.heatmap().shape) == (2, size, size)
    assert expl.target.tolist() == [0, 3]


@pytest.mark.parametrize("kind, prefix", [("vit", 1), ("vit-model", 1), ("deit", 2), ("deit-teacher", 2), ("dinov2", 1), ("dinov2-reg", 5)])
def test_prefix_tokens_come_from_the_model(kind, prefix):
    stream = adapter_for(tiny_hf(kind)).streams(images(kind))["image"]
    assert stream.prefix_tokens == prefix
    assert stream.readout.tolist() == [0, 0]


@pytest.mark.parametrize("kind, size, grid", [
    ("vit", (48, 64), (6, 8)), ("deit-teacher", (40, 24), (5, 3)), ("dinov2", (56, 70), (4, 5)), ("dinov2-reg", (28, 84), (2, 6)),
])
@pytest.mark.parametrize("method", ["generic_attention", "transformer_attribution", "lrp", "token_ablation"])
def test_other_image_sizes_interpolate_the_position_embeddings(kind, size, grid, method):
    model = tiny_hf(kind)
    batch = images(kind, size=size)
    expl = relevancy.explain(model, batch, method=method, target=1)
    assert tuple(expl.scores.shape) == ((2, *size) if method == "lrp" else (2, *grid))
    assert torch.isfinite(expl.scores).all()
    # the model's own forward at that size gives the explained logits
    with torch.no_grad():
        own = model(pixel_values=batch, **({} if kind.startswith("dinov2") else {"interpolate_pos_encoding": True})).logits
    torch.testing.assert_close(expl.logits, own)


@pytest.mark.parametrize("shape, message", [
    ((1, 3, 30, 32), r"H a multiple of 8 and W a multiple of 8"),
    ((1, 1, 32, 32), r"\(B, 3, H, W\)"),
    ((1, 3, 4, 8), r"got \(1, 3, 4, 8\)"),
])
def test_sizes_the_model_cannot_take_are_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        relevancy.explain(tiny_hf("vit"), torch.randn(shape), method="rollout")


def test_a_batch_gives_the_maps_of_its_images_alone():
    model, batch = tiny_hf("dinov2-reg"), images("dinov2-reg", batch=3)
    for method in SEED_METHODS:
        whole = relevancy.explain(model, batch, method=method, target=[1, 2, 4]).scores
        for i, target in enumerate([1, 2, 4]):
            alone = relevancy.explain(model, batch[i : i + 1], method=method, target=target).scores
            torch.testing.assert_close(whole[i : i + 1], alone, atol=1e-5 * float(alone.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_the_paper_rules_conserve_relevance(kind):
    model = tiny_hf(kind, dtype=torch.float64)
    expl = relevancy.explain(model, images(kind, dtype=torch.float64), method="transformer_attribution", target=[0, 3])
    torch.testing.assert_close(expl.relevance_total, torch.ones(2, dtype=torch.float64), atol=1e-6, rtol=0)  # the rules add 1e-9 to denominators


def test_class_names_come_from_the_config():
    model = tiny_hf("vit")
    model.config.id2label = {i: name for i, name in enumerate(["cat", "cup", "person", "rocket", "tree"])}
    model.config.label2id = {name: i for i, name in model.config.id2label.items()}
    expl = relevancy.explain(model, images("vit"), method="rollout", target=[0, 3])
    assert expl.class_names == ["cat", "cup", "person", "rocket", "tree"]
    assert [label.split(" (")[0] for label in expl.labels()] == ["cat", "rocket"]
    assert relevancy.explain(tiny_hf("dinov2-model"), images("dinov2-model"), method="rollout").class_names is None


# -- the same weights in timm give the same maps ------------------------------------------------------------
@pytest.mark.parametrize("kind", list(TWINS))
def test_timm_and_transformers_give_the_same_maps(kind):
    """float64, every method (the LRP methods in both arithmetics): within 1e-8 of each map's largest magnitude
    (measured: at most 5e-13)."""
    reference, model = timm_twin(kind)
    size = NATIVE[TWINS[kind][1]][0]
    batch = images(kind, batch=3, size=(size, size), dtype=torch.float64)
    for method in SEED_METHODS:
        for options in ([{}, {"exact": True}] if method in LRP_METHODS else [{}]):
            a = relevancy.explain(reference, batch, method=method, target=[0, 3, 1], **options)
            b = relevancy.explain(model, batch, method=method, target=[0, 3, 1], **options)
            worst = float((a.scores - b.scores).abs().max() / a.scores.abs().max())
            assert worst <= 1e-8, (method, options, worst)
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-12)


def test_timm_and_transformers_agree_at_other_sizes_and_on_concepts():
    """DINOv2 with registers interpolates its position embeddings as timm's dynamic size does; a Concept from the
    same examples explains the same."""
    reference, model = timm_twin("dinov2-reg-model")
    batch = images("dinov2-reg", batch=2, size=(56, 70), dtype=torch.float64)
    examples = images("dinov2-reg", batch=4, size=(42, 42), dtype=torch.float64)
    concepts = relevancy.Concept(reference, examples), relevancy.Concept(model, examples)
    torch.testing.assert_close(concepts[0].vector, concepts[1].vector, rtol=0, atol=1e-12)
    for method in SEED_METHODS:
        target = concepts if method in ("cdam", "token_ablation") else (2, 2)
        a = relevancy.explain(reference, batch, method=method, target=target[0]).scores
        b = relevancy.explain(model, batch, method=method, target=target[1]).scores
        assert float((a - b).abs().max() / a.abs().max()) <= 1e-8, method


# -- the model is handed back as it was ---------------------------------------------------------------------
def configuration(model: torch.nn.Module) -> list:
    return [(type(m).__name__, m.config._attn_implementation) for m in model.modules() if hasattr(m, "config")]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["vit", "deit-teacher", "dinov2-reg"])
def test_model_unchanged_after_every_method(kind, implementation):
    model = tiny_hf(kind, attn_implementation=implementation)
    before, attention = snapshot(model), configuration(model)
    for method in SEED_METHODS:
        relevancy.explain(model, images(kind), method=method)
        assert_same(before, snapshot(model))
        assert configuration(model) == attention == [(name, implementation) for name, _ in attention], method


def test_attention_implementation_is_switched_for_the_call_only():
    """Inside the call the attention runs relevancy's exact eager attention (probabilities on the graph), whatever
    the model had, even an implementation that cannot run here (flash attention on a CPU)."""
    model = tiny_hf("vit")
    model.config._attn_implementation = "flash_attention_2"
    seen = []
    handle = model.vit.layers[0].attention.register_forward_hook(lambda m, *_: seen.append(m.config._attn_implementation))
    expl = relevancy.explain(model, images("vit"), method="raw_attention")
    handle.remove()
    assert seen == [EXACT_ATTENTION] and torch.isfinite(expl.scores).all()
    assert model.config._attn_implementation == "flash_attention_2"


def failing(*_args, **_kwargs):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("method", SEED_METHODS)
def test_model_unchanged_after_an_injected_failure(method, monkeypatch):
    model = tiny_hf("dinov2-reg").train()
    before, attention = snapshot(model), configuration(model)
    # fails inside the method, after hooks, patched forwards, the attention switch and eval mode are in place
    monkeypatch.setattr(capture, "target_score", failing)
    monkeypatch.setattr("relevancy.methods.ablation.target_score", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, images("dinov2-reg"), method=method)
    assert_same(before, snapshot(model))
    assert configuration(model) == attention
    assert all(m.training for m in model.modules())


def test_model_unchanged_after_a_failure_in_the_relevance_pass(monkeypatch):
    model = tiny_hf("deit-teacher")
    before = snapshot(model)
    monkeypatch.setattr(engine.rules, "matmul_halved", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, images("deit-teacher"), method="transformer_attribution")
    assert_same(before, snapshot(model))


def test_a_relevance_session_swaps_the_head_operations_for_its_duration_only():
    from relevancy.families.hf_vit.adapter import PLAIN_OPS
    from relevancy.lrp import PAPER, relevance_session

    adapter = adapter_for(tiny_hf("dinov2"))
    with pytest.raises(RuntimeError, match="injected failure"):
        with relevance_session(adapter.model, adapter.relevance_rule_map(), PAPER):
            assert adapter.ops is not PLAIN_OPS
            failing()
    assert adapter.ops is PLAIN_OPS


def test_train_mode_model_is_explained_in_eval_mode():
    model = tiny_hf("vit")
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.5
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    batch = images("vit")
    expected = relevancy.explain(model.eval(), batch, method="generic_attention").scores
    model.train()
    for method in ("generic_attention", "cdam"):
        first = relevancy.explain(model, batch, method=method).scores
        torch.testing.assert_close(first, relevancy.explain(model, batch, method=method).scores)
    torch.testing.assert_close(relevancy.explain(model, batch, method="generic_attention").scores, expected)
    assert all(m.training for m in model.modules())


def test_frozen_models_are_explained():
    model = tiny_hf("dinov2")
    for p in model.parameters():
        p.requires_grad_(False)
    for method in SEED_METHODS:
        assert torch.isfinite(relevancy.explain(model, images("dinov2"), method=method).scores).all(), method
    assert not any(p.requires_grad for p in model.parameters())


def test_half_precision_models_are_explained_without_change():
    model = tiny_hf("vit", dtype=torch.bfloat16)
    before = snapshot(model)
    for method in ("generic_attention", "transformer_attribution", "lrp"):
        assert torch.isfinite(relevancy.explain(model, images("vit"), method=method).scores.float()).all(), method
    assert_same(before, snapshot(model))
