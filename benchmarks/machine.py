"""What the benchmark scripts print about the machine they ran on: the CPU's name, the date, the versions."""
from __future__ import annotations

import datetime
import platform


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
