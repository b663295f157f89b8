"""Resumable evaluation, measured: a two-process `torchrun` run of `relevancy evaluate` killed midway and run again,
against the same run uninterrupted, and the cost of recording each batch.

    OMP_NUM_THREADS=1 python benchmarks/evaluate_resume.py [--n 120] [--batch-size 4] [--methods rollout,generic_attention]
                                                          [--kill-at 0.5] [--out FILE]

1. `torchrun --standalone --nproc-per-node 2 -m relevancy.apps.cli evaluate --benchmark shapes` (the shipped model,
   `--threads 1`) uninterrupted: its wall time.
2. The same command into a fresh folder; once rank 1 has recorded `--kill-at` of its batches, rank 1 is killed
   with SIGKILL (torchrun then ends rank 0); the batches recorded by then; then the same command again: its wall
   time, the batches it computed, and whether results.json equals the uninterrupted one (timings aside).
3. In one process, `relevancy.evaluation.run` with the records kept in memory and written to files (JSON lines,
   fsync per batch; the model's weights digested once for the run's identity), interleaved twice: the recording's cost.
Writes a Markdown report to `--out` (default benchmarks/results/evaluate_resume.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name, today

from relevancy.evaluation.shards import PARTIAL, Shards
from relevancy.core.files import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def command(out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "relevancy.apps.cli",
            "evaluate", "--benchmark", "shapes", "--methods", args.methods, "-n", str(args.n), "--batch-size",
            str(args.batch_size), "--threads", "1", "--quiet", "--out", str(out)]


def recorded(out: Path, rank: int | None = None) -> int:
    return sum(1 for path in out.glob(f"{PARTIAL}/*/rank-*-of-2.jsonl") if rank is None or path.name.startswith(f"rank-{rank}-")
               for _ in path.read_text().splitlines())


def worker(parent: int, rank: int) -> int:
    """The pid of torchrun's worker process of `rank` (read from the children's environments)."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise RuntimeError(f"no worker of rank {rank} under {parent}")


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if "seconds" not in k and k != "world_size"}
    return [without_timings(v) for v in value] if isinstance(value, list) else value


def recording_cost(args: argparse.Namespace, folder: Path) -> tuple[float, float, int]:
    """Seconds of one single-process run with records in memory and with record files (best of 2, interleaved),
    and the records' size in bytes."""
    from relevancy.evaluation import Settings, run
    from relevancy.models import load_image_model

    model = load_image_model("shapes")
    settings = Settings(benchmark="shapes", methods=tuple(args.methods.split(",")), n=args.n // 2, batch_size=args.batch_size)
    memory, files, size = [], [], 0
    for attempt in range(2):
        started = time.perf_counter()
        run(model, settings, progress=False, shards=Shards())
        memory.append(time.perf_counter() - started)
        with Shards.at(folder / str(attempt), "shapes", {"attempt": attempt}) as shards:
            started = time.perf_counter()
            shards.weigh(model)
            run(model, settings, progress=False, shards=shards)
            files.append(time.perf_counter() - started)
            size = shards.path.stat().st_size
    return min(memory), min(files), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--methods", default="rollout,generic_attention")
    parser.add_argument("--kill-at", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=RESULTS / "evaluate_resume.md")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    batches = -(-args.n // args.batch_size) + -(-max(1, args.n // 2) // args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        whole, parts = Path(tmp) / "whole", Path(tmp) / "parts"
        started = time.perf_counter()
        subprocess.run(command(whole, args), env=env, check=True, capture_output=True)
        uninterrupted = time.perf_counter() - started

        started = time.perf_counter()
        first = subprocess.Popen(command(parts, args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        goal = int(args.kill_at * batches / 2)
        while recorded(parts, rank=1) < goal:
            if first.poll() is not None:
                raise RuntimeError("the run ended before the kill")
            time.sleep(0.02)
        os.kill(worker(first.pid, 1), signal.SIGKILL)
        first.wait()
        killed_after = time.perf_counter() - started
        kept = recorded(parts)
        started = time.perf_counter()
        subprocess.run(command(parts, args), env=env, check=True, capture_output=True)
        resumed = time.perf_counter() - started
        equal = without_timings(json.loads((whole / "results.json").read_text())) == \
            without_timings(json.loads((parts / "results.json").read_text()))
        memory, files, size = recording_cost(args, Path(tmp) / "cost")
    report = "\n".join([
        f"# Resumable evaluation ({today()}, {cpu_name()}, OMP_NUM_THREADS=1)", "",
        f"`relevancy evaluate --benchmark shapes --methods {args.methods} -n {args.n} --batch-size {args.batch_size} "
        f"--threads 1` under `torchrun --nproc-per-node 2` ({batches} batches), the shipped model.", "",
        "| run | wall time | batches computed |", "| --- | --- | --- |",
        f"| uninterrupted | {uninterrupted:.1f} s | {batches} |",
        f"| killed (rank 1 SIGKILL after {goal} of its batches) | {killed_after:.1f} s | {kept} recorded |",
        f"| the same command again | {resumed:.1f} s | {batches - kept} |", "",
        f"results.json of the resumed run equals the uninterrupted one (timings aside): **{equal}**.", "",
        f"Recording, one process, {args.n // 2} + {max(1, args.n // 4)} scenes (best of 2, interleaved): records in memory "
        f"{memory:.2f} s, in a file (a JSON line and an fsync per batch, the weights' digest) {files:.2f} s ({100 * (files / memory - 1):+.1f} %); "
        f"the file holds {size / 1024:.0f} KiB.", "",
    ])
    write_atomic(args.out, report)
    print(report)


if __name__ == "__main__":
    main()
