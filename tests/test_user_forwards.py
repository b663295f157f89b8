"""The user's own forward passes on a model from another thread while it is explained: the explanation records only
its own forward (every method gives the map it gives alone) and the user's forwards give their normal outputs.

`explain` serialises explanations per model, but not the user's plain forwards; the hooks and patched forwards an
explanation attaches act only in its own thread (`relevancy.core.guard.this_thread_only`)."""
from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch

import relevancy
from relevancy.families import UnsupportedModelError
from bimodal_golden import bimodal_case, build as build_bimodal
from hf_vit_models import tiny_hf
from models import tiny_vit
from test_causal_lm import batch as llm_batch, build as build_llm
from test_concurrency import assert_same_map, bert_inputs, tiny_bert


ROUNDS = 3  # each method several times while the user's forwards run: races show up more than once


def shipped_clip() -> tuple[torch.nn.Module, object]:
    from relevancy.worlds import load_clip, make_scenes
    from relevancy.families.clip.batch import ImageTextBatch

    model, tok = load_clip()
    return model, ImageTextBatch.of(make_scenes(2, seed=3, objects=2).images, tok(["a red star", "a blue circle"]))


def shipped_detr() -> tuple[torch.nn.Module, object]:
    from relevancy.worlds.detection import detector_inputs, load_detector, make_detection_scenes

    return load_detector(), detector_inputs(make_detection_scenes(1, seed=5).images)


def bimodal(family: str) -> tuple[torch.nn.Module, object]:
    case = bimodal_case(family)
    return build_bimodal(case), case["inputs"][0]


CASES: dict[str, Callable[[], tuple[torch.nn.Module, object]]] = {
    "timm-vit": lambda: (tiny_vit(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))),
    "hf-vit": lambda: (tiny_hf("vit"), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))),
    "bert": lambda: (tiny_bert(), bert_inputs()),
    "clip": shipped_clip,
    "detr": shipped_detr,
    "lxmert": lambda: bimodal("lxmert"),
    "visualbert": lambda: bimodal("visualbert"),
    "llama": lambda: (build_llm("llama"), llm_batch("right")),
    "gpt2": lambda: (build_llm("gpt2"), llm_batch("right")),
}


def plain_output(model: torch.nn.Module, inputs: object) -> torch.Tensor:
    """The user's forward: the model called on the inputs as the model takes them, reduced to one tensor."""
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "question_answering_score", "logits_per_image"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return out[0]


def maps(model: torch.nn.Module, inputs: object, method: str) -> dict[str, torch.Tensor]:
    """Every map of one explanation: one per stream for the several-stream families."""
    expl = relevancy.explain(model, inputs, method=method)
    parts = getattr(expl, "parts", None)
    return {name: part.scores for name, part in parts.items()} if parts else {"scores": expl.scores}


def model_inputs(family: str, inputs: object) -> object:
    """What the user's own forward takes (CLIP: the pair batch's images and texts as transformers takes them)."""
    if family == "clip":
        return {"pixel_values": inputs.images, "input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
    return inputs


@pytest.mark.parametrize("family", CASES)
def test_explanations_ignore_the_users_forwards_from_another_thread(family):
    model, inputs = CASES[family]()
    expected = {}
    for method in relevancy.METHODS:  # the decoder methods too: the other families refuse them
        try:
            expected[method] = maps(model, inputs, method)
        except UnsupportedModelError:  # a method the family refuses by name
            continue
    methods = list(expected)
    user_inputs = model_inputs(family, inputs)
    normal = plain_output(model, user_inputs)
    stop, outputs, errors = threading.Event(), [], []

    def users_forwards() -> None:
        try:
            while not stop.is_set():
                outputs.append(plain_output(model, user_inputs))
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=users_forwards)
    thread.start()
    try:
        for method in methods * ROUNDS:
            for name, values in maps(model, inputs, method).items():
                assert_same_map(values, expected[method][name], f"{method} ({name})")
    finally:
        stop.set()
        thread.join(120)
    assert not errors, f"the user's forward failed: {errors[0]!r}"
    assert outputs, "the user's thread ran no forward"
    # equal up to float32 rounding: during a call the model's attention may run unfused or eager
    scale = normal.abs().max().item()
    for output in outputs:
        torch.testing.assert_close(output, normal, rtol=1e-4, atol=1e-4 * max(scale, 1.0))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generations_ignore_the_users_padded_forwards_and_generate_from_another_thread(arch):
    """The user's padded batch (transformers' sdpa mask: boolean) and `generate()` (a KV cache, one query per step)
    in another thread while `explain_generation` and `explain` switch the decoder's attention: the user's calls run
    the model's own attention and mask whenever the switch happens, and give their normal outputs."""
    from test_generation import Characters

    model = build_llm(arch, implementation="sdpa")
    padded = llm_batch("right")
    prompt_ids = padded["input_ids"][:1, :5]
    normal = plain_output(model, padded)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        generated = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **settings)
    stop, errors, calls = threading.Event(), [], [0]

    def users_calls() -> None:
        while not stop.is_set():
            try:
                torch.testing.assert_close(plain_output(model, padded), normal, rtol=1e-6, atol=1e-6)
                with torch.no_grad():
                    again = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **settings)
                assert torch.equal(again, generated)
            except BaseException as error:  # reported below
                errors.append(error)
            calls[0] += 1

    thread = threading.Thread(target=users_calls)
    thread.start()
    try:
        for _ in range(ROUNDS * 2):
            for method in ("generic_attention", "attnlrp"):
                relevancy.explain_generation(model, Characters(), "abcdefgh", max_new_tokens=4, method=method)
            relevancy.explain(model, padded, method="generic_attention")
    finally:
        stop.set()
        thread.join(120)
    assert calls[0] > 0, "the user's thread ran no call"
    assert not errors, f"{len(errors)} of the user's {calls[0]} calls went wrong: {errors[0]!r}"
