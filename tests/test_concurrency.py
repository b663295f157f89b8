"""Safe under any call: explanations from several threads on one model, different models at once, and every
autograd context (no_grad, set_grad_enabled(False), inference_mode, inputs and concepts made in inference mode)."""
from __future__ import annotations

import gc
import threading
import weakref
from contextlib import nullcontext
from typing import Callable

import pytest
import torch
import transformers

import relevancy
from relevancy.core import guard
from relevancy.families.base import SEED_METHODS
from models import tiny_vit
from test_model_unchanged import assert_same, snapshot

THREADS = 4
CONCEPT_METHODS = [name for name in SEED_METHODS if name in ("cdam", "token_ablation")]


def tiny_bert(config: transformers.BertConfig | None = None) -> torch.nn.Module:
    """A random 2-layer BERT classifier with dropout (so that a forgotten train mode would change the maps)."""
    torch.manual_seed(0)
    config = config or bert_config()
    return transformers.BertForSequenceClassification(config).eval()


def bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=60, max_position_embeddings=40, num_labels=3, hidden_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def vit_inputs() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def bert_inputs() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[2, 11, 12, 13, 14, 15, 3], [2, 21, 22, 3, 0, 0, 0]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], object]]] = {
    "vit": (lambda: tiny_vit(drop_rate=0.3, attn_drop_rate=0.3, proj_drop_rate=0.3), vit_inputs),
    "bert": (tiny_bert, bert_inputs),
}


def plain_attributes(obj: object) -> dict:
    """Every instance attribute: plain values as they are, dicts (parameters, buffers, hooks) by their keys,
    anything else (tensors, submodules, a patched `forward`) by its type."""
    def describe(value: object) -> object:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, dict):
            return tuple(value)
        return type(value).__name__
    return {key: describe(value) for key, value in vars(obj).items()}


def model_state(model: torch.nn.Module) -> dict:
    """Weights, flags, hooks and patches (`test_model_unchanged.snapshot`), every module's own attributes and the
    attributes of every config the modules read (a text model's attention implementation)."""
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    return {
        **snapshot(model),
        "attributes": {name: plain_attributes(m) for name, m in model.named_modules()},
        "configs": [plain_attributes(c) for c in configs.values()],
        "attn_implementation": [c._attn_implementation for c in configs.values()],
    }


def assert_same_map(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item()
    assert torch.allclose(actual, expected, rtol=1e-6, atol=1e-6 * scale), (
        f"{what}: max difference {(actual - expected).abs().max().item():.3g} (map scale {scale:.3g})")


def serial_maps(model: torch.nn.Module, inputs: object) -> dict[str, torch.Tensor]:
    """Every method's map (predicted classes), and the concept methods on a concept of the inputs."""
    maps = {method: relevancy.explain(model, inputs, method=method).scores for method in SEED_METHODS}
    concept = relevancy.Concept(model, inputs)
    maps["concept vector"] = concept.vector
    for method in CONCEPT_METHODS:
        maps[f"{method} on a concept"] = relevancy.explain(model, inputs, method=method, target=concept).scores
    return maps


def run_in_threads(jobs: list[Callable[[], None]], timeout: float = 300) -> None:
    """Start all jobs at once (a barrier), wait for them, and fail with every thread's exception."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def wrapped(job: Callable[[], None]) -> None:
        try:
            barrier.wait()
            job()
        except BaseException as error:  # every failure, assertions included, is reported below
            errors.append(error)

    threads = [threading.Thread(target=wrapped, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread is still running (deadlock?)"
    assert not errors, "\n".join(f"{type(e).__name__}: {e}" for e in errors)


def check_against(model: torch.nn.Module, inputs: object, expected: dict[str, torch.Tensor], offset: int) -> Callable[[], None]:
    """A thread's job: every method (in an order of its own) and a concept, each compared with the serial map."""
    def job() -> None:
        methods = list(SEED_METHODS)
        for method in methods[offset:] + methods[:offset]:
            assert_same_map(relevancy.explain(model, inputs, method=method).scores, expected[method], method)
        concept = relevancy.Concept(model, inputs)
        assert_same_map(concept.vector, expected["concept vector"], "concept vector")
        for method in CONCEPT_METHODS:
            scores = relevancy.explain(model, inputs, method=method, target=concept).scores
            assert_same_map(scores, expected[f"{method} on a concept"], f"{method} on a concept")
    return job


@pytest.mark.parametrize("train_mode", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", FAMILIES)
def test_threads_on_one_model_give_the_serial_maps_and_leave_it_unchanged(family, train_mode):
    build, inputs = FAMILIES[family]
    model, batch = build(), inputs()
    model.train(train_mode)
    before = model_state(model)
    expected = serial_maps(model, batch)
    run_in_threads([check_against(model, batch, expected, offset) for offset in range(THREADS)])
    assert_same(before, model_state(model))
    assert all(m.training == train_mode for m in model.modules())


def test_different_models_run_in_parallel_and_each_is_correct():
    models = [tiny_vit(), tiny_vit(), tiny_bert(), tiny_bert()]
    batches = [vit_inputs(), vit_inputs(), bert_inputs(), bert_inputs()]
    befores = [model_state(m) for m in models]
    expected = [serial_maps(m, b) for m, b in zip(models, batches)]
    run_in_threads([check_against(m, b, e, k) for k, (m, b, e) in enumerate(zip(models, batches, expected))])
    for model, before in zip(models, befores):
        assert_same(before, model_state(model))


def test_a_call_on_another_model_is_not_held_up_by_a_busy_model():
    busy, free = tiny_vit(), tiny_vit()
    images = vit_inputs()
    expected = relevancy.explain(busy, images, method="generic_attention").scores
    results: dict[str, torch.Tensor] = {}

    def explain_into(name: str, model: torch.nn.Module) -> threading.Thread:
        def job() -> None:
            results[name] = relevancy.explain(model, images, method="generic_attention").scores
        thread = threading.Thread(target=job)
        thread.start()
        return thread

    with guard.exclusive(busy):  # as if another thread were explaining `busy`
        waiting = explain_into("busy", busy)
        explain_into("free", free).join(120)
        assert "free" in results, "a call on another model waited for the busy one"
        waiting.join(0.5)
        assert waiting.is_alive() and "busy" not in results, "a second call on the busy model did not wait"
    waiting.join(120)
    assert_same_map(results["busy"], expected, "busy")
    assert_same_map(results["free"], expected, "free")


def test_models_sharing_one_config_are_explained_in_parallel_correctly():
    config = bert_config()  # both switch config._attn_implementation: their calls must not overlap
    models = [tiny_bert(config), tiny_bert(config)]
    batch = bert_inputs()
    before = model_state(models[0])
    expected = serial_maps(models[0], batch)
    run_in_threads([check_against(models[k % 2], batch, expected, k) for k in range(THREADS)])
    assert_same(before, model_state(models[0]))
    assert config._attn_implementation == before["attn_implementation"][0]


def test_nested_calls_from_one_thread_do_not_deadlock():
    model, images = tiny_vit(), vit_inputs()
    expected = relevancy.explain(model, images, method="cdam").scores

    def nested() -> None:
        with guard.exclusive(model), guard.exclusive(model):
            concept = relevancy.Concept(model, images)
            assert_same_map(relevancy.explain(model, images, method="cdam").scores, expected, "cdam")
            relevancy.explain(model, images, method="cdam", target=concept)

    run_in_threads([nested], timeout=120)


def test_explained_models_are_still_garbage_collected():
    gc.collect()
    locks_before = len(guard._locks)
    model = tiny_bert()
    relevancy.Concept(model, bert_inputs())
    relevancy.explain(model, bert_inputs(), method="raw_attention")
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    assert len(guard._locks) == locks_before  # the model's and its config's locks went with them


# -- autograd contexts ----------------------------------------------------------------------------------------

CONTEXTS: dict[str, Callable[[], object]] = {
    "no_grad": torch.no_grad,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
    "inference_mode": torch.inference_mode,
}


def assert_ordinary(explanation: relevancy.Explanation) -> None:
    for tensor in (explanation.scores, explanation.logits, explanation.target):
        assert not tensor.requires_grad and not tensor.is_inference()


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_in_an_autograd_context_gives_the_maps_made_outside(family, context):
    build, inputs = FAMILIES[family]
    model, batch = build(), inputs()
    before = model_state(model)
    expected = serial_maps(model, batch)
    grad_mode = torch.is_grad_enabled()
    with CONTEXTS[context]():
        for method in SEED_METHODS:
            explanation = relevancy.explain(model, batch, method=method)
            assert_same_map(explanation.scores, expected[method], f"{method} in {context}")
            assert_ordinary(explanation)
        concept = relevancy.Concept(model, batch)
        assert not concept.vector.requires_grad and not concept.vector.is_inference()
        for method in CONCEPT_METHODS:
            explanation = relevancy.explain(model, batch, method=method, target=concept)
            assert_same_map(explanation.scores, expected[f"{method} on a concept"], f"{method} on a concept in {context}")
        still_off = not torch.is_grad_enabled()
    assert still_off and torch.is_grad_enabled() == grad_mode  # the caller's mode is untouched
    assert_same(before, model_state(model))


def made_in_inference_mode(inputs: object) -> object:
    with torch.inference_mode():
        if isinstance(inputs, torch.Tensor):
            return inputs.clone()
        return {key: value.clone() for key, value in inputs.items()}


@pytest.mark.parametrize("later", ["outside", "inference_mode"])
@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_and_concepts_made_in_inference_mode_work_later(family, later):
    build, inputs = FAMILIES[family]
    model, batch = build(), inputs()
    expected = serial_maps(model, batch)
    inference_batch = made_in_inference_mode(batch)
    assert all(t.is_inference() for t in ([inference_batch] if family == "vit" else inference_batch.values()))
    with torch.inference_mode():
        concepts = {
            "built in inference_mode": relevancy.Concept(model, inference_batch),
            "from an inference vector": relevancy.Concept.from_vector(expected["concept vector"].clone()),
        }
    assert concepts["from an inference vector"].vector.is_inference()
    with torch.inference_mode() if later == "inference_mode" else nullcontext():
        for method in SEED_METHODS:
            explanation = relevancy.explain(model, inference_batch, method=method)
            assert_same_map(explanation.scores, expected[method], f"{method} on inference inputs")
            assert_ordinary(explanation)
        for name, concept in concepts.items():
            for method in CONCEPT_METHODS:
                scores = relevancy.explain(model, batch, method=method, target=concept).scores
                assert_same_map(scores, expected[f"{method} on a concept"], f"{method} on a concept {name}")
    assert_same_map(concepts["built in inference_mode"].vector, expected["concept vector"], "concept vector")


def test_a_shared_function_patched_by_overlapping_calls_is_given_back_whatever_order_they_end():
    """Two calls in two threads patch one shared function (two models of a family share their modeling file's
    functions, e.g. RoPE's rotation under attnlrp): whichever ends first, the function is the original after both,
    and a call that ended no longer acts (its gate hands on to what it replaced)."""
    import types

    from relevancy.lrp.engine import replaced

    def original(x):
        return x

    for first_to_end in ("a", "b"):
        shared = types.SimpleNamespace(rotate=original)
        entered = {name: threading.Event() for name in "ab"}
        leave = {name: threading.Event() for name in "ab"}
        seen: dict[str, int] = {}

        def call(name: str, add: int) -> None:
            with replaced([(shared, "rotate", lambda x: x + add)]):
                entered[name].set()
                leave[name].wait(5)
                seen[name] = shared.rotate(0)

        a = threading.Thread(target=call, args=("a", 1))
        a.start()
        entered["a"].wait(5)
        b = threading.Thread(target=call, args=("b", 2))
        b.start()
        entered["b"].wait(5)
        assert shared.rotate(0) == 0  # this thread runs the original
        for name in (first_to_end, "b" if first_to_end == "a" else "a"):
            leave[name].set()
            {"a": a, "b": b}[name].join(5)
            if name == first_to_end:
                assert shared.rotate(0) == 0
        assert shared.rotate is original and seen == {"a": 1, "b": 2}, (first_to_end, seen)
