"""benchmarks/gpu.py runs end to end on a CPU (`--device cpu --quick`, the tests' tiny models), so that it is known
to work before GPU time is spent on it; the table it writes names every family and method and the exactness rows."""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_benchmark_quick_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--device", "cpu", "--quick", "--repeats", "1"])
    import gpu
    from family_cases import FAMILIES

    out = gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--out", str(tmp_path / "gpu.md")])
    text = out.read_text()
    speed, exact = text.split("## Exactness in float64 on the device")
    for family in FAMILIES:
        assert f"| {family} (tiny" in speed, f"{family} missing from the time table"
        assert f"| {family} vs CPU | transformer_attribution |" in exact or f"| {family} | transformer_attribution | not offered" in exact
    assert "| | rollout | " in speed and "| | attnlrp | " in speed
    for line in exact.splitlines():
        if " vs CPU | " in line and "not offered" not in line:
            assert float(line.rsplit("|", 2)[1]) == 0.0, line  # the same device: the same numbers
        if line.startswith("| authors' ViT"):
            assert float(line.rsplit("|", 2)[1]) < 1e-8, line
