"""Hostile probes of round 4 (issue 44 item 8): explained scores from a user's callable (integers, detached, Python
numbers, wrong shapes, NaN, infinity), a result's rows and spans (numpy integers, arrays, out-of-range rows),
`exclude`, saving and loading (hostile paths, round trips), vision-language decoders (placeholder counts, images),
`register_method`, latent relevance options and non-finite inputs. Each gets a one-line error naming the argument and
what it takes, and writes nothing; or the right result. The tiny float64 Llama of test_causal_lm and the tiny LLaVA,
Gemma 3 and Idefics3 of vlm_models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from language_models import build
from PIL import Image
from test_probes_decoders import one_line
from vlm_models import IMAGE_TOKEN, build as build_vlm, inputs as vlm_inputs
from vlm_processor import picture, processor

import relevancy
from relevancy.core.files import OutputError
from relevancy.families import BUILT_IN, CausalLMAdapter, TimmViTAdapter
from relevancy.methods import REGISTRY, Method, register_method

IDS = torch.tensor([[1, 5, 9, 13, 2, 7], [3, 8, 6, 10, 12, 14]])
#: the methods that take the explained score's gradient, and those that read it only
GRADIENT_METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "generic_attention", "attention_gradcam", "transformer_attribution", "lrp")
READING_METHODS = ("raw_attention", "rollout", "token_ablation")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("llama")


@pytest.fixture(scope="module")
def explanation(model):
    return relevancy.explain(model, IDS, method="attnlrp")


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    return build_vlm("llava")


# -- explained scores from a user's callable ------------------------------------------------------------------
BAD_TARGETS = {
    "argmax": (lambda logits: logits.argmax(-1), TypeError, ("target=f(logits) must return floating point scores", "torch.int64")),
    "comparison": (lambda logits: logits[:, 3] > 0, TypeError, ("floating point scores", "torch.bool")),
    "python float": (lambda logits: logits[0, 3].item(), TypeError, ("torch tensor of shape (2,)", "got float", ".item()")),
    "numpy": (lambda logits: logits[:, 3].detach().numpy(), TypeError, ("torch tensor of shape (2,)", "got ndarray")),
    "list": (lambda logits: [1.0, 2.0], TypeError, ("torch tensor of shape (2,)", "got list")),
    "two per row": (lambda logits: logits[:, 3:5], ValueError, ("one score per row, a tensor of shape (2,); got shape (2, 2)",)),
    "one for all": (lambda logits: logits[:, 3].sum(), ValueError, ("got shape ()",)),
    "NaN": (lambda logits: logits[:, 3] * float("nan"), ValueError, ("explained score is NaN or infinite for rows 0, 1", "target=f(logits)")),
    "infinity": (lambda logits: logits[:, 3] + torch.tensor([0.0, float("inf")], dtype=logits.dtype), ValueError,
                 ("NaN or infinite for row 1 ",)),
}


@pytest.mark.parametrize("kind", BAD_TARGETS)
@pytest.mark.parametrize("method", ("attnlrp", "generic_attention", "token_ablation"))
def test_a_bad_callable_target_is_named(model, method, kind):
    target, error_type, words = BAD_TARGETS[kind]
    with pytest.raises(error_type) as error:
        relevancy.explain(model, IDS, method=method, target=target)
    one_line(error, *words)


@pytest.mark.parametrize("method", GRADIENT_METHODS)
def test_a_detached_target_is_named_where_a_gradient_is_taken(model, method):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, IDS, method=method, target=lambda logits: logits[:, 3].detach())
    one_line(error, "target=f(logits) returned scores detached from the model's output", ".detach()", "torch.no_grad()")


@pytest.mark.parametrize("method", READING_METHODS)
def test_a_detached_target_is_read_where_no_gradient_is_taken(model, method):
    detached = relevancy.explain(model, IDS, method=method, target=lambda logits: logits[:, 3].detach())
    attached = relevancy.explain(model, IDS, method=method, target=lambda logits: logits[:, 3])
    assert torch.equal(detached.scores, attached.scores) and detached.target.tolist() == [-1, -1]


BAD_SCORES = {
    "ids": (lambda logits, ids: ids, TypeError, ("score=f(logits, ids) must return floating point scores", "torch.int64")),
    "detached": (lambda logits, ids: logits.gather(1, ids[:, None])[:, 0].detach(), ValueError, ("score=f(logits, ids) returned scores detached",)),
    "list": (lambda logits, ids: [0.0] * len(ids), TypeError, ("score=f(logits, ids) must return a torch tensor of shape (2,)", "one score per explained token")),
    "one for all": (lambda logits, ids: logits.sum(), ValueError, ("one score per explained token, a tensor of shape (2,); got shape ()",)),
    "NaN": (lambda logits, ids: logits[:, 0] * float("nan"), ValueError, ("NaN or infinite for explained tokens 0, 1", "score=f(logits, ids)")),
}


@pytest.mark.parametrize("kind", BAD_SCORES)
def test_a_bad_score_callable_is_named(model, kind):
    score, error_type, words = BAD_SCORES[kind]
    with pytest.raises(error_type) as error:
        relevancy.explain(model, IDS, method="attnlrp", target=7, score=score)
    one_line(error, *words)


@pytest.mark.parametrize("target, error_type, words", [
    (lambda logits: logits[:, 3].detach(), ValueError, ("detached from the model's output",)),
    (lambda logits: logits.argmax(-1), TypeError, ("floating point scores", "torch.int64")),
])
@pytest.mark.parametrize("method", ("attnlrp", "generic_attention"))
def test_a_bad_target_on_a_vision_language_decoder_is_named(llava, method, target, error_type, words):
    with pytest.raises(error_type) as error:
        relevancy.explain(llava, vlm_inputs("llava"), method=method, target=target)
    one_line(error, "target=f(logits)", *words)


@pytest.mark.parametrize("tokens", (np.array([3, 4]), torch.tensor([3, 4]), (np.int64(3), np.int16(4))))
def test_a_span_of_array_or_numpy_ids_equals_the_list(model, tokens):
    listed = relevancy.explain(model, IDS, method="attnlrp", target=relevancy.Span([3, 4]))
    given = relevancy.explain(model, IDS, method="attnlrp", target=relevancy.Span(tokens))
    assert torch.equal(given.scores, listed.scores) and torch.equal(given.span.scores, listed.span.scores)


@pytest.mark.parametrize("tokens, error_type, said", [
    (torch.tensor([1.5]), TypeError, "a Span of token ids as a tensor or array is 1-D integers, got shape (1,) of torch.float32"),
    (torch.tensor([[1, 2]]), TypeError, "got shape (1, 2) of torch.int64"),
    (torch.tensor(3), TypeError, "got shape () of torch.int64"),
    (np.array([True, False]), TypeError, "got shape (2,) of bool"),
    (None, TypeError, "a Span is a text (a non-empty str) or token ids (a non-empty list of ints), got None"),
    (torch.tensor([], dtype=torch.long), ValueError, "a Span needs at least one token id or a non-empty text"),
])
def test_a_bad_span_is_refused_where_it_is_made(tokens, error_type, said):
    with pytest.raises(error_type) as error:
        relevancy.Span(tokens)
    one_line(error, said)


# -- a result's rows and spans ---------------------------------------------------------------------------------
@pytest.mark.parametrize("integer", (np.int64, np.int32, np.uint16))
def test_spans_take_numpy_integers(explanation, integer):
    assert explanation.spans(integer(1), [(integer(0), integer(3)), (integer(3), integer(7))]) == explanation.spans(1, [(0, 3), (3, 7)])


@pytest.mark.parametrize("array", (np.array([[0, 3], [3, 7]]), torch.tensor([[0, 3], [3, 7]])))
def test_spans_take_an_array_of_spans(explanation, array):
    assert explanation.spans(0, array) == explanation.spans(0, [(0, 3), (3, 7)])


@pytest.mark.parametrize("view", ("words", "spans", "token_scores", "text"))
def test_a_row_out_of_range_is_named(explanation, view):
    with pytest.raises(IndexError) as error:
        getattr(explanation, view)(5)
    one_line(error, "index 5 is out of range: the result has 2 rows, 0..1")


@pytest.mark.parametrize("index", (1.0, "0", True, None))
def test_a_row_that_is_no_integer_is_named(explanation, index):
    with pytest.raises(TypeError) as error:
        explanation.words(index)
    one_line(error, "index must be an int, a row of the result (0..1)", type(index).__name__)


def test_rows_count_from_the_end_and_take_numpy_integers(explanation):
    assert explanation.words(-1) == explanation.words(1) == explanation.words(np.int8(1))


@pytest.mark.parametrize("span", ((0.0, 2.0), (3, 1), (0, 999), (0, True), (1,)))
def test_a_bad_span_is_named(explanation, span):
    with pytest.raises(ValueError) as error:
        explanation.spans(0, [span])
    one_line(error, "each span is (start, end) with 0 <= start < end <=", "the characters of text(0)")


# -- exclude -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("integer", (np.int8, np.int64, np.uint8))
def test_exclude_takes_numpy_integers(explanation, integer):
    assert torch.equal(explanation.excluding(integer(2)).excluded, explanation.excluding(2).excluded)


@pytest.mark.parametrize("position", (6, -7, np.int64(99)))
def test_an_excluded_position_out_of_range_is_named(explanation, position):
    with pytest.raises(ValueError) as error:
        explanation.excluding(position)
    one_line(error, f"exclude position {int(position)} is outside row 0's 6 real tokens")


@pytest.mark.parametrize("item", ("firstt", "BOS", "", 1.0, None, np.bool_(True)))
def test_an_exclude_item_that_is_no_name_or_position_is_named(explanation, item):
    with pytest.raises(ValueError) as error:
        explanation.excluding(item)
    one_line(error, "exclude takes first, last, bos, special, template, token positions (ints) or a (B, T) bool tensor")


@pytest.mark.parametrize("mask", (torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 5, dtype=torch.bool)))
def test_an_exclude_tensor_of_another_kind_is_named(explanation, mask):
    with pytest.raises(ValueError) as error:
        explanation.excluding(mask)
    one_line(error, "exclude as a tensor must be bool of the scores' shape (2, 6)")


def test_explain_takes_a_numpy_position_to_exclude(model, explanation):
    assert torch.equal(relevancy.explain(model, IDS, method="attnlrp", exclude=np.int32(0)).excluded, explanation.excluding(0).excluded)


# -- saving and loading --------------------------------------------------------------------------------------------
HOSTILE_PATHS = {
    "bytes": (lambda folder: b"x.json", "must be a str or a pathlib.Path, got bytes"),
    "None": (lambda folder: None, "must be a str or a pathlib.Path, got NoneType"),
    "int": (lambda folder: 3, "must be a str or a pathlib.Path, got int"),
    "NUL": (lambda folder: str(folder / "a\x00b.json"), "cannot hold a NUL character"),
    "long name": (lambda folder: str(folder / ("x" * 300 + ".json")), "305 bytes long; a file or folder name takes at most 255"),
    "long folder": (lambda folder: str(folder / ("y" * 300) / "a.json"), "300 bytes long"),
}


@pytest.mark.parametrize("kind", HOSTILE_PATHS)
def test_save_refuses_a_hostile_path_and_writes_nothing(explanation, tmp_path, kind):
    path, said = HOSTILE_PATHS[kind]
    with pytest.raises(OutputError) as error:
        explanation.save(path(tmp_path))
    one_line(error, "an output path", said)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", HOSTILE_PATHS)
def test_load_refuses_a_hostile_path(tmp_path, kind):
    path, said = HOSTILE_PATHS[kind]
    with pytest.raises(ValueError) as error:
        relevancy.load(path(tmp_path))
    one_line(error, "relevancy.load takes the dict to_json() gives or a path", said)


@pytest.mark.parametrize("name", ("z" * 250 + ".json", "é🎉 and spaces.json", "UPPER.JSON", "é" * 125 + ".json"))
def test_a_result_saved_under_an_unusual_name_loads_back(explanation, tmp_path, name):
    loaded = relevancy.load(explanation.save(tmp_path / name))
    assert torch.equal(loaded.scores, explanation.scores) and loaded.tokens == explanation.tokens
    assert [path.name for path in tmp_path.iterdir()] == [name]  # no temporary file left


# -- vision-language decoders: placeholders ---------------------------------------------------------------------
@pytest.mark.parametrize("change", (-1, 1))
@pytest.mark.parametrize("family, expected", (("llava", 16), ("llava_full", 17), ("llava_siglip", 16), ("gemma3", 4), ("idefics3", 4)))
def test_a_placeholder_count_other_than_the_images_is_named(family, expected, change):
    batch = vlm_inputs(family, lengths=(5,))
    ids = batch["input_ids"]
    ids = torch.cat([ids[:, :1], ids[:, 1:2].expand(1, 2), ids[:, 2:]], 1) if change > 0 else torch.cat([ids[:, :1], ids[:, 2:]], 1)
    with pytest.raises(ValueError) as error:
        relevancy.explain(build_vlm(family), {**batch, "input_ids": ids, "attention_mask": torch.ones_like(ids)}, method="attnlrp")
    one_line(error, f"input_ids must hold one image's {expected} placeholder tokens (id {IMAGE_TOKEN})",
             f"counted per row: [{expected + change}]", "processor(images=image, text=prompt)")


def test_rows_with_different_placeholder_counts_are_named(llava):
    batch = vlm_inputs("llava", lengths=(5, 5))
    batch["input_ids"] = batch["input_ids"].clone()
    batch["input_ids"][1, 1] = 3
    with pytest.raises(ValueError) as error:
        relevancy.explain(llava, batch, method="generic_attention")
    one_line(error, "counted per row: [16, 15]")


# -- vision-language decoders: images ------------------------------------------------------------------------------
BAD_IMAGES = {
    "0 x 0": (Image.new("RGB", (0, 0)), ValueError, "image= is 0 x 0 pixels: an image has at least 1 x 1"),
    "5 x 0": (Image.new("RGB", (5, 0)), ValueError, "image= is 5 x 0 pixels"),
    "empty array": (np.zeros((0, 0, 3), np.uint8), ValueError, "image= is 0 x 0 pixels"),
    "two in a list": ([picture(), picture(1)], TypeError, "image= is one image, got a list of 2"),
    "one in a list": ([picture()], TypeError, "image= is one image, got a list of 1"),
    "a tuple": ((picture(), picture(1)), TypeError, "got a tuple of 2"),
    "a batch array": (np.zeros((2, 20, 20, 3), np.uint8), ValueError, "image= as an array is one image, (H, W, C) or (C, H, W)"),
    "a flat array": (np.zeros(20, np.uint8), ValueError, "got shape (20,)"),
    "two channels": (np.zeros((20, 20, 2), np.uint8), ValueError, "with 1, 3 or 4 channels; got shape (20, 20, 2)"),
    "complex": (np.zeros((20, 20, 3), np.complex64), TypeError, "image= as an array holds real numbers"),
    "bool": (torch.zeros(3, 20, 20, dtype=torch.bool), TypeError, "got torch.bool"),
    "NaN": (np.full((20, 20, 3), np.nan, np.float32), ValueError, "image= holds NaN or infinite values"),
    "an int": (5, TypeError, "image= takes a PIL image, an image file's path, or one image as an array"),
    "bytes": (b"\x89PNG", TypeError, "got bytes"),
}


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_a_bad_image_is_named(llava, kind):
    image, error_type, said = BAD_IMAGES[kind]
    with pytest.raises(error_type) as error:
        relevancy.explain_generation(llava, processor(), "what is it", image=image, max_new_tokens=2)
    one_line(error, said)


def test_a_missing_image_file_is_named(llava, tmp_path):
    with pytest.raises(ValueError) as error:
        relevancy.explain_generation(llava, processor(), "what is it", image=tmp_path / "missing.png", max_new_tokens=2)
    one_line(error, "missing.png does not exist")


CHAT = "{% for m in messages %}{% for item in m['content'] %}{% if item['type'] == 'image' %}<image>{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endfor %} ASSISTANT :"


@pytest.mark.parametrize("prompt", ("<image> <image> what is it", [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what"}]}]))
def test_a_prompt_with_two_image_tokens_is_named(llava, prompt):
    made = processor()
    made.chat_template = CHAT
    with pytest.raises(ValueError) as error:
        relevancy.explain_generation(llava, made, prompt, image=picture(), max_new_tokens=2)
    one_line(error, "the prompt holds the image token '<image>' 2 times, but one image is explained")


@pytest.mark.parametrize("image", (np.array(picture()), torch.from_numpy(np.array(picture())).permute(2, 0, 1)))
def test_an_image_as_an_array_is_the_picture(llava, image):
    made = processor()
    plain = relevancy.explain_generation(llava, made, "what is it", image=picture(), continuation="a red", method="input_x_gradient")
    array = relevancy.explain_generation(llava, made, "what is it", image=image, continuation="a red", method="input_x_gradient")
    assert torch.equal(array.scores, plain.scores) and torch.equal(array.image_scores, plain.image_scores)


# -- register_method -------------------------------------------------------------------------------------------
def run(adapter, inputs, target):
    return None


def mine(name: str = "mine", **fields) -> Method:
    return Method(name, fields.pop("run", run), **{"signed": False, "reads_class_token": False, **fields})


BAD_REGISTRATIONS = {
    "run takes nothing": ((mine(run=lambda: None), [TimmViTAdapter]), {}, TypeError, "got run <lambda>()"),
    "run is a str": ((mine(run="run"), [TimmViTAdapter]), {}, TypeError, "got run str"),
    "across is a str": ((mine(across="x"), [TimmViTAdapter]), {}, TypeError, "got across str"),
    "signed is a str": ((mine(signed="no"), [TimmViTAdapter]), {}, TypeError, "signed must be True or False, got 'no'"),
    "pixels is an int": ((mine(pixels=1), [TimmViTAdapter]), {}, TypeError, "pixels must be True or False, got 1"),
    "unknown generation": ((mine(generation="bogus"), [CausalLMAdapter]), {}, ValueError,
                           "generation must be one of one_forward, shared_forward, prefixes or None, got 'bogus'"),
    "replace is a str": ((mine("rollout"), [TimmViTAdapter]), {"replace": "yes"}, TypeError, "replace must be True or False, got 'yes'"),
    "a family's name": ((mine(), "vit"), {}, TypeError, "families must be adapter classes"),
    "an instance": ((mine(), [object()]), {}, TypeError, "families must be adapter classes"),
    "no families": ((mine(), None), {}, TypeError, "got None"),
}


@pytest.mark.parametrize("kind", BAD_REGISTRATIONS)
def test_a_bad_registration_is_named_and_changes_nothing(registry_restored, kind):
    arguments, keywords, error_type, said = BAD_REGISTRATIONS[kind]
    before, offered = dict(REGISTRY), {family: family.methods for family in BUILT_IN}
    with pytest.raises(error_type) as error:
        register_method(*arguments, **keywords)
    one_line(error, said)
    assert dict(REGISTRY) == before and {family: family.methods for family in BUILT_IN} == offered


@pytest.mark.parametrize("families", (TimmViTAdapter, {TimmViTAdapter}, (family for family in [TimmViTAdapter])))
def test_families_may_be_one_class_or_any_collection(registry_restored, families):
    method = mine("mine_too")
    register_method(method, families)
    assert REGISTRY["mine_too"] is method and "mine_too" in TimmViTAdapter.methods


# -- latent relevance options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("latent", ("layer", (), 1, {"layers"}, ("layers", "bogus"), "True"))
def test_a_bad_latent_option_is_named(model, latent):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, IDS, method="attnlrp", latent=latent)
    one_line(error, "latent must be True, False or some of layers, neurons, heads")


def test_latent_heads_with_checkpoint_are_refused(model):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, IDS, method="cp_lrp", latent="heads", checkpoint=True)
    one_line(error, "ask for them without checkpoint")


def test_latent_on_a_method_without_it_is_named(model):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, IDS, method="generic_attention", latent=True)
    one_line(error, "method 'generic_attention' has no option 'latent'")


def test_latent_as_a_list_equals_the_tuple(model):
    listed = relevancy.explain(model, IDS, method="attnlrp", latent=["layers", "heads"]).latent
    tupled = relevancy.explain(model, IDS, method="attnlrp", latent=("heads", "layers")).latent
    assert torch.equal(listed.layers, tupled.layers) and torch.equal(listed.heads, tupled.heads) and listed.neurons is None


# -- non-finite and other inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", (float("nan"), float("inf")))
def test_non_finite_pixels_of_a_vision_language_decoder_are_named(llava, value):
    batch = vlm_inputs("llava")
    batch["pixel_values"] = batch["pixel_values"].clone()
    batch["pixel_values"][1, 2, 3, 4] = value
    with pytest.raises(ValueError) as error:
        relevancy.explain(llava, batch, method="attnlrp")
    one_line(error, "pixel_values holds 1 NaN or infinite value")


@pytest.mark.parametrize("dtype", (torch.float32, torch.complex64))
def test_token_ids_of_another_dtype_are_named(model, dtype):
    with pytest.raises(TypeError) as error:
        relevancy.explain(model, IDS.to(dtype), method="attnlrp")
    one_line(error, "input_ids must be integers", str(dtype))
