"""`explain_generation`'s memory plan (`relevancy.generation.shared_forward_memory`) against the measured peak: the
shared-forward methods group a generation's rows so that what they hold stays within `MEMORY_BUDGET`, counting
heads, gradients and the dtype; a call whose one forward exceeds the budget is refused by name.

The peak is the process's resident-memory high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` just
before the call) above its resident memory then, in a fresh process whose allocator returns every large block to
the system (a fixed `MALLOC_MMAP_THRESHOLD_`), so that it measures what the call holds at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import relevancy
from relevancy import generation

HERE = Path(__file__).parent
BUDGET_MIB = 128
METHODS = ("generic_attention", "attention_gradcam", "rollout")
#: a decoder of 8 heads over 4 layers, a 400-token prompt and 24 generated tokens: the (T, T) matrices dominate
MEASURE = r"""
import json, re, sys
import torch, transformers
import relevancy, relevancy.generation as generation
from test_generation import Characters

def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
model = transformers.LlamaForCausalLM(config).eval()
prompt = "".join(chr(33 + (i * 7) % 90) for i in range(400))
continuation = "".join(chr(97 + i % 26) for i in range(24))
generation.MEMORY_BUDGET = int(sys.argv[1]) * 2**20
for method in sys.argv[2:]:
    relevancy.explain_generation(model, Characters(), prompt[:20], method=method, continuation="abc")  # imports, caches
    forwards = []
    handle = model.model.register_forward_hook(lambda *_: forwards.append(1))
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
    before = status("VmRSS")
    relevancy.explain_generation(model, Characters(), prompt, method=method, continuation=continuation)
    peak = status("VmHWM") - before
    handle.remove()
    print(json.dumps({"method": method, "peak": peak, "forwards": len(forwards)}))
"""


def measured_peaks(budget_mib: int, methods: tuple[str, ...]) -> dict[str, dict]:
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(HERE), str(Path(relevancy.__file__).parents[1])])}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(budget_mib), *methods], capture_output=True, text=True,
                          env=environment, timeout=600, cwd=HERE)
    assert done.returncode == 0, done.stderr[-2000:]
    return {row["method"]: row for row in map(json.loads, done.stdout.splitlines())}


def test_the_peak_stays_within_the_budget():
    """Linux's /proc/self/status and clear_refs measure the peak (the test command runs on Debian)."""
    peaks = measured_peaks(BUDGET_MIB, METHODS)
    for method in METHODS:
        row = peaks[method]
        assert row["forwards"] > 1, f"{method}: the rows should not fit one forward in {BUDGET_MIB} MiB"
        assert row["peak"] <= BUDGET_MIB * 2**20, f"{method}: peak {row['peak'] / 2**20:.1f} MiB over the budget of {BUDGET_MIB} MiB"


def test_the_plan_counts_heads_gradients_and_dtype():
    from test_causal_lm import build

    llama = build("llama")  # float64, 4 heads
    forward, per_row = generation.shared_forward_memory(llama, 2, 100, "generic_attention")
    heads = llama.config.num_attention_heads
    assert forward == 4 * heads * 2 * 100 * 100 * 8 and per_row == 3 * 2 * 100 * 100 * 8
    forward_half, _ = generation.shared_forward_memory(build("llama", torch.float16), 2, 100, "generic_attention")
    assert forward_half == forward // 2  # explained in float32


def test_a_forward_over_the_budget_is_refused_by_name(monkeypatch):
    from test_causal_lm import build
    from test_generation import Characters

    monkeypatch.setattr(generation, "MEMORY_BUDGET", 2**12)
    with pytest.raises(ValueError, match=r"generic_attention on \d+ tokens needs about .* MiB .* budget of 0 MiB .*attnlrp"):
        relevancy.explain_generation(build("llama"), Characters(), "abcdefgh", method="generic_attention", continuation="abc")
