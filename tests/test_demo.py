"""`relevancy demo` end to end on the shipped model, in a small setting."""
from __future__ import annotations

from relevancy.cli import main


def test_demo_writes_page_and_grids(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--singles", "1", "--pairs", "1", "--methods", "raw_attention,cdam,transformer_attribution"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "pair_0.png", "single_0.png"]
    page = (out / "index.html").read_text()
    assert "pair_0.png" in page and "transformer_attribution" in page and "object mask" not in page
    assert "open" in capsys.readouterr().out


def test_demo_rejects_unknown_methods(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--methods", "rollout,gradcam"]) == 2
    assert "unknown method 'gradcam'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
