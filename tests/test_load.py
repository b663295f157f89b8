"""`relevancy.load` reads back what `save("....json")` and `to_json()` wrote, for every result class: one model per
family (tests/family_cases.py), a generation, a concept's result, an LRP result with its totals; the tensors equal
(dtype and shape), the tokens, targets and every other field as they were."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from family_cases import FAMILIES, explain_once

import relevancy
from relevancy.results.explanation import SCHEMA, _kinds


def assert_same_result(loaded, original) -> None:
    assert type(loaded) is type(original)
    for item in dataclasses.fields(original):
        before, after = getattr(original, item.name), getattr(loaded, item.name)
        if item.name == "concept":  # not written: its vector lives on the Concept
            assert after is None
        elif dataclasses.is_dataclass(before):  # an answer span's relevance, the latent relevance
            assert_same_result(after, before)
        elif isinstance(before, torch.Tensor):
            assert isinstance(after, torch.Tensor) and after.dtype == before.dtype and after.shape == before.shape, item.name
            assert torch.equal(after, before.cpu()) or torch.equal(after.isnan(), before.isnan()), item.name
        else:
            assert after == before and type(after) is type(before), (item.name, before, after)
    if isinstance(original, relevancy.Explanation):
        assert torch.equal(loaded.target, original.target) and loaded.to_json() == original.to_json()


def round_trips(result, tmp_path) -> None:
    path = result.save(tmp_path / "result.json")
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert_same_result(relevancy.load(path), result)
    assert_same_result(relevancy.load(str(path)), result)
    assert_same_result(relevancy.load(json.loads(json.dumps(result.to_json()))), result)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_result_loads_back(family, tmp_path):
    result = explain_once(FAMILIES[family])
    round_trips(result, tmp_path)


def test_lrp_totals_a_concept_and_a_decoders_result_load_back(tmp_path):
    from relevancy.worlds import load_model, make_scenes

    model = load_model()
    scenes = make_scenes(3, seed=0)
    round_trips(relevancy.explain(model, scenes.images[:2], method="transformer_attribution"), tmp_path)
    concept = relevancy.Concept(model, scenes.images)
    round_trips(relevancy.explain(model, scenes.images[:2], method="cdam", target=concept), tmp_path)
    decoder = FAMILIES["causal_lm_llama"]
    inputs, _ = decoder.batch()
    round_trips(relevancy.explain(decoder.build(), inputs, method="attnlrp"), tmp_path)
    # a decoder's answer span with the latent relevance of layers, neurons and heads, its first token left out
    spanned = relevancy.explain(decoder.build(), inputs, method="attnlrp", target=relevancy.Span([11, 22, 33]), latent=True,
                                exclude="first")
    assert spanned.span is not None and spanned.latent.heads is not None and spanned.excluded is not None
    round_trips(spanned, tmp_path)


def test_generations_load_back(tmp_path):
    from test_causal_lm import build
    from test_generation import PROMPT, Characters

    result = relevancy.explain_generation(build("llama"), Characters(), PROMPT, max_new_tokens=3, method="cp_lrp")
    round_trips(result, tmp_path)
    loaded = relevancy.load(result.save(tmp_path / "generation.json"))
    assert loaded.token_scores(1) == result.token_scores(1) and loaded.to_html() == result.to_html()
    from vlm_models import build as build_vlm
    from vlm_processor import picture, processor

    seen = relevancy.explain_generation(build_vlm("llava"), processor(), "what is in the image ?", image=picture(), max_new_tokens=2)
    round_trips(seen, tmp_path)
    assert relevancy.load(seen.save(tmp_path / "seen.json")).to_html() == seen.to_html()


def test_every_result_class_is_covered():
    covered = {"ImageExplanation", "TextExplanation", "PairExplanation", "RegionTextExplanation", "DetectionExplanation",
               "DecoderExplanation", "GenerationExplanation", "VisionLanguageExplanation", "VisionLanguageGenerationExplanation"}
    assert {kind.__name__ for kind in _kinds(relevancy.Explanation)} == covered


def test_what_is_not_a_saved_result_is_named(tmp_path):
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a saved relevancy result"):
        relevancy.load(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        relevancy.load(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        relevancy.load(tmp_path / "missing.json")
    result = relevancy.explain(FAMILIES["causal_lm_gpt2"].build(), FAMILIES["causal_lm_gpt2"].batch()[0], method="attnlrp")
    damaged = result.to_json()
    damaged["tensors"]["logits"]["dtype"] = "load"  # a torch function, not a dtype
    with pytest.raises(ValueError, match=r"tensors\['logits'\] has dtype \"load\"; a saved tensor is one of float16"):
        relevancy.load(damaged)
    cut = result.to_json()
    cut["scores"]["text"] = cut["scores"]["text"][:1]
    with pytest.raises(ValueError, match="the saved DecoderExplanation is damaged"):
        relevancy.load(cut)
    with pytest.raises(ValueError, match="not a saved relevancy result"):
        relevancy.load({**result.to_json(), "kind": ["DecoderExplanation"]})
    newer = {**result.to_json(), "schema": "relevancy.explanation/2"}
    with pytest.raises(ValueError, match=f"saved in schema relevancy.explanation/2; this relevancy reads {SCHEMA}: update relevancy"):
        relevancy.load(newer)
    with pytest.raises(ValueError, match="not a saved relevancy result"):
        relevancy.load({key: value for key, value in result.to_json().items() if key != "schema"})


def test_load_reads_regular_files_only_and_checks_the_schema_before_building(tmp_path):
    """issue 44's probes: a pipe or a device is never read, the tensors' shapes and dtypes are checked, the tokens
    fit the scores, and unusual JSON (deep nesting, values JSON has not, a cycle) is one clear error."""
    import os

    result = relevancy.explain(FAMILIES["causal_lm_gpt2"].build(), FAMILIES["causal_lm_gpt2"].batch()[0], method="attnlrp")
    os.mkfifo(tmp_path / "pipe.json")
    for path, said in ((tmp_path / "pipe.json", "a named pipe"), ("/dev/zero", "a character device"), (tmp_path, "is a folder")):
        with pytest.raises(ValueError, match=said):
            relevancy.load(path)
    cases = {
        "no tensors entry": ({**result.to_json(), "tensors": {}}, "has no 'tensors' entry"),
        "a negative shape": (_with_tensor(result, "scores/text", shape=[-1, 7]), r"tensors\['scores/text'\] has shape \[-1, 7\]"),
        "a shape of another kind": (_with_tensor(result, "logits", shape="3x96"), r"has shape \"3x96\""),
        "a dtype outside the list": (_with_tensor(result, "logits", dtype="complex64"), "complex64"),
        "an entry of other keys": ({**result.to_json(), "tensors": {**result.to_json()["tensors"], "logits": [3, 96]}}, r"must be \{'dtype'"),
    }
    for name, (numbers, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            relevancy.load(numbers)
    too_many = result.to_json()
    too_many["tokens"][0] = too_many["tokens"][0] * 3
    with pytest.raises(ValueError, match="row 0 has 21 tokens but its scores 7 columns"):
        relevancy.load(too_many)
    nested: list = []
    deep = nested
    for _ in range(100_000):
        deep.append([])
        deep = deep[0]
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    for source in ({**result.to_json(), "extra": nested}, tmp_path / "deep.json"):
        with pytest.raises(ValueError, match="RecursionError|could not be read as JSON"):
            relevancy.load(source)
    cyclic = result.to_json()
    cyclic["itself"] = cyclic
    for source in (cyclic, {**result.to_json(), "odd": {1, 2}}):
        with pytest.raises(ValueError, match="not plain JSON data"):
            relevancy.load(source)


def _with_tensor(result, path: str, **meta) -> dict:
    numbers = result.to_json()
    numbers["tensors"][path] = {**numbers["tensors"][path], **meta}
    return numbers
