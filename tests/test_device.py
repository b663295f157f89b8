"""Every method and family on the model's device: no tensor made on the CPU by default inside a call.

- On any machine: every family's case runs every method under a `TorchFunctionMode` that records each tensor
  factory called by relevancy's own code without `device=` (`torch.zeros`, `arange`, `eye`, `tensor`, ...). On a
  CPU such a tensor works; on a GPU it is made on the CPU and either fails or is copied over at each use. Only
  the conversions of the caller's own Python values (token ids, class indices given as lists) may be made on the
  host: they are moved to the model's device where they meet its tensors, and the test names them.
- Where a GPU is present (`-m cuda`, skipped elsewhere with the reason): every family and method on CUDA gives the
  CPU's maps (float64): within rounding, or within 1e-4 of the map's largest where the model itself computes
  some steps in float32 (its own logits differ between the devices).
"""
from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import relevancy
from family_cases import FAMILIES, to_device
from relevancy.families.base import UnsupportedModelError
from relevancy.lrp import MissingRuleError

#: factories that allocate a tensor of their own: inside a call they must name the device
ALLOCATIONS = frozenset((torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.eye, torch.rand,
                         torch.randn, torch.randint, torch.linspace, torch.scalar_tensor))
#: factories that convert values: host values (lists, arrays) converted without a device are made on the CPU
CONVERSIONS = frozenset((torch.tensor, torch.as_tensor))
#: frames of a function's own comprehensions: the function is the caller
COMPREHENSIONS = frozenset(("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>"))
#: the functions that convert the caller's own Python values (the result is moved where it meets the model's tensors)
HOST_VALUES = {
    "_class_indices": "class indices given as ints or lists (targets.py); resolve_target moves them to the logits' device",
    "_target_rows": "a per-row target split with rows_at_once (api.py); resolved like any target",
    "_token_tensor": "token ids and masks given as lists (hf_bert); check_inputs moves them to the model's device",
    "reading": "a decoder's reading rows built from the targets' token lists (causal_lm/targets.py), each moved to the ids' device once",
    "_padded": "the targets' token spans as a padded table (causal_lm/targets.py), moved to the ids' device by `reading`",
}


#: the installed package's folder: the frames of relevancy's own code (a clone's folder may be called relevancy too)
PACKAGE = os.path.dirname(relevancy.__file__) + os.sep


class DefaultDeviceWatch(TorchFunctionMode):
    """Records `(file:line, function, factory)` for each factory that relevancy's code calls without a device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is None and (func in ALLOCATIONS or func in CONVERSIONS and not isinstance(args[0], torch.Tensor)):
            frames = traceback.extract_stack(limit=4)[:-1]  # the frames that led to the factory, innermost last
            caller = next(f for f in reversed(frames) if f.name not in COMPREHENSIONS or f is frames[0])  # their function
            if caller.filename.startswith(PACKAGE) and caller.name not in HOST_VALUES:
                where = caller.filename[len(PACKAGE):]
                self.found.append(f"{where}:{caller.lineno} {caller.name}: torch.{func.__name__}")
        return func(*args, **kwargs)


def explain(model: torch.nn.Module, call: tuple, method: str) -> relevancy.Explanation | None:
    """The explanation, or None where the family refuses the method by name."""
    inputs, target = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # conservation warnings of random weights
        try:
            return relevancy.explain(model, inputs, method=method, target=target)
        except (UnsupportedModelError, MissingRuleError, ValueError) as error:
            assert f"'{method}'" in str(error), f"{method} refused without naming it: {error}"
            return None


def test_the_watch_sees_a_factory_without_device():
    """The mode records what it is meant to: a factory called without a device from relevancy's code."""
    from relevancy.methods import attention

    with DefaultDeviceWatch() as watch:
        torch.eye(3)  # called from this test: not relevancy's
        attention.with_identity(torch.zeros(2, 2, device="cpu"))  # names its device: not recorded
    assert watch.found == []
    with DefaultDeviceWatch() as watch:
        exec(compile("torch.zeros(2)", PACKAGE + "made_up.py", "exec"), {"torch": torch})
    assert watch.found == ["made_up.py:1 <module>: torch.zeros"]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_tensor_made_on_the_default_device_inside_a_call(family):
    case = FAMILIES[family]
    model = case.build()
    ran = 0
    for method in relevancy.METHODS:
        with DefaultDeviceWatch() as watch:
            explained = explain(model, case.batch(), method)
        ran += explained is not None
        assert watch.found == [], f"{family} {method}: tensors made on the default device: {sorted(set(watch.found))}"
    assert ran >= 3, f"{family}: too few methods ran to check anything"


def own_logits(model: torch.nn.Module, inputs) -> torch.Tensor:
    """The model's own logits for a case's inputs (its adapter's plain forward, no rules)."""
    from relevancy.api import prepared

    with torch.no_grad(), prepared(model, inputs, attention_probabilities=False) as call:
        return call.adapter.forward(call.inputs)[0].detach()


#: the largest CUDA-CPU difference allowed, over a map's largest magnitude: where the model computes in float64
#: throughout, rounding alone; where the model itself computes some steps in float32 whatever its dtype
#: (transformers' RoPE tables and RMSNorm's float32 cast: its own logits then differ between devices at about
#: 1e-8), that difference carried through the map's backward (seen up to 6e-6 on an H200)
EXACT, FLOAT32_INSIDE = 1e-10, 1e-4


@pytest.mark.cuda  # deselected by default (pyproject.toml); `pytest -m cuda` where a GPU is present
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_on_cuda_gives_the_cpu_maps(family):
    assert torch.cuda.is_available(), "pytest -m cuda compares CUDA with the CPU: it needs a CUDA device"
    case = FAMILIES[family]
    model = case.build()
    on_gpu = case.build().to("cuda")
    call = case.batch()
    logits = own_logits(model, call[0])
    own = ((own_logits(on_gpu, to_device(call, "cuda")[0]).cpu() - logits).abs().max() / logits.abs().max()).item()
    tolerance = EXACT if own < 1e-13 else FLOAT32_INSIDE
    for method in relevancy.METHODS:
        expected = explain(model, call, method)
        actual = explain(on_gpu, to_device(call, "cuda"), method)
        assert (expected is None) == (actual is None), f"{family} {method}: runs on one device only"
        if expected is None:
            continue
        for name, part in expected.parts.items():
            got = actual.parts[name].scores
            scale = part.scores.abs().max().clamp(min=1e-30)
            error = ((got.cpu() - part.scores).abs().max() / scale).item()
            assert error < tolerance, (f"{family} {method} {name}: CUDA differs from the CPU by {error:.2g} of the map's "
                                       f"largest (the model's own logits by {own:.2g})")


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["causal_lm_llama", "causal_lm_qwen3", "vision_language_llava", "vision_language_gemma3"])
def test_checkpoint_on_cuda_gives_the_plain_maps(family):
    """checkpoint=True on CUDA, where autograd runs the backward (and with it the recomputation of the checkpointed
    layers) in a device thread of its own: the maps equal the plain call's (float64)."""
    assert torch.cuda.is_available(), "pytest -m cuda compares CUDA with the CPU: it needs a CUDA device"
    case = FAMILIES[family]
    model = case.build().to("cuda")
    call = to_device(case.batch(), "cuda")
    inputs, target = call
    for method in ("attnlrp", "cp_lrp", "lrp"):
        try:
            plain = relevancy.explain(model, inputs, method=method, target=target)
        except (UnsupportedModelError, MissingRuleError, ValueError):
            continue  # refused by name: tests/test_device.py's first tests check the refusals
        kept = relevancy.explain(model, inputs, method=method, target=target, checkpoint=True)
        for name, part in plain.parts.items():
            scale = part.scores.abs().max().clamp(min=1e-30)
            error = ((kept.parts[name].scores - part.scores).abs().max() / scale).item()
            assert error < 1e-10, f"{family} {method} {name}: checkpoint=True differs by {error:.2g} of the map's largest"


@pytest.mark.cuda
def test_bf16_decoder_on_cuda_makes_no_float32_copy_of_the_weights():
    """A bf16 decoder is explained in its own dtype: the call's peak stays far below a float32 copy of its weights,
    and its map is close to the float32 model's."""
    assert torch.cuda.is_available(), "pytest -m cuda compares CUDA with the CPU: it needs a CUDA device"
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        full = transformers.LlamaForCausalLM(config).eval()
    half = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    half.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.state_dict().items()})
    ids = torch.randint(100, 31000, (1, 64), generator=torch.Generator().manual_seed(0)).to("cuda")
    prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    expected = relevancy.explain(full, prompt, method="attnlrp").scores[0]
    del full
    torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in half.parameters())
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    explained = relevancy.explain(half, prompt, method="attnlrp")
    above = torch.cuda.max_memory_allocated() - before
    assert all(p.dtype == torch.bfloat16 for p in half.parameters()), "the model's weights changed dtype"
    assert above < weights, f"the call took {above / 2**20:.0f} MiB above the model: a float32 copy of the weights is {2 * weights / 2**20:.0f} MiB"
    got = explained.scores[0].float()
    correlation = torch.corrcoef(torch.stack([got, expected.float()]))[0, 1].item()
    assert correlation > 0.95, f"the bf16 map correlates {correlation:.3f} with the float32 map"


@pytest.mark.cuda
def test_a_model_split_over_cuda_and_the_cpu_gives_the_cpu_maps(tmp_path):
    """accelerate's device map over the GPU and the CPU (embeddings and the first layer on cuda:0, the rest on the
    CPU, the head offloaded to the CPU's memory): every decoder method gives the undispatched CPU model's maps, and
    the dispatch is as it was after the call."""
    assert torch.cuda.is_available(), "pytest -m cuda compares CUDA with the CPU: it needs a CUDA device"
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    split = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map={
        "model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.layers.2": "cpu",
        "model.norm": "cpu", "lm_head": "cpu"}).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 11, 4]])
    for method in relevancy.families.CausalLMAdapter.methods:
        expected = relevancy.explain(plain, ids, method=method, target=3).scores
        got = relevancy.explain(split, ids, method=method, target=3).scores.cpu()
        error = ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()
        assert error < 1e-4, f"{method}: the split model's map differs by {error:.2g} of the map's largest"
    assert split.model.layers[0].mlp.gate_proj.weight.device.type == "cuda" and split.lm_head.weight.device.type == "cpu"
