"""The command line as a whole: --version, a --help that loads no torch, the lazy package, the demo's checks."""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest

import relevancy
from relevancy.apps.cli import METHOD_NAMES, main
from relevancy.families.base import SEED_METHODS

HEAVY = ("torch", "timm", "transformers", "numpy", "PIL", "matplotlib")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"relevancy {relevancy.__version__}\n"


@pytest.mark.parametrize("command", [[], ["explain"], ["explain-text"], ["demo"], ["evaluate"]])
def test_help_loads_no_heavy_library(command):
    """`relevancy [COMMAND] --help` in a fresh interpreter: the help is printed and torch & co. are never imported."""
    script = (
        "import sys\n"
        "from relevancy.apps.cli import main\n"
        "try:\n"
        f"    main({command + ['--help']!r})\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: relevancy" in done.stdout
    assert done.stdout.strip().endswith("LOADED []")


def test_the_help_names_every_method(capsys):
    assert METHOD_NAMES == SEED_METHODS
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    words = " ".join(capsys.readouterr().out.split())
    assert f"one of {', '.join(METHOD_NAMES)}, or 'all'" in words


def test_the_package_loads_its_public_names_on_first_use():
    script = (
        "import sys, relevancy\n"
        "assert 'torch' not in sys.modules\n"
        "from relevancy import Concept, Explanation, METHODS, explain\n"
        "assert 'torch' in sys.modules and callable(explain) and 'rollout' in METHODS\n"
        "assert relevancy.explain is explain and relevancy.Concept is Concept and relevancy.Explanation is Explanation\n"
        "assert set(relevancy.__all__) <= set(dir(relevancy))\n"
        "try:\n"
        "    relevancy.explian\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module 'relevancy' has no attribute 'explian'"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--singles", "-1"], "--singles must be between 0 and 100, got -1"),
        (["--pairs", "-2"], "--pairs must be between 0 and 100, got -2"),
        (["--singles", "0", "--pairs", "0"], "there is no scene to explain"),
        (["--methods", "rollout,saliency"], "unknown method 'saliency'"),
    ],
)
def test_demo_refuses_bad_requests_before_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr("relevancy.apps.demos.shapes.run_demo", lambda *a, **k: pytest.fail("the demo ran"))
    assert main(["demo", "--out", str(tmp_path / "d"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_demo_checks_its_output_folder_before_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("relevancy.apps.demos.shapes.run_demo", lambda *a, **k: pytest.fail("the demo ran"))
    a_file = tmp_path / "demo"
    a_file.write_text("keep me")
    assert main(["demo", "--out", str(a_file)]) == 2
    assert f"{a_file} exists and is not a folder" in capsys.readouterr().err
    assert main(["demo", "--out", "/proc/relevancy-demo"]) == 2
    assert "is not writable" in capsys.readouterr().err
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize("command, collector_during", [("explain", False), ("demo", False), ("evaluate", True), ("serve", True)])
def test_a_short_command_runs_without_the_cycle_collector(command, collector_during):
    """In its own process a short command runs with the collector off and freezes what it made at the end (the
    exit is then quick); long-running ones keep it. The collector is on again after either."""
    from relevancy.apps.cli import _short_lived_process

    assert gc.isenabled()
    try:
        with _short_lived_process(command):
            assert gc.isenabled() is collector_during
        assert gc.isenabled()
        assert (gc.get_freeze_count() > 0) is not collector_during
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("module", ["relevancy", "relevancy.apps.cli"])
def test_the_module_entry_point_runs_a_command_and_exits_with_its_status(tmp_path, module):
    """`python -m relevancy` (and `-m relevancy.apps.cli`) goes through `entry_point`: a bad request exits 2 with one
    line and writes nothing."""
    done = subprocess.run([sys.executable, "-m", module, "explain", str(tmp_path / "missing.png"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("relevancy explain: error:") and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_explanations_leave_no_reference_cycles():
    """What lets short commands run without the cycle collector: explaining (every method, the shipped model) frees
    all it made by reference counting, so nothing would wait for a collection."""
    from relevancy import explain
    from relevancy.worlds import load_model, make_scenes

    model = load_model()
    images = make_scenes(2, seed=3).images
    for method in SEED_METHODS:  # warm-up: first calls fill caches and import modules
        explain(model, images, method=method)
    gc.collect()
    gc.disable()
    try:
        for method in SEED_METHODS:
            explain(model, images, method=method)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_serve_without_its_extra_is_refused_in_one_line_naming_it(capsys, monkeypatch):
    for name in [name for name in sys.modules if name.startswith("relevancy.apps.serve")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    assert main(["serve", "--port", "0"]) != 0
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "fastapi" in error and 'relevancy[serve]' in error
