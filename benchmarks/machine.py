"""What the benchmark scripts print about the machine they ran on (the CPU's name, the date, the versions) and the
one median timer they share."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable


def timed(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`, after one untimed warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def today() -> str:
    """The UTC date, for the header of a results file."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def write_results(out: Path, lines: list[str], data: dict) -> None:
    """Print a benchmark's table and write it to `out`.txt, its numbers to `out`.json (the folder made)."""
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
