"""The apps share a layer of their own (`relevancy.apps`) and never import each other: the web page's code
(`relevancy.apps.serve`) imports nothing of the command line's (`relevancy.apps.cli`), read from its source; the catalogue
of shipped models names what the library loads; `evaluate` has one row per benchmark."""
from __future__ import annotations

import ast
from pathlib import Path

import relevancy

SOURCE = Path(relevancy.__file__).parent


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` (a module of `package`) imports, absolute (`relevancy.apps.cli.common`), wherever the import
    statement stands (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.update({module} | {f"{module}.{alias.name}" for alias in node.names})
    return found


def test_serve_imports_nothing_from_the_command_line():
    files = sorted((SOURCE / "apps" / "serve").rglob("*.py"))
    assert len(files) >= 8
    offending = {path.name: sorted(m for m in imported_modules(path, "relevancy.apps.serve") if m.startswith("relevancy.apps.cli"))
                 for path in files}
    assert {name: modules for name, modules in offending.items() if modules} == {}


def test_the_reader_sees_relative_and_nested_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..cli.common import warn\n    from . import jobs\nimport relevancy.apps.cli\n")
    modules = imported_modules(probe, "relevancy.apps.serve")
    assert {"relevancy.apps.cli.common", "relevancy.apps.cli.common.warn", "relevancy.apps.serve.jobs", "relevancy.apps.cli"} <= modules


def test_the_apps_layer_imports_neither_app():
    for path in sorted((SOURCE / "apps").glob("*.py")):  # the shared layer; its apps are the folders below it
        assert not [m for m in imported_modules(path, "relevancy.apps") if m.startswith(("relevancy.apps.cli", "relevancy.apps.serve"))]


def test_the_catalogue_names_the_librarys_shipped_models():
    from relevancy import models
    from relevancy.apps.catalogue import SHIPPED

    assert (SHIPPED["image"].name, SHIPPED["pairs"].name, SHIPPED["language"].name) == (
        models.SHIPPED, models.SHIPPED_CLIP, models.SHIPPED_LANGUAGE_MODEL)
    for row in SHIPPED.values():
        if row.weights is not None:
            assert row.weights_path().is_file() and row.means(None) and row.means(row.name) and not row.means("other")


def test_a_missing_shipped_model_names_its_trainer():
    import pytest

    from relevancy.apps.catalogue import Shipped
    from relevancy.apps.common import UsageError

    missing = Shipped("shapes", "shapes thing", "relevancy.apps.catalogue:__file__", "training.shapes_vit", settings=True)
    with pytest.raises(UsageError, match="the shipped shapes thing is missing .*python -m training.shapes_vit"):
        missing.weights_path()  # catalogue.py has no .json beside it


def test_evaluate_has_one_row_per_benchmark():
    from relevancy.apps.catalogue import SHIPPED
    from relevancy.apps.cli.evaluate import TABLE
    from relevancy.evaluation.data import BENCHMARKS

    assert list(TABLE) == list(BENCHMARKS)
    assert all(row.model in SHIPPED for row in TABLE.values())
    assert TABLE["shapes-clip"].shipped("shapes") and TABLE["shapes-clip"].shipped("shapes-clip")
    assert not TABLE["coco-detr"].shipped("folder") and TABLE["eraser"].shipped(SHIPPED["text"].name) and TABLE["eraser"].shipped("shapes")
