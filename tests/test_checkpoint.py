"""`checkpoint=True` (transformer_attribution, lrp, generic_attention on one-stream models): each block runs again in
the backward and the map is the one of the ordinary call, bit for bit in float64; the model is handed back as it
was, also after a failure, and a user's forwards from another thread are untouched; families with several streams
are refused by name. (partial_lrp on one-stream models always runs its last block this way: the golden tests check
its maps against the authors'.)"""
from __future__ import annotations

import threading

import pytest
import torch

import relevancy
from relevancy.methods import recompute
from relevancy.families import UnsupportedModelError
from relevancy.lrp import engine
from family_cases import FAMILIES
from models import tiny_vit
from test_model_unchanged import assert_same, snapshot
from test_user_forwards import plain_output

ONE_STREAM = ["timm_vit", "timm_vit_gated_attention", "timm_vit_swiglu", "hf_vit", "hf_dinov2_swiglu", "hf_bert",
              "hf_roberta", "hf_distilbert", "causal_lm_llama", "causal_lm_gpt2"]
CALLS = [
    ("transformer_attribution", {}),
    ("transformer_attribution", {"exact": True}),
    ("transformer_attribution", {"blocks": "last"}),
    ("transformer_attribution", {"weights": "attention", "start_layer": 1}),
    ("lrp", {}),
    ("lrp", {"exact": True}),
    ("generic_attention", {}),
    ("generic_attention", {"start_layer": -1}),
]


def assert_same_explanation(checkpointed, whole, what: str) -> None:
    assert torch.equal(checkpointed.scores, whole.scores), what
    assert torch.equal(checkpointed.logits, whole.logits), what
    total = getattr(whole, "relevance_total", None)
    if total is not None:
        assert torch.equal(checkpointed.relevance_total, total), what


@pytest.mark.parametrize("family", ONE_STREAM)
def test_blocks_run_again_give_the_same_maps(family, monkeypatch):
    case = FAMILIES[family]
    model = case.build()
    inputs, target = case.batch()
    reruns = []
    rerun = recompute.BlockRecompute.rerun
    monkeypatch.setattr(recompute.BlockRecompute, "rerun", lambda self, index: reruns.append(index) or rerun(self, index))
    for method, options in CALLS:
        whole = relevancy.explain(model, inputs, method=method, target=target, **options)
        reruns.clear()
        checkpointed = relevancy.explain(model, inputs, method=method, target=target, checkpoint=True, **options)
        assert_same_explanation(checkpointed, whole, f"{method} {options}")
        assert reruns, f"{method} {options}: no block ran again"
        assert reruns == sorted(reruns, reverse=True), "blocks run again from the last down"


@pytest.mark.parametrize("family", ["clip_open_clip", "lxmert", "detr"])
@pytest.mark.parametrize("method", ["transformer_attribution", "lrp", "generic_attention"])
def test_families_with_several_streams_are_refused_by_name(family, method):
    case = FAMILIES[family]
    inputs, target = case.batch()
    # lrp refuses these families whatever the options
    expected = "one-stream|does not apply" if method == "lrp" else "checkpoint=True .* several token streams.*rows_at_once=1"
    with pytest.raises(UnsupportedModelError, match=expected):
        relevancy.explain(case.build(), inputs, method=method, target=target, checkpoint=True)


@pytest.mark.parametrize("method", ["transformer_attribution", "lrp", "generic_attention"])
def test_model_and_grad_mode_unchanged_after_a_failure_in_the_backward(method, monkeypatch):
    model = tiny_vit()
    before = snapshot(model)
    rerun = recompute.BlockRecompute.rerun

    def fail_after_rerun(self, index):
        rerun(self, index)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(recompute.BlockRecompute, "rerun", fail_after_rerun)
    with pytest.raises(RuntimeError, match="injected failure"):
        relevancy.explain(model, torch.randn(2, 3, 32, 32), method=method, checkpoint=True)
    assert_same(before, snapshot(model))
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("method", ["transformer_attribution", "generic_attention"])
def test_model_and_grad_mode_unchanged_after_a_failure_inside_a_block_of_the_forward(method):
    model = tiny_vit()

    def fail(*_args) -> None:
        raise RuntimeError("injected failure")

    handle = model.blocks[1].register_forward_hook(fail)  # the forward runs the block without a graph
    try:
        before = snapshot(model)
        with pytest.raises(RuntimeError, match="injected failure"):
            relevancy.explain(model, torch.randn(2, 3, 32, 32), method=method, checkpoint=True)
        assert_same(before, snapshot(model))
        assert torch.is_grad_enabled()
    finally:
        handle.remove()


def test_the_users_forwards_from_another_thread_are_untouched():
    model = tiny_vit()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    expected = relevancy.explain(model, images, method="transformer_attribution").scores
    normal = plain_output(model, images)
    stop, outputs = threading.Event(), []

    def users_forwards() -> None:
        while not stop.is_set():
            outputs.append(plain_output(model, images))

    thread = threading.Thread(target=users_forwards)
    thread.start()
    try:
        for _ in range(3):
            for method in ("transformer_attribution", "lrp", "generic_attention"):
                relevancy.explain(model, images, method=method, checkpoint=True)
            scores = relevancy.explain(model, images, method="transformer_attribution", checkpoint=True).scores
            torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-7)
    finally:
        stop.set()
        thread.join(60)
    assert outputs
    for output in outputs:
        torch.testing.assert_close(output, normal, rtol=1e-4, atol=1e-4)


def backward_in_a_worker_thread(monkeypatch) -> list[str]:
    """`torch.autograd.grad` called from the explaining thread runs in a worker thread, as CUDA's autograd runs the
    backward (and with it the checkpoint's recomputation) in a device thread of its own. Returns the names of the
    threads the backward ran in."""
    grad = torch.autograd.grad
    ran_in: list[str] = []

    def in_a_worker(*args, **kwargs):
        if threading.current_thread().name.startswith("autograd-worker"):
            return grad(*args, **kwargs)
        result: list = []

        def run() -> None:
            ran_in.append(threading.current_thread().name)
            try:
                result.append(grad(*args, **kwargs))
            except BaseException as error:  # raised again in the calling thread
                result.append(error)

        worker = threading.Thread(target=run, name="autograd-worker")
        worker.start()
        worker.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    monkeypatch.setattr(torch.autograd, "grad", in_a_worker)
    return ran_in


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "input_x_gradient"])
def test_checkpoint_recomputes_the_calls_forwards_in_the_thread_autograd_runs_the_backward_in(method, monkeypatch):
    """The recomputation of `checkpoint=True` in autograd's own thread runs the call's rule forwards (the gate of
    `guard.this_thread_only` knows the call's recomputation), so the map is the plain call's; a user's forwards in a
    third thread meanwhile run the model's own."""
    from test_causal_lm import batch as llm_batch, build as build_llm

    model = build_llm("llama")
    inputs = llm_batch("left")
    plain = relevancy.explain(model, inputs, method=method)
    normal = plain_output(model, inputs)
    ran_in = backward_in_a_worker_thread(monkeypatch)
    stop, outputs = threading.Event(), []

    def users_forwards() -> None:
        while not stop.is_set():
            outputs.append(plain_output(model, inputs))

    user = threading.Thread(target=users_forwards)
    user.start()
    try:
        for _ in range(3):
            checkpointed = relevancy.explain(model, inputs, method=method, checkpoint=True)
            torch.testing.assert_close(checkpointed.scores, plain.scores, rtol=0, atol=1e-12 * plain.scores.abs().max().item())
    finally:
        stop.set()
        user.join(60)
    assert ran_in and set(ran_in) == {"autograd-worker"}
    assert outputs
    for output in outputs:
        torch.testing.assert_close(output, normal, rtol=1e-10, atol=1e-10)



def deeper(family: str) -> torch.nn.Module:
    """A tiny float64 model of `family` ("llama": a text decoder of 7 layers; else vlm_models') with 5 tower and 4
    decoder layers: uneven halves, LLaVA's chosen hidden state inside the tower."""
    import transformers
    from vlm_models import _config

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
        return transformers.LlamaForCausalLM(config).double().eval()
    config = _config(family)
    config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers = 5, 4
    if family == "gemma3":
        config.text_config.layer_types = ["sliding_attention", "full_attention"] * 2
    return getattr(transformers, type(config).__name__.replace("Config", "ForConditionalGeneration"))(config).double().eval()


@pytest.mark.parametrize("family", ["llama", "llava", "gemma3", "idefics3"])
def test_stacks_run_again_by_bisection_give_the_plain_maps(family, monkeypatch):
    """`checkpoint=True` on a decoder (and a vision-language model's tower) keeps each stack's input only and runs
    its layers again by bisection in the backward (`lrp.segments`): the maps are the plain call's, also with the
    backward in a thread of its own; the deepest recursion holds about log2(L) + 1 inputs, not L."""
    from relevancy.lrp import segments

    from vlm_models import inputs as vlm_inputs

    model = deeper(family)
    batch = {"input_ids": torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])} if family == "llama" else vlm_inputs(family)
    plain = relevancy.explain(model, batch, method="attnlrp")
    depth, deepest = [0], [0]
    backpropagated = segments._backpropagated

    def counted(calls, start, grad):
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            return backpropagated(calls, start, grad)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(segments, "_backpropagated", counted)
    bisected = {}
    for segment in (1, segments.SEGMENT):  # pure bisection, then runs of SEGMENT layers each from its start
        with monkeypatch.context() as patched:
            patched.setattr(segments, "SEGMENT", segment)
            deepest[0] = 0
            bisected[segment] = relevancy.explain(model, batch, method="attnlrp", checkpoint=True), deepest[0]
    # bisection: ceil(log2(n)) halvings, then one layer: n = 7 (Llama), 5 (a tower read at its end), 4 (LLaVA's tower
    # read at -2, the decoders); with runs of SEGMENT (8) layers each of these stacks is one run from its start
    assert bisected[1][1] == (3 if family == "llava" else 4), bisected[1][1]
    assert bisected[segments.SEGMENT][1] == 1, bisected[segments.SEGMENT][1]
    with monkeypatch.context() as patched:  # runs of 4: 7 -> 3 | 4 and 5 -> 2 | 3, two levels; 4, one
        patched.setattr(segments, "SEGMENT", 4)
        deepest[0] = 0
        four = relevancy.explain(model, batch, method="attnlrp", checkpoint=True)
        assert deepest[0] == (1 if family == "llava" else 2), deepest[0]
    checkpointed = bisected[segments.SEGMENT][0]
    ran_in = backward_in_a_worker_thread(monkeypatch)
    elsewhere = relevancy.explain(model, batch, method="attnlrp", checkpoint=True)
    assert ran_in and set(ran_in) == {"autograd-worker"}
    for result in (bisected[1][0], four, checkpointed, elsewhere):
        for name in ("scores", "pixel_scores"):
            if getattr(plain, name, None) is not None:
                expected = getattr(plain, name)
                torch.testing.assert_close(getattr(result, name), expected, rtol=0, atol=1e-12 * expected.abs().max().item())
    assert all("forward" not in module.__dict__ for module in model.modules())
