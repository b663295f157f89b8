"""Cold start of the command line: `relevancy explain` on one shapes scene with the shipped model, in fresh processes.

    python benchmarks/cold_start.py [--repeats 5] [--method transformer_attribution] [--out FILE]

Runs `python -m relevancy.apps.cli explain scene.png --method METHOD` `--repeats` times (each a new interpreter, so every
import is paid again; the scene is drawn by the shapes generator), interleaved with the same command run through
`main` with the cycle collector left on (what `entry_point` saves), reports the median and range of the wall time,
then runs it once more under `python -X importtime` and splits the import time by the packages relevancy imports
(each with everything it pulled in: timm's share holds torchvision and the parts of torch that torchvision imports). Writes a markdown report to `--out`
(default benchmarks/results/cold_start.md).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name, today

RESULTS = Path(__file__).resolve().parent / "results"


def write_scene(folder: Path) -> Path:
    """One one-object shapes scene as a PNG (the picture the shipped model was trained on)."""
    from PIL import Image

    from relevancy.worlds import make_scenes

    path = folder / "scene.png"
    Image.fromarray(make_scenes(1, seed=7, objects=1).pixels[0]).save(path)
    return path


def command(scene: Path, method: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "relevancy.apps.cli", "explain", str(scene), "--method", method, "--out", str(out)]


def command_with_collector(argv: list[str]) -> list[str]:
    """The same command through `main` alone: Python's cycle collector left as it is (the cost `entry_point` saves)."""
    return [sys.executable, "-c", f"import sys; from relevancy.apps.cli import main; sys.exit(main({argv[3:]!r}))"]


def wall_seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def import_seconds_by_package(argv: list[str]) -> dict[str, float]:
    """Import seconds per package that relevancy (or the command itself) imported, with everything it pulled in;
    "relevancy" is the time of relevancy's own modules."""
    log = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], check=True, capture_output=True, text=True).stderr
    totals: collections.Counter[str] = collections.Counter()
    ancestors: list[tuple[int, str]] = []
    # importtime prints a module after the modules it imported, indented one step deeper: read backwards to see parents first
    for line in reversed(log.splitlines()):
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, indented = line[len("import time:"):].split("|")
        name = indented.strip()
        depth = len(indented) - len(indented.lstrip())
        while ancestors and ancestors[-1][0] >= depth:
            ancestors.pop()
        package = name.split(".")[0]
        if all(parent == "relevancy" for _, parent in ancestors):
            totals[package] += int(own if package == "relevancy" else cumulative) / 1e6
        ancestors.append((depth, package))
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--method", default="transformer_attribution")
    parser.add_argument("--out", type=Path, default=RESULTS / "cold_start.md")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        argv = command(write_scene(folder), args.method, folder / "maps")
        wall_seconds(argv)  # warm the file cache: the first run after an install also compiles the bytecode
        walls, collected = [], []
        for _ in range(args.repeats):  # interleaved, so that a change of load touches both
            walls.append(wall_seconds(argv))
            collected.append(wall_seconds(command_with_collector(argv)))
        imports = import_seconds_by_package(argv)
    bare = statistics.median(wall_seconds([sys.executable, "-c", "pass"]) for _ in range(3))
    total_import = sum(imports.values())
    lines = [
        f"# Cold start: `relevancy explain scene.png --method {args.method}` (shipped shapes model)",
        "",
        f"{cpu_name()}, {today()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; a machine shared "
        "with other jobs, so the times are noisy.",
        "",
        f"Wall time over {args.repeats} fresh processes: median {statistics.median(walls):.2f} s "
        f"(min {min(walls):.2f}, max {max(walls):.2f}); an empty interpreter starts in {bare:.2f} s. The same command "
        f"with Python's cycle collector left on (`main` without `entry_point`): median {statistics.median(collected):.2f} s "
        f"(min {min(collected):.2f}, max {max(collected):.2f}).",
        "",
        f"Imports in one run under `-X importtime`: {total_import:.2f} s (the profiler adds some), by the "
        "package relevancy imported, each with what it pulled in (relevancy: its own modules):",
        "",
        "| package | import seconds |",
        "|---|---:|",
    ]
    ranked = sorted(imports.items(), key=lambda item: -item[1])
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in ranked if seconds >= 0.01]
    lines.append(f"| (the other {sum(1 for _, s in ranked if s < 0.01)} packages) | {sum(s for _, s in ranked if s < 0.01):.2f} |")
    report = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
