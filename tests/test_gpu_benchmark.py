"""benchmarks/gpu.py runs end to end on a CPU (`--device cpu --quick`, the tests' tiny models), so that it is known
to work before GPU time is spent on it: the table names each chosen family's methods, and the float64 exactness rows
(here the CPU against itself, and the authors' ViT maps) hold."""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: one image family, one with two streams, one decoder (with its own methods): every kind of row, in seconds
FAMILIES = ("timm_vit", "clip_transformers", "causal_lm_llama")


def test_gpu_benchmark_quick_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    argv = ["--device", "cpu", "--quick", "--repeats", "1", "--families", *FAMILIES, "--out", str(tmp_path / "gpu.md")]
    monkeypatch.setattr(sys, "argv", ["gpu.py", *argv])
    import gpu

    text = gpu.main(argv).read_text()
    decoders, rest = text.split("## A vision-language decoder")
    assert decoders.count("| | relevancy attnlrp, checkpoint=True |") == 2  # float32 and bf16
    assert "| | relevancy transformer_attribution, checkpoint=True |" in decoders
    assert "| | lxt AttnLRP (lxt's own code) |" in decoders  # timed, or "not run" naming lxt's absence
    vlm, rest = rest.split("## Time and memory")
    assert vlm.count("| | attnlrp, checkpoint=True |") == 2 and "| | generic_attention |" in vlm
    speed, exact = rest.split("## Exactness in float64 on the device")
    for family in FAMILIES:
        assert f"| {family} (tiny" in speed, f"{family} missing from the time table"
        assert f"| {family} vs CPU | transformer_attribution |" in exact or f"| {family} | transformer_attribution | not offered" in exact
    assert "| | rollout | " in speed and "| | attnlrp | " in speed
    assert speed.count("| plain forward (no gradients) |") == len(FAMILIES)
    for line in exact.splitlines():
        if " vs CPU | " in line and "not offered" not in line:
            assert float(line.rsplit("|", 2)[1]) < 1e-12, line  # the same device: the same numbers
        if line.startswith("| authors' ViT"):
            assert float(line.rsplit("|", 2)[1]) < 1e-8, line
