"""`relevancy evaluate` on a tiny benchmark, killed at a chosen point: the driver of the kill tests in
tests/test_evaluate_resume.py.

    RELEVANCY_TEST_RUN=<token> [RELEVANCY_TEST_KILL=<point>] \\
        torchrun --standalone --nproc-per-node K tests/resume_driver.py --out DIR [-n N] [--seed S]

Runs the command's own `evaluate` (process group, `Shards`, records, lock, finish) on "resume-probe", a benchmark
added here for the test: chunk k is a small seeded float64 model applied to inputs drawn from seed k, so its record
is the same in every process and every run. With `RELEVANCY_TEST_KILL`, one process sends SIGKILL to every process
whose environment holds ``RELEVANCY_TEST_RUN=<token>`` (torchrun's agent, every worker, itself) at that point:

- ``start``: rank 0 beginning the run, before any record;
- ``mid-chunk``: the last rank inside the write of its second record (half a line on disk);
- ``finished``: rank 0 done with its share, about to collect the others';
- ``gather``: the last rank in the final gather, the others waiting in it (one process: its records collected);
- ``cleanup``: rank 0 removing the records, after the first file, results.json written.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from relevancy.apps.cli import evaluate as command
from relevancy.apps.cli import main
from relevancy.core.files import write_atomic
from relevancy.evaluation import data
from relevancy.evaluation.shards import Shards

from processes import kill_all

#: the points `RELEVANCY_TEST_KILL` names
POINTS = ("start", "mid-chunk", "finished", "gather", "cleanup")
BENCHMARK = "resume-probe"


def run_probe(args, methods, n: int, shards: Shards) -> list[Path]:
    """The benchmark: `n` chunks of a seeded model's outputs; rank 0 writes results.json."""
    torch.manual_seed(args.seed)
    model = nn.Linear(8, 3).double()
    shards.weigh(model)

    def chunk(k: int) -> dict:
        inputs = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        time.sleep(0.02)  # a chunk takes a moment, as a real one does
        with torch.no_grad():
            outputs = model(inputs)
        return {"outputs": outputs, "sum": float(outputs.sum()), "argmax": outputs.argmax(-1)}

    records = shards.map(list(range(n)), chunk)
    if shards.rank != 0:
        return []
    results = {"n": n, "seed": args.seed, "sums": [r["sum"] for r in records],
               "outputs": [r["outputs"].tolist() for r in records], "argmax": [r["argmax"].tolist() for r in records]}
    return [write_atomic(Path(args.out) / "results.json", json.dumps(results) + "\n")]


def arm(point: str) -> None:
    """Patch `Shards` (and the gather) so that the run is killed at `point`."""
    if point not in POINTS:
        raise SystemExit(f"RELEVANCY_TEST_KILL must be one of {', '.join(POINTS)}, got {point!r}")
    begin, save, collect, finish = Shards._begin, Shards.save, Shards.collect, Shards.finish
    gather, unlink = dist.all_gather_object, Path.unlink
    state = {"saves": 0, "collecting": False, "finishing": False}

    def killing_begin(self, count):
        if point == "start" and self.rank == 0:
            kill_all()
        return begin(self, count)

    def killing_save(self, chunk, record):
        state["saves"] += 1
        if point == "mid-chunk" and self.rank == self.world - 1 and state["saves"] == 2:
            with open(self.path, "ab") as f:
                f.write(b'{"chunk": %d, "record": {"outp' % chunk)
            kill_all()
        return save(self, chunk, record)

    def killing_collect(self, count):
        if point == "finished" and self.rank == 0:
            kill_all()
        state["collecting"] = True
        records = collect(self, count)
        if point == "gather" and self.world == 1:
            kill_all()
        return records

    def killing_gather(parts, value, *rest, **options):
        if point == "gather" and state["collecting"] and dist.get_rank() == dist.get_world_size() - 1:
            kill_all()
        return gather(parts, value, *rest, **options)

    def killing_finish(self):
        state["finishing"] = self.rank == 0
        return finish(self)

    def killing_unlink(self, *rest, **options):
        unlink(self, *rest, **options)
        if point == "cleanup" and state["finishing"]:
            kill_all()

    Shards._begin, Shards.save, Shards.collect, Shards.finish = killing_begin, killing_save, killing_collect, killing_finish
    dist.all_gather_object = killing_gather
    Path.unlink = killing_unlink


def probe() -> int:
    """`relevancy evaluate --benchmark resume-probe` with this script's arguments."""
    command.TABLE[BENCHMARK] = command.Benchmark(lambda args, n: None, run_probe, "image", default_n=7,
                                                 methods=lambda spec: (), shipped_name="probe")
    data.BENCHMARKS = (*data.BENCHMARKS, BENCHMARK)
    if os.environ.get("RELEVANCY_TEST_KILL"):
        arm(os.environ["RELEVANCY_TEST_KILL"])
    return main(["evaluate", "--benchmark", BENCHMARK, "--threads", "1", "--quiet", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(probe())
