"""Every result's `to_json()` follows the one schema documented in docs/api.md (`relevancy.explanation/1`): the
schema and its examples are read from the page, and checked here by a small JSON Schema reader (the keywords the
schema uses: type, const, enum, required, properties, additionalProperties, items, $ref; plus `kinds`)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from family_cases import FAMILIES, explain_once

import relevancy
from relevancy.results.explanation import SCHEMA, _kinds

PAGE = Path(__file__).parents[1] / "docs" / "api.md"
TYPES = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list), "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def documented() -> tuple[dict, list[dict]]:
    """The schema (the JSON block with an `$id`) and the examples (the other JSON blocks) of docs/api.md."""
    blocks = [json.loads(block) for block in re.findall(r"```json\n(.*?)\n```", PAGE.read_text(encoding="utf-8"), re.S)]
    (schema,) = [block for block in blocks if "$id" in block]
    return schema, [block for block in blocks if "$id" not in block]


def problems(value: Any, rule: dict, root: dict, path: str = "$") -> list[str]:
    """Where `value` breaks `rule` (a JSON Schema subset), as readable lines; [] when it follows it."""
    if "$ref" in rule:
        return problems(value, root["$defs"][rule["$ref"].removeprefix("#/$defs/")], root, path)
    found = []
    if "const" in rule and value != rule["const"]:
        found.append(f"{path}: {value!r} is not {rule['const']!r}")
    if "enum" in rule and value not in rule["enum"]:
        found.append(f"{path}: {value!r} is none of {rule['enum']}")
    if "type" in rule:
        kinds = rule["type"] if isinstance(rule["type"], list) else [rule["type"]]
        if not any(TYPES[kind](value) for kind in kinds):
            return [*found, f"{path}: {type(value).__name__} is not {' or '.join(kinds)}"]
    if isinstance(value, dict):
        found += [f"{path}: no key {key!r}" for key in rule.get("required", []) if key not in value]
        properties = rule.get("properties", {})
        for key, item in value.items():
            if key in properties:
                found += problems(item, properties[key], root, f"{path}.{key}")
            elif rule.get("additionalProperties") is False:
                found.append(f"{path}: key {key!r} is not in the schema")
            elif isinstance(rule.get("additionalProperties"), dict):
                found += problems(item, rule["additionalProperties"], root, f"{path}.{key}")
    if isinstance(value, list) and "items" in rule:
        for k, item in enumerate(value):
            found += problems(item, rule["items"], root, f"{path}[{k}]")
    return found


def result_problems(numbers: dict, schema: dict) -> list[str]:
    """`problems` of a `to_json()` against the common part merged with its kind's part; no key beyond both."""
    kind = schema["kinds"].get(numbers.get("kind"))
    if kind is None:
        return [f"$.kind: {numbers.get('kind')!r} is no kind of the schema"]
    merged = {"type": "object", "additionalProperties": False, "required": schema["required"] + kind["required"],
              "properties": {**schema["properties"], **kind["properties"]}}
    return problems(numbers, merged, schema)


def test_the_page_documents_every_kind_once_with_a_valid_example():
    schema, examples = documented()
    kinds = {kind.__name__ for kind in _kinds(relevancy.Explanation)}
    assert schema["$id"] == SCHEMA and set(schema["kinds"]) == kinds == set(schema["properties"]["kind"]["enum"])
    assert sorted(example["kind"] for example in examples) == sorted(kinds)
    for example in examples:
        assert result_problems(example, schema) == [], example["kind"]
        assert relevancy.load(example).to_json() == example  # the examples are what to_json() writes


def test_the_reader_names_what_breaks_the_schema():
    schema, examples = documented()
    image = next(example for example in examples if example["kind"] == "ImageExplanation")
    assert result_problems({**image, "extra": 1}, schema) == ["$: key 'extra' is not in the schema"]
    assert result_problems({key: value for key, value in image.items() if key != "mean"}, schema) == ["$: no key 'mean'"]
    assert result_problems({**image, "tokens": [["a"]]}, schema) == ["$.tokens: list is not null"]
    assert result_problems({**image, "scores": {"text": [[1.0]]}}, schema) == ["$.scores: no key 'image'",
                                                                                 "$.scores: key 'text' is not in the schema"]
    assert result_problems({**image, "target": [True]}, schema) == ["$.target[0]: bool is not integer"]
    assert result_problems({**image, "schema": "relevancy.explanation/0"}, schema)[0].startswith("$.schema:")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_result_follows_the_schema(family):
    result = explain_once(FAMILIES[family])
    assert result_problems(json.loads(json.dumps(result.to_json())), documented()[0]) == []


def test_lrp_totals_a_decoders_span_and_latent_and_generations_follow_the_schema():
    from test_causal_lm import build
    from test_generation import PROMPT, Characters

    schema = documented()[0]
    decoder = FAMILIES["causal_lm_llama"]
    inputs, _ = decoder.batch()
    spanned = relevancy.explain(decoder.build(), inputs, method="attnlrp", target=relevancy.Span([11, 22, 33]), latent=True,
                                exclude="first")
    generation = relevancy.explain_generation(build("llama"), Characters(), PROMPT, max_new_tokens=3, method="cp_lrp")
    from vlm_models import build as build_vlm
    from vlm_processor import picture, processor

    seen = relevancy.explain_generation(build_vlm("llava"), processor(), "what is in the image ?", image=picture(), max_new_tokens=2)
    for result in (spanned, generation, seen):
        assert result.relevance_total is not None
        assert result_problems(json.loads(json.dumps(result.to_json())), schema) == [], type(result).__name__


@pytest.mark.parametrize("kind", sorted(kind.__name__ for kind in _kinds(relevancy.Explanation)))
def test_every_kind_saves_by_suffix_with_the_same_arguments(kind, tmp_path):
    import inspect

    import numpy as np
    import torch

    from relevancy.core.files import OutputError

    example = next(example for example in documented()[1] if example["kind"] == kind)
    result = relevancy.load(example)
    assert "save" not in vars(type(result)) and inspect.signature(type(result).save) == inspect.signature(relevancy.Explanation.save)
    assert relevancy.load(result.save(tmp_path / "r.json")).to_json() == example
    with np.load(result.save(tmp_path / "r.npz")) as arrays:
        assert sorted(arrays.files) == sorted(example["tensors"])
        assert all(torch.equal(torch.from_numpy(arrays[path]),
                             torch.tensor(example_value(example, path), dtype=getattr(torch, example["tensors"][path]["dtype"])))
                   for path in arrays.files)
    has_image, has_text = "image" in example["scores"], example["tokens"] is not None
    for suffix, offered in ((".png", has_image), (".html", has_text), (".htm", has_text)):
        if offered:
            written = result.save(tmp_path / f"r{suffix}", by_word=False)
            assert written.read_bytes()[:4] == b"\x89PNG" if suffix == ".png" else written.read_text().startswith("<!DOCTYPE html>")
        else:
            with pytest.raises(OutputError, match=f"a {kind} is saved as .json, .npz, .*got 'r{suffix}'"):
                result.save(tmp_path / f"r{suffix}")
    with pytest.raises(OutputError, match=r"\(chosen by the path's suffix\), got 'r.txt'"):
        result.save(tmp_path / "r.txt")
    assert not (tmp_path / "r.txt").exists() and not [p for p in tmp_path.iterdir() if p.suffix not in (".json", ".npz", ".png", ".html", ".htm")]


def example_value(numbers: dict, path: str) -> Any:
    """The value at `path` (`scores/image`) of a `to_json()`."""
    for key in path.split("/"):
        numbers = numbers[int(key) if isinstance(numbers, list) else key]
    return numbers
