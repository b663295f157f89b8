"""`relevancy evaluate` machinery: benchmark data and sharding (`data`), the protocol runner (`runner`), the
output files (`report`). The command line lives in :mod:`relevancy.evaluate`."""
from .data import BENCHMARKS
from .report import render_report, write_outputs
from .runner import PAPER_OPTIONS, SECTIONS, Settings, run

__all__ = ["BENCHMARKS", "PAPER_OPTIONS", "SECTIONS", "Settings", "render_report", "run", "write_outputs"]
