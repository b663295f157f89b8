"""The documentation runs: every ```python block of the README executes as written (offline, shipped models),
and `help(relevancy.explain)` names every registered method and option."""
from __future__ import annotations

import inspect
import pydoc
import re
from pathlib import Path

import pytest
import torch

import relevancy
from relevancy.methods import REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SAVED_FILE = re.compile(r"""\.save\(["']([^"']+)["']""")
BLOCKS = PYTHON_BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2  # the image call and the text call


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_written(index, tmp_path, monkeypatch):
    """Each block on its own, in a fresh namespace, in an empty folder: what it saves appears there."""
    block = BLOCKS[index]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block, f"README.md python block {index + 1}", "exec"), namespace)
    # every kind of explanation (image, text, pairs, questions, detections) has parts and one target per row
    explanations = [value for value in namespace.values() if hasattr(value, "parts") and hasattr(value, "target")]
    assert explanations, "every README example explains something"
    for explanation in explanations:
        for part in explanation.parts.values():
            assert torch.isfinite(part.scores).all()
            assert len(explanation.target) == len(part.scores)
    saved = SAVED_FILE.findall(block)
    assert saved, "every README example writes its picture"
    for name in saved:
        assert (tmp_path / name).stat().st_size > 0


def test_help_names_every_method_and_option():
    text = pydoc.render_doc(relevancy.explain, renderer=pydoc.plaintext)
    rows = [row.strip() for row in text.splitlines()]
    for name, spec in REGISTRY.items():
        found = [i for i, row in enumerate(rows) if re.match(rf"{name}( \[[a-z, ]+\])?: ", row)]
        assert len(found) == 1, f"help(relevancy.explain) does not list {name} once"
        assert spec.summary in rows[found[0]]
        options_row = rows[found[0] + 1]  # the method's options, on the line under it
        for option in list(inspect.signature(spec.run).parameters.values())[3:]:
            assert f"{option.name}={option.default!r}" in options_row, f"{name}'s option {option.name} is not in the help"
    for accepted in ("(B, 3, H, W)", "BatchEncoding", "input_ids", "Concept", "list or tensor of ints", "None"):
        assert accepted in text
