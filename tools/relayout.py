#!/usr/bin/env python3
"""Move relevancy into the layout that docs/design.md draws, on whatever the tree holds when it runs.

    python tools/relayout.py            # from anywhere inside the clone; the working tree must be clean

Replayable and idempotent: the tables below say where every module goes (a folder of modules at a time where it
moves whole); the script `git mv`s what is still at its old place, rewrites every import that names a moved module
(relative imports resolved to absolute names, mapped, and written back relative to the file's new place; absolute
ones mapped), then every textual mention of an old module or path (tests, benchmarks/, docs, README.md,
pyproject.toml, .ci/run, importlib and mock strings, `python -m ...` commands), and applies the few code edits of
`EDITS`. A module that no row places stops the run before anything changes, naming it. Run again on the result,
it changes nothing. Logs and recorded results (`*.log`, `RECORDS`) are records of past runs and are left as
they were.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

#: (old module, new module): a module, or a package whose every module and file moves with it.
#: `training.*`: outside the library's import path, at the repository's root.
MOVES: list[tuple[str, str]] = [
    # core: what every layer may use
    ("relevancy.streams", "relevancy.core.streams"),
    ("relevancy.conventions", "relevancy.core.conventions"),
    ("relevancy.guard", "relevancy.core.guard"),
    ("relevancy.messages", "relevancy.core.messages"),
    ("relevancy.extras", "relevancy.core.extras"),
    ("relevancy.cancel", "relevancy.core.cancel"),
    ("relevancy.files", "relevancy.core.files"),
    ("relevancy.class_names", "relevancy.core.class_names"),
    # results and their rendering
    ("relevancy.explanation", "relevancy.results.explanation"),
    ("relevancy.parts", "relevancy.results.parts"),
    ("relevancy.viz", "relevancy.results.viz"),
    ("relevancy.generation_page", "relevancy.results.generation_page"),
    # what the methods share: targets, the recorded forward, recomputation
    ("relevancy.targets", "relevancy.methods.targets"),
    ("relevancy.capture", "relevancy.methods.capture"),
    ("relevancy.recompute", "relevancy.methods.recompute"),
    # the synthetic worlds and the models trained on them (their weights: worlds/weights)
    ("relevancy.bench", "relevancy.worlds"),  # the package's __init__ (its public names)
    ("relevancy.bench.scenes", "relevancy.worlds.scenes"),
    ("relevancy.bench.captions", "relevancy.worlds.captions"),
    ("relevancy.bench.vqa", "relevancy.worlds.questions"),
    ("relevancy.bench.detection", "relevancy.worlds.detection"),
    ("relevancy.bench.llm_world", "relevancy.worlds.language"),
    ("relevancy.bench.vlm_world", "relevancy.worlds.vision_language"),
    ("relevancy.bench.model", "relevancy.worlds.shapes_vit"),
    ("relevancy.bench.clip_model", "relevancy.worlds.shapes_clip"),
    ("relevancy.bench.vqa_model", "relevancy.worlds.shapes_lxmert"),
    ("relevancy.bench.vlm_model", "relevancy.worlds.shapes_vlm"),
    # the loaders of models by name, of packaged models, of the shipped text classifier
    ("relevancy.photos", "relevancy.zoo.photos"),
    ("relevancy.smollm2", "relevancy.zoo.smollm2"),
    ("relevancy.gemma3", "relevancy.zoo.gemma3"),
    ("relevancy.text", "relevancy.zoo.text"),  # the package's __init__ (load_model, encode)
    ("relevancy.text.model", "relevancy.zoo.text.model"),
    ("relevancy.text.data", "relevancy.zoo.text.data"),  # its training data, read by benchmarks/text_speed.py too
    # the evaluation
    ("relevancy.metrics", "relevancy.evaluation.metrics"),
    ("relevancy.datasets", "relevancy.evaluation.datasets"),
    ("relevancy.text.rationales", "relevancy.evaluation.text_rationales"),
    # the apps: command line, web page, demos, what the two share
    ("relevancy.cli", "relevancy.apps.cli"),
    ("relevancy.serve", "relevancy.apps.serve"),
    ("relevancy.pictures", "relevancy.core.pictures"),
    ("relevancy.bench.demo", "relevancy.apps.demos.shapes"),
    ("relevancy.bench.photo_demo", "relevancy.apps.demos.photos"),
    ("relevancy.bench.photo_concepts", "relevancy.apps.demos.photo_concepts"),
    ("relevancy.bench.vqa_show", "relevancy.apps.demos.questions"),
    # training: scripts beside the library, run as `python -m training.NAME` from the repository's root
    ("relevancy.bench.train", "training.shapes_vit"),
    ("relevancy.bench.clip_train", "training.shapes_clip"),
    ("relevancy.bench.vqa_train", "training.shapes_lxmert"),
    ("relevancy.bench.detr_train", "training.shapes_detr"),
    ("relevancy.bench.vlm_train", "training.shapes_vlm"),
    ("relevancy.text.train", "training.sentiment"),
]
#: packages moved whole (every file below them, `static/` included); the other rows with an `__init__` move it alone
WHOLE = {"relevancy.cli", "relevancy.serve", "relevancy.metrics"}
#: folders of data that move with their loaders (shipped: pyproject.toml's package-data follows)
DATA = [("src/relevancy/bench/weights", "src/relevancy/worlds/weights"),
        ("src/relevancy/text/weights", "src/relevancy/zoo/text/weights")]
#: modules that stay where they are; packages that stay with everything below them (the new ones too, for what is
#: added there later)
STAYS = {"relevancy", "relevancy.api", "relevancy.generation", "relevancy.models"}  # models: the public `relevancy.models`
STAYS_BELOW = ["relevancy.families", "relevancy.lrp", "relevancy.methods", "relevancy.evaluation", "relevancy.core",
               "relevancy.results", "relevancy.worlds", "relevancy.zoo", "relevancy.apps", "training"]
#: the new packages' faces, made where missing
INITS = {
    "src/relevancy/core/__init__.py": '"""The core every layer may use: streams and attention sites, conventions, the model guard, messages,\noptional extras, cancellation, files written whole, class names."""\n',
    "src/relevancy/results/__init__.py": '"""The results and their rendering: Explanation classes, their parts, pictures and pages."""\n',
    "src/relevancy/zoo/__init__.py": '"""Models to explain (loaded by name in `relevancy.models`): packaged real models (SmolLM2, Gemma 3, DINOv2) and the\nshipped text classifier (`zoo.text`)."""\n',
    "src/relevancy/apps/__init__.py": '"""The apps on top of the library: the command line, the web page, the demos."""\n',
    "src/relevancy/apps/demos/__init__.py": '"""The demos the command line runs: the shapes world, real photographs, the question world."""\n',
    "training/__init__.py": '"""Training of the shipped models, outside the library\'s import path: `python -m training.NAME` from the\nrepository\'s root (each module\'s docstring gives its command)."""\n',
}
#: code edits that a move needs (file after the move, old text, new text); a file missing both fails the run
EDITS = [
    ("src/relevancy/results/generation_page.py", 'Path(__file__).parent / "serve" / "static" / "generation.js"',
     'Path(__file__).resolve().parents[1] / "apps" / "serve" / "static" / "generation.js"'),
    ("tests/test_readme.py", '"bench import load_model"', '"worlds import load_model"'),
    ("tests/test_apps_layer.py", 'sorted((SOURCE / "serve").rglob("*.py"))', 'sorted((SOURCE / "apps" / "serve").rglob("*.py"))'),
    ("tests/test_apps_layer.py", 'for path in sorted((SOURCE / "apps").rglob("*.py")):',
     'for path in sorted((SOURCE / "apps").glob("*.py")):  # the shared layer; its apps are the folders below it'),
    ("pyproject.toml", 'testpaths = ["tests"]\n', 'testpaths = ["tests"]\npythonpath = ["."]  # the tests of training/ import it\n'),
]
#: text files whose mentions are rewritten (besides `.ci/run`)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".js", ".html", ".yml", ".yaml"}
SELF = "tools/relayout.py"
#: records of past runs, left as they were written (and `*.log` files)
RECORDS = ("benchmarks/results/", "docs/results/")


class LayoutError(Exception):
    """The move cannot go on: the message says what and where."""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def module_path(module: str) -> tuple[Path, Path]:
    """`(file.py, package/__init__.py)`: the two places a module's code can live."""
    parts = module.split(".")
    base = Path("src") / Path(*parts) if parts[0] == "relevancy" else Path(*parts)
    return base.with_suffix(".py"), base / "__init__.py"


def tracked_modules() -> dict[str, Path]:
    """Every tracked Python module of the library and of training/, by name."""
    found = {}
    for line in git("ls-files", "src/relevancy", "training").splitlines():
        path = Path(line)
        if path.suffix != ".py":
            continue
        parts = list(path.with_suffix("").parts)
        parts = parts[1:] if parts[0] == "src" else parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def destination(module: str) -> str | None:
    """The new name of an old module (None: it does not move)."""
    best = None
    for old, new in MOVES:
        exact = module == old
        if exact or (old in WHOLE and under(module, old)):
            if best is None or len(old) > len(best[0]):
                best = (old, new)
    return None if best is None else best[1] + module[len(best[0]):]


def check_tables() -> None:
    """No new name begins with an old one that moves elsewhere (the rewrite would not be idempotent)."""
    olds = [old for old, _ in MOVES]
    for _, new in MOVES:
        for old in olds:
            if under(new, old):
                raise LayoutError(f"table: new name {new} lies under the old name {old}")


def plan(modules: dict[str, Path]) -> dict[str, str]:
    """`{old module: new module}` for every module still to move; refuses any module no row places."""
    moves, unplaced = {}, []
    for module in modules:
        new = destination(module)
        if new is not None:
            moves[module] = new
        elif module not in STAYS and not any(under(module, keep) for keep in STAYS_BELOW):
            unplaced.append(module)
    if unplaced:
        raise LayoutError("no row of tools/relayout.py's MOVES places " + ", ".join(sorted(unplaced))
                          + ": add one (old module, new module) per module and run again")
    return moves


def file_moves(moves: dict[str, str], modules: dict[str, Path]) -> list[tuple[Path, Path]]:
    """(old file, new file) for every tracked file to move: modules, the whole packages' other files, data. A
    tracked file left behind in a package that is taken apart stops the run."""
    pairs = []
    for old, new in moves.items():
        if not any(under(old, whole) for whole in WHOLE):
            file_py, init = module_path(new)
            pairs.append((modules[old], init if modules[old].name == "__init__.py" else file_py))
    folders = [(module_path(old)[1].parent, module_path(new)[1].parent) for old, new in MOVES if old in WHOLE]
    folders += [(Path(old), Path(new)) for old, new in DATA]
    for old_dir, new_dir in folders:
        for line in git("ls-files", str(old_dir)).splitlines():
            pairs.append((Path(line), new_dir / Path(line).relative_to(old_dir)))
    moving = {old for old, _ in pairs}
    for old in moves:
        if modules[old].name == "__init__.py" and old not in WHOLE:  # a package taken apart
            left = [line for line in git("ls-files", str(modules[old].parent)).splitlines() if Path(line) not in moving]
            if left:
                raise LayoutError(f"no row places {', '.join(left)} (in {modules[old].parent}, which is taken apart)")
    return pairs


def move_files(pairs: list[tuple[Path, Path]]) -> None:
    for old, new in pairs:
        if new.exists():
            raise LayoutError(f"cannot move {old} to {new}: {new} exists")
    for old, new in pairs:
        new.parent.mkdir(parents=True, exist_ok=True)
        git("mv", str(old), str(new))
    for folder in sorted({old.parent for old, _ in pairs}, key=lambda f: len(f.parts), reverse=True):
        # folders left with bytecode caches only go
        if folder.exists() and all(item.name == "__pycache__" for item in folder.iterdir()):
            for cache in folder.iterdir():
                for item in cache.iterdir():
                    item.unlink()
                cache.rmdir()
            folder.rmdir()


def make_inits() -> list[Path]:
    made = []
    for name, text in INITS.items():
        path = Path(name)
        if path.parent.exists() and not path.exists():
            path.write_text(text, encoding="utf-8")
            git("add", name)
            made.append(path)
    return made


def file_module(path: Path) -> tuple[str, str]:
    """`(module, package)` of a Python file of the library or training/ (package: what `.` means in it)."""
    parts = list(path.with_suffix("").parts)
    parts = parts[1:] if parts[0] == "src" else parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def resolve(package: str, level: int, name: str | None) -> str:
    base = package.split(".")
    if level > len(base):
        raise LayoutError(f"relative import beyond the top of {package}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def relative(package: str, target: str) -> str:
    """`target` spelled relative to `package` (`..core.files`)."""
    here, there = package.split("."), target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(there[common:])


def new_name(module: str, old_to_new: dict[str, str]) -> str:
    """The name `module` (a module, or a dotted attribute chain below one) has after the move."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        new = old_to_new.get(head)
        if new is not None:
            return ".".join([new, *parts[cut:]])
    return module


def written_as(module: str, package: str | None, was_relative: bool) -> str:
    """How a file in `package` imports `module`: relative within its own top package where it was relative,
    absolute across the library's edge (training/ imports relevancy by name)."""
    if package is not None and module.split(".")[0] == package.split(".")[0]:
        return relative(package, module) if was_relative else module
    if package is not None and package.startswith("relevancy") and module.startswith("training"):
        raise LayoutError(f"{package} would import {module}: the library may not import training/")
    return module


def rewrite_imports(path: Path, old_path: Path, old_to_new: dict[str, str], known: set[str]) -> bool:
    """Rewrite the imports of one Python file whose old place was `old_path`; True when it changed."""
    source = path.read_text(encoding="utf-8")
    in_package = path.parts[0] == "training" or path.parts[:2] == ("src", "relevancy")
    old_package = file_module(old_path)[1] if in_package else None
    new_package = file_module(path)[1] if in_package else None
    new = imports_rewritten(source, str(path), old_package, new_package, old_to_new, known)
    if new == source:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def imports_rewritten(source: str, where: str, old_package: str | None, new_package: str | None,
                      old_to_new: dict[str, str], known: set[str]) -> str:
    """`source` with its imports of moved modules rewritten (`old_package`/`new_package`: what `.` meant in the file
    and means now; None outside the library and training/)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise LayoutError(f"{where}: cannot parse: {error}") from None
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        if isinstance(node, ast.Import):
            names = []
            for alias in node.names:
                moved = new_name(alias.name, old_to_new)
                if moved != alias.name and alias.asname is None and moved.split(".")[0] != alias.name.split(".")[0]:
                    raise LayoutError(f"{where}:{node.lineno}: `import {alias.name}` would bind another top name; write it with `as`")
                names.append((alias.name, moved, alias.asname))
            if any(old != moved for old, moved, _ in names):
                edits.append((start, end, "import " + ", ".join(m + (f" as {a}" if a else "") for _, m, a in names)))
            continue
        if node.level:
            if old_package is None:
                raise LayoutError(f"{where}:{node.lineno}: a relative import outside a package")
            target = resolve(old_package, node.level, node.module)
        else:
            target = node.module or ""
        if not (under(target, "relevancy") or under(target, "training")):
            continue
        groups: dict[str, list[tuple[str, str | None]]] = {}
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in known:  # a submodule imported by its name: it may move apart from its package
                moved = new_name(sub, old_to_new)
                parent, _, leaf = moved.rpartition(".")
                groups.setdefault(parent, []).append((leaf, alias.asname or (alias.name if leaf != alias.name else None)))
            else:
                groups.setdefault(new_name(target, old_to_new), []).append((alias.name, alias.asname))
        unchanged_names = list(groups.values()) == [[(a.name, a.asname) for a in node.names]]
        if unchanged_names:
            (module,) = groups
            try:
                now = resolve(new_package, node.level, node.module) if node.level else node.module
            except LayoutError:  # the file left its package: the import becomes absolute
                now = None
            if now == module and (not node.level or module.split(".")[0] == new_package.split(".")[0]):
                continue
            head = re.match(r"from\s+[.\w]+\s+import", source[start:end])
            edits.append((start, start + head.end(), f"from {written_as(module, new_package, bool(node.level))} import"))
            continue
        if "#" in source[start:end]:
            raise LayoutError(f"{where}:{node.lineno}: this import must be split and holds a comment: split it by hand, then run again")
        statements = [f"from {written_as(module, new_package, bool(node.level))} import "
                      + ", ".join(name + (f" as {asname}" if asname else "") for name, asname in aliases)
                      for module, aliases in groups.items()]
        edits.append((start, end, ("\n" + " " * node.col_offset).join(statements)))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return source


WHOLE_FOLDERS = {old.removeprefix("relevancy.").replace(".", "/") for old in WHOLE}
#: a dotted name; one followed by `/` is an identifier of its own (the results' schema `relevancy.explanation/1`)
DOTTED = re.compile(r"(?<![\w.])relevancy(?:\.\w+)+(?![\w/])")
FULL_PATH = re.compile(r"(?<![\w.\-])(src/relevancy/|(?<!/)relevancy/)([\w./*-]*)")


def path_table(pairs: list[tuple[Path, Path]]) -> dict[str, str]:
    """`{old path: new path}` of files and folders, relative to the repository (the rows' files and packages
    too, so that a second run still knows them)."""
    table = {str(old): str(new) for old, new in pairs}
    for old, new in MOVES:
        for before, after in zip(module_path(old), module_path(new)):
            table.setdefault(str(before), str(after))
        if old in WHOLE:
            table.setdefault(str(module_path(old)[1].parent), str(module_path(new)[1].parent))
    for old, new in DATA:
        table.setdefault(old, new)
    return table


def mapped_path(path: str, table: dict[str, str]) -> str | None:
    """The new repository path of `path` (a file or folder path, maybe with a glob tail), None if it does not move."""
    parts = path.split("/")
    for cut in range(len(parts), 0, -1):
        head = "/".join(parts[:cut])
        if head in table:
            return "/".join([table[head], *parts[cut:]])
    return None


MARKDOWN_IMPORT = re.compile(r"^([ \t]*)((?:from|import)[ \t]+relevancy\b[^\n(]*)$", re.MULTILINE)


def rewrite_text(text: str, old_to_new: dict[str, str], table: dict[str, str], short: bool, known: set[str]) -> str:
    """Old module names and paths in a text, written as they are after the move (in docs, each one-line import of
    their code blocks as a Python file's)."""
    def code_line(match: re.Match) -> str:
        try:
            ast.parse(match.group(2))
        except SyntaxError:  # prose that starts like an import: its names are rewritten below
            return match.group(0)
        return match.group(1) + imports_rewritten(match.group(2), "a docs import", None, None, old_to_new, known)

    if short:
        text = MARKDOWN_IMPORT.sub(code_line, text)
    text = DOTTED.sub(lambda m: new_name(m.group(0), old_to_new), text)

    def full(match: re.Match) -> str:
        prefix, rest = match.group(1), match.group(2)
        tail = rest[len(rest.rstrip(".")):]  # a sentence's full stop
        new = mapped_path("src/relevancy/" + rest.rstrip("."), table)
        if new is None:
            return match.group(0)
        new = prefix + new[len("src/relevancy/"):] if new.startswith("src/relevancy/") else new  # training/: the root
        return new + tail

    text = FULL_PATH.sub(full, text)
    if short:  # package-relative paths (`bench/weights/*`, `serve/static/`) in docs and pyproject.toml
        inside = {old[len("src/relevancy/"):]: new for old, new in table.items() if old.startswith("src/relevancy/")}
        inside = {old + ("/" if old in WHOLE_FOLDERS else ""): new + ("/" if old in WHOLE_FOLDERS else "")
                  for old, new in inside.items() if "/" in old or old in WHOLE_FOLDERS}
        alternatives = [re.escape(name) + ("" if name.endswith("/") else r"(?!\w)") for name in sorted(inside, key=len, reverse=True)]
        pattern = re.compile(r"(?<![\w./\-])(" + "|".join(alternatives) + ")")
        text = pattern.sub(lambda m: inside[m.group(0)].removeprefix("src/relevancy/"), text)
    return text


def text_files() -> list[Path]:
    files = []
    for line in git("ls-files").splitlines():
        path = Path(line)
        if line == SELF or path.suffix == ".log" or line.startswith(RECORDS) or not path.exists():
            continue
        if path.suffix in TEXT_SUFFIXES or line == ".ci/run":
            files.append(path)
    return files


def apply_edits() -> list[str]:
    done = []
    for name, old, new in EDITS:
        path = Path(name)
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        if new in text:
            continue
        if old not in text:
            raise LayoutError(f"{name}: expected `{old}` (to become `{new}`); edit it by hand and run again")
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
        done.append(name)
    return done


def main() -> int:
    os.chdir(git("rev-parse", "--show-toplevel").strip())
    check_tables()
    if git("status", "--porcelain", "--untracked-files=no").strip():
        raise LayoutError("the working tree has uncommitted changes: commit or stash them first")
    modules = tracked_modules()
    moves = plan(modules)
    pairs = file_moves(moves, modules)
    old_to_new = {old: new for old, new in MOVES}
    known = set(modules) | set(old_to_new)
    move_files(pairs)
    made = make_inits()
    where_from = {new: old for old, new in pairs}
    changed = set()
    for path in [Path(p) for p in git("ls-files", "*.py").splitlines()]:
        if str(path) == SELF or not path.exists():
            continue
        if rewrite_imports(path, where_from.get(path, path), old_to_new, known):
            changed.add(str(path))
    table = path_table(pairs)
    for path in text_files():
        text = path.read_text(encoding="utf-8")
        new = rewrite_text(text, old_to_new, table, short=path.suffix in (".md", ".toml"), known=known)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.add(str(path))
    changed.update(apply_edits())
    print(f"relayout: {len(pairs)} files moved, {len(made)} packages made, {len(changed)} files rewritten"
          + ("" if pairs or changed or made else " (nothing to do: the tree has the new layout)"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LayoutError as error:
        print(f"relayout: {error}", file=sys.stderr)
        sys.exit(1)
