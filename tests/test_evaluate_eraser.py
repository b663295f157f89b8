"""`relevancy evaluate --benchmark eraser`: token-F1 of the shipped text model on a small ERASER-format set."""
from __future__ import annotations

import json

from relevancy.apps.cli import main
from relevancy.evaluation.metrics.rationales import load_eraser
from relevancy.evaluation.text_rationales import make_rationale_set, write_eraser


def test_eraser_benchmark_end_to_end(tmp_path, capsys):
    data = tmp_path / "movies"
    generated = make_rationale_set(8, seed=3)
    write_eraser(generated, data, split="test")
    # ERASER Movie Reviews names its classes POS / NEG: matched to the model's positive / negative
    lines = (data / "test.jsonl").read_text().splitlines()
    renamed = []
    for line in lines:
        record = json.loads(line)
        record["classification"] = {"positive": "POS", "negative": "NEG"}[record["classification"]]
        renamed.append(json.dumps(record))
    (data / "test.jsonl").write_text("\n".join(renamed) + "\n")
    assert len(load_eraser(data, "test")[0]) == 8

    out = tmp_path / "out"
    assert main(["evaluate", "--benchmark", "eraser", "--data", str(data), "--methods", "raw_attention,cdam", "-n", "6", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["benchmark"] == "eraser" and results["n"] == 6
    assert results["model"] == "sentiment: drug-review sentiment (shipped)"  # the text classifier, not "shapes"
    assert results["units"].startswith("token_f1: precision, recall and F1 as fractions in [0, 1]")
    assert set(results["methods"]) == {"raw_attention", "cdam"}
    f1 = results["methods"]["cdam"]["token_f1"]["10"]["macro"]["f1"]
    assert 0 < f1 <= 1
    assert "| `raw_attention` |" in (out / "report.md").read_text()


def test_eraser_benchmark_needs_its_data(tmp_path, capsys):
    assert main(["evaluate", "--benchmark", "eraser", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "ERASER folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
